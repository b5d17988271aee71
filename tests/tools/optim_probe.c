/* optim_probe: a few steps of one optimizer (worker/optim/optimizer.c on the CPU backend) on one
 * model and batch, every gradient and every step's parameters written out, so that a test can
 * replay the same steps with torch.optim (tests/interop/test_torch_adam.py). optim_probe OPTIM NAME
 * WIDTH H W C CLASSES BATCH SEED STEPS LR BETAS EPS WEIGHT_DECAY OUTDIR OPTIM and BETAS ("b1,b2")
 * as train.conf spells them. OUTDIR gets params0.f32 (initial), input.f32 (N,H,W,C), labels.i32,
 * and for k = 1..STEPS grads<k>.f32 (the gradient step k used) and params<k>.f32 (the parameters
 * after it). */
#include <stdio.h>
#include <stdlib.h>

#include "model.h"
#include "optimizer.h"
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

static void set(train_conf_t *c, const char *key, const char *value) {
    char err[256];
    if (train_conf_set(c, "optim", key, value, err, sizeof err) < 0) {
        fprintf(stderr, "optim_probe: %s\n", err);
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 16) {
        fprintf(stderr, "usage: optim_probe OPTIM NAME WIDTH H W C CLASSES BATCH SEED STEPS LR "
                        "BETAS EPS WEIGHT_DECAY OUTDIR\n");
        return 2;
    }
    train_conf_t conf;
    train_conf_default(&conf);
    set(&conf, "name", argv[1]);
    set(&conf, "betas", argv[12]);
    set(&conf, "eps", argv[13]);
    set(&conf, "weight_decay", argv[14]);
    int width = atoi(argv[3]), h = atoi(argv[4]), w = atoi(argv[5]), c = atoi(argv[6]);
    int classes = atoi(argv[7]), n = atoi(argv[8]), steps = atoi(argv[10]);
    uint64_t seed = strtoull(argv[9], NULL, 10);
    double lr = strtod(argv[11], NULL);
    const char *dir = argv[15];
    backend_t *b = backend_cpu_create(1);
    model_t m;
    optimizer_t opt;
    char err[256] = "out of memory";
    if (!b || model_init(&m, b, argv[2], width, h, w, c, classes, n, err, sizeof err) < 0 ||
        model_init_params(&m, seed) < 0 || optimizer_init(&opt, &conf, b, m.n_params) < 0) {
        fprintf(stderr, "optim_probe: %s\n", err);
        return 1;
    }
    write_file(dir, "params0.f32", m.params, m.n_params * sizeof(float));
    float *x = model_input(&m);
    uint64_t state = seed + 1;
    size_t n_in = (size_t)n * h * w * c;
    for (size_t i = 0; i < n_in; i++)
        x[i] = (float)((double)(rng_next(&state) >> 11) / 9007199254740992.0 * 4 - 2);
    for (int i = 0; i < n; i++)
        m.labels[i] = (int32_t)(rng_next(&state) % (uint64_t)classes);
    write_file(dir, "input.f32", x, n_in * sizeof(float));
    write_file(dir, "labels.i32", m.labels, (size_t)n * sizeof(int32_t));
    for (int step = 1; step <= steps; step++) {
        model_forward(&m, n, true);
        model_loss(&m, n, 0.0f, 1.0f, NULL);
        model_take_loss(&m);
        model_backward(&m, n, NULL, NULL);
        optimizer_step(&opt, m.params, m.grads, m.momentum, lr, 1.0f, NULL);
        char name[64];
        snprintf(name, sizeof name, "grads%d.f32", step);
        write_file(dir, name, m.grads, m.n_params * sizeof(float));
        snprintf(name, sizeof name, "params%d.f32", step);
        write_file(dir, name, m.params, m.n_params * sizeof(float));
    }
    if (optimizer_steps(&opt) != (uint64_t)steps && opt.kind != OPTIM_SGD) {
        fprintf(stderr, "optim_probe: %llu steps counted, %d taken\n",
                (unsigned long long)optimizer_steps(&opt), steps);
        return 1;
    }
    optimizer_free(&opt);
    model_free(&m);
    b->mem->destroy(b);
    return 0;
}
