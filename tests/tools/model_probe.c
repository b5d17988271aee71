/* model_probe: one model, one batch, two SGD steps on the CPU backend, every tensor written out so
 * a test can replay the same thing in PyTorch (tests/interop/test_torch_reference.py).
 *   model_probe NAME WIDTH H W C CLASSES BATCH SEED SMOOTHING OUTDIR [OPTION=VALUE ...]
 * options: stem=auto|imagenet|cifar, fc_width=N, dropout=P, zero_init_residual=0|1 (model.h).
 * OUTDIR gets params.f32 (initial), input.f32 (N,H,W,C), labels.i32, logits.f32, loss.txt (mean
 * loss of the first forward), grads.f32 (its gradients), buffers.f32 (BN running stats after it),
 * params2.f32 (after two steps of SGD lr 0.1, momentum 0.9, nesterov, weight decay 5e-4), and
 * mask<step>_<k>.f32 (1 kept, 0 dropped) for the k-th dropout layer in step 0 and 1. */
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

#include "model.h"
#include "rng.h"

static void write_file(const char *dir, const char *name, const void *data, size_t bytes) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* The keep masks the next forward's dropout layers draw (dropout.h), as 1.0 / 0.0. */
static void write_masks(const model_t *m, const char *dir, int n, int step) {
    for (int l = 0, k = 0; l < m->n_layers; l++) {
        const layer_t *ly = &m->layers[l];
        if (ly->kind != LAYER_DROPOUT) continue;
        const tensor_t *t = &m->tensors[ly->in];
        size_t count = (size_t)n * t->h * t->w * t->c;
        float *mask = malloc(count * sizeof *mask);
        uint64_t key = model_dropout_key(m, l);
        uint32_t threshold = dropout_threshold(ly->dropout_p);
        for (size_t i = 0; i < count; i++)
            mask[i] = dropout_keeps(key, i, threshold) ? 1.0f : 0.0f;
        char name[64];
        snprintf(name, sizeof name, "mask%d_%d.f32", step, k++);
        write_file(dir, name, mask, count * sizeof *mask);
        free(mask);
    }
}

int main(int argc, char **argv) {
    if (argc < 11) {
        fprintf(stderr, "usage: model_probe NAME WIDTH H W C CLASSES BATCH SEED SMOOTHING OUTDIR "
                        "[stem=S] [fc_width=N] [dropout=P] [zero_init_residual=0|1]\n");
        return 2;
    }
    int width = atoi(argv[2]), h = atoi(argv[3]), w = atoi(argv[4]), c = atoi(argv[5]);
    int classes = atoi(argv[6]), n = atoi(argv[7]);
    uint64_t seed = strtoull(argv[8], NULL, 10);
    float smoothing = strtof(argv[9], NULL);
    const char *dir = argv[10];
    model_opts_t opts = model_opts_default(argv[1], width);
    for (int i = 11; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        const char *v = eq ? eq + 1 : "";
        if (!strncmp(argv[i], "stem=", 5))
            opts.stem = !strcmp(v, "imagenet") ? MODEL_STEM_IMAGENET
                        : !strcmp(v, "cifar")  ? MODEL_STEM_CIFAR
                                               : MODEL_STEM_AUTO;
        else if (!strncmp(argv[i], "fc_width=", 9))
            opts.fc_width = atoi(v);
        else if (!strncmp(argv[i], "dropout=", 8))
            opts.dropout = strtof(v, NULL);
        else if (!strncmp(argv[i], "zero_init_residual=", 19))
            opts.is_zero_init_residual = atoi(v) != 0;
        else {
            fprintf(stderr, "model_probe: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    backend_t *b = backend_cpu_create(1);
    model_t m;
    char err[256];
    if (!b || model_init_opts(&m, b, &opts, h, w, c, classes, n, err, sizeof err) < 0 ||
        model_init_params(&m, seed) < 0) {
        fprintf(stderr, "model_probe: %s\n", err);
        return 1;
    }
    write_file(dir, "params.f32", m.params, m.n_params * sizeof(float));
    float *x = model_input(&m);
    uint64_t state = seed + 1;
    size_t n_in = (size_t)n * h * w * c;
    for (size_t i = 0; i < n_in; i++)
        x[i] = (float)((double)(rng_next(&state) >> 11) / 9007199254740992.0 * 4 - 2);
    for (int i = 0; i < n; i++)
        m.labels[i] = (int32_t)(rng_next(&state) % (uint64_t)classes);
    write_file(dir, "input.f32", x, n_in * sizeof(float));
    write_file(dir, "labels.i32", m.labels, (size_t)n * sizeof(int32_t));
    for (int step = 0; step < 2; step++) {
        model_set_step(&m, seed, step, 0);
        write_masks(&m, dir, n, step);
        model_forward(&m, n, true);
        model_loss(&m, n, smoothing, 1.0f, NULL);
        double loss = model_take_loss(&m) / n;
        model_backward(&m, n, NULL, NULL);
        if (step == 0) {
            write_file(dir, "logits.f32", model_logits(&m), (size_t)n * classes * sizeof(float));
            write_file(dir, "grads.f32", m.grads, m.n_params * sizeof(float));
            write_file(dir, "buffers.f32", m.buffers, m.n_buffers * sizeof(float));
            char text[64];
            int len = snprintf(text, sizeof text, "%.9g\n", loss);
            write_file(dir, "loss.txt", text, (size_t)len);
        }
        b->ops->sgd_step(b, m.params, m.grads, m.momentum, m.n_params, 0.1f, 0.9f, 5e-4f, true,
                         1.0f, NULL);
    }
    write_file(dir, "params2.f32", m.params, m.n_params * sizeof(float));
    model_free(&m);
    b->mem->destroy(b);
    return 0;
}
