/* model_probe: one model, one batch, two SGD steps on the CPU backend, every tensor written out so
 * a test can replay the same thing in PyTorch (tests/interop/test_torch_reference.py).
 *   model_probe NAME WIDTH H W C CLASSES BATCH SEED SMOOTHING OUTDIR
 * OUTDIR gets params.f32 (initial), input.f32 (N,H,W,C), labels.i32, logits.f32, loss.txt (mean loss
 * of the first forward), grads.f32 (its gradients), buffers.f32 (BN running stats after it), and
 * params2.f32 (after two steps of SGD lr 0.1, momentum 0.9, nesterov, weight decay 5e-4). */
#include <stdio.h>
#include <stdlib.h>

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

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: model_probe NAME WIDTH H W C CLASSES BATCH SEED SMOOTHING OUTDIR\n");
        return 2;
    }
    int width = atoi(argv[2]), h = atoi(argv[3]), w = atoi(argv[4]), c = atoi(argv[5]);
    int classes = atoi(argv[6]), n = atoi(argv[7]);
    uint64_t seed = strtoull(argv[8], NULL, 10);
    float smoothing = strtof(argv[9], NULL);
    const char *dir = argv[10];
    backend_t *b = backend_cpu_create(1);
    model_t m;
    char err[256];
    if (!b || model_init(&m, b, argv[1], width, h, w, c, classes, n, err, sizeof err) < 0 ||
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
    for (int i = 0; i < n; i++) m.labels[i] = (int32_t)(rng_next(&state) % (uint64_t)classes);
    write_file(dir, "input.f32", x, n_in * sizeof(float));
    write_file(dir, "labels.i32", m.labels, (size_t)n * sizeof(int32_t));
    for (int step = 0; step < 2; step++) {
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
        b->ops->sgd_step(b, m.params, m.grads, m.momentum, m.n_params, 0.1f, 0.9f, 5e-4f, true, 1.0f, NULL);
    }
    write_file(dir, "params2.f32", m.params, m.n_params * sizeof(float));
    model_free(&m);
    b->ops->destroy(b);
    return 0;
}
