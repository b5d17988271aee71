/* memory_peer: see memory_peer.h. One frame per generation on a connection that stays open:
 * magic (8) | origin group rank u32 | 0 u32 | step u64 | n_bytes u64 | reached u64, then the slot
 * file's bytes (a snapshot in the disk format). reached: the step the sender's node had trained to
 * when it sent (its progress file), kept beside the copy (peer-<origin>-progress) so that a
 * restart from the copy can say how many steps the lost node had trained beyond it.
 * Little-endian, as the snapshot itself. The receiving side is memory_peer_recv.c, the sending side
 * memory_peer_send.c; this file finds the next node's agent, starts and stops. */
#include "memory/memory_peer.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "memory/memory_peer_internal.h"
#include "ddp_error.h"
#include "log.h"

void memory_peer__maybe_free(memory_peer_t *p) {
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
    memory_peer__maybe_free(p);
}

/* A sealed header's step (its checksum verifies), else -1. */
int64_t memory_peer__header_step(const snapshot_header_t *h) {
    if (memcmp(h->magic, SNAPSHOT_MAGIC, sizeof h->magic) != 0 || h->version != SNAPSHOT_VERSION ||
        h->header_bytes != sizeof *h || XXH3_64bits(h, HEADER_CHECKED) != h->header_checksum)
        return -1;
    return (int64_t)h->step;
}

int64_t memory_peer__file_step(const char *path) {
    snapshot_header_t h;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = pread(fd, &h, sizeof h, 0);
    close(fd);
    return n == (ssize_t)sizeof h ? memory_peer__header_step(&h) : -1;
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
        memory_peer__maybe_free(p);
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
        if (p->out) memory_peer__drop_out(p);
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
        if (p->out) memory_peer__drop_out(p);
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
    if (rc == 0) rc = uv_listen((uv_stream_t *)&p->listener, 16, memory_peer__on_connection);
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
    uv_timer_start(&p->poll, memory_peer__on_poll, POLL_MS, POLL_MS);
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
    if (p->out) memory_peer__drop_out(p);
    for (conn_t *c = p->conns; c; c = c->next)
        memory_peer__conn_close(c);
    memory_peer__maybe_free(p);
}
