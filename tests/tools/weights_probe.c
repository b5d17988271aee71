/* weights_probe: a model's weights in and out of safetensors files (weights.h) and its logits in
 * evaluation mode, for tests/interop/test_torch_weights.py to hold against torchvision.
 *   weights_probe NAME WIDTH H W C CLASSES N INPUT OUTPUT [OPTION=VALUE ...]
 * INPUT: N samples (N,H,W,C) fp32; OUTPUT gets their logits (N, CLASSES) fp32 after the options:
 *   load=FILE    weights_load_init (strict; skip=1: model.init_skip_mismatched, skip_list=NAMES:
 *                model.init_skip, over values drawn from seed 5, which every run without load=FILE
 *                has)
 *   train=T      T training steps (SGD lr 0.05, momentum 0.9) on INPUT with labels i % CLASSES,
 *                so the parameters and the batch-norm statistics move off their initial values
 *   save=FILE    weights_save with num_batches_tracked = steps (steps=S, default T)
 *   stem=S fc_width=N dropout=P zero_init_residual=0|1 as model_probe.
 * Exits 3 with the error on stderr when loading or saving fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "weights.h"

static float *read_floats(const char *path, size_t n) {
    float *p = malloc((n ? n : 1) * sizeof *p);
    FILE *f = fopen(path, "rb");
    if (!p || !f || fread(p, sizeof *p, n, f) != n) {
        fprintf(stderr, "weights_probe: %s: cannot read %zu floats\n", path, n);
        exit(1);
    }
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 10) {
        fprintf(
            stderr,
            "usage: weights_probe NAME WIDTH H W C CLASSES N INPUT OUTPUT [OPTION=VALUE ...]\n");
        return 2;
    }
    int width = atoi(argv[2]), h = atoi(argv[3]), w = atoi(argv[4]), c = atoi(argv[5]);
    int classes = atoi(argv[6]), n = atoi(argv[7]), train = 0;
    long long steps = -1;
    const char *load = NULL, *save = NULL;
    bool is_skip = false;
    const char *skip_list = NULL;
    model_opts_t opts = model_opts_default(argv[1], width);
    for (int i = 10; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        const char *v = eq ? eq + 1 : "";
        size_t k = eq ? (size_t)(eq - argv[i]) : strlen(argv[i]);
#define IS(key) (k == strlen(key) && strncmp(argv[i], key, k) == 0)
        if (IS("load"))
            load = v;
        else if (IS("save"))
            save = v;
        else if (IS("skip"))
            is_skip = atoi(v) != 0;
        else if (IS("skip_list"))
            skip_list = v;
        else if (IS("train"))
            train = atoi(v);
        else if (IS("steps"))
            steps = atoll(v);
        else if (IS("stem"))
            opts.stem = !strcmp(v, "imagenet") ? MODEL_STEM_IMAGENET
                        : !strcmp(v, "cifar")  ? MODEL_STEM_CIFAR
                                               : MODEL_STEM_AUTO;
        else if (IS("fc_width"))
            opts.fc_width = atoi(v);
        else if (IS("dropout"))
            opts.dropout = strtof(v, NULL);
        else if (IS("zero_init_residual"))
            opts.is_zero_init_residual = atoi(v) != 0;
        else {
            fprintf(stderr, "weights_probe: unknown option %s\n", argv[i]);
            return 2;
        }
#undef IS
    }
    backend_t *b = backend_cpu_create(0);
    model_t m;
    char err[1024];
    /* a strict load replaces every value: drawing VGG's 143M first would only cost seconds */
    if (!b || model_init_opts(&m, b, &opts, h, w, c, classes, n, err, sizeof err) < 0 ||
        ((!load || is_skip || skip_list) && model_init_params(&m, 5) < 0)) {
        fprintf(stderr, "weights_probe: %s\n", err);
        return 1;
    }
    size_t n_in = (size_t)n * h * w * c;
    float *x = read_floats(argv[8], n_in);
    int rc = 0;
    weights_skip_t skip = {.is_skip_head = is_skip, .skip = skip_list};
    if (load && weights_load_init(&m, load, &skip, stderr, err, sizeof err) < 0) {
        fprintf(stderr, "weights_probe: %s\n", err);
        rc = 3;
    }
    for (int s = 0; rc == 0 && s < train; s++) {
        memcpy(model_input(&m), x, n_in * sizeof *x);
        for (int i = 0; i < n; i++)
            m.labels[i] = i % classes;
        model_set_step(&m, 1, s, 0);
        model_forward(&m, n, true);
        model_loss(&m, n, 0.0f, 1.0f, NULL);
        model_backward(&m, n, NULL, NULL);
        b->ops->sgd_step(b, m.params, m.grads, m.momentum, m.n_params, 0.05f, 0.9f, 0.0f, false,
                         1.0f, NULL);
    }
    if (rc == 0) {
        memcpy(model_input(&m), x, n_in * sizeof *x);
        model_forward(&m, n, false);
        FILE *f = fopen(argv[9], "wb");
        size_t n_out = (size_t)n * classes;
        if (!f || fwrite(model_logits(&m), sizeof(float), n_out, f) != n_out || fclose(f) != 0) {
            perror(argv[9]);
            rc = 1;
        }
    }
    if (rc == 0 && save &&
        weights_save(&m, save, steps >= 0 ? steps : train, err, sizeof err) < 0) {
        fprintf(stderr, "weights_probe: %s\n", err);
        rc = 3;
    }
    free(x);
    model_free(&m);
    b->mem->destroy(b);
    return rc;
}
