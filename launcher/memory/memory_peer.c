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
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "memory/memory_peer_internal.h"
#include "ddp_error.h"
#include "log.h"
#include "xxh3_simd.h"

void memory_peer__maybe_free(memory_peer_t *p) {
    if (p->is_stopping && p->open_handles == 0 && !p->is_reading && !p->is_writing &&
        !p->is_resolving) {
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

void memory_peer__keep_alive(uv_tcp_t *t) {
    enum { IDLE_S = 10, INTERVAL_S = 5, PROBES = 3, UNACKED_MS = 30000 };
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)t, &fd) < 0) return;
    int on = 1, idle = IDLE_S, interval = INTERVAL_S, probes = PROBES;
    unsigned unacked = UNACKED_MS;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &unacked, sizeof unacked);
}

/* ---- the successor ---- */

void memory_peer_round(memory_peer_t *p, int round, int group_rank, int n_nodes,
                       const char *next_host, uint16_t next_port) {
    if (!p || p->is_stopping) return;
    p->round = round;
    if (n_nodes < 2 || group_rank < 0 || !next_host[0]) { /* alone, or the next keeps none */
        if (n_nodes >= 2 && group_rank >= 0)
            LOG_WARN("memory snapshots: the next node's agent (round %d) takes no copies; this "
                     "node's stay local",
                     round);
        p->has_next = false;
        if (p->out) memory_peer__drop_out(p);
        return;
    }
    bool is_same = p->has_next && strcmp(p->next_host, next_host) == 0 && p->next_port == next_port;
    snprintf(p->next_host, sizeof p->next_host, "%s", next_host);
    p->next_port = next_port;
    p->origin = (uint32_t)group_rank;
    p->has_next = true;
    if (!is_same) {
        if (p->out) memory_peer__drop_out(p);
        p->retry_at = 0;
        p->sent_step = -1;
    }
}

void memory_peer_address(const memory_peer_t *p, const char **host, uint16_t *port) {
    *host = p->host;
    *port = p->port;
}

/* ---- life ---- */

int memory_peer_start(uv_loop_t *loop, const ddprun_opts_t *o, const char *dir, memory_peer_t **out,
                      char *err, size_t err_len) {
    *out = NULL;
    memory_peer_t *p = calloc(1, sizeof *p);
    if (!p) return ddp_errf(err, err_len, "memory snapshots: out of memory"), -ENOMEM;
    p->loop = loop;
    p->o = o;
    p->sent_step = -1;
    p->round = -1;
    snprintf(p->dir, sizeof p->dir, "%s", dir);
    p->job_tag = (uint32_t)XXH3_64bits(o->rdzv_id, strlen(o->rdzv_id));
    p->secret = o->store_secret;
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
    if (p->is_resolving) uv_cancel((uv_req_t *)&p->resolve_req); /* only if not begun yet */
    uv_close((uv_handle_t *)&p->listener, on_handle_closed);
    uv_close((uv_handle_t *)&p->poll, on_handle_closed);
    if (p->out) memory_peer__drop_out(p);
    for (conn_t *c = p->conns; c; c = c->next)
        memory_peer__conn_close(c);
    memory_peer__maybe_free(p);
}
