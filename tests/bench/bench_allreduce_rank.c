/* bench_allreduce_rank: one rank of ddpworker's ring all-reduce, timed; bench_allreduce.py starts W
 * of them against one store and compares with gloo. bench_allreduce_rank RANK WORLD
 * [STORE_HOST:]STORE_PORT KEY_PREFIX SIZES_MB ITERS bench_allreduce_rank      (from $RANK
 * $WORLD_SIZE $MASTER_ADDR $MASTER_PORT, as torchrun sets them; prefix /bench_allreduce_rank/,
 * sizes 1,4,16,64 MB, 10 iterations) Rank 0 prints one JSON line per size: {"mb": M, "ms": median
 * milliseconds per all-reduce}. After the timed rounds every rank checks one all-reduce of known
 * values, so a wrong sum fails it. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

int main(int argc, char **argv) {
    if (argc != 7 && argc != 1) {
        fprintf(stderr,
                "usage: bench_allreduce_rank RANK WORLD [STORE_HOST:]STORE_PORT KEY_PREFIX "
                "SIZES_MB ITERS\n       bench_allreduce_rank   (RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT from the environment)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    const char *rank_s = argc == 7 ? argv[1] : env_or("RANK", "0");
    const char *world_s = argc == 7 ? argv[2] : env_or("WORLD_SIZE", "1");
    const char *prefix = argc == 7 ? argv[4] : "/bench_allreduce_rank/";
    const char *sizes_mb = argc == 7 ? argv[5] : "1,4,16,64";
    const char *iters_s = argc == 7 ? argv[6] : "10";
    char host[128];
    const char *port_s;
    if (argc == 7 && strrchr(argv[3], ':')) {
        const char *colon = strrchr(argv[3], ':');
        snprintf(host, sizeof host, "%.*s", (int)(colon - argv[3]), argv[3]);
        port_s = colon + 1;
    } else {
        snprintf(host, sizeof host, "%s",
                 argc == 7 ? "127.0.0.1" : env_or("MASTER_ADDR", "127.0.0.1"));
        port_s = argc == 7 ? argv[3] : env_or("MASTER_PORT", "29500");
    }
    int rank = atoi(rank_s), world = atoi(world_s), iters = atoi(iters_s), port = atoi(port_s);
    if (world < 1 || rank < 0 || rank >= world || iters < 1 || port < 1 || port > 65535) {
        fprintf(stderr,
                "bench_allreduce_rank: rank %s of world %s, port %s, %s iterations: out of range\n",
                rank_s, world_s, port_s, iters_s);
        return 2;
    }
    store_client_opts_t so = {
        .host = host, .port = (uint16_t)port, .connect_timeout_ms = 10000, .op_timeout_ms = 60000};
    store_client_t *store = NULL;
    if (store_client_connect(&so, &store) < 0) {
        fprintf(stderr, "bench_allreduce_rank: %s\n", store_client_error(store));
        return 1;
    }
    comm_ring_opts_t ro = {.rank = rank,
                           .world = world,
                           .store = store,
                           .key_prefix = prefix,
                           .store_host = host,
                           .timeout_ms = 60000};
    comm_t *c = NULL;
    char err[512];
    if (comm_ring_create(&ro, &c, err, sizeof err) < 0) {
        fprintf(stderr, "bench_allreduce_rank: %s\n", err);
        return 1;
    }
    store_client_destroy(store);
    double *times = calloc((size_t)iters, sizeof *times);
    char sizes[256];
    snprintf(sizes, sizeof sizes, "%s", sizes_mb);
    for (char *tok = strtok(sizes, ","); tok; tok = strtok(NULL, ",")) {
        double mb = atof(tok);
        size_t n = (size_t)(mb * (1 << 20)) / sizeof(float);
        float *data = calloc(n, sizeof *data);
        for (int i = -2; i < iters; i++) { /* two warm-up rounds */
            c->ops->barrier(c);
            double t0 = now_ms();
            if (c->ops->allreduce_sum_f32(c, data, n) < 0) {
                fprintf(stderr, "bench_allreduce_rank: %s\n", comm_error(c));
                return 1;
            }
            if (i >= 0) times[i] = now_ms() - t0;
        }
        /* one checked round: element i of rank r holds r + i % 5, so the sum is exact in f32 */
        for (size_t i = 0; i < n; i++)
            data[i] = (float)(rank + (int)(i % 5));
        if (c->ops->allreduce_sum_f32(c, data, n) < 0) {
            fprintf(stderr, "bench_allreduce_rank: %s\n", comm_error(c));
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            float want = (float)(world * (world - 1) / 2 + world * (int)(i % 5));
            if (data[i] != want) {
                fprintf(stderr, "bench_allreduce_rank: rank %d, %g MB: [%zu] = %g, want %g\n", rank,
                        mb, i, data[i], want);
                return 1;
            }
        }
        qsort(times, (size_t)iters, sizeof *times, by_value);
        if (rank == 0) printf("{\"mb\": %g, \"ms\": %.3f}\n", mb, times[iters / 2]);
        fflush(stdout);
        free(data);
    }
    free(times);
    c->ops->destroy(c);
    return 0;
}
