/* bench_store_load: closed-loop load on a TCPStore-protocol server, one connection and one thread
 * per simulated client. Prints one JSON line: ops/s, latency percentiles, the load generator's own
 * CPU per op. bench_store.py drives ddprun's store and PyTorch's with it, sending the same bytes.
 *
 *   bench_store_load --endpoint H:P [--legacy] --op set|get|add|wait [--clients N]
 *               [--seconds S | --ops-per-client K] [--depth D] [--raw]
 *
 * set/get/add: each client repeats the op in a closed loop. An op is what PyTorch's client sends:
 *   GET = WAIT + GET, SET = SET + a CHECK of that key (SET has no reply; the CHECK proves it was
 *   applied), ADD = ADD. By default through ddprun's blocking client (common/store_client.h), one
 *   op in flight, as PyTorch's client does. --raw frames the same bytes on a plain socket and sends
 *   each op's requests in one write; --depth D (> 1, implies --raw) keeps D ops in flight, so the
 *   server rather than the load generator is the bottleneck. Latency: from sending an op (or a
 *   batch of D) to that op's last reply.
 * wait: rounds in which every client WAITs on a fresh key, then one more connection SETs it;
 *   latency = from just before the SET to each waiter's return (a wake-up), CLOCK_MONOTONIC across
 *   threads; the rate is wake-ups per second of SET-to-last-wake-up time.
 * Runs on its own threads only; exits 1 if any connection or op fails, 2 on bad usage. */
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
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
    unsigned b =
        HIST_LINEAR + (e - 11u) * HIST_SUB + (unsigned)((us >> (e - 10u)) & (HIST_SUB - 1));
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
    if (rank == 0) rank = 1;
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

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

typedef enum { OP_SET, OP_GET, OP_ADD, OP_WAIT } bench_op_t;

static const char *const op_names[] = {"set", "get", "add", "wait"};
static const char value32[] = "0123456789abcdef0123456789abcdef";

typedef struct {
    store_client_opts_t opts;
    bench_op_t op;
    int clients;
    int depth;      /* ops in flight per connection (raw mode) */
    bool is_raw;    /* plain socket instead of store_client */
    double seconds; /* run length, unless ops_per_client > 0 */
    uint64_t ops_per_client;
    char prefix[64]; /* unique per run: keys of an earlier run on the same server are not reused */
    atomic_int failed;
    atomic_int stop;
    pthread_barrier_t round_start, round_end;
    /* wait mode: the round the setter is in and when it started that round's SET */
    atomic_int round;
    atomic_int set_round;
    _Atomic uint64_t set_ns;
} bench_t;

typedef struct {
    bench_t *b;
    int id;
    hist_t hist;
    uint64_t ops;
    pthread_t thread;
} worker_t;

static void bench_fail(bench_t *b, const char *what, const char *detail) {
    fprintf(stderr, "bench_store_load: %s %s: %s\n", op_names[b->op], what, detail);
    atomic_store(&b->failed, 1);
}

static store_client_t *open_client(bench_t *b) {
    store_client_t *c = NULL;
    if (store_client_connect(&b->opts, &c) < 0) {
        bench_fail(b, "connect", c ? store_client_error(c) : "out of memory");
        store_client_destroy(c);
        return NULL;
    }
    return c;
}

static bool is_done(bench_t *b, const worker_t *w) {
    if (atomic_load_explicit(&b->failed, memory_order_relaxed)) return true;
    if (b->ops_per_client) return w->ops >= b->ops_per_client;
    return atomic_load_explicit(&b->stop, memory_order_relaxed);
}

/* ---- through ddprun's blocking client --------------------------------------------------- */

static int client_op(bench_t *b, store_client_t *c, const char *key) {
    int rc;
    switch (b->op) {
    case OP_SET: {
        bool is_ready = false;
        rc = store_client_set(c, key, value32, 32);
        if (rc == 0) rc = store_client_check(c, &key, 1, &is_ready);
        if (rc == 0 && !is_ready) return bench_fail(b, "CHECK", "key missing after SET"), -1;
        break;
    }
    case OP_GET: {
        uint8_t *v = NULL;
        size_t n = 0;
        rc = store_client_get(c, key, &v, &n);
        if (rc == 0 && n != 32) rc = -1;
        free(v);
        if (rc == -1) return bench_fail(b, "GET", "wrong value length"), -1;
        break;
    }
    default: {
        int64_t r;
        rc = store_client_add(c, key, 1, &r);
        break;
    }
    }
    if (rc < 0) bench_fail(b, "op", store_client_error(c));
    return rc;
}

static void *client_worker(void *arg) {
    worker_t *w = arg;
    bench_t *b = w->b;
    store_client_t *c = open_client(b);
    char key[128];
    /* SET: a key per client (no contention on one entry); GET/ADD: one shared key. */
    snprintf(key, sizeof key, "%s/%s/%d", b->prefix, op_names[b->op], b->op == OP_SET ? w->id : 0);
    if (b->op == OP_GET) snprintf(key, sizeof key, "%s/get", b->prefix);
    pthread_barrier_wait(&b->round_start);
    while (c && !is_done(b, w)) {
        uint64_t t0 = now_ns();
        if (client_op(b, c, key) < 0) break;
        hist_add(&w->hist, (now_ns() - t0) / 1000u);
        w->ops++;
    }
    store_client_destroy(c);
    return NULL;
}

/* ---- raw: the same bytes on a plain socket, D ops per write ------------------------------ */

static void put_op(const bench_t *b, store_writer_t *w, const char *key) {
    store_dialect_t d = b->opts.dialect;
    size_t klen = strlen(key);
    if (b->op == OP_ADD) {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_ADD));
        store_put_bytes(w, key, klen);
        store_put_i64(w, 1);
        return;
    }
    if (b->op == OP_SET) {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_SET));
        store_put_bytes(w, key, klen);
        store_put_bytes(w, value32, 32);
    }
    store_put_u8(
        w, (uint8_t)store_proto_wire_opcode(d, b->op == OP_SET ? STORE_OP_CHECK : STORE_OP_WAIT));
    store_put_u64(w, 1);
    store_put_bytes(w, key, klen);
    if (b->op == OP_GET) {
        store_put_u8(w, (uint8_t)store_proto_wire_opcode(d, STORE_OP_GET));
        store_put_bytes(w, key, klen);
    }
}

/* Consume one op's replies from buf; returns bytes used, 0 if incomplete, < 0 if malformed or
 * not the expected answer. */
static long take_op_reply(const bench_t *b, const store_limits_t *lim, const uint8_t *buf,
                          size_t len) {
    store_reply_t r;
    store_reply_kind_t first = b->op == OP_ADD ? STORE_REPLY_I64 : STORE_REPLY_U8;
    int n1 = store_proto_decode_reply(first, lim, buf, len, &r);
    if (n1 <= 0) return n1;
    if (b->op != OP_ADD && r.u8 != 0) return -1; /* CHECK READY / WAIT STOP_WAITING are 0 */
    if (b->op != OP_GET) return n1;
    int n2 = store_proto_decode_reply(STORE_REPLY_BYTES, lim, buf + n1, len - (size_t)n1, &r);
    if (n2 > 0 && r.bytes.len != 32) return -1;
    return n2 <= 0 ? n2 : n1 + n2;
}

static int raw_connect(const bench_t *b) {
    char port[8];
    snprintf(port, sizeof port, "%u", b->opts.port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(b->opts.host, port, &hints, &res) != 0) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM, 0), one = 1;
    if (fd < 0) {
        freeaddrinfo(res);
        return -1;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int rc = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (rc == 0 && b->opts.dialect != STORE_DIALECT_LEGACY) {
        uint8_t v[5];
        store_writer_t w;
        store_writer_init(&w, v, sizeof v);
        store_put_u8(&w, (uint8_t)STORE_OP_VALIDATE);
        store_put_u32(&w, STORE_PROTO_MAGIC);
        rc = send(fd, v, sizeof v, MSG_NOSIGNAL) == (ssize_t)sizeof v ? 0 : -1;
    }
    if (rc < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void *raw_worker(void *arg) {
    worker_t *w = arg;
    bench_t *b = w->b;
    store_limits_t lim;
    store_limits_default(&lim);
    int fd = raw_connect(b);
    if (fd < 0) bench_fail(b, "connect", "cannot open a raw connection");
    char key[128];
    snprintf(key, sizeof key, "%s/%s/%d", b->prefix, op_names[b->op], b->op == OP_SET ? w->id : 0);
    if (b->op == OP_GET) snprintf(key, sizeof key, "%s/get", b->prefix);
    static _Thread_local uint8_t out[1 << 16], in[1 << 16];
    store_writer_t req;
    store_writer_init(&req, out, sizeof out);
    for (int i = 0; i < b->depth; i++)
        put_op(b, &req, key);
    pthread_barrier_wait(&b->round_start);
    while (fd >= 0 && !is_done(b, w)) {
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
    bench_fail(b, "raw connection", "closed, failed or answered wrongly");
    close(fd);
    return NULL;
}

/* ---- WAIT wake-ups ---------------------------------------------------------------------- */

static void *wait_worker(void *arg) {
    worker_t *w = arg;
    bench_t *b = w->b;
    store_client_t *c = open_client(b);
    for (;;) {
        pthread_barrier_wait(&b->round_start);
        if (atomic_load(&b->stop)) break;
        int round = atomic_load(&b->round);
        char key[128];
        snprintf(key, sizeof key, "%s/wait/%d", b->prefix, round);
        const char *keys[] = {key};
        if (c && store_client_wait(c, keys, 1, 30000) == 0) {
            uint64_t t = now_ns();
            if (atomic_load(&b->set_round) != round) {
                bench_fail(b, "WAIT", "returned before its key was SET");
            } else {
                uint64_t t_set = atomic_load(&b->set_ns);
                hist_add(&w->hist, t > t_set ? (t - t_set) / 1000u : 0);
                w->ops++;
            }
        } else if (c) {
            bench_fail(b, "WAIT", store_client_error(c));
        }
        pthread_barrier_wait(&b->round_end);
    }
    store_client_destroy(c);
    return NULL;
}

/* Drives the rounds; returns the seconds spent between SETs and the last wake-ups. */
static double run_wait_rounds(bench_t *b) {
    store_client_t *setter = open_client(b);
    double busy = 0;
    uint64_t end = now_ns() + (uint64_t)(b->seconds * 1e9);
    /* Let every WAIT reach the server before the SET; with many threads on few cores they need
     * longer to be scheduled. A late WAIT only makes its own wake-up look faster, on both servers.
     */
    useconds_t settle_us = 1000u + 25u * (useconds_t)b->clients;
    for (uint64_t r = 0; setter && !atomic_load(&b->failed); r++) {
        if (b->ops_per_client ? r >= b->ops_per_client : now_ns() >= end) break;
        pthread_barrier_wait(&b->round_start);
        usleep(settle_us);
        int round = atomic_load(&b->round);
        char key[128];
        snprintf(key, sizeof key, "%s/wait/%d", b->prefix, round);
        atomic_store(&b->set_ns, now_ns());
        atomic_store(&b->set_round, round);
        if (store_client_set(setter, key, "1", 1) < 0)
            bench_fail(b, "SET", store_client_error(setter));
        pthread_barrier_wait(&b->round_end);
        busy += (double)(now_ns() - atomic_load(&b->set_ns)) / 1e9;
        atomic_store(&b->round, round + 1);
    }
    atomic_store(&b->stop, 1);
    pthread_barrier_wait(&b->round_start);
    store_client_destroy(setter);
    return busy;
}

static int usage(void) {
    fprintf(stderr, "usage: bench_store_load --endpoint H:P [--legacy] --op set|get|add|wait "
                    "[--clients N] [--seconds S | --ops-per-client K] [--depth D] [--raw]\n");
    return 2;
}

int main(int argc, char **argv) {
    static bench_t b;
    char host[256] = "127.0.0.1", err[256];
    b.opts = (store_client_opts_t){
        .host = host, .port = 29400, .connect_timeout_ms = 10000, .op_timeout_ms = 60000};
    b.op = OP_SET;
    b.clients = 1;
    b.depth = 1;
    b.seconds = 3;
    uint64_t v64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--legacy") == 0) {
            b.opts.dialect = STORE_DIALECT_LEGACY;
            continue;
        }
        if (strcmp(a, "--raw") == 0) {
            b.is_raw = true;
            continue;
        }
        if (!v) return usage();
        i++;
        if (strcmp(a, "--endpoint") == 0) {
            if (endpoint_parse(v, 29400, host, sizeof host, &b.opts.port, err, sizeof err) < 0) {
                fprintf(stderr, "bench_store_load: --endpoint: %s\n", err);
                return 2;
            }
        } else if (strcmp(a, "--op") == 0) {
            int k = 0;
            while (k < 4 && strcmp(v, op_names[k]) != 0)
                k++;
            if (k == 4) return usage();
            b.op = (bench_op_t)k;
        } else if (strcmp(a, "--depth") == 0 && parse_u64(v, 1, 256, &v64) == 0) {
            b.depth = (int)v64;
        } else if (strcmp(a, "--clients") == 0 && parse_u64(v, 1, 4096, &v64) == 0) {
            b.clients = (int)v64;
        } else if (strcmp(a, "--ops-per-client") == 0 && parse_u64(v, 1, 1ull << 40, &v64) == 0) {
            b.ops_per_client = v64;
        } else if (strcmp(a, "--seconds") == 0 && (b.seconds = atof(v)) > 0) {
        } else {
            return usage();
        }
    }
    if (b.depth > 1) b.is_raw = true;
    if (b.op == OP_WAIT && (b.is_raw || b.depth > 1)) return usage();
    snprintf(b.prefix, sizeof b.prefix, "bench/%d.%llu", (int)getpid(),
             (unsigned long long)(now_ns() / 1000u));

    if (b.op == OP_GET) { /* the value every GET reads */
        store_client_t *c = open_client(&b);
        char key[128];
        snprintf(key, sizeof key, "%s/get", b.prefix);
        if (!c || store_client_set(c, key, value32, 32) < 0) {
            if (c) bench_fail(&b, "SET", store_client_error(c));
            store_client_destroy(c);
            return 1;
        }
        store_client_destroy(c);
    }
    worker_t *w = calloc((size_t)b.clients, sizeof *w);
    if (!w) return 1;
    pthread_barrier_init(&b.round_start, NULL, (unsigned)b.clients + 1);
    pthread_barrier_init(&b.round_end, NULL, (unsigned)b.clients + 1);
    void *(*fn)(void *) = b.op == OP_WAIT ? wait_worker : b.is_raw ? raw_worker : client_worker;
    for (int i = 0; i < b.clients; i++) {
        w[i].b = &b;
        w[i].id = i;
        if (pthread_create(&w[i].thread, NULL, fn, &w[i]) != 0) {
            fprintf(stderr, "bench_store_load: cannot start client thread %d\n", i);
            return 1; /* the barrier can never fill: exit without joining */
        }
    }
    double elapsed, cpu0;
    if (b.op == OP_WAIT) {
        cpu0 = cpu_seconds();
        elapsed = run_wait_rounds(&b);
    } else {
        pthread_barrier_wait(&b.round_start);
        cpu0 = cpu_seconds();
        uint64_t t0 = now_ns();
        if (!b.ops_per_client) {
            usleep((useconds_t)(b.seconds * 1e6));
            atomic_store(&b.stop, 1);
        }
        for (int i = 0; i < b.clients; i++)
            pthread_join(w[i].thread, NULL);
        elapsed = (double)(now_ns() - t0) / 1e9;
    }
    if (b.op == OP_WAIT)
        for (int i = 0; i < b.clients; i++)
            pthread_join(w[i].thread, NULL);
    double cpu = cpu_seconds() - cpu0;
    static hist_t all;
    uint64_t ops = 0;
    for (int i = 0; i < b.clients; i++) {
        for (unsigned k = 0; k < HIST_BUCKETS; k++)
            all.counts[k] += w[i].hist.counts[k];
        all.n += w[i].hist.n;
        ops += w[i].ops;
    }
    free(w);
    if (atomic_load(&b.failed)) return 1;
    if (ops == 0 || elapsed <= 0) {
        fprintf(stderr, "bench_store_load: no op completed\n");
        return 1;
    }
    printf("{\"op\": \"%s\", \"clients\": %d, \"depth\": %d, \"mode\": \"%s\", \"ops\": %llu, "
           "\"seconds\": %.3f, \"ops_per_s\": %.1f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
           "\"p999_us\": %.1f, \"client_cpu_us_per_op\": %.2f}\n",
           op_names[b.op], b.clients, b.depth, b.is_raw ? "raw" : "client", (unsigned long long)ops,
           elapsed, (double)ops / elapsed, hist_percentile(&all, 0.50), hist_percentile(&all, 0.99),
           hist_percentile(&all, 0.999), cpu * 1e6 / (double)ops);
    return 0;
}
