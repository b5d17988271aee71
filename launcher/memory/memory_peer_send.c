/* memory_peer_send: the sending side of memory_peer (memory_peer.h): this node's newest sealed
 * generation, read and verified on the thread pool, to the next node's agent, one in flight.
 * The agent's loop thread (read_slot: libuv's thread pool). */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory/memory_peer_internal.h"
#include "clock.h"
#include "log.h"
#include "xxh3_simd.h"

static void out_closed(uv_handle_t *h) {
    memory_peer_t *p = h->data;
    free(h);
    p->open_handles--;
    memory_peer__maybe_free(p);
}

void memory_peer__drop_out(memory_peer_t *p) {
    if (p->out && !uv_is_closing((uv_handle_t *)p->out))
        uv_close((uv_handle_t *)p->out, out_closed);
    p->out = NULL;
    p->is_connected = false; /* is_connecting stays until its callback: connect_req is in use */
    p->retry_at = clock_now_s() + RETRY_MS / 1000.0;
}

static void challenge_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    memory_peer_t *p = h->data;
    *buf = uv_buf_init((char *)p->challenge_buf, sizeof p->challenge_buf);
}

/* The receiver's nonce: answer with ours and the MAC over both, then frames may follow. */
static void challenge_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    memory_peer_t *p = s->data;
    if (n == 0) return;
    if (n < 0 || p->challenge_got + (size_t)n > sizeof p->challenge) {
        LOG_WARN("memory snapshots: the next node's agent at %s:%u %s", p->next_host, p->next_port,
                 n < 0 ? "closed the connection (another store secret?)" : "sent too much");
        uv_read_stop(s);
        memory_peer__drop_out(p);
        return;
    }
    memcpy(p->challenge + p->challenge_got, buf->base, (size_t)n);
    p->challenge_got += (size_t)n;
    if (p->challenge_got < sizeof p->challenge) return;
    uv_read_stop(s);
    store_auth_random_nonce(p->proof);
    store_auth_mac(&p->secret, MEMORY_PEER_ROLE, p->challenge, p->proof, NULL, 0,
                   p->proof + STORE_AUTH_NONCE_BYTES);
    uv_buf_t pb = uv_buf_init((char *)p->proof, sizeof p->proof);
    if (uv_write(&p->proof_req, s, &pb, 1, NULL) < 0) {
        memory_peer__drop_out(p);
        return;
    }
    p->is_connected = true; /* writes go out in order: frames follow the proof */
}

static void on_connect(uv_connect_t *req, int status) {
    memory_peer_t *p = req->data;
    p->is_connecting = false;
    if (status < 0 || p->is_stopping || req->handle != (uv_stream_t *)p->out) {
        if (status < 0 && !p->is_stopping)
            LOG_WARN("memory snapshots: cannot reach the next node's agent at %s:%u: %s (retrying)",
                     p->next_host, p->next_port, uv_strerror(status));
        if (req->handle == (uv_stream_t *)p->out)
            memory_peer__drop_out(p);
        else if (!uv_is_closing((uv_handle_t *)req->handle))
            uv_close((uv_handle_t *)req->handle, out_closed);
        return;
    }
    memory_peer__keep_alive(p->out);
    if (p->secret.is_set) { /* connected once the receiver's challenge is answered */
        p->challenge_got = 0;
        p->challenge_by = clock_now_s() + CHALLENGE_MS / 1000.0;
        if (uv_read_start((uv_stream_t *)p->out, challenge_alloc, challenge_read) < 0)
            memory_peer__drop_out(p);
        return;
    }
    p->is_connected = true;
}

static void connect_to(memory_peer_t *p, const struct sockaddr *addr) {
    p->out = malloc(sizeof *p->out);
    if (!p->out) return;
    uv_tcp_init(p->loop, p->out);
    p->out->data = p;
    p->open_handles++;
    uv_unref((uv_handle_t *)p->out);
    uv_tcp_nodelay(p->out, 1);
    p->connect_req.data = p;
    if (uv_tcp_connect(&p->connect_req, p->out, addr, on_connect) < 0) {
        memory_peer__drop_out(p);
        return;
    }
    p->is_connecting = true;
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *ai) {
    memory_peer_t *p = req->data;
    p->is_resolving = false;
    /* the round may have named another successor meanwhile: that one is resolved next */
    bool is_current =
        p->has_next && strcmp(p->resolving, p->next_host) == 0 && p->resolving_port == p->next_port;
    if (status == 0 && ai && is_current && !p->is_stopping && !p->out)
        connect_to(p, ai->ai_addr);
    else if (is_current && !p->is_stopping)
        p->retry_at = clock_now_s() + RETRY_MS / 1000.0;
    if (ai) uv_freeaddrinfo(ai);
    memory_peer__maybe_free(p);
}

/* The name is resolved on the thread pool: a slow DNS (a lookup waits seconds for each
 * unreachable nameserver) held the agent's loop, its heartbeats, signals and hosted store, on
 * every retry. */
static void start_connect(memory_peer_t *p) {
    static const struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    char port[8];
    snprintf(port, sizeof port, "%u", p->next_port);
    snprintf(p->resolving, sizeof p->resolving, "%s", p->next_host);
    p->resolving_port = p->next_port;
    p->resolve_req.data = p;
    if (uv_getaddrinfo(p->loop, &p->resolve_req, on_resolved, p->next_host, port, &hints) < 0) {
        p->retry_at = clock_now_s() + RETRY_MS / 1000.0;
        return;
    }
    p->is_resolving = true;
}

/* Thread pool: the slot into buf, then every checksum (the worker may have begun overwriting it).
 */
static void read_slot(uv_work_t *req) {
    memory_peer_t *p = req->data;
    p->is_read_ok = false;
    char path[1500];
    snprintf(path, sizeof path, "%s/own-%d.ddps", p->dir, p->read_slot);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < sizeof(snapshot_header_t) ||
        (uint64_t)st.st_size > MEMORY_PEER_MAX_BYTES) {
        close(fd);
        return;
    }
    size_t n = (size_t)st.st_size;
    if (n > p->buf_cap) {
        uint8_t *grown = realloc(p->buf, n);
        if (!grown) {
            close(fd);
            return;
        }
        p->buf = grown;
        p->buf_cap = n;
    }
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(fd, p->buf + got, n - got, (off_t)got);
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    if (got < n) return;
    snapshot_header_t h;
    memcpy(&h, p->buf, sizeof h);
    if (memory_peer__header_step(&h) != p->read_step || h.n_sections > SNAPSHOT_MAX_SECTIONS)
        return;
    for (uint32_t i = 0; i < h.n_sections; i++) {
        const snapshot_section_t *s = &h.sections[i];
        if (s->offset > n || s->n_bytes > n - s->offset ||
            XXH3_64bits(p->buf + s->offset, s->n_bytes) != s->checksum)
            return;
    }
    p->buf_len = n;
    p->is_read_ok = true;
    p->reached = (uint64_t)p->read_step;
    uint64_t v[2];
    snprintf(path, sizeof path, "%s/progress", p->dir);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 && pread(fd, v, sizeof v, 0) == (ssize_t)sizeof v && v[1] == ~v[0] &&
        v[0] > p->reached)
        p->reached = v[0];
    if (fd >= 0) close(fd);
}

static void on_written(uv_write_t *req, int status) {
    memory_peer_t *p = req->data;
    p->is_writing = false;
    if (p->is_stopping) {
        memory_peer__maybe_free(p);
        return;
    }
    if (status < 0) {
        LOG_WARN("memory snapshots: sending step %lld to %s:%u failed: %s (reconnecting)",
                 (long long)p->read_step, p->next_host, p->next_port, uv_strerror(status));
        memory_peer__drop_out(p);
        return;
    }
    p->sent_step = p->read_step;
}

static void after_read(uv_work_t *req, int status) {
    memory_peer_t *p = req->data;
    p->is_reading = false;
    if (p->is_stopping || status < 0) {
        memory_peer__maybe_free(p);
        return;
    }
    if (!p->is_read_ok || !p->is_connected) return; /* torn by the next generation: the next poll */
    memcpy(p->frame, MEMORY_PEER_MAGIC, 8);
    uint64_t step = (uint64_t)p->read_step, n = p->buf_len;
    memcpy(p->frame + 8, &p->origin, 4);
    memcpy(p->frame + 12, &p->job_tag, 4);
    memcpy(p->frame + 16, &step, 8);
    memcpy(p->frame + 24, &n, 8);
    memcpy(p->frame + 32, &p->reached, 8);
    uv_buf_t bufs[2] = {uv_buf_init((char *)p->frame, FRAME_BYTES),
                        uv_buf_init((char *)p->buf, (unsigned)p->buf_len)};
    p->write_req.data = p;
    if (uv_write(&p->write_req, (uv_stream_t *)p->out, bufs, 2, on_written) < 0) {
        memory_peer__drop_out(p);
        return;
    }
    p->is_writing = true;
}

void memory_peer__on_poll(uv_timer_t *t) {
    memory_peer_t *p = t->data;
    memory_peer__drop_unproven(p);
    if (!p->has_next || p->is_reading || p->is_writing || p->is_connecting || p->is_resolving)
        return;
    if (!p->is_connected) {
        /* p->out: the receiver's challenge is awaited on it (another connection would orphan it,
         * and both nonces would arrive into one challenge) */
        double now = clock_now_s();
        if (!p->out && now >= p->retry_at) {
            start_connect(p);
        } else if (p->out && now >= p->challenge_by) {
            LOG_WARN("memory snapshots: the next node's agent at %s:%u sent no challenge within "
                     "%d s (reconnecting)",
                     p->next_host, p->next_port, CHALLENGE_MS / 1000);
            memory_peer__drop_out(p);
        }
        return;
    }
    int64_t best = -1;
    int slot = -1;
    for (int i = 0; i < 2; i++) {
        char path[1500];
        snprintf(path, sizeof path, "%s/own-%d.ddps", p->dir, i);
        int64_t s = memory_peer__file_step(path);
        if (s > best) {
            best = s;
            slot = i;
        }
    }
    if (best < 0 || best <= p->sent_step) return;
    p->read_slot = slot;
    p->read_step = best;
    p->read_work.data = p;
    if (uv_queue_work(p->loop, &p->read_work, read_slot, after_read) == 0) p->is_reading = true;
}
