/* bench_loader: ddpworker's image-folder loader alone (worker/loader/loader), for the comparison
 * with PyTorch's DataLoader (tests/bench/bench_dataloader.py): bench_loader ROOT SIZE BATCH WORKERS
 * EPOCHS TRANSFORM(rrc|resize|center) decodes and transforms every training image EPOCHS times, a
 * batch ahead as the trainer does, and prints "images N seconds S". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "imagefolder.h"
#include "loader.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: bench_loader ROOT SIZE BATCH WORKERS EPOCHS rrc|resize|center\n");
        return 2;
    }
    int size = atoi(argv[2]), batch = atoi(argv[3]), workers = atoi(argv[4]),
        epochs = atoi(argv[5]);
    image_transform_kind_t kind = strcmp(argv[6], "rrc") == 0      ? IMAGE_RANDOM_RESIZED_CROP
                                  : strcmp(argv[6], "resize") == 0 ? IMAGE_RESIZE
                                                                   : IMAGE_RESIZE_CENTER_CROP;
    imagefolder_t f;
    char err[1024];
    if (imagefolder_scan(argv[1], &f, err, sizeof err) < 0) {
        fprintf(stderr, "bench_loader: %s\n", err);
        return 1;
    }
    dataset_t d = {.n = f.train.n,
                   .h = size,
                   .w = size,
                   .c = 3,
                   .classes = f.n_classes,
                   .labels = f.train.labels,
                   .paths = f.train.paths};
    loader_opts_t o = {.workers = workers,
                       .slots = 3,
                       .batch_max = batch,
                       .size = size,
                       .mean = {0.485f, 0.456f, 0.406f},
                       .std = {0.229f, 0.224f, 0.225f},
                       .seed = 1};
    loader_t *l;
    if (loader_create(&o, &l, err, sizeof err) < 0) {
        fprintf(stderr, "bench_loader: %s\n", err);
        return 1;
    }
    int64_t *idx = malloc(sizeof *idx * (size_t)d.n);
    int64_t images = 0;
    uint64_t id = 0;
    double start = now_s();
    for (int e = 0; e < epochs; e++) {
        for (int64_t i = 0; i < d.n; i++)
            idx[i] = (i * 7919 + e) % d.n; /* a fixed shuffle */
        int64_t batches = (d.n + batch - 1) / batch;
        for (int64_t b = 0; b < batches; b++, id++) {
            int n = (int)(d.n - b * batch < batch ? d.n - b * batch : batch);
            if (!loader_has(l, id)) loader_submit(l, id, &d, kind, e, idx + b * batch, n);
            if (b + 1 < batches) {
                int m = (int)(d.n - (b + 1) * batch < batch ? d.n - (b + 1) * batch : batch);
                if (!loader_has(l, id + 1))
                    loader_submit(l, id + 1, &d, kind, e, idx + (b + 1) * batch, m);
            }
            loader_batch_t out;
            if (loader_take(l, id, &out, err, sizeof err) < 0) {
                fprintf(stderr, "bench_loader: %s\n", err);
                return 1;
            }
            images += out.n;
            loader_release(l, id);
        }
    }
    printf("images %lld seconds %.4f\n", (long long)images, now_s() - start);
    loader_destroy(l);
    free(idx);
    imagefolder_free(&f);
    return 0;
}
