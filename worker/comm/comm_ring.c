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
 * failure every call returns the same error. Runs on whichever single thread calls it. Joining the
 * ring (the addresses, the handshake with both neighbours) is comm_ring_join.c's. */
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
#include "comm_ring_internal.h"
#include "ddp_error.h"
#include "stop_signal.h"

#define RING_FRAME_MAGIC     0x52444444u  /* "DDDR" */
#define RING_MIN_BYTES_PER_S (256u << 10) /* a 2 Mbit/s link still passes */
/* Once a stop is requested (SIGTERM), a peer that moves nothing for this long, or for twice the
 * longest wait a live peer has needed since training settled (ranks that compute at different
 * speeds, rank 0 writing a snapshot), is not waited for: the agent stopping this worker has
 * usually judged that peer lost already, and would otherwise wait --shutdown-timeout and SIGKILL
 * a worker that waits collective_timeout. A stop that every rank gets (a preemption) still finds
 * every peer moving, and ends at the step's boundary with its snapshot. */
#define RING_STOP_GRACE_MS 5000
/* the collectives of a start (the parameters' broadcast, a resume's agreement) wait for the
 * slowest rank's data loading or snapshot read: not a live peer's pace in training */
#define RING_SETTLED_AFTER 4
/* how often a wait looks at the stop request (a signal may land just before the poll) */
#define RING_STOP_CHECK_MS 250

enum { RING_OP_ALLREDUCE_F32 = 1, RING_OP_ALLREDUCE_F64, RING_OP_BROADCAST, RING_OP_BARRIER };

/* Opens every collective on the wire, rank -> next; equal on every rank when all is well. */
typedef struct {
    uint32_t magic, op;
    uint64_t seq, n_bytes;
    int64_t root; /* broadcast's; -1 otherwise */
} ring_frame_t;

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

int comm_ring__fail(ring_t *r, int rc, const char *fmt, ...) {
    r->failed_rc = rc;
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(r->base.err, sizeof r->base.err, "ring: ");
    vsnprintf(r->base.err + n, sizeof r->base.err - (size_t)n, fmt, ap);
    va_end(ap);
    return rc;
}

/* Data moved: the time since the last progress was a live peer's wait (counted once the run has
 * settled). Returns now. */
static int64_t note_progress(ring_t *r, int64_t last_progress) {
    int64_t now = (int64_t)clock_now_ms();
    if (r->seq > RING_SETTLED_AFTER && now - last_progress > r->longest_quiet_ms)
        r->longest_quiet_ms = now - last_progress;
    return now;
}

/* Send send_len bytes to next while receiving recv_len bytes from prev (either may be 0). With
 * add, what arrives is added into recv_buf (elements of elem bytes) instead of copied: it lands in
 * scratch one piece at a time, so the sender streams its whole chunk ahead of the additions. */
static int exchange_add(ring_t *r, const void *send_buf, size_t send_len, void *recv_buf,
                        size_t recv_len, add_fn add, size_t elem) {
    const uint8_t *s = send_buf;
    uint8_t *d = recv_buf;
    size_t sent = 0, got = 0, fill = 0; /* fill: bytes of the current piece in scratch */
    int64_t last_progress = (int64_t)clock_now_ms(), stop_seen_ms = 0;
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
        bool is_stopping = false;
        if (stop_signal_is_stop_requested()) {
            if (!stop_seen_ms) stop_seen_ms = now;
            int64_t since = last_progress > stop_seen_ms ? last_progress : stop_seen_ms;
            int64_t grace = r->longest_quiet_ms * 2 > RING_STOP_GRACE_MS ? r->longest_quiet_ms * 2
                                                                         : RING_STOP_GRACE_MS;
            is_stopping = grace - (now - since) < left;
            if (is_stopping) left = grace - (now - since);
        }
        /* a wait that has run out still looks once: this process may itself have been stopped
         * (SIGSTOP, a paused VM) while the peer's data arrived */
        int wait_ms = left <= 0 ? 0 : left > RING_STOP_CHECK_MS ? RING_STOP_CHECK_MS : (int)left;
        int ready = poll(p, (nfds_t)n, wait_ms);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0)
            return comm_ring__fail(r, -errno, "poll failed during %s: %s", r->doing,
                                   strerror(errno));
        if (ready == 0 && left > wait_ms) continue; /* a slice: look at the stop request again */
        if (ready == 0) {
            bool is_recv_stuck = got < recv_len;
            if (is_stopping)
                return comm_ring__fail(
                    r, -ECANCELED,
                    "stopping (SIGTERM) while rank %d (%s, %s) moved nothing for %lld ms during "
                    "%s",
                    is_recv_stuck ? prev_rank(r) : next_rank(r),
                    is_recv_stuck ? r->prev_addr : r->next_addr, is_recv_stuck ? "prev" : "next",
                    (long long)((int64_t)clock_now_ms() -
                                (last_progress > stop_seen_ms ? last_progress : stop_seen_ms)),
                    r->doing);
            /* the collective's bound also ends a peer that moved nothing in the whole
             * collective (it starts a little before the per-wait timeout): that one is silent,
             * not slow */
            bool has_moved = is_recv_stuck ? r->has_received : r->has_sent;
            if (is_bounded && has_moved)
                return comm_ring__fail(
                    r, DDP_ETIMEOUT,
                    "rank %d (%s, %s) moves its data too slowly: %s did not end within "
                    "collective_timeout (%lld ms) plus %u KiB/s for its bytes",
                    is_recv_stuck ? prev_rank(r) : next_rank(r),
                    is_recv_stuck ? r->prev_addr : r->next_addr, is_recv_stuck ? "prev" : "next",
                    r->doing, (long long)r->timeout_ms, RING_MIN_BYTES_PER_S >> 10);
            return comm_ring__fail(
                r, DDP_ETIMEOUT, "no data %s rank %d (%s, %s) for %lld ms during %s; is it alive?",
                is_recv_stuck ? "from" : "to", is_recv_stuck ? prev_rank(r) : next_rank(r),
                is_recv_stuck ? r->prev_addr : r->next_addr, is_recv_stuck ? "prev" : "next",
                (long long)r->timeout_ms, r->doing);
        }
        if (send_at >= 0 && p[send_at].revents) {
            ssize_t k = send(r->next_fd, s + sent, send_len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0) {
                sent += (size_t)k;
                r->has_sent = true;
                last_progress = note_progress(r, last_progress);
            } else if (k < 0 && errno != EAGAIN && errno != EINTR) {
                return comm_ring__fail(r, DDP_ECLOSED,
                                       "sending to rank %d (%s, next) failed during %s: %s",
                                       next_rank(r), r->next_addr, r->doing, strerror(errno));
            }
        }
        if (recv_at >= 0 && p[recv_at].revents) {
            size_t piece_len = recv_len - got + fill;
            if (piece_len > RING_PIECE_BYTES) piece_len = RING_PIECE_BYTES;
            ssize_t k = add ? recv(r->prev_fd, r->scratch + fill, piece_len - fill, MSG_DONTWAIT)
                            : recv(r->prev_fd, d + got, recv_len - got, MSG_DONTWAIT);
            if (k > 0) {
                got += (size_t)k;
                r->has_received = true;
                last_progress = note_progress(r, last_progress);
                fill += (size_t)k;
                if (add && fill == piece_len) { /* piece_len is whole elements */
                    add(d + got - fill, r->scratch, piece_len / elem);
                    fill = 0;
                }
            } else if (k == 0) {
                return comm_ring__fail(r, DDP_ECLOSED,
                                       "rank %d (%s, prev) closed the connection during %s",
                                       prev_rank(r), r->prev_addr, r->doing);
            } else if (errno != EAGAIN && errno != EINTR) {
                return comm_ring__fail(r, DDP_ECLOSED,
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
    r->has_sent = r->has_received = false;
    ring_frame_t mine = {.magic = RING_FRAME_MAGIC,
                         .op = op,
                         .seq = r->seq++,
                         .n_bytes = n_bytes,
                         .root = root},
                 theirs;
    int rc = exchange(r, &mine, sizeof mine, &theirs, sizeof theirs);
    if (rc < 0) return rc;
    if (theirs.magic != RING_FRAME_MAGIC)
        return comm_ring__fail(r, DDP_EPROTO, "rank %d (%s, prev) sent a malformed frame during %s",
                               prev_rank(r), r->prev_addr, r->doing);
    if (theirs.op != mine.op || theirs.seq != mine.seq || theirs.n_bytes != mine.n_bytes ||
        theirs.root != mine.root) {
        char want[96], got[96];
        describe(&mine, want, sizeof want);
        describe(&theirs, got, sizeof got);
        return comm_ring__fail(
            r, DDP_EPROTO,
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
        return comm_ring__fail(r, -EINVAL, "broadcast from rank %d, outside the world of %d", root,
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

const comm_i comm_ring__ops = {
    .name = "ring",
    .allreduce_sum_f32 = ring_allreduce_f32,
    .allreduce_sum_f64 = ring_allreduce_f64,
    .broadcast = ring_broadcast,
    .barrier = ring_barrier,
    .destroy = ring_destroy,
};
