/* memory_peer: see memory_peer.h. One frame per generation on a connection that stays open:
 * magic (8) | origin group rank u32 | 0 u32 | step u64 | n_bytes u64 | reached u64, then the slot
 * file's bytes (a snapshot in the disk format). reached: the step the sender's node had trained to
 * when it sent (its progress file), kept beside the copy (peer-<origin>-progress) so that a
 * restart from the copy can say how many steps the lost node had trained beyond it.
 * Little-endian, as the snapshot itself. */
#include "agent/memory_peer.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "clock.h"
#include "ddp_error.h"
#include "log.h"
#include "snapshot_format.h"
#include "store_auth.h"

#define POLL_MS        10
#define RETRY_MS       500
#define FRAME_BYTES    40
#define LOOKUP_WAIT_MS 2000 /* one wait for the successor's key; repeated until it comes */
#define LOOKUP_TRIES   60
#define HEADER_CHECKED offsetof(snapshot_header_t, header_checksum)

typedef struct conn conn_t;
struct conn {
    uv_tcp_t tcp;
    memory_peer_t *p;
    conn_t *next;
    /* with the store's secret: our nonce, then the sender's nonce and MAC before any frame */
    bool is_authed;
    uint8_t nonce[STORE_AUTH_NONCE_BYTES];
    uint8_t proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES];
    size_t proof_got;
    uv_write_t nonce_req;
    uint8_t frame[FRAME_BYTES];
    size_t frame_got;
    uint32_t origin;
    uint64_t n_bytes, got, reached;
    uint8_t *map;           /* the slot being received, NULL between frames */
    snapshot_header_t head; /* the payload's header, written last */
    char rbuf[1 << 16];
};

struct memory_peer {
    uv_loop_t *loop;
    const ddprun_opts_t *o;
    rdzv_lease_t *lease;
    char dir[1200], host[256];
    uint16_t port;
    uv_tcp_t listener;
    uv_timer_t poll;
    store_secret_t secret; /* the store's (DDPRUN_STORE_SECRET...): peers prove it */
    int open_handles;
    bool is_stopping;
    conn_t *conns;
    /* finding the next node's agent (thread pool) */
    uv_work_t lookup;
    bool is_looking;
    rdzv_kv_t *kv;
    int round, group_rank, n_nodes; /* the newest round asked for */
    int lookup_round, lookup_rank, lookup_nodes;
    char found[300]; /* HOST:PORT of the successor, from the lookup */
    int lookup_rc;
    char lookup_err[300];
    /* sending to it */
    bool has_next;
    char next_host[300];
    uint16_t next_port;
    uint32_t origin; /* our group rank in the round being sent for */
    uv_tcp_t *out;
    bool is_connected, is_connecting;
    double retry_at;
    uv_connect_t connect_req;
    uv_work_t read_work;
    bool is_reading, is_writing, is_read_ok;
    uv_write_t write_req;
    uint8_t *buf;
    size_t buf_cap, buf_len;
    int read_slot;
    int64_t read_step, sent_step;
    uint64_t reached; /* the sender's progress file when its slot was read */
    uint8_t frame[FRAME_BYTES];
    uint8_t challenge[STORE_AUTH_NONCE_BYTES], challenge_buf[64];
    size_t challenge_got;
    uint8_t proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES];
    uv_write_t proof_req;
};

static void maybe_free(memory_peer_t *p) {
    if (p->is_stopping && p->open_handles == 0 && !p->is_looking && !p->is_reading &&
        !p->is_writing) {
        if (p->kv) rdzv_kv_destroy(p->kv);
        free(p->buf);
        free(p);
    }
}

static void on_handle_closed(uv_handle_t *h) {
    memory_peer_t *p = h->data;
    p->open_handles--;
    maybe_free(p);
}

/* A sealed header's step (its checksum verifies), else -1. */
static int64_t header_step(const snapshot_header_t *h) {
    if (memcmp(h->magic, SNAPSHOT_MAGIC, sizeof h->magic) != 0 || h->version != SNAPSHOT_VERSION ||
        h->header_bytes != sizeof *h || XXH3_64bits(h, HEADER_CHECKED) != h->header_checksum)
        return -1;
    return (int64_t)h->step;
}

static int64_t file_step(const char *path) {
    snapshot_header_t h;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = pread(fd, &h, sizeof h, 0);
    close(fd);
    return n == (ssize_t)sizeof h ? header_step(&h) : -1;
}

/* ---- receiving ---- */

static void conn_closed(uv_handle_t *h) {
    conn_t *c = h->data;
    memory_peer_t *p = c->p;
    for (conn_t **q = &p->conns; *q; q = &(*q)->next)
        if (*q == c) {
            *q = c->next;
            break;
        }
    free(c);
    p->open_handles--;
    maybe_free(p);
}

static void conn_close(conn_t *c) {
    if (c->map) munmap(c->map, c->n_bytes); /* its header is zero: an invalid slot */
    c->map = NULL;
    if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, conn_closed);
}

/* Other origins' copies go once a newer origin's is complete: two generations per peer. */
static void remove_other_origins(memory_peer_t *p, uint32_t origin) {
    DIR *d = opendir(p->dir);
    if (!d) return;
    char keep[64];
    snprintf(keep, sizeof keep, "peer-%u-", origin);
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "peer-", 5) != 0 || strncmp(e->d_name, keep, strlen(keep)) == 0)
            continue;
        char path[1500];
        snprintf(path, sizeof path, "%s/%s", p->dir, e->d_name);
        unlink(path);
    }
    closedir(d);
}

/* The frame is complete: open the slot that does not hold origin's newest copy. */
static int begin_payload(conn_t *c) {
    memory_peer_t *p = c->p;
    if (memcmp(c->frame, MEMORY_PEER_MAGIC, 8) != 0) return -EPROTO;
    memcpy(&c->origin, c->frame + 8, 4);
    memcpy(&c->n_bytes, c->frame + 24, 8);
    memcpy(&c->reached, c->frame + 32, 8);
    if (c->n_bytes < sizeof(snapshot_header_t) || c->n_bytes > MEMORY_PEER_MAX_BYTES)
        return -EMSGSIZE;
    char path[2][1500];
    int64_t steps[2];
    for (int i = 0; i < 2; i++) {
        snprintf(path[i], sizeof path[i], "%s/peer-%u-%d.ddps", p->dir, c->origin, i);
        steps[i] = file_step(path[i]);
    }
    int slot = steps[0] <= steps[1] ? 0 : 1;
    int fd = open(path[slot], O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    int rc = ftruncate(fd, (off_t)c->n_bytes) < 0 ? -errno : 0;
    void *map = rc == 0 ? mmap(NULL, c->n_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : NULL;
    if (rc == 0 && map == MAP_FAILED) rc = -errno;
    close(fd);
    if (rc < 0) return rc;
    c->map = map;
    memset(c->map, 0, sizeof(snapshot_header_t)); /* invalid until the whole copy is in */
    c->got = 0;
    return 0;
}

static void end_payload(conn_t *c) {
    int64_t step = header_step(&c->head);
    if (step >= 0) {
        memcpy(c->map, &c->head, sizeof c->head);
        remove_other_origins(c->p, c->origin);
        char path[1500];
        snprintf(path, sizeof path, "%s/peer-%u-progress", c->p->dir, c->origin);
        uint64_t v[2] = {c->reached, ~c->reached};
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            if (pwrite(fd, v, sizeof v, 0) != (ssize_t)sizeof v) unlink(path);
            close(fd);
        }
    } else {
        LOG_WARN("memory snapshot from the node of group rank %u: its header does not verify; "
                 "the copy before it stays",
                 c->origin);
    }
    munmap(c->map, c->n_bytes);
    c->map = NULL;
    c->frame_got = 0;
}

static void conn_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    conn_t *c = h->data;
    *buf = uv_buf_init(c->rbuf, sizeof c->rbuf);
}

static void conn_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    conn_t *c = s->data;
    if (n < 0) {
        if (n != UV_EOF && c->map)
            LOG_WARN("memory snapshot from group rank %u cut at %llu of %llu bytes: %s", c->origin,
                     (unsigned long long)c->got, (unsigned long long)c->n_bytes,
                     uv_strerror((int)n));
        conn_close(c);
        return;
    }
    const uint8_t *b = (const uint8_t *)buf->base;
    size_t left = (size_t)n;
    if (!c->is_authed) { /* the sender's nonce and MAC over both nonces, before anything else */
        size_t take = sizeof c->proof - c->proof_got < left ? sizeof c->proof - c->proof_got : left;
        memcpy(c->proof + c->proof_got, b, take);
        c->proof_got += take;
        b += take;
        left -= take;
        if (c->proof_got < sizeof c->proof) return;
        uint8_t want[STORE_AUTH_MAC_BYTES];
        store_auth_client_mac(&c->p->secret, c->nonce, c->proof, want);
        if (!store_auth_mac_equal(want, c->proof + STORE_AUTH_NONCE_BYTES)) {
            LOG_WARN("memory snapshots: a peer connection without the store's secret refused");
            conn_close(c);
            return;
        }
        c->is_authed = true;
    }
    while (left) {
        if (!c->map) {
            size_t take = FRAME_BYTES - c->frame_got < left ? FRAME_BYTES - c->frame_got : left;
            memcpy(c->frame + c->frame_got, b, take);
            c->frame_got += take;
            b += take;
            left -= take;
            if (c->frame_got < FRAME_BYTES) break;
            int rc = begin_payload(c);
            if (rc < 0) {
                LOG_WARN("memory snapshot from a peer refused: %s",
                         rc == -EPROTO     ? "not a ddprun "
                                             "memory snapshot frame"
                         : rc == -EMSGSIZE ? "size out of bounds"
                                           : strerror(-rc));
                conn_close(c);
                return;
            }
            continue;
        }
        size_t take = c->n_bytes - c->got < left ? (size_t)(c->n_bytes - c->got) : left;
        size_t at = (size_t)c->got;
        if (at < sizeof c->head) { /* the header aside: it lands last */
            size_t h = sizeof c->head - at < take ? sizeof c->head - at : take;
            memcpy((uint8_t *)&c->head + at, b, h);
            if (take > h) memcpy(c->map + at + h, b + h, take - h);
        } else {
            memcpy(c->map + at, b, take);
        }
        c->got += take;
        b += take;
        left -= take;
        if (c->got == c->n_bytes) end_payload(c);
    }
}

static void on_connection(uv_stream_t *server, int status) {
    memory_peer_t *p = server->data;
    if (status < 0 || p->is_stopping) return;
    conn_t *c = calloc(1, sizeof *c);
    if (!c) return;
    c->p = p;
    uv_tcp_init(p->loop, &c->tcp);
    c->tcp.data = c;
    p->open_handles++;
    c->next = p->conns;
    p->conns = c;
    c->is_authed = !p->secret.is_set;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, conn_alloc, conn_read) < 0) {
        conn_close(c);
        return;
    }
    if (!c->is_authed) { /* the challenge: a fresh nonce the sender's MAC must cover */
        store_auth_random_nonce(c->nonce);
        uv_buf_t nb = uv_buf_init((char *)c->nonce, sizeof c->nonce);
        if (uv_write(&c->nonce_req, (uv_stream_t *)&c->tcp, &nb, 1, NULL) < 0) {
            conn_close(c);
            return;
        }
    }
    uv_unref((uv_handle_t *)&c->tcp);
}

/* ---- sending ---- */

static void out_closed(uv_handle_t *h) {
    memory_peer_t *p = h->data;
    free(h);
    p->open_handles--;
    maybe_free(p);
}

static void drop_out(memory_peer_t *p) {
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
        drop_out(p);
        return;
    }
    memcpy(p->challenge + p->challenge_got, buf->base, (size_t)n);
    p->challenge_got += (size_t)n;
    if (p->challenge_got < sizeof p->challenge) return;
    uv_read_stop(s);
    store_auth_random_nonce(p->proof);
    store_auth_client_mac(&p->secret, p->challenge, p->proof, p->proof + STORE_AUTH_NONCE_BYTES);
    uv_buf_t pb = uv_buf_init((char *)p->proof, sizeof p->proof);
    if (uv_write(&p->proof_req, s, &pb, 1, NULL) < 0) {
        drop_out(p);
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
            drop_out(p);
        else if (!uv_is_closing((uv_handle_t *)req->handle))
            uv_close((uv_handle_t *)req->handle, out_closed);
        return;
    }
    if (p->secret.is_set) { /* connected once the receiver's challenge is answered */
        p->challenge_got = 0;
        if (uv_read_start((uv_stream_t *)p->out, challenge_alloc, challenge_read) < 0) drop_out(p);
        return;
    }
    p->is_connected = true;
}

static void start_connect(memory_peer_t *p) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char port[8];
    snprintf(port, sizeof port, "%u", p->next_port);
    if (getaddrinfo(p->next_host, port, &hints, &ai) != 0 || !ai) {
        p->retry_at = clock_now_s() + RETRY_MS / 1000.0;
        return;
    }
    p->out = malloc(sizeof *p->out);
    if (!p->out) {
        freeaddrinfo(ai);
        return;
    }
    uv_tcp_init(p->loop, p->out);
    p->out->data = p;
    p->open_handles++;
    uv_unref((uv_handle_t *)p->out);
    uv_tcp_nodelay(p->out, 1);
    p->connect_req.data = p;
    int rc = uv_tcp_connect(&p->connect_req, p->out, ai->ai_addr, on_connect);
    freeaddrinfo(ai);
    if (rc < 0) {
        drop_out(p);
        return;
    }
    p->is_connecting = true;
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
    if (header_step(&h) != p->read_step || h.n_sections > SNAPSHOT_MAX_SECTIONS) return;
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
        maybe_free(p);
        return;
    }
    if (status < 0) {
        LOG_WARN("memory snapshots: sending step %lld to %s:%u failed: %s (reconnecting)",
                 (long long)p->read_step, p->next_host, p->next_port, uv_strerror(status));
        drop_out(p);
        return;
    }
    p->sent_step = p->read_step;
}

static void after_read(uv_work_t *req, int status) {
    memory_peer_t *p = req->data;
    p->is_reading = false;
    if (p->is_stopping || status < 0) {
        maybe_free(p);
        return;
    }
    if (!p->is_read_ok || !p->is_connected) return; /* torn by the next generation: the next poll */
    memcpy(p->frame, MEMORY_PEER_MAGIC, 8);
    uint32_t zero = 0;
    uint64_t step = (uint64_t)p->read_step, n = p->buf_len;
    memcpy(p->frame + 8, &p->origin, 4);
    memcpy(p->frame + 12, &zero, 4);
    memcpy(p->frame + 16, &step, 8);
    memcpy(p->frame + 24, &n, 8);
    memcpy(p->frame + 32, &p->reached, 8);
    uv_buf_t bufs[2] = {uv_buf_init((char *)p->frame, FRAME_BYTES),
                        uv_buf_init((char *)p->buf, (unsigned)p->buf_len)};
    p->write_req.data = p;
    if (uv_write(&p->write_req, (uv_stream_t *)p->out, bufs, 2, on_written) < 0) {
        drop_out(p);
        return;
    }
    p->is_writing = true;
}

static void on_poll(uv_timer_t *t) {
    memory_peer_t *p = t->data;
    if (!p->has_next || p->is_reading || p->is_writing || p->is_connecting) return;
    if (!p->is_connected) {
        if (clock_now_s() >= p->retry_at) start_connect(p);
        return;
    }
    int64_t best = -1;
    int slot = -1;
    for (int i = 0; i < 2; i++) {
        char path[1500];
        snprintf(path, sizeof path, "%s/own-%d.ddps", p->dir, i);
        int64_t s = file_step(path);
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

/* ---- the successor ---- */

static void lookup_work(uv_work_t *req) {
    memory_peer_t *p = req->data;
    p->lookup_rc = 0;
    p->found[0] = '\0';
    if (!p->kv) {
        p->lookup_rc = rdzv_kv_connect(p->o, p->lease, 5000, LOOKUP_WAIT_MS, &p->kv);
        if (p->lookup_rc < 0) {
            snprintf(p->lookup_err, sizeof p->lookup_err, "%s",
                     p->kv ? p->kv->ops->error(p->kv) : "cannot connect");
            rdzv_kv_destroy(p->kv);
            p->kv = NULL;
            return;
        }
    }
    char key[400], next[400], val[300];
    snprintf(key, sizeof key, "/ddprun/%s/memsnap/r%d/%d", p->o->rdzv_id, p->lookup_round,
             p->lookup_rank);
    snprintf(next, sizeof next, "/ddprun/%s/memsnap/r%d/%d", p->o->rdzv_id, p->lookup_round,
             (p->lookup_rank + 1) % p->lookup_nodes);
    int n = snprintf(val, sizeof val, "%s:%u", p->host, p->port);
    int rc = p->kv->ops->set(p->kv, key, val, (size_t)n);
    const char *keys[1] = {next};
    for (int i = 0; rc == 0 && i < LOOKUP_TRIES; i++) {
        rc = p->kv->ops->wait(p->kv, keys, 1, LOOKUP_WAIT_MS);
        if (rc == 0 || rc != DDP_ETIMEOUT || p->is_stopping || p->round != p->lookup_round) break;
        rc = 0;
    }
    uint8_t *got = NULL;
    size_t len = 0;
    if (rc == 0) rc = p->kv->ops->get(p->kv, next, &got, &len);
    if (rc == 0 && len < sizeof p->found) {
        memcpy(p->found, got, len);
        p->found[len] = '\0';
    } else if (rc == 0) {
        rc = -EMSGSIZE;
    }
    free(got);
    p->lookup_rc = rc;
    if (rc < 0) snprintf(p->lookup_err, sizeof p->lookup_err, "%s", p->kv->ops->error(p->kv));
}

static void start_lookup(memory_peer_t *p);

static void after_lookup(uv_work_t *req, int status) {
    memory_peer_t *p = req->data;
    p->is_looking = false;
    if (p->is_stopping || status < 0) {
        maybe_free(p);
        return;
    }
    if (p->lookup_round != p->round) { /* a newer round came meanwhile */
        start_lookup(p);
        return;
    }
    char *colon = strrchr(p->found, ':');
    long port = colon ? strtol(colon + 1, NULL, 10) : 0;
    if (p->lookup_rc < 0 || !colon || port <= 0 || port > 65535) {
        if (p->lookup_rc < 0)
            LOG_WARN(
                "memory snapshots: the next node's agent (round %d) not found: %s; this node's "
                "copies stay local",
                p->lookup_round, p->lookup_err);
        return;
    }
    *colon = '\0';
    bool is_same = p->has_next && strcmp(p->next_host, p->found) == 0 && p->next_port == port;
    snprintf(p->next_host, sizeof p->next_host, "%s", p->found);
    p->next_port = (uint16_t)port;
    p->origin = (uint32_t)p->lookup_rank;
    p->has_next = true;
    if (!is_same) {
        if (p->out) drop_out(p);
        p->retry_at = 0;
        p->sent_step = -1;
    }
}

static void start_lookup(memory_peer_t *p) {
    p->lookup_round = p->round;
    p->lookup_rank = p->group_rank;
    p->lookup_nodes = p->n_nodes;
    p->lookup.data = p;
    if (uv_queue_work(p->loop, &p->lookup, lookup_work, after_lookup) == 0) p->is_looking = true;
}

void memory_peer_round(memory_peer_t *p, int round, int group_rank, int n_nodes) {
    if (!p || p->is_stopping) return;
    p->round = round;
    p->group_rank = group_rank;
    p->n_nodes = n_nodes;
    if (n_nodes < 2 || group_rank < 0) { /* alone: nobody to send to */
        p->has_next = false;
        if (p->out) drop_out(p);
        return;
    }
    if (!p->is_looking) start_lookup(p);
}

/* ---- life ---- */

int memory_peer_start(uv_loop_t *loop, const ddprun_opts_t *o, rdzv_lease_t *lease, const char *dir,
                      memory_peer_t **out, char *err, size_t err_len) {
    *out = NULL;
    memory_peer_t *p = calloc(1, sizeof *p);
    if (!p) return ddp_errf(err, err_len, "memory snapshots: out of memory"), -ENOMEM;
    p->loop = loop;
    p->o = o;
    p->lease = lease;
    p->sent_step = -1;
    p->round = -1;
    snprintf(p->dir, sizeof p->dir, "%s", dir);
    if (store_secret_from_env(&p->secret, err, err_len) < 0 ||
        (p->secret.is_set && store_auth_init() < 0)) {
        free(p);
        return -EINVAL;
    }
    if (o->local_addr[0])
        snprintf(p->host, sizeof p->host, "%s", o->local_addr);
    else if (gethostname(p->host, sizeof p->host - 1) != 0)
        snprintf(p->host, sizeof p->host, "127.0.0.1");
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *ai = NULL;
    if (getaddrinfo(p->host, "0", &hints, &ai) != 0 || !ai) {
        ddp_errf(err, err_len,
                 "memory snapshots: cannot resolve this node's address %s "
                 "(--local-addr)",
                 p->host);
        free(p);
        return -EADDRNOTAVAIL;
    }
    uv_tcp_init(loop, &p->listener);
    p->listener.data = p;
    p->open_handles++;
    int rc = uv_tcp_bind(&p->listener, ai->ai_addr, 0);
    freeaddrinfo(ai);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&p->listener, 16, on_connection);
    struct sockaddr_storage sa;
    int len = sizeof sa;
    if (rc == 0) rc = uv_tcp_getsockname(&p->listener, (struct sockaddr *)&sa, &len);
    if (rc < 0) {
        ddp_errf(err, err_len, "memory snapshots: cannot listen on %s: %s", p->host,
                 uv_strerror(rc));
        p->is_stopping = true;
        uv_close((uv_handle_t *)&p->listener, on_handle_closed);
        return rc;
    }
    p->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    uv_unref((uv_handle_t *)&p->listener);
    uv_timer_init(loop, &p->poll);
    p->poll.data = p;
    p->open_handles++;
    uv_timer_start(&p->poll, on_poll, POLL_MS, POLL_MS);
    uv_unref((uv_handle_t *)&p->poll);
    *out = p;
    return 0;
}

void memory_peer_stop(memory_peer_t *p) {
    if (!p || p->is_stopping) return;
    p->is_stopping = true;
    if (p->is_looking && p->kv) p->kv->ops->interrupt(p->kv);
    uv_close((uv_handle_t *)&p->listener, on_handle_closed);
    uv_close((uv_handle_t *)&p->poll, on_handle_closed);
    if (p->out) drop_out(p);
    for (conn_t *c = p->conns; c; c = c->next)
        conn_close(c);
    maybe_free(p);
}
