/* comm_ring: collectives over a TCP ring of the job's workers. Rank r holds one connection to
 * rank r+1 (next, it only sends there) and one from rank r-1 (prev, it only receives there);
 * addresses go through the job's store. All-reduce is reduce-scatter then all-gather (2 (W-1)/W
 * of the data per rank on the wire), in pieces so a bounded scratch buffer suffices; each step
 * sends and receives at once through poll(2) on non-blocking sockets, so no ordering deadlocks.
 * Every wait is bounded: no progress for timeout_ms (per wait, not per collective: a 1 GB
 * all-reduce may take longer, a stalled peer may not) is a failure naming the silent peer; and a
 * collective as a whole gets timeout_ms plus its bytes at RING_MIN_BYTES_PER_S, so a peer that
 * trickles a byte now and then (progress, each time) cannot hold a rank without end. Each
 * collective opens with a small frame (op, sequence number, size, root) checked against prev's, so
 * ranks that disagree on what they are doing fail with a message instead of mixing bytes. After a
 * failure every call returns the same error. Runs on whichever single thread calls it. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "comm.h"
#include "ddp_error.h"

#define RING_PIECE_BYTES         (1u << 18)
#define RING_MAGIC               0x444450524e473031ull /* "DDPRNG01" */
#define RING_SOCKET_BUFFER_BYTES (4 << 20)
#define RING_FRAME_MAGIC         0x52444444u  /* "DDDR" */
#define RING_MIN_BYTES_PER_S     (256u << 10) /* a 2 Mbit/s link still passes */

enum { RING_OP_ALLREDUCE_F32 = 1, RING_OP_ALLREDUCE_F64, RING_OP_BROADCAST, RING_OP_BARRIER };

typedef struct {
    uint64_t magic, job_hash;
    uint32_t rank, world;
} ring_hello_t;

/* Opens every collective on the wire, rank -> next; equal on every rank when all is well. */
typedef struct {
    uint32_t magic, op;
    uint64_t seq, n_bytes;
    int64_t root; /* broadcast's; -1 otherwise */
} ring_frame_t;

typedef struct {
    comm_t base;
    int next_fd, prev_fd;
    char next_addr[80], prev_addr[80];
    int64_t timeout_ms;
    uint8_t *scratch;  /* RING_PIECE_BYTES */
    const char *doing; /* the collective in progress, for messages */
    uint64_t seq;      /* collectives begun so far */
    int64_t bound_ms;  /* the collective in progress ends by then (clock_now_ms) */
    int failed_rc;     /* 0, or the code of the failure that made this ring unusable */
} ring_t;

typedef void (*add_fn)(void *dst, const void *src, size_t n_elems);

static void add_f32(void *dst, const void *src, size_t n) {
    float *d = dst;
    const float *s = src;
    for (size_t i = 0; i < n; i++)
        d[i] += s[i];
}

static void add_f64(void *dst, const void *src, size_t n) {
    double *d = dst;
    const double *s = src;
    for (size_t i = 0; i < n; i++)
        d[i] += s[i];
}

static int ring_fail(ring_t *r, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int ring_fail(ring_t *r, int rc, const char *fmt, ...) {
    r->failed_rc = rc;
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(r->base.err, sizeof r->base.err, "ring: ");
    vsnprintf(r->base.err + n, sizeof r->base.err - (size_t)n, fmt, ap);
    va_end(ap);
    return rc;
}

static int prev_rank(const ring_t *r) {
    return (r->base.rank + r->base.world - 1) % r->base.world;
}
static int next_rank(const ring_t *r) {
    return (r->base.rank + 1) % r->base.world;
}

/* Send send_len bytes to next while receiving recv_len bytes from prev (either may be 0). With
 * add, what arrives is added into recv_buf (elements of elem bytes) instead of copied: it lands in
 * scratch one piece at a time, so the sender streams its whole chunk ahead of the additions. */
static int exchange_add(ring_t *r, const void *send_buf, size_t send_len, void *recv_buf,
                        size_t recv_len, add_fn add, size_t elem) {
    const uint8_t *s = send_buf;
    uint8_t *d = recv_buf;
    size_t sent = 0, got = 0, fill = 0; /* fill: bytes of the current piece in scratch */
    int64_t last_progress = (int64_t)clock_now_ms();
    while (sent < send_len || got < recv_len) {
        struct pollfd p[2];
        int n = 0, send_at = -1, recv_at = -1;
        if (sent < send_len) {
            p[n] = (struct pollfd){.fd = r->next_fd, .events = POLLOUT};
            send_at = n++;
        }
        if (got < recv_len) {
            p[n] = (struct pollfd){.fd = r->prev_fd, .events = POLLIN};
            recv_at = n++;
        }
        int64_t now = (int64_t)clock_now_ms();
        int64_t left = r->timeout_ms - (now - last_progress);
        bool is_bounded = r->bound_ms && r->bound_ms - now < left;
        if (is_bounded) left = r->bound_ms - now;
        int ready = left > 0 ? poll(p, (nfds_t)n, (int)(left > 1000000000 ? 1000000000 : left)) : 0;
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0)
            return ring_fail(r, -errno, "poll failed during %s: %s", r->doing, strerror(errno));
        if (ready == 0) {
            bool is_recv_stuck = got < recv_len;
            if (is_bounded)
                return ring_fail(
                    r, DDP_ETIMEOUT,
                    "rank %d (%s, %s) moves its data too slowly: %s did not end within "
                    "collective_timeout (%lld ms) plus %u KiB/s for its bytes",
                    is_recv_stuck ? prev_rank(r) : next_rank(r),
                    is_recv_stuck ? r->prev_addr : r->next_addr, is_recv_stuck ? "prev" : "next",
                    r->doing, (long long)r->timeout_ms, RING_MIN_BYTES_PER_S >> 10);
            return ring_fail(
                r, DDP_ETIMEOUT, "no data %s rank %d (%s, %s) for %lld ms during %s; is it alive?",
                is_recv_stuck ? "from" : "to", is_recv_stuck ? prev_rank(r) : next_rank(r),
                is_recv_stuck ? r->prev_addr : r->next_addr, is_recv_stuck ? "prev" : "next",
                (long long)r->timeout_ms, r->doing);
        }
        if (send_at >= 0 && p[send_at].revents) {
            ssize_t k = send(r->next_fd, s + sent, send_len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0) {
                sent += (size_t)k;
                last_progress = (int64_t)clock_now_ms();
            } else if (k < 0 && errno != EAGAIN && errno != EINTR) {
                return ring_fail(r, DDP_ECLOSED,
                                 "sending to rank %d (%s, next) failed during %s: %s", next_rank(r),
                                 r->next_addr, r->doing, strerror(errno));
            }
        }
        if (recv_at >= 0 && p[recv_at].revents) {
            size_t piece_len = recv_len - got + fill;
            if (piece_len > RING_PIECE_BYTES) piece_len = RING_PIECE_BYTES;
            ssize_t k = add ? recv(r->prev_fd, r->scratch + fill, piece_len - fill, MSG_DONTWAIT)
                            : recv(r->prev_fd, d + got, recv_len - got, MSG_DONTWAIT);
            if (k > 0) {
                got += (size_t)k;
                last_progress = (int64_t)clock_now_ms();
                fill += (size_t)k;
                if (add && fill == piece_len) { /* piece_len is whole elements */
                    add(d + got - fill, r->scratch, piece_len / elem);
                    fill = 0;
                }
            } else if (k == 0) {
                return ring_fail(r, DDP_ECLOSED,
                                 "rank %d (%s, prev) closed the connection during %s", prev_rank(r),
                                 r->prev_addr, r->doing);
            } else if (errno != EAGAIN && errno != EINTR) {
                return ring_fail(r, DDP_ECLOSED,
                                 "receiving from rank %d (%s, prev) failed during %s: %s",
                                 prev_rank(r), r->prev_addr, r->doing, strerror(errno));
            }
        }
    }
    return 0;
}

static int exchange(ring_t *r, const void *send_buf, size_t send_len, void *recv_buf,
                    size_t recv_len) {
    return exchange_add(r, send_buf, send_len, recv_buf, recv_len, NULL, 0);
}

static const char *op_name(uint32_t op) {
    switch (op) {
    case RING_OP_ALLREDUCE_F32:
        return "allreduce(f32)";
    case RING_OP_ALLREDUCE_F64:
        return "allreduce(f64)";
    case RING_OP_BROADCAST:
        return "broadcast";
    case RING_OP_BARRIER:
        return "barrier";
    default:
        return "an unknown op";
    }
}

static void describe(const ring_frame_t *f, char *out, size_t out_len) {
    int n =
        snprintf(out, out_len, "%s of %llu bytes", op_name(f->op), (unsigned long long)f->n_bytes);
    if (f->op == RING_OP_BROADCAST && n > 0 && (size_t)n < out_len)
        snprintf(out + n, out_len - (size_t)n, " from rank %lld", (long long)f->root);
    snprintf(out + strlen(out), out_len - strlen(out), " as collective #%llu",
             (unsigned long long)f->seq);
}

/* Start a collective: refuse on a broken ring, then check that prev entered the same one. */
static int begin(ring_t *r, uint32_t op, size_t n_bytes, int root) {
    if (r->failed_rc < 0) return r->failed_rc; /* err still says why */
    r->doing = op == RING_OP_BARRIER     ? "barrier"
               : op == RING_OP_BROADCAST ? "broadcast"
                                         : "allreduce";
    /* what each rank moves: 2 (W-1)/W of the data for an all-reduce, at most twice for the rest */
    uint64_t wire_bytes = 2 * (uint64_t)n_bytes + sizeof(ring_frame_t);
    r->bound_ms = (int64_t)clock_now_ms() + r->timeout_ms +
                  (int64_t)(wire_bytes * 1000 / RING_MIN_BYTES_PER_S);
    ring_frame_t mine = {.magic = RING_FRAME_MAGIC,
                         .op = op,
                         .seq = r->seq++,
                         .n_bytes = n_bytes,
                         .root = root},
                 theirs;
    int rc = exchange(r, &mine, sizeof mine, &theirs, sizeof theirs);
    if (rc < 0) return rc;
    if (theirs.magic != RING_FRAME_MAGIC)
        return ring_fail(r, DDP_EPROTO, "rank %d (%s, prev) sent a malformed frame during %s",
                         prev_rank(r), r->prev_addr, r->doing);
    if (theirs.op != mine.op || theirs.seq != mine.seq || theirs.n_bytes != mine.n_bytes ||
        theirs.root != mine.root) {
        char want[96], got[96];
        describe(&mine, want, sizeof want);
        describe(&theirs, got, sizeof got);
        return ring_fail(r, DDP_EPROTO,
                         "rank %d (%s, prev) entered %s while rank %d entered %s; every rank must "
                         "call the same collectives with the same sizes in the same order",
                         prev_rank(r), r->prev_addr, got, r->base.rank, want);
    }
    return 0;
}

/* Chunk i of n elements split among world ranks: [chunk_start(i), chunk_start(i + 1)). */
static size_t chunk_start(size_t n, int world, int i) {
    return n * (size_t)i / (size_t)world;
}

static int allreduce(ring_t *r, uint32_t op, void *data, size_t n, size_t elem, add_fn add) {
    int world = r->base.world, rank = r->base.rank;
    if (world == 1) return 0;
    int rc = begin(r, op, n * elem, -1);
    if (rc < 0 || n == 0) return rc;
    uint8_t *base = data;
    /* reduce-scatter: after world - 1 steps rank r holds the full sum of chunk r + 1 */
    for (int step = 0; step < 2 * (world - 1); step++) {
        bool is_gather = step >= world - 1;
        int s = is_gather ? step - (world - 1) : step;
        int send_chunk = ((rank - s + (is_gather ? 1 : 0)) % world + world) % world;
        int recv_chunk = ((rank - s - (is_gather ? 0 : 1)) % world + world) % world;
        size_t send_lo = chunk_start(n, world, send_chunk),
               send_hi = chunk_start(n, world, send_chunk + 1);
        size_t recv_lo = chunk_start(n, world, recv_chunk),
               recv_hi = chunk_start(n, world, recv_chunk + 1);
        /* the chunk sent in this step was completed in the previous one: it streams whole */
        rc = exchange_add(r, base + send_lo * elem, (send_hi - send_lo) * elem,
                          base + recv_lo * elem, (recv_hi - recv_lo) * elem, is_gather ? NULL : add,
                          elem);
        if (rc < 0) return rc;
    }
    return 0;
}

static int ring_allreduce_f32(comm_t *c, float *data, size_t n) {
    return allreduce((ring_t *)c, RING_OP_ALLREDUCE_F32, data, n, sizeof(float), add_f32);
}

static int ring_allreduce_f64(comm_t *c, double *data, size_t n) {
    return allreduce((ring_t *)c, RING_OP_ALLREDUCE_F64, data, n, sizeof(double), add_f64);
}

/* Passed along the ring from root, piece by piece, so the ranks work as a pipeline. */
static int ring_broadcast(comm_t *c, void *data, size_t n_bytes, int root) {
    ring_t *r = (ring_t *)c;
    if (c->world == 1) return 0;
    if (root < 0 || root >= c->world)
        return ring_fail(r, -EINVAL, "broadcast from rank %d, outside the world of %d", root,
                         c->world);
    int rc = begin(r, RING_OP_BROADCAST, n_bytes, root);
    if (rc < 0) return rc;
    bool is_root = c->rank == root, is_last = next_rank(r) == root;
    uint8_t *p = data;
    for (size_t off = 0; off < n_bytes; off += RING_PIECE_BYTES) {
        size_t len = n_bytes - off < RING_PIECE_BYTES ? n_bytes - off : RING_PIECE_BYTES;
        rc = is_root ? 0 : exchange(r, NULL, 0, p + off, len);
        if (rc == 0 && !is_last) rc = exchange(r, p + off, len, NULL, 0);
        if (rc < 0) return rc;
    }
    return 0;
}

static int ring_barrier(comm_t *c) {
    ring_t *r = (ring_t *)c;
    double token = 1;
    return allreduce(r, RING_OP_BARRIER, &token, 1, sizeof token, add_f64);
}

static void ring_destroy(comm_t *c) {
    ring_t *r = (ring_t *)c;
    if (r->next_fd >= 0) close(r->next_fd);
    if (r->prev_fd >= 0) close(r->prev_fd);
    free(r->scratch);
    free(r);
}

static const comm_i ring_ops = {
    .name = "ring",
    .allreduce_sum_f32 = ring_allreduce_f32,
    .allreduce_sum_f64 = ring_allreduce_f64,
    .broadcast = ring_broadcast,
    .barrier = ring_barrier,
    .destroy = ring_destroy,
};

/* ---- setting the ring up ---- */

static uint64_t hash_text(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static void tune_socket(int fd) {
    int one = 1, size = RING_SOCKET_BUFFER_BYTES;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

/* This host's address as seen on the route to the store (no packet is sent). */
static int route_address(const char *store_host, char *out, size_t out_len) {
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_DGRAM}, *ai = NULL;
    if (getaddrinfo(store_host, "9", &hints, &ai) != 0 || !ai) return -EHOSTUNREACH;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in local;
    socklen_t len = sizeof local;
    int rc = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                     getsockname(fd, (struct sockaddr *)&local, &len) == 0
                 ? 0
                 : -errno;
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
    if (rc == 0 && !inet_ntop(AF_INET, &local.sin_addr, out, (socklen_t)out_len)) rc = -EINVAL;
    return rc;
}

static int wait_fd(int fd, short events, int64_t deadline_ms) {
    for (;;) {
        int64_t left = deadline_ms - (int64_t)clock_now_ms();
        if (left <= 0) return DDP_ETIMEOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, (int)(left > 1000000 ? 1000000 : left));
        if (rc > 0) return 0;
        if (rc < 0 && errno != EINTR) return -errno;
    }
}

/* Blocking full write/read on a non-blocking socket, bounded by deadline_ms. */
static int io_all(int fd, void *buf, size_t len, bool is_write, int64_t deadline_ms) {
    uint8_t *p = buf;
    while (len) {
        int rc = wait_fd(fd, is_write ? POLLOUT : POLLIN, deadline_ms);
        if (rc < 0) return rc;
        ssize_t k = is_write ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                             : recv(fd, p, len, MSG_DONTWAIT);
        if (k == 0) return DDP_ECLOSED;
        if (k < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            return -errno;
        }
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

static int split_address(const char *text, size_t len, char *host, size_t host_len, char *port,
                         size_t port_len) {
    const char *colon = memrchr(text, ':', len);
    if (!colon || (size_t)(colon - text) >= host_len ||
        len - (size_t)(colon - text) - 1 >= port_len || colon == text ||
        (size_t)(colon - text) + 1 == len)
        return -EINVAL;
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = '\0';
    memcpy(port, colon + 1, len - (size_t)(colon - text) - 1);
    port[len - (size_t)(colon - text) - 1] = '\0';
    return 0;
}

/* Connect to next (retrying while it is not listening yet) and say who we are. */
static int connect_next(ring_t *r, const char *host, const char *port, const ring_hello_t *hello,
                        int64_t deadline_ms) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0)
        return ring_fail(r, -EHOSTUNREACH, "rank %d's address %s: %s", next_rank(r), r->next_addr,
                         gai_strerror(rc));
    int delay_ms = 10;
    for (;;) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            rc = -errno;
            break;
        }
        tune_socket(fd);
        rc = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS ? 0 : -errno;
        if (rc == 0) rc = wait_fd(fd, POLLOUT, deadline_ms);
        int so_error = 0;
        socklen_t len = sizeof so_error;
        if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error)
            rc = -so_error;
        if (rc == 0) rc = io_all(fd, (void *)(uintptr_t)hello, sizeof *hello, true, deadline_ms);
        if (rc == 0) {
            r->next_fd = fd;
            break;
        }
        close(fd);
        if (rc == DDP_ETIMEOUT || (int64_t)clock_now_ms() + delay_ms >= deadline_ms) {
            rc = DDP_ETIMEOUT;
            break;
        }
        usleep((useconds_t)delay_ms * 1000);
        delay_ms = delay_ms < 500 ? delay_ms * 2 : 1000;
    }
    freeaddrinfo(ai);
    if (rc < 0)
        return ring_fail(r, rc, "cannot connect to rank %d at %s: %s", next_rank(r), r->next_addr,
                         ddp_strerror(rc));
    return 0;
}

/* Accept until the connection from prev arrives with a hello for this job. Strays (a port reused
 * by another job, a scanner, a rank of an older round) are dropped, and the last one is named if
 * prev never comes; a hello of this job with the wrong rank or world fails at once. */
static int accept_prev(ring_t *r, int listen_fd, uint64_t job_hash, int64_t deadline_ms) {
    char stray[160] = "";
    for (;;) {
        int rc = wait_fd(listen_fd, POLLIN, deadline_ms);
        if (rc < 0)
            return ring_fail(r, rc, "rank %d (%s) did not connect within %lld ms%s%s", prev_rank(r),
                             r->prev_addr, (long long)r->timeout_ms,
                             stray[0] ? "; refused meanwhile: " : "", stray);
        struct sockaddr_storage from;
        socklen_t from_len = sizeof from;
        int fd =
            accept4(listen_fd, (struct sockaddr *)&from, &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) continue;
        char from_host[64] = "?";
        if (from.ss_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)&from)->sin_addr, from_host,
                      sizeof from_host);
        else if (from.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&from)->sin6_addr, from_host,
                      sizeof from_host);
        tune_socket(fd);
        ring_hello_t h;
        int64_t hello_deadline = (int64_t)clock_now_ms() + 5000 < deadline_ms
                                     ? (int64_t)clock_now_ms() + 5000
                                     : deadline_ms;
        rc = io_all(fd, &h, sizeof h, false, hello_deadline);
        if (rc < 0) {
            snprintf(stray, sizeof stray, "a connection from %s sent no hello (%s)", from_host,
                     ddp_strerror(rc));
        } else if (h.magic != RING_MAGIC || h.job_hash != job_hash) {
            snprintf(stray, sizeof stray, "a connection from %s was not from this job's ring",
                     from_host);
        } else if (h.world != (uint32_t)r->base.world || h.rank != (uint32_t)prev_rank(r)) {
            close(fd);
            return ring_fail(
                r, DDP_EPROTO,
                "a peer at %s joined this job's ring as rank %u of %u, but this is "
                "rank %d of %d and expects rank %d: are two rounds sharing the prefix?",
                from_host, h.rank, h.world, r->base.rank, r->base.world, prev_rank(r));
        } else {
            r->prev_fd = fd;
            return 0;
        }
        close(fd);
    }
}

static int publish_and_lookup(ring_t *r, const comm_ring_opts_t *o, const char *self_addr) {
    char key[600];
    snprintf(key, sizeof key, "%sring/%d", o->key_prefix, o->rank);
    if (store_client_set(o->store, key, self_addr, strlen(self_addr)) < 0)
        return ring_fail(r, DDP_ECLOSED, "cannot publish this rank's address: %s",
                         store_client_error(o->store));
    int peers[2] = {next_rank(r), prev_rank(r)};
    char *outs[2] = {r->next_addr, r->prev_addr};
    for (int i = 0; i < 2; i++) {
        snprintf(key, sizeof key, "%sring/%d", o->key_prefix, peers[i]);
        uint8_t *val = NULL;
        size_t len = 0;
        if (store_client_get(o->store, key, &val, &len) < 0)
            return ring_fail(r, DDP_ETIMEOUT, "rank %d never published its address: %s", peers[i],
                             store_client_error(o->store));
        if (len >= sizeof r->next_addr) len = sizeof r->next_addr - 1;
        memcpy(outs[i], val, len);
        outs[i][len] = '\0';
        free(val);
    }
    return 0;
}

int comm_ring_create(const comm_ring_opts_t *o, comm_t **out, char *err, size_t err_len) {
    *out = NULL;
    if (o->world < 1 || o->rank < 0 || o->rank >= o->world) {
        snprintf(err, err_len, "ring: rank %d is outside a world of %d", o->rank, o->world);
        return -EINVAL;
    }
    ring_t *r = calloc(1, sizeof *r);
    if (r) r->scratch = malloc(RING_PIECE_BYTES);
    if (!r || !r->scratch) {
        free(r);
        snprintf(err, err_len, "ring: out of memory");
        return -ENOMEM;
    }
    r->base = (comm_t){.ops = &ring_ops, .rank = o->rank, .world = o->world};
    r->next_fd = r->prev_fd = -1;
    r->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 300000;
    int64_t deadline_ms = (int64_t)clock_now_ms() + r->timeout_ms;
    int listen_fd = -1, rc = 0;
    char host[64] = "127.0.0.1";
    if (o->advertise_host)
        snprintf(host, sizeof host, "%s", o->advertise_host);
    else if (o->store_host && route_address(o->store_host, host, sizeof host) < 0)
        snprintf(host, sizeof host, "127.0.0.1");
    if (o->world > 1) {
        /* on the advertised address only, as the store: not every interface of the host */
        struct sockaddr_in addr = {.sin_family = AF_INET};
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
        if (getaddrinfo(host, NULL, &hints, &ai) != 0 || !ai) {
            rc = ring_fail(r, -EADDRNOTAVAIL, "cannot resolve this host's address %s", host);
            goto done;
        }
        addr.sin_addr = ((struct sockaddr_in *)ai->ai_addr)->sin_addr;
        freeaddrinfo(ai);
        socklen_t len = sizeof addr;
        listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (listen_fd < 0 || bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) < 0 ||
            listen(listen_fd, 16) < 0 ||
            getsockname(listen_fd, (struct sockaddr *)&addr, &len) < 0) {
            rc = ring_fail(r, -errno, "cannot listen on %s for rank %d: %s", host, prev_rank(r),
                           strerror(errno));
            goto done;
        }
        char self_addr[96], peer_host[64], peer_port[16];
        snprintf(self_addr, sizeof self_addr, "%s:%u", host, ntohs(addr.sin_port));
        rc = publish_and_lookup(r, o, self_addr);
        if (rc < 0) goto done;
        if (split_address(r->next_addr, strlen(r->next_addr), peer_host, sizeof peer_host,
                          peer_port, sizeof peer_port) < 0) {
            rc = ring_fail(r, DDP_EPROTO, "rank %d published a malformed address '%s'",
                           next_rank(r), r->next_addr);
            goto done;
        }
        uint64_t job_hash = hash_text(o->key_prefix);
        ring_hello_t hello = {.magic = RING_MAGIC,
                              .job_hash = job_hash,
                              .rank = (uint32_t)o->rank,
                              .world = (uint32_t)o->world};
        rc = connect_next(r, peer_host, peer_port, &hello, deadline_ms);
        if (rc == 0) rc = accept_prev(r, listen_fd, job_hash, deadline_ms);
    }
done:
    if (listen_fd >= 0) close(listen_fd);
    if (rc < 0) {
        snprintf(err, err_len, "%s", r->base.err);
        ring_destroy(&r->base);
        return rc;
    }
    *out = &r->base;
    return 0;
}
