/* op_probe: one op of the CPU backend, forward and backward, on tensors a test wrote, so that
 * tests/interop/test_torch_ops.py can hold it against PyTorch's forward and autograd.
 *   op_probe conv N H W C K SIZE STRIDE PAD DIR    x (N,H,W,C), w (K,SIZE,SIZE,C), dy -> y, dx, dw
 *   op_probe maxpool N H W C SIZE STRIDE PAD DIR   x, dy -> y, dx
 *   op_probe adaptive N H W C OH OW DIR            x, dy -> y, dx
 *   op_probe dropout COUNT P KEY DIR               x, dy -> y, dx
 *   op_probe linear N IN OUT DIR                   x (N,IN), w (OUT,IN), b, dy -> y, dx, dw, db
 *   op_probe bnact ROWS C RELU RESIDUAL DIR        x (ROWS,C), gamma, beta, [res], dy -> y, dx,
 *       [dres], dgamma, dbeta, running (mean then var, from 0 and 1): bn_act in training
 * Every file is raw fp32 (DIR/x.f32 ...), NHWC; gradients start at zero. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An fp32 tensor as the ops take it (backend.h); the ops take sizes from their own arguments. */
#define T(p) tensor_f32((p), 0)

#include "backend.h"

static const char *dir;
static void *owned[24]; /* every buffer, freed at the end (sanitizer builds check for leaks) */
static int n_owned;

static void *own(void *p) {
    if (!p || n_owned == 24) {
        fprintf(stderr, "op_probe: out of memory\n");
        exit(1);
    }
    return owned[n_owned++] = p;
}

static float *load(const char *name, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.f32", dir, name);
    float *p = own(calloc(n ? n : 1, sizeof *p));
    FILE *f = fopen(path, "rb");
    if (!f || fread(p, sizeof *p, n, f) != n) {
        fprintf(stderr, "op_probe: %s: cannot read %zu floats\n", path, n);
        exit(1);
    }
    fclose(f);
    return p;
}

static void save(const char *name, const float *p, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.f32", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, sizeof *p, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

static float *zeros(size_t n) {
    return own(calloc(n ? n : 1, sizeof(float)));
}

static int usage(void) {
    fprintf(stderr, "usage: op_probe conv|maxpool|adaptive|dropout|linear|bnact ARGS... DIR (see "
                    "the source)\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 3) return usage();
    const char *op = argv[1];
    dir = argv[argc - 1];
    int a[8] = {0};
    for (int i = 2; i < argc - 1 && i - 2 < 8; i++)
        a[i - 2] = atoi(argv[i]);
    backend_t *b = backend_cpu_create(1);
    if (!b || b->mem->reserve_workspace(b, 64 << 20) < 0) return 1;
    const backend_i *o = b->ops;
    if (!strcmp(op, "conv") && argc == 11) {
        conv_shape_t s = {.n = a[0],
                          .h = a[1],
                          .w = a[2],
                          .c = a[3],
                          .k = a[4],
                          .r = a[5],
                          .s = a[5],
                          .stride = a[6],
                          .pad = a[7]};
        s.oh = (s.h + 2 * s.pad - s.r) / s.stride + 1;
        s.ow = (s.w + 2 * s.pad - s.s) / s.stride + 1;
        size_t nx = (size_t)s.n * s.h * s.w * s.c, nw = (size_t)s.k * s.r * s.s * s.c;
        size_t ny = (size_t)s.n * s.oh * s.ow * s.k;
        float *x = load("x", nx), *w = load("w", nw), *dy = load("dy", ny);
        float *y = zeros(ny), *dx = zeros(nx), *dw = zeros(nw);
        o->conv2d_forward(b, &s, T(x), w, T(y));
        o->conv2d_backward(b, &s, T(x), w, T(dy), T(dx), dw);
        save("y", y, ny);
        save("dx", dx, nx);
        save("dw", dw, nw);
    } else if ((!strcmp(op, "maxpool") && argc == 10) || (!strcmp(op, "adaptive") && argc == 9)) {
        bool is_max = op[0] == 'm';
        pool_shape_t s = {.n = a[0], .h = a[1], .w = a[2], .c = a[3]};
        if (is_max) {
            s.size = a[4];
            s.stride = a[5];
            s.pad = a[6];
            s.oh = (s.h + 2 * s.pad - s.size) / s.stride + 1;
            s.ow = (s.w + 2 * s.pad - s.size) / s.stride + 1;
        } else {
            s.oh = a[4];
            s.ow = a[5];
        }
        size_t nx = (size_t)s.n * s.h * s.w * s.c, ny = (size_t)s.n * s.oh * s.ow * s.c;
        float *x = load("x", nx), *dy = load("dy", ny), *y = zeros(ny), *dx = zeros(nx);
        int32_t *argmax = own(calloc(ny ? ny : 1, sizeof(int32_t)));
        if (is_max) {
            o->maxpool_forward(b, &s, T(x), T(y), argmax);
            o->maxpool_backward(b, &s, argmax, T(dy), T(dx));
        } else {
            o->avgpool_adaptive_forward(b, &s, T(x), T(y));
            o->avgpool_adaptive_backward(b, &s, T(dy), T(dx));
        }
        save("y", y, ny);
        save("dx", dx, nx);
    } else if (!strcmp(op, "dropout") && argc == 6) {
        size_t n = strtoull(argv[2], NULL, 10);
        float p = strtof(argv[3], NULL);
        uint64_t key = strtoull(argv[4], NULL, 10);
        float *x = load("x", n), *dy = load("dy", n), *y = zeros(n), *dx = zeros(n);
        o->dropout_forward(b, T(x), T(y), n, p, key);
        o->dropout_backward(b, T(dy), T(dx), n, p, key);
        save("y", y, n);
        save("dx", dx, n);
    } else if (!strcmp(op, "linear") && argc == 6) {
        int n = a[0], in = a[1], out = a[2];
        size_t nx = (size_t)n * in, nw = (size_t)out * in, ny = (size_t)n * out;
        float *x = load("x", nx), *w = load("w", nw), *bias = load("b", (size_t)out),
              *dy = load("dy", ny);
        float *y = zeros(ny), *dx = zeros(nx), *dw = zeros(nw), *db = zeros((size_t)out);
        o->linear_forward(b, n, in, out, T(x), w, bias, T(y));
        o->linear_backward(b, n, in, out, T(x), w, T(dy), T(dx), dw, db);
        save("y", y, ny);
        save("dx", dx, nx);
        save("dw", dw, nw);
        save("db", db, (size_t)out);
    } else if (!strcmp(op, "bnact") && argc == 7) {
        size_t rows = (size_t)a[0];
        int c = a[1];
        bool has_res = a[3];
        unsigned flags = a[2] ? BN_ACT_RELU : 0;
        size_t n = rows * (size_t)c;
        float *x = load("x", n), *gamma = load("gamma", (size_t)c), *beta = load("beta", (size_t)c);
        float *res = has_res ? load("res", n) : NULL, *dy = load("dy", n);
        float *y = zeros(n), *dx = zeros(n), *dres = zeros(n), *dgamma = zeros((size_t)c);
        float *dbeta = zeros((size_t)c), *save_ = zeros(2 * (size_t)c), *run = zeros(2 * (size_t)c);
        for (int j = 0; j < c; j++)
            run[c + j] = 1.0f;
        o->bn_act_forward_train(b, rows, c, T(x), gamma, beta, T(res), flags, T(y), save_,
                                save_ + c, run, run + c, 0.1f, 1e-5f);
        o->bn_act_backward(b, rows, c, T(x), gamma, save_, save_ + c, T(y), T(dy), flags, T(dx),
                           T(has_res ? dres : NULL), dgamma, dbeta);
        save("y", y, n);
        save("dx", dx, n);
        if (has_res) save("dres", dres, n);
        save("dgamma", dgamma, (size_t)c);
        save("dbeta", dbeta, (size_t)c);
        save("running", run, 2 * (size_t)c);
    } else {
        return usage();
    }
    b->mem->destroy(b);
    for (int i = 0; i < n_owned; i++)
        free(owned[i]);
    return 0;
}
