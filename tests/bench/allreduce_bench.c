/* allreduce_bench: one rank of ddpworker's ring all-reduce, timed; bench_allreduce.py starts W of
 * them against one store and compares with gloo.
 *   allreduce_bench RANK WORLD STORE_PORT KEY_PREFIX SIZES_MB ITERS
 * Rank 0 prints one JSON line per size: {"mb": M, "ms": median milliseconds per all-reduce}. */
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

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: allreduce_bench RANK WORLD STORE_PORT KEY_PREFIX SIZES_MB ITERS\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int rank = atoi(argv[1]), world = atoi(argv[2]), iters = atoi(argv[6]);
    store_client_opts_t so = {.host = "127.0.0.1", .port = (uint16_t)atoi(argv[3]),
                              .connect_timeout_ms = 10000, .op_timeout_ms = 60000};
    store_client_t *store = NULL;
    if (store_client_connect(&so, &store) < 0) {
        fprintf(stderr, "allreduce_bench: %s\n", store_client_error(store));
        return 1;
    }
    comm_ring_opts_t ro = {.rank = rank, .world = world, .store = store, .key_prefix = argv[4],
                           .store_host = "127.0.0.1", .timeout_ms = 60000};
    comm_t *c = NULL;
    char err[512];
    if (comm_ring_create(&ro, &c, err, sizeof err) < 0) {
        fprintf(stderr, "allreduce_bench: %s\n", err);
        return 1;
    }
    store_client_destroy(store);
    double *times = calloc((size_t)iters, sizeof *times);
    char sizes[256];
    snprintf(sizes, sizeof sizes, "%s", argv[5]);
    for (char *tok = strtok(sizes, ","); tok; tok = strtok(NULL, ",")) {
        double mb = atof(tok);
        size_t n = (size_t)(mb * (1 << 20)) / sizeof(float);
        float *data = calloc(n, sizeof *data);
        for (int i = -2; i < iters; i++) { /* two warm-up rounds */
            c->ops->barrier(c);
            double t0 = now_ms();
            if (c->ops->allreduce_sum_f32(c, data, n) < 0) {
                fprintf(stderr, "allreduce_bench: %s\n", comm_error(c));
                return 1;
            }
            if (i >= 0) times[i] = now_ms() - t0;
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
