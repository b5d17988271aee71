/* memory_peer_recv: the receiving side of memory_peer (memory_peer.h): peers' generations, one
 * frame each on a connection that stays open, written into this node's region header-last, two per
 * peer. The agent's loop thread. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "memory/memory_peer_internal.h"
#include "clock.h"
#include "log.h"

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
    memory_peer__maybe_free(p);
}

void memory_peer__conn_close(conn_t *c) {
    if (c->map) munmap(c->map, c->n_bytes); /* its header is zero: an invalid slot */
    c->map = NULL;
    if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, conn_closed);
}

/* Other origins' copies go once origin's copy of step is complete (two generations per peer):
 * those of an older step, or none that verifies. A newer one stays (its node's state, which a
 * resume may still need: ranks are renumbered by rounds, the copies are not), as does its
 * progress file while a copy of its origin is left. */
static void remove_other_origins(memory_peer_t *p, uint32_t origin, int64_t step) {
    char keep[64];
    snprintf(keep, sizeof keep, "peer-%u-", origin);
    for (int pass = 0; pass < 2; pass++) { /* copies, then the progress files left alone */
        DIR *d = opendir(p->dir);
        if (!d) return;
        for (struct dirent *e; (e = readdir(d));) {
            unsigned other;
            char kind[16], extra;
            if (strncmp(e->d_name, keep, strlen(keep)) == 0 ||
                sscanf(e->d_name, "peer-%u-%15[a-z0-9.]%c", &other, kind, &extra) != 2)
                continue;
            char path[1500];
            snprintf(path, sizeof path, "%s/%s", p->dir, e->d_name);
            bool is_progress = strcmp(kind, "progress") == 0;
            if (pass == 0 && !is_progress && memory_peer__file_step(path) <= step) unlink(path);
            if (pass == 1 && is_progress) {
                char copy[2][1500];
                for (int i = 0; i < 2; i++)
                    snprintf(copy[i], sizeof copy[i], "%s/peer-%u-%d.ddps", p->dir, other, i);
                if (access(copy[0], F_OK) != 0 && access(copy[1], F_OK) != 0) unlink(path);
            }
        }
        closedir(d);
    }
}

/* The frame is complete: open the slot that does not hold origin's newest copy. */
static int begin_payload(conn_t *c) {
    memory_peer_t *p = c->p;
    if (memcmp(c->frame, MEMORY_PEER_MAGIC, 8) != 0) return -EPROTO;
    uint32_t job_tag;
    memcpy(&job_tag, c->frame + 12, 4);
    /* another job's agent (reusing the port of one of this job's that died): not ours to keep */
    if (job_tag != p->job_tag) return -EXDEV;
    memcpy(&c->origin, c->frame + 8, 4);
    memcpy(&c->n_bytes, c->frame + 24, 8);
    memcpy(&c->reached, c->frame + 32, 8);
    if (c->n_bytes < sizeof(snapshot_header_t) || c->n_bytes > MEMORY_PEER_MAX_BYTES)
        return -EMSGSIZE;
    char path[2][1500];
    int64_t steps[2];
    for (int i = 0; i < 2; i++) {
        snprintf(path[i], sizeof path[i], "%s/peer-%u-%d.ddps", p->dir, c->origin, i);
        steps[i] = memory_peer__file_step(path[i]);
    }
    int slot = steps[0] <= steps[1] ? 0 : 1;
    int fd = open(path[slot], O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    int rc = ftruncate(fd, (off_t)c->n_bytes) < 0 ? -errno : 0;
    if (rc == 0) /* reserved: a full tmpfs would make the copy's writes a SIGBUS of the agent */
        rc = -posix_fallocate(fd, 0, (off_t)c->n_bytes);
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
    int64_t step = memory_peer__header_step(&c->head);
    if (step >= 0) {
        memcpy(c->map, &c->head, sizeof c->head);
        remove_other_origins(c->p, c->origin, step);
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
        memory_peer__conn_close(c);
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
        store_auth_mac(&c->p->secret, MEMORY_PEER_ROLE, c->nonce, c->proof, NULL, 0, want);
        if (!store_auth_mac_equal(want, c->proof + STORE_AUTH_NONCE_BYTES)) {
            LOG_WARN("memory snapshots: a peer connection without the store's secret refused");
            memory_peer__conn_close(c);
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
                LOG_WARN("memory snapshot from a peer refused: %s (%s)",
                         rc == -EPROTO     ? "not a ddprun "
                                             "memory snapshot frame"
                         : rc == -EMSGSIZE ? "size out of bounds"
                         : rc == -EXDEV    ? "sent by an agent of another run id"
                                           : strerror(-rc),
                         c->p->dir);
                memory_peer__conn_close(c);
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

void memory_peer__drop_unproven(memory_peer_t *p) {
    double now = clock_now_s();
    for (conn_t *c = p->conns; c; c = c->next)
        if (!c->is_authed && now >= c->proof_by && !uv_is_closing((uv_handle_t *)&c->tcp)) {
            LOG_WARN("memory snapshots: a peer connection sent no proof of the store's secret "
                     "within %d s: closed",
                     PROOF_MS / 1000);
            memory_peer__conn_close(c);
        }
}

void memory_peer__on_connection(uv_stream_t *server, int status) {
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
        memory_peer__conn_close(c);
        return;
    }
    memory_peer__keep_alive(&c->tcp);
    if (!c->is_authed) { /* the challenge: a fresh nonce the sender's MAC must cover */
        c->proof_by = clock_now_s() + PROOF_MS / 1000.0;
        store_auth_random_nonce(c->nonce);
        uv_buf_t nb = uv_buf_init((char *)c->nonce, sizeof c->nonce);
        if (uv_write(&c->nonce_req, (uv_stream_t *)&c->tcp, &nb, 1, NULL) < 0) {
            memory_peer__conn_close(c);
            return;
        }
    }
    uv_unref((uv_handle_t *)&c->tcp);
}
