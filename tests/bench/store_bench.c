/* store_bench: closed-loop load on a TCPStore-protocol server through ddprun's blocking client,
 * one connection and one thread per simulated client. Prints one JSON line: ops/s and latency
 * percentiles. Used by bench_store.py to drive ddprun's store and PyTorch's with the same bytes.
 *
 *   store_bench --endpoint H:P [--legacy] --op set|get|add|wait --clients N [--seconds S]
 *               [--depth D]
 *
 * set/get/add: each client repeats the op for S seconds over a raw connection, D ops in flight
 *              (D = 1: a closed loop like PyTorch's client); an op is what PyTorch's client sends:
 *              GET = WAIT + GET, SET = SET + a CHECK of that key (SET itself has no reply).
 *              Latency = from sending a batch to that op's last reply.
 * wait: rounds in which every client WAITs on a fresh key, then one more connection SETs it;
 *       latency = from just before the SET to each waiter's return (a wake-up). */
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "endpoint.h"
#include "store_client.h"

/* Log-linear latency histogram in microseconds: exact below 2048 us, ~0.1% above. */
#define HIST_LINEAR  2048u
#define HIST_SUB     1024u
#define HIST_BUCKETS (HIST_LINEAR + 40u * HIST_SUB)

typedef struct {
    uint64_t counts[HIST_BUCKETS];
    uint64_t n;
} hist_t;

static unsigned hist_bucket(uint64_t us) {
    if (us < HIST_LINEAR) return (unsigned)us;
    unsigned e = 63u - (unsigned)__builtin_clzll(us); /* >= 11 */
    unsigned b = HIST_LINEAR + (e - 11u) * HIST_SUB + (unsigned)((us >> (e - 10u)) & (HIST_SUB - 1));
    return b < HIST_BUCKETS ? b : HIST_BUCKETS - 1;
}

static double hist_value(unsigned b) {
    if (b < HIST_LINEAR) return b;
    unsigned e = (b - HIST_LINEAR) / HIST_SUB + 11u, sub = (b - HIST_LINEAR) % HIST_SUB;
    return ldexp(1.0 + (sub + 0.5) / HIST_SUB, (int)e);
}

static void hist_add(hist_t *h, uint64_t us) {
    h->counts[hist_bucket(us)]++;
    h->n++;
}

static double hist_percentile(const hist_t *h, double p) {
    uint64_t rank = (uint64_t)ceil(p * (double)h->n), seen = 0;
    for (unsigned b = 0; b < HIST_BUCKETS; b++) {
        seen += h->counts[b];
        if (seen >= rank && h->counts[b]) return hist_value(b);
    }
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct {
    store_client_opts_t opts;
    const char *op;
    int clients;
    int depth; /* ops in flight per connection */
    double seconds;
    atomic_int failed;
    pthread_barrier_t round_start, round_end;
    atomic_int stop;
    uint64_t set_ns; /* wait mode: when the setter started the SET of this round */
    int round;
} bench_t;

typedef struct {
    bench_t *b;
    int id;
    hist_t hist;
    uint64_t ops;
    pthread_t thread;
} worker_t;

static store_client_t *open_client(bench_t *b) {
    store_client_t *c = NULL;
    if (store_client_connect(&b->opts, &c) < 0) {
        fprintf(stderr, "store_bench: %s\n", store_client_error(c));
        store_client_destroy(c);
        atomic_store(&b->failed, 1);
        return NULL;
    }
    return c;
}

/* One op's request bytes, as PyTorch's client sends them: GET = WAIT + GET; SET has no reply, so a
 * CHECK of the key follows to prove the server applied it. */
static void put_op(const bench_t *b, store_writer_t *w, const char *key) {
    store_dialect_t d = b->opts.dialect;
    size_t klen = strlen(key);
    if (b->op[0] == 's') {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_SET));
        store_put_bytes(w, key, klen);
        store_put_bytes(w, "0123456789abcdef0123456789abcdef", 32);
    }
    if (b->op[0] == 'a') {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_ADD));
        store_put_bytes(w, key, klen);
        store_put_i64(w, 1);
        return;
    }
    store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, b->op[0] == 's' ? STORE_OP_CHECK
                                                                          : STORE_OP_WAIT));
    store_put_u64(w, 1);
    store_put_bytes(w, key, klen);
    if (b->op[0] == 'g') {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_GET));
        store_put_bytes(w, key, klen);
    }
}

/* Consume one op's replies from buf; returns bytes used, 0 if incomplete, -1 if malformed. */
static long take_op_reply(const bench_t *b, const store_limits_t *lim, const uint8_t *buf,
                          size_t len) {
    store_reply_t r;
    store_reply_kind_t first = b->op[0] == 'a' ? STORE_REPLY_I64 : STORE_REPLY_U8;
    int n1 = store_proto_decode_reply(first, lim, buf, len, &r);
    if (n1 <= 0 || b->op[0] != 'g') return n1;
    int n2 = store_proto_decode_reply(STORE_REPLY_BYTES, lim, buf + n1, len - (size_t)n1, &r);
    return n2 <= 0 ? n2 : n1 + n2;
}

static int raw_connect(const bench_t *b) {
    char port[8];
    snprintf(port, sizeof port, "%u", b->opts.port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(b->opts.host, port, &hints, &res) != 0) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int rc = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (rc == 0 && b->opts.dialect != STORE_DIALECT_LEGACY) {
        uint8_t v[5];
        store_writer_t w;
        store_writer_init(&w, v, sizeof v);
        store_put_u8(&w, 0);
        store_put_u32(&w, STORE_PROTO_MAGIC);
        rc = send(fd, v, sizeof v, MSG_NOSIGNAL) == (ssize_t)sizeof v ? 0 : -1;
    }
    if (rc < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Closed loop over a raw connection: send `depth` ops at once, then read their replies. */
static void *loop_worker(void *arg) {
    worker_t *w = arg;
    bench_t *b = w->b;
    store_limits_t lim;
    store_limits_default(&lim);
    int fd = raw_connect(b);
    if (fd < 0) {
        perror("store_bench: connect");
        atomic_store(&b->failed, 1);
    }
    char key[32];
    snprintf(key, sizeof key, "%s/%d", b->op, b->op[0] == 's' ? w->id : 0);
    static _Thread_local uint8_t out[1 << 16], in[1 << 16];
    store_writer_t req;
    store_writer_init(&req, out, sizeof out);
    for (int i = 0; i < b->depth; i++) put_op(b, &req, key);
    pthread_barrier_wait(&b->round_start);
    while (fd >= 0 && !atomic_load(&b->stop)) {
        uint64_t t0 = now_ns();
        if (send(fd, out, req.len, MSG_NOSIGNAL) != (ssize_t)req.len) goto broken;
        size_t have = 0, used = 0;
        for (int done = 0; done < b->depth;) {
            long n = take_op_reply(b, &lim, in + used, have - used);
            if (n < 0) goto broken;
            if (n > 0) {
                used += (size_t)n;
                done++;
                hist_add(&w->hist, (now_ns() - t0) / 1000u);
                w->ops++;
                continue;
            }
            if (used > 0) {
                memmove(in, in + used, have - used);
                have -= used;
                used = 0;
            }
            ssize_t r = recv(fd, in + have, sizeof in - have, 0);
            if (r <= 0) goto broken;
            have += (size_t)r;
        }
    }
    if (fd >= 0) close(fd);
    return NULL;
broken:
    fprintf(stderr, "store_bench: connection to the store failed during %s\n", b->op);
    atomic_store(&b->failed, 1);
    close(fd);
    return NULL;
}

static void *wait_worker(void *arg) {
    worker_t *w = arg;
    bench_t *b = w->b;
    store_client_t *c = open_client(b);
    for (;;) {
        pthread_barrier_wait(&b->round_start);
        if (atomic_load(&b->stop)) break;
        char key[32];
        snprintf(key, sizeof key, "wait/%d", b->round);
        const char *keys[] = {key};
        if (c && store_client_wait(c, keys, 1, 30000) == 0) {
            uint64_t t = now_ns();
            hist_add(&w->hist, t > b->set_ns ? (t - b->set_ns) / 1000u : 0);
            w->ops++;
        } else if (c) {
            fprintf(stderr, "store_bench: %s\n", store_client_error(c));
            atomic_store(&b->failed, 1);
        }
        pthread_barrier_wait(&b->round_end);
    }
    store_client_destroy(c);
    return NULL;
}

/* Drives the wait rounds; returns the seconds spent between SETs and the last wake-up. */
static double run_wait_rounds(bench_t *b) {
    store_client_t *setter = open_client(b);
    double busy = 0;
    uint64_t end = now_ns() + (uint64_t)(b->seconds * 1e9);
    while (setter && now_ns() < end && !atomic_load(&b->failed)) {
        pthread_barrier_wait(&b->round_start);
        /* Let every WAIT reach the server before the SET (loopback: far more than enough). */
        usleep(2000);
        char key[32];
        snprintf(key, sizeof key, "wait/%d", b->round);
        b->set_ns = now_ns();
        if (store_client_set(setter, key, "1", 1) < 0) atomic_store(&b->failed, 1);
        pthread_barrier_wait(&b->round_end);
        busy += (double)(now_ns() - b->set_ns) / 1e9;
        b->round++;
    }
    atomic_store(&b->stop, 1);
    pthread_barrier_wait(&b->round_start);
    store_client_destroy(setter);
    return busy;
}

int main(int argc, char **argv) {
    static bench_t b;
    char host[256] = "127.0.0.1", err[256];
    b.opts = (store_client_opts_t){.host = host, .port = 29400, .connect_timeout_ms = 10000,
                                   .op_timeout_ms = 60000};
    b.op = "set";
    b.clients = 1;
    b.depth = 1;
    b.seconds = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--legacy") == 0) {
            b.opts.dialect = STORE_DIALECT_LEGACY;
            continue;
        }
        if (!v) {
            fprintf(stderr, "store_bench: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--endpoint") == 0) {
            if (endpoint_parse(v, 29400, host, sizeof host, &b.opts.port, err, sizeof err) < 0) {
                fprintf(stderr, "store_bench: %s\n", err);
                return 2;
            }
        } else if (strcmp(a, "--op") == 0) {
            b.op = v;
        } else if (strcmp(a, "--depth") == 0) {
            b.depth = atoi(v);
        } else if (strcmp(a, "--clients") == 0) {
            b.clients = atoi(v);
        } else if (strcmp(a, "--seconds") == 0) {
            b.seconds = atof(v);
        } else {
            fprintf(stderr, "store_bench: unknown option %s\n", a);
            return 2;
        }
    }
    bool is_wait = strcmp(b.op, "wait") == 0;
    if (b.clients < 1 || b.seconds <= 0 || b.depth < 1 || b.depth > 256 ||
        (!is_wait && strcmp(b.op, "set") && strcmp(b.op, "get") && strcmp(b.op, "add"))) {
        fprintf(stderr, "store_bench: --op set|get|add|wait, --clients >= 1, --seconds > 0, "
                        "--depth 1..256\n");
        return 2;
    }
    if (strcmp(b.op, "get") == 0) { /* the value every GET reads */
        store_client_t *c = open_client(&b);
        if (!c || store_client_set(c, "get/0", "0123456789abcdef0123456789abcdef", 32) < 0)
            return 1;
        store_client_destroy(c);
    }
    worker_t *w = calloc((size_t)b.clients, sizeof *w);
    pthread_barrier_init(&b.round_start, NULL, (unsigned)b.clients + 1);
    pthread_barrier_init(&b.round_end, NULL, (unsigned)b.clients + 1);
    for (int i = 0; i < b.clients; i++) {
        w[i].b = &b;
        w[i].id = i;
        pthread_create(&w[i].thread, NULL, is_wait ? wait_worker : loop_worker, &w[i]);
    }
    double elapsed;
    if (is_wait) {
        elapsed = run_wait_rounds(&b);
    } else {
        pthread_barrier_wait(&b.round_start);
        uint64_t t0 = now_ns();
        usleep((useconds_t)(b.seconds * 1e6));
        atomic_store(&b.stop, 1);
        for (int i = 0; i < b.clients; i++) pthread_join(w[i].thread, NULL);
        elapsed = (double)(now_ns() - t0) / 1e9;
    }
    if (is_wait)
        for (int i = 0; i < b.clients; i++) pthread_join(w[i].thread, NULL);
    static hist_t all;
    uint64_t ops = 0;
    for (int i = 0; i < b.clients; i++) {
        for (unsigned k = 0; k < HIST_BUCKETS; k++) all.counts[k] += w[i].hist.counts[k];
        all.n += w[i].hist.n;
        ops += w[i].ops;
    }
    if (atomic_load(&b.failed) || ops == 0) return 1;
    printf("{\"op\": \"%s\", \"clients\": %d, \"depth\": %d, \"ops\": %llu, \"seconds\": %.3f, "
           "\"ops_per_s\": %.1f, \"p50_us\": %.1f, \"p99_us\": %.1f}\n",
           b.op, b.clients, is_wait ? 1 : b.depth, (unsigned long long)ops, elapsed, (double)ops / elapsed,
           hist_percentile(&all, 0.50), hist_percentile(&all, 0.99));
    free(w);
    return 0;
}
