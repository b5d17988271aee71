/* The CPU backend's ops: every backward against central finite differences of its forward on
 * small shapes (through L = sum(y * r) for a fixed random r), the accumulate (+=) contract of
 * every backward, and the optimizer against torch.optim.SGD's update rule written out. */
#include <criterion/criterion.h>
#include <signal.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "rng.h"
#include "tensor_close.h"

/* An fp32 tensor as the ops take it (backend.h); the ops take sizes from their own arguments. */
#define T(p) tensor_f32((p), 0)

/* Gradients start at PREFILL: a backward that overwrites instead of adding fails. */
#define MAX_INPUTS 4
#define PREFILL    0.25f

typedef struct op_check op_check_t;
struct op_check {
    backend_t *b;
    int n_inputs;
    float *in[MAX_INPUTS], *grad[MAX_INPUTS];
    size_t n_in[MAX_INPUTS];
    float *y, *r;
    size_t n_out;
    void (*forward)(op_check_t *c);
    void (*backward)(op_check_t *c); /* dy = r */
    /* op parameters */
    conv_shape_t conv;
    pool_shape_t pool;
    int rows, ch, n, in_f, out_f, classes;
    float smoothing;
    int32_t labels[16];
    int32_t argmax[4096];
    float save[64], running[64];
};

static uint64_t rng_state = 12345;

static float *random_buffer(size_t n, float scale) {
    float *p = calloc(n, sizeof(float));
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * ((float)(rng_next(&rng_state) >> 40) / (float)(1 << 24) * 2.0f - 1.0f);
    return p;
}

static void add_input(op_check_t *c, size_t n, float scale) {
    int i = c->n_inputs++;
    c->in[i] = random_buffer(n, scale);
    c->grad[i] = calloc(n, sizeof(float));
    c->n_in[i] = n;
}

static void set_output(op_check_t *c, size_t n) {
    c->n_out = n;
    c->y = calloc(n, sizeof(float));
    c->r = random_buffer(n, 1.0f);
}

static double objective(op_check_t *c) {
    c->forward(c);
    double l = 0;
    for (size_t i = 0; i < c->n_out; i++)
        l += (double)c->y[i] * c->r[i];
    return l;
}

/* Checks every input element (shapes here are small). */
static void check_gradients(op_check_t *c, double h, double atol, double rtol) {
    c->forward(c);
    for (int i = 0; i < c->n_inputs; i++)
        for (size_t j = 0; j < c->n_in[i]; j++)
            c->grad[i][j] = PREFILL;
    c->backward(c);
    for (int i = 0; i < c->n_inputs; i++) {
        for (size_t j = 0; j < c->n_in[i]; j++) {
            float v = c->in[i][j];
            c->in[i][j] = (float)(v + h);
            double up = objective(c);
            c->in[i][j] = (float)(v - h);
            double down = objective(c);
            c->in[i][j] = v;
            double numeric = (up - down) / (2 * h);
            double analytic = (double)c->grad[i][j] - PREFILL;
            cr_assert(fabs(numeric - analytic) <= atol + rtol * fabs(numeric),
                      "input %d element %zu: analytic %.6f, finite differences %.6f", i, j,
                      analytic, numeric);
        }
    }
}

static void free_check(op_check_t *c) {
    for (int i = 0; i < c->n_inputs; i++) {
        free(c->in[i]);
        free(c->grad[i]);
    }
    free(c->y);
    free(c->r);
    c->b->mem->destroy(c->b);
}

static op_check_t *new_check(void) {
    static op_check_t c;
    memset(&c, 0, sizeof c);
    c.b = backend_cpu_create(1);
    cr_assert_not_null(c.b);
    cr_assert_eq(c.b->mem->reserve_workspace(c.b, 1 << 20), 0);
    return &c;
}

/* ---- conv2d ---- */

static void conv_fwd(op_check_t *c) {
    c->b->ops->conv2d_forward(c->b, &c->conv, T(c->in[0]), c->in[1], T(c->y));
}
static void conv_bwd(op_check_t *c) {
    c->b->ops->conv2d_backward(c->b, &c->conv, T(c->in[0]), c->in[1], T(c->r), T(c->grad[0]),
                               c->grad[1]);
}

static void check_conv(int n, int h, int w, int ch, int k, int size, int stride, int pad) {
    op_check_t *c = new_check();
    conv_shape_t *s = &c->conv;
    *s = (conv_shape_t){.n = n,
                        .h = h,
                        .w = w,
                        .c = ch,
                        .k = k,
                        .r = size,
                        .s = size,
                        .stride = stride,
                        .pad = pad};
    s->oh = (h + 2 * pad - size) / stride + 1;
    s->ow = (w + 2 * pad - size) / stride + 1;
    add_input(c, (size_t)n * h * w * ch, 1.0f);
    add_input(c, (size_t)k * size * size * ch, 0.5f);
    set_output(c, (size_t)n * s->oh * s->ow * k);
    c->forward = conv_fwd;
    c->backward = conv_bwd;
    check_gradients(c, 1e-2, 2e-3, 1e-2);
    free_check(c);
}

Test(cpu_ops, conv2d_3x3_same_padding) {
    check_conv(2, 5, 4, 3, 4, 3, 1, 1);
}
Test(cpu_ops, conv2d_3x3_stride_2) {
    check_conv(2, 5, 6, 2, 3, 3, 2, 1);
}
Test(cpu_ops, conv2d_1x1_pointwise) {
    check_conv(2, 3, 3, 4, 5, 1, 1, 0);
}
Test(cpu_ops, conv2d_1x1_stride_2) {
    check_conv(1, 5, 5, 3, 2, 1, 2, 0);
}
Test(cpu_ops, conv2d_5x5_no_padding) {
    check_conv(1, 6, 7, 2, 2, 5, 1, 0);
}
/* the ImageNet stem's 7x7 stride 2 pad 3, on an odd and an even side */
Test(cpu_ops, conv2d_7x7_stride_2_pad_3) {
    check_conv(2, 9, 8, 3, 4, 7, 2, 3);
}

Test(cpu_ops, conv2d_forward_matches_direct_loops) {
    op_check_t *c = new_check();
    conv_shape_t *s = &c->conv;
    *s = (conv_shape_t){.n = 2,
                        .h = 4,
                        .w = 5,
                        .c = 3,
                        .k = 2,
                        .r = 3,
                        .s = 3,
                        .stride = 2,
                        .pad = 1,
                        .oh = 2,
                        .ow = 3};
    add_input(c, 2 * 4 * 5 * 3, 1.0f);
    add_input(c, 2 * 3 * 3 * 3, 1.0f);
    set_output(c, 2 * 2 * 3 * 2);
    conv_fwd(c);
    for (int n = 0; n < 2; n++)
        for (int oy = 0; oy < 2; oy++)
            for (int ox = 0; ox < 3; ox++)
                for (int k = 0; k < 2; k++) {
                    double sum = 0;
                    for (int ky = 0; ky < 3; ky++)
                        for (int kx = 0; kx < 3; kx++)
                            for (int ci = 0; ci < 3; ci++) {
                                int iy = oy * 2 - 1 + ky, ix = ox * 2 - 1 + kx;
                                if (iy < 0 || iy >= 4 || ix < 0 || ix >= 5) continue;
                                sum += c->in[0][((n * 4 + iy) * 5 + ix) * 3 + ci] *
                                       c->in[1][((k * 3 + ky) * 3 + kx) * 3 + ci];
                            }
                    float got = c->y[((n * 2 + oy) * 3 + ox) * 2 + k];
                    cr_assert_float_eq(got, sum, 1e-5, "y[%d,%d,%d,%d]", n, oy, ox, k);
                }
    free_check(c);
}

/* ---- batch norm ---- */

static void bn_fwd(op_check_t *c) {
    float *g = c->in[1], *b = c->in[2];
    c->b->ops->batchnorm_forward_train(c->b, (size_t)c->rows, c->ch, T(c->in[0]), g, b, T(c->y),
                                       c->save, c->save + c->ch, c->running, c->running + c->ch,
                                       0.1f, 1e-5f);
}
static void bn_bwd(op_check_t *c) {
    c->b->ops->batchnorm_backward(c->b, (size_t)c->rows, c->ch, T(c->in[0]), c->in[1], c->save,
                                  c->save + c->ch, T(c->r), T(c->grad[0]), c->grad[1], c->grad[2]);
}

Test(cpu_ops, batchnorm_train_gradients) {
    op_check_t *c = new_check();
    c->rows = 12;
    c->ch = 3;
    add_input(c, 36, 2.0f);
    add_input(c, 3, 1.5f);
    add_input(c, 3, 1.0f);
    set_output(c, 36);
    c->forward = bn_fwd;
    c->backward = bn_bwd;
    check_gradients(c, 1e-2, 3e-3, 2e-2);
    free_check(c);
}

Test(cpu_ops, batchnorm_statistics_and_eval_follow_pytorch) {
    op_check_t *c = new_check();
    c->rows = 4;
    c->ch = 1;
    float x[4] = {1, 2, 3, 6}, g = 2, beta = 0.5f, y[4];
    float running[2] = {0, 1}, save[2];
    c->b->ops->batchnorm_forward_train(c->b, 4, 1, T(x), &g, &beta, T(y), save, save + 1, running,
                                       running + 1, 0.1f, 1e-5f);
    /* mean 3, biased var 3.5, unbiased 14/3 */
    cr_assert_float_eq(save[0], 3.0f, 1e-6);
    cr_assert_float_eq(save[1], 1.0 / sqrt(3.5 + 1e-5), 1e-6);
    cr_assert_float_eq(running[0], 0.3f, 1e-6);
    cr_assert_float_eq(running[1], 0.9 + 0.1 * 14.0 / 3.0, 1e-6);
    cr_assert_float_eq(y[3], 2.0 * 3.0 / sqrt(3.5 + 1e-5) + 0.5, 1e-5);
    c->b->ops->batchnorm_forward_eval(c->b, 4, 1, T(x), &g, &beta, T(y), running, running + 1,
                                      1e-5f);
    cr_assert_float_eq(y[0], 2.0 * (1.0 - 0.3) / sqrt(running[1] + 1e-5) + 0.5, 1e-5);
    c->b->mem->destroy(c->b);
}

/* A channel whose mean is large next to its spread (a near-constant activation): folding the mean
 * into one per-channel offset, x * k + (b - mean * k), loses the difference to rounding of the
 * offset. Forward and backward against double-precision arithmetic on the same floats. */
Test(cpu_ops, batchnorm_keeps_precision_when_the_mean_dwarfs_the_spread) {
    backend_t *b = backend_cpu_create(1);
    cr_assert_eq(b->mem->reserve_workspace(b, 1 << 20), 0);
    enum { ROWS = 64 };
    float x[ROWS], dy[ROWS], y[ROWS], dx[ROWS] = {0}, g = 1.5f, beta = 0.25f, dg = 0, db = 0;
    float running[2] = {0, 1}, save[2];
    for (int i = 0; i < ROWS; i++) {
        x[i] = 1000.0f + 1e-3f * (float)((i * 37) % 19 - 9);
        dy[i] = (float)((i * 11) % 7 - 3);
    }
    b->ops->batchnorm_forward_train(b, ROWS, 1, T(x), &g, &beta, T(y), save, save + 1, running,
                                    running + 1, 0.1f, 1e-5f);
    b->ops->batchnorm_backward(b, ROWS, 1, T(x), &g, save, save + 1, T(dy), T(dx), &dg, &db);
    double mean = 0, var = 0, sdy = 0, sdyx = 0;
    for (int i = 0; i < ROWS; i++)
        mean += x[i] / (double)ROWS;
    for (int i = 0; i < ROWS; i++)
        var += (x[i] - mean) * (x[i] - mean) / ROWS;
    double invstd = 1.0 / sqrt(var + 1e-5);
    for (int i = 0; i < ROWS; i++) {
        sdy += dy[i];
        sdyx += dy[i] * (x[i] - mean) * invstd;
    }
    float want_y[ROWS], want_dx[ROWS];
    double scale_dx = 0;
    for (int i = 0; i < ROWS; i++) {
        double xhat = (x[i] - mean) * invstd;
        want_y[i] = (float)(xhat * g + beta);
        want_dx[i] = (float)(g * invstd / ROWS * (ROWS * dy[i] - sdy - xhat * sdyx));
        scale_dx = fmax(scale_dx, fabs(want_dx[i])); /* of the reference: finite by construction */
    }
    /* element by element, so that a NaN or an infinity fails (fmax(x, NaN) is x) */
    tensor_close_t r;
    char msg[256];
    /* the saved mean itself is rounded to fp32 (~3e-5 here, 1e-2 of the spread): that bounds y */
    tensor_tol_t tol_y = {.atol = 2e-2}, tol_dx = {.atol = 1e-4 * scale_dx};
    tensor_close(want_y, y, ROWS, tol_y, &r);
    tensor_close_describe(&r, ROWS, tol_y, msg, sizeof msg);
    cr_assert(r.n_bad == 0, "forward: %s", msg);
    tensor_close(want_dx, dx, ROWS, tol_dx, &r);
    tensor_close_describe(&r, ROWS, tol_dx, msg, sizeof msg);
    cr_assert(r.n_bad == 0, "backward: %s", msg);
    b->mem->destroy(b);
}

/* ---- elementwise, pooling, linear ---- */

static void relu_fwd(op_check_t *c) {
    c->b->ops->relu_forward(c->b, T(c->in[0]), T(c->y), c->n_out);
}
static void relu_bwd(op_check_t *c) {
    c->b->ops->relu_backward(c->b, T(c->y), T(c->r), T(c->grad[0]), c->n_out);
}

Test(cpu_ops, relu_gradients) {
    op_check_t *c = new_check();
    add_input(c, 40, 1.0f);
    for (int i = 0; i < 40; i++) /* keep away from the kink at 0 */
        if (fabsf(c->in[0][i]) < 0.05f) c->in[0][i] = 0.5f;
    set_output(c, 40);
    c->forward = relu_fwd;
    c->backward = relu_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-4);
    free_check(c);
}

static void add_fwd(op_check_t *c) {
    c->b->ops->add_forward(c->b, T(c->in[0]), T(c->in[1]), T(c->y), c->n_out);
}
static void add_bwd(op_check_t *c) {
    c->b->ops->accumulate(c->b, T(c->r), T(c->grad[0]), c->n_out);
    c->b->ops->accumulate(c->b, T(c->r), T(c->grad[1]), c->n_out);
}

Test(cpu_ops, add_gradients) {
    op_check_t *c = new_check();
    add_input(c, 30, 1.0f);
    add_input(c, 30, 1.0f);
    set_output(c, 30);
    c->forward = add_fwd;
    c->backward = add_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-4);
    free_check(c);
}

static void maxpool_fwd(op_check_t *c) {
    c->b->ops->maxpool_forward(c->b, &c->pool, T(c->in[0]), T(c->y), c->argmax);
}
static void maxpool_bwd(op_check_t *c) {
    c->b->ops->maxpool_backward(c->b, &c->pool, c->argmax, T(c->r), T(c->grad[0]));
}

static void check_maxpool(int size, int stride, int pad) {
    op_check_t *c = new_check();
    pool_shape_t *s = &c->pool;
    *s = (pool_shape_t){.n = 2, .h = 6, .w = 5, .c = 3, .size = size, .stride = stride, .pad = pad};
    s->oh = (6 + 2 * pad - size) / stride + 1;
    s->ow = (5 + 2 * pad - size) / stride + 1;
    add_input(c, 2 * 6 * 5 * 3, 1.0f);
    set_output(c, (size_t)2 * s->oh * s->ow * 3);
    c->forward = maxpool_fwd;
    c->backward = maxpool_bwd;
    check_gradients(c, 1e-4, 1e-3, 1e-3); /* piecewise linear: a small step avoids near-ties */
    free_check(c);
}

Test(cpu_ops, maxpool_2x2_stride_2_gradients) {
    check_maxpool(2, 2, 0);
}
Test(cpu_ops, maxpool_3x3_stride_2_overlapping_gradients) {
    check_maxpool(3, 2, 0);
}
Test(cpu_ops, maxpool_3x3_stride_2_pad_1_gradients) {
    check_maxpool(3, 2, 1);
}

/* The padding is -inf, not 0: an all-negative input still pools to its own values at the border. */
Test(cpu_ops, maxpool_padding_never_wins) {
    backend_t *b = backend_cpu_create(1);
    pool_shape_t s = {
        .n = 1, .h = 3, .w = 3, .c = 1, .size = 3, .stride = 2, .pad = 1, .oh = 2, .ow = 2};
    float x[9] = {-9, -8, -7, -6, -5, -4, -3, -2, -1}, y[4];
    int32_t argmax[4];
    b->ops->maxpool_forward(b, &s, T(x), T(y), argmax);
    /* windows: rows/cols [-1, 1] and [1, 3] clipped to the image */
    float want[4] = {-5, -4, -2, -1};
    int32_t want_at[4] = {4, 5, 7, 8};
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(y[i], want[i], "y[%d] = %g", i, y[i]);
        cr_assert_eq(argmax[i], want_at[i], "argmax[%d] = %d", i, argmax[i]);
    }
    b->mem->destroy(b);
}

/* As nn.MaxPool2d: a NaN in a window wins (and the last of several), ties go to the first cell in
 * row-major order; channels apart (the loop runs all channels of a cell at once). 2x2 windows,
 * stride 2, 4 channels: ch 0 a NaN in the third cell, ch 1 all equal, ch 2 NaNs in the first and
 * last cells, ch 3 plain values with the largest second. */
Test(cpu_ops, maxpool_nan_wins_and_ties_go_first) {
    backend_t *b = backend_cpu_create(1);
    pool_shape_t s = {.n = 1, .h = 2, .w = 2, .c = 4, .size = 2, .stride = 2, .oh = 1, .ow = 1};
    float x[16] = {1,   7, NAN, 0, /* cell (0,0) */ 2, 7, 5,   9, /* cell (0,1) */
                   NAN, 7, 6,   3, /* cell (1,0) */ 3, 7, NAN, 2 /* cell (1,1) */};
    float y[4];
    int32_t argmax[4];
    b->ops->maxpool_forward(b, &s, T(x), T(y), argmax);
    cr_assert(isnan(y[0]) && argmax[0] == 8, "ch 0: %g at %d", y[0], argmax[0]);
    cr_assert(y[1] == 7 && argmax[1] == 1, "ch 1: %g at %d", y[1], argmax[1]);
    cr_assert(isnan(y[2]) && argmax[2] == 14, "ch 2: %g at %d", y[2], argmax[2]);
    cr_assert(y[3] == 9 && argmax[3] == 7, "ch 3: %g at %d", y[3], argmax[3]);
    b->mem->destroy(b);
}

static void gap_fwd(op_check_t *c) {
    c->b->ops->avgpool_global_forward(c->b, c->n, c->rows, c->ch, T(c->in[0]), T(c->y));
}
static void gap_bwd(op_check_t *c) {
    c->b->ops->avgpool_global_backward(c->b, c->n, c->rows, c->ch, T(c->r), T(c->grad[0]));
}

Test(cpu_ops, global_average_pool_gradients) {
    op_check_t *c = new_check();
    c->n = 2;
    c->rows = 6; /* H * W */
    c->ch = 4;
    add_input(c, 48, 1.0f);
    set_output(c, 8);
    c->forward = gap_fwd;
    c->backward = gap_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-3);
    free_check(c);
}

static void adaptive_fwd(op_check_t *c) {
    c->b->ops->avgpool_adaptive_forward(c->b, &c->pool, T(c->in[0]), T(c->y));
}
static void adaptive_bwd(op_check_t *c) {
    c->b->ops->avgpool_adaptive_backward(c->b, &c->pool, T(c->r), T(c->grad[0]));
}

static void check_adaptive(int h, int w, int oh, int ow) {
    op_check_t *c = new_check();
    c->pool = (pool_shape_t){.n = 2, .h = h, .w = w, .c = 3, .oh = oh, .ow = ow};
    add_input(c, (size_t)2 * h * w * 3, 1.0f);
    set_output(c, (size_t)2 * oh * ow * 3);
    c->forward = adaptive_fwd;
    c->backward = adaptive_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-3);
    free_check(c);
}

Test(cpu_ops, adaptive_avgpool_gradients) {
    check_adaptive(6, 5, 3, 2); /* bins that divide evenly and bins that overlap */
    check_adaptive(5, 7, 7, 7); /* VGG's 7x7 from a smaller input: repeated cells */
    check_adaptive(2, 3, 7, 7);
    check_adaptive(7, 7, 7, 7); /* the identity */
}

/* PyTorch's bins: start floor(i * in / out), end ceil((i + 1) * in / out). */
Test(cpu_ops, adaptive_avgpool_bins_follow_pytorch) {
    backend_t *b = backend_cpu_create(1);
    pool_shape_t s = {.n = 1, .h = 1, .w = 5, .c = 1, .oh = 1, .ow = 3};
    float x[5] = {1, 2, 4, 8, 16}, y[3];
    b->ops->avgpool_adaptive_forward(b, &s, T(x), T(y));
    /* bins [0, 2) [1, 4) [3, 5) */
    cr_assert_float_eq(y[0], 1.5f, 1e-6);
    cr_assert_float_eq(y[1], 14.0f / 3.0f, 1e-6);
    cr_assert_float_eq(y[2], 12.0f, 1e-6);
    s = (pool_shape_t){.n = 1, .h = 1, .w = 2, .c = 1, .oh = 1, .ow = 7};
    float y7[7];
    b->ops->avgpool_adaptive_forward(b, &s, T(x),
                                     T(y7)); /* [0,1) three times, [0,2), [1,2) three times */
    float want[7] = {1, 1, 1, 1.5f, 2, 2, 2};
    for (int i = 0; i < 7; i++)
        cr_assert_float_eq(y7[i], want[i], 1e-6, "y[%d] = %g", i, y7[i]);
    b->mem->destroy(b);
}

/* ---- dropout ---- */

#define DROP_KEY 0x1234abcdull

static void dropout_fwd(op_check_t *c) {
    c->b->ops->dropout_forward(c->b, T(c->in[0]), T(c->y), c->n_out, c->smoothing, DROP_KEY);
}
static void dropout_bwd(op_check_t *c) {
    c->b->ops->dropout_backward(c->b, T(c->r), T(c->grad[0]), c->n_out, c->smoothing, DROP_KEY);
}

Test(cpu_ops, dropout_gradients) {
    op_check_t *c = new_check();
    c->smoothing = 0.3f; /* the drop probability */
    add_input(c, 64, 1.0f);
    set_output(c, 64);
    c->forward = dropout_fwd;
    c->backward = dropout_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-4);
    free_check(c);
}

/* nn.Dropout's contract: survivors scaled by 1 / (1 - p), about p dropped, the mask a function of
 * the key alone (so the backward and every backend find it again), p = 0 the identity. */
Test(cpu_ops, dropout_scales_survivors_and_drops_about_p) {
    backend_t *b = backend_cpu_create(2);
    size_t n = 200000;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *y2 = malloc(n * sizeof *y2);
    for (size_t i = 0; i < n; i++)
        x[i] = 1.0f + (float)(i % 7);
    float ps[3] = {0.5f, 0.1f, 0.9f};
    for (int k = 0; k < 3; k++) {
        b->ops->dropout_forward(b, T(x), T(y), n, ps[k], DROP_KEY + (uint64_t)k);
        size_t dropped = 0;
        for (size_t i = 0; i < n; i++) {
            if (y[i] == 0.0f)
                dropped++;
            else
                cr_assert_eq(y[i], x[i] * (1.0f / (1.0f - ps[k])), "p %g element %zu", ps[k], i);
        }
        double frac = (double)dropped / (double)n; /* binomial: sd <= 0.0012 */
        cr_assert(fabs(frac - ps[k]) < 0.006, "p %g: dropped %.4f", ps[k], frac);
        b->ops->dropout_forward(b, T(x), T(y2), n, ps[k], DROP_KEY + (uint64_t)k);
        cr_assert(memcmp(y, y2, n * sizeof *y) == 0, "the same key draws the same mask");
        b->ops->dropout_forward(b, T(x), T(y2), n, ps[k], DROP_KEY + 100);
        cr_assert(memcmp(y, y2, n * sizeof *y) != 0, "another key, another mask");
    }
    b->ops->dropout_forward(b, T(x), T(y), n, 0.0f, DROP_KEY);
    cr_assert(memcmp(x, y, n * sizeof *y) == 0, "p = 0 copies");
    free(x);
    free(y);
    free(y2);
    b->mem->destroy(b);
}

/* ---- convolution bias ---- */

static void bias_fwd(op_check_t *c) {
    memcpy(c->y, c->in[0], c->n_out * sizeof(float));
    c->b->ops->bias_add(c->b, (size_t)c->rows, c->ch, c->in[1], T(c->y));
}
static void bias_bwd(op_check_t *c) {
    c->b->ops->accumulate(c->b, T(c->r), T(c->grad[0]), c->n_out);
    c->b->ops->bias_backward(c->b, (size_t)c->rows, c->ch, T(c->r), c->grad[1]);
}

Test(cpu_ops, conv_bias_gradients) {
    op_check_t *c = new_check();
    c->rows = 10;
    c->ch = 70; /* more than one block of 64 channels */
    add_input(c, 700, 1.0f);
    add_input(c, 70, 1.0f);
    set_output(c, 700);
    c->forward = bias_fwd;
    c->backward = bias_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-4);
    free_check(c);
}

static void linear_fwd(op_check_t *c) {
    c->b->ops->linear_forward(c->b, c->n, c->in_f, c->out_f, T(c->in[0]), c->in[1], c->in[2],
                              T(c->y));
}
static void linear_bwd(op_check_t *c) {
    c->b->ops->linear_backward(c->b, c->n, c->in_f, c->out_f, T(c->in[0]), c->in[1], T(c->r),
                               T(c->grad[0]), c->grad[1], c->grad[2]);
}

Test(cpu_ops, linear_gradients) {
    op_check_t *c = new_check();
    c->n = 3;
    c->in_f = 5;
    c->out_f = 4;
    add_input(c, 15, 1.0f);
    add_input(c, 20, 1.0f);
    add_input(c, 4, 1.0f);
    set_output(c, 12);
    c->forward = linear_fwd;
    c->backward = linear_bwd;
    check_gradients(c, 1e-2, 1e-3, 1e-3);
    free_check(c);
}

/* VGG's first classifier layer, 25088 -> 4096 (103M weights, 411 MB): every offset past 2^31
 * bytes must be size_t, and the GEMMs must take it. Entries spread over the whole matrix against
 * double-precision sums; backward accumulates onto non-zero gradients. */
Test(cpu_ops, linear_of_100m_parameters, .timeout = 60) {
    backend_t *b = backend_cpu_create(2);
    int n = 2, in = 25088, out = 4096;
    size_t nw = (size_t)in * out;
    float *x = random_buffer((size_t)n * in, 1.0f), *w = malloc(nw * sizeof *w);
    float *dw = malloc(nw * sizeof *dw), *bias = random_buffer((size_t)out, 1.0f);
    float *y = calloc((size_t)n * out, sizeof *y), *dy = random_buffer((size_t)n * out, 1.0f);
    float *dx = calloc((size_t)n * in, sizeof *dx), *db = calloc((size_t)out, sizeof *db);
    cr_assert(w && dw && y && dx && db);
    for (size_t i = 0; i < nw; i++) { /* cheap, distinct everywhere */
        w[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        dw[i] = PREFILL;
    }
    b->ops->linear_forward(b, n, in, out, T(x), w, bias, T(y));
    b->ops->linear_backward(b, n, in, out, T(x), w, T(dy), T(dx), dw, db);
    int rows[3] = {0, 2047, 4095}, cols[3] = {0, 12345, 25087};
    for (int s = 0; s < n; s++)
        for (int k = 0; k < 3; k++) {
            int o = rows[k];
            double want = bias[o];
            for (int i = 0; i < in; i++)
                want += (double)x[(size_t)s * in + i] * w[(size_t)o * in + i];
            cr_assert(fabs(y[(size_t)s * out + o] - want) < 1e-3 * (1 + fabs(want)),
                      "y[%d][%d]: %g, want %g", s, o, y[(size_t)s * out + o], want);
            int i = cols[k];
            double dxw = 0;
            for (int j = 0; j < out; j++)
                dxw += (double)dy[(size_t)s * out + j] * w[(size_t)j * in + i];
            cr_assert(fabs(dx[(size_t)s * in + i] - dxw) < 1e-3 * (1 + fabs(dxw)), "dx[%d][%d]", s,
                      i);
        }
    for (int k = 0; k < 3; k++)
        for (int m = 0; m < 3; m++) {
            size_t at = (size_t)rows[k] * in + cols[m]; /* the last one is past 2^31 bytes */
            double want = PREFILL;
            for (int s = 0; s < n; s++)
                want += (double)dy[(size_t)s * out + rows[k]] * x[(size_t)s * in + cols[m]];
            cr_assert(fabs(dw[at] - want) < 1e-5 * (1 + fabs(want)), "dw[%d][%d]: %g, want %g",
                      rows[k], cols[m], dw[at], want);
            cr_assert_float_eq(db[rows[k]], dy[rows[k]] + dy[out + rows[k]], 1e-5);
        }
    free(x);
    free(w);
    free(dw);
    free(bias);
    free(y);
    free(dy);
    free(dx);
    free(db);
    b->mem->destroy(b);
}

/* ---- loss: y is the summed loss, r = [1/n] so the objective is the mean loss ---- */

static void xent_fwd(op_check_t *c) {
    c->y[0] = 0;
    c->b->ops->softmax_xent(c->b, c->n, c->classes, T(c->in[0]), c->labels, c->smoothing, 1.0f,
                            NULL, T(NULL), c->y);
}
static void xent_bwd(op_check_t *c) {
    float *d = calloc(c->n_in[0], sizeof(float)), loss = 0;
    c->b->ops->softmax_xent(c->b, c->n, c->classes, T(c->in[0]), c->labels, c->smoothing, 1.0f,
                            NULL, T(d), &loss);
    for (size_t i = 0; i < c->n_in[0]; i++)
        c->grad[0][i] += d[i];
    free(d);
}

static void check_xent(float smoothing) {
    op_check_t *c = new_check();
    c->n = 4;
    c->classes = 5;
    c->smoothing = smoothing;
    for (int i = 0; i < 4; i++)
        c->labels[i] = (i * 3) % 5;
    add_input(c, 20, 3.0f);
    set_output(c, 1);
    c->r[0] = 1.0f / 4;
    c->forward = xent_fwd;
    c->backward = xent_bwd;
    check_gradients(c, 1e-2, 1e-4, 1e-3);
    free_check(c);
}

Test(cpu_ops, softmax_cross_entropy_gradients) {
    check_xent(0.0f);
}
Test(cpu_ops, softmax_cross_entropy_label_smoothing_gradients) {
    check_xent(0.1f);
}

Test(cpu_ops, softmax_cross_entropy_value) {
    backend_t *b = backend_cpu_create(1);
    float logits[3] = {1.0f, 2.0f, 0.5f}, loss = 0;
    int32_t label = 1;
    b->ops->softmax_xent(b, 1, 3, T(logits), &label, 0.0f, 1.0f, NULL, T(NULL), &loss);
    double lse = log(exp(1.0) + exp(2.0) + exp(0.5));
    cr_assert_float_eq(loss, lse - 2.0, 1e-6);
    loss = 0;
    b->ops->softmax_xent(b, 1, 3, T(logits), &label, 0.3f, 1.0f, NULL, T(NULL), &loss);
    /* torch: (1 - eps) * nll + eps * mean_j(-log p_j) */
    double smooth = 0.7 * (lse - 2.0) + 0.3 * ((lse - 1.0) + (lse - 2.0) + (lse - 0.5)) / 3;
    cr_assert_float_eq(loss, smooth, 1e-6);
    b->mem->destroy(b);
}

Test(cpu_ops, sgd_step_follows_torch_optim_sgd) {
    backend_t *b = backend_cpu_create(1);
    for (int nesterov = 0; nesterov < 2; nesterov++) {
        float p = 1.0f, m = 0.0f, g = 0.5f;
        double rp = 1.0, rm = 0.0;
        for (int step = 0; step < 3; step++) {
            b->ops->sgd_step(b, &p, &g, &m, 1, 0.1f, 0.9f, 0.01f, nesterov, 0.5f, NULL);
            double d = 0.5 * 0.5 + 0.01 * rp;
            rm = 0.9 * rm + d; /* torch starts the buffer at d: the same as 0.9 * 0 + d */
            rp -= 0.1 * (nesterov ? d + 0.9 * rm : rm);
            cr_assert_float_eq(p, rp, 1e-6, "nesterov %d step %d", nesterov, step);
        }
    }
    b->mem->destroy(b);
}

Test(cpu_ops, loss_scale_check_finds_an_inf_or_a_nan_anywhere) {
    backend_t *b = backend_cpu_create(2);
    size_t n = 100000; /* over the size the loop goes parallel at */
    float *x = calloc(n, sizeof *x);
    loss_scale_t ls = {.scale = 8.0f};
    b->ops->loss_scale_check(b, x, n, &ls);
    cr_assert_eq(ls.found_inf, 0);
    float bad[] = {INFINITY, -INFINITY, NAN};
    size_t where[] = {0, n / 2 + 3, n - 1};
    for (int i = 0; i < 3; i++) {
        x[where[i]] = bad[i];
        ls.found_inf = 0;
        b->ops->loss_scale_check(b, x, n, &ls);
        cr_assert_eq(ls.found_inf, 1, "value %d at %zu", i, where[i]);
        x[where[i]] = FLT_MAX; /* large but finite */
    }
    ls.found_inf = 1; /* the check only ever sets the flag: a later clean arena keeps it */
    b->ops->loss_scale_check(b, x, n, &ls);
    cr_assert_eq(ls.found_inf, 1);
    free(x);
    b->mem->destroy(b);
}

Test(cpu_ops, sgd_step_unscales_and_skips_an_overflowed_step) {
    backend_t *b = backend_cpu_create(1);
    float p[2] = {1.0f, -2.0f}, m[2] = {0.25f, 0.5f}, g[2] = {0.5f, 3.0f};
    float rp[2] = {1.0f, -2.0f}, rm[2] = {0.25f, 0.5f}, scaled[2] = {0.5f * 1024, 3.0f * 1024};
    loss_scale_t ls = {.scale = 1024.0f};
    b->ops->sgd_step(b, rp, g, rm, 2, 0.1f, 0.9f, 5e-4f, true, 0.5f, NULL);
    b->ops->sgd_step(b, p, scaled, m, 2, 0.1f, 0.9f, 5e-4f, true, 0.5f, &ls);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i], rp[i], "a power-of-two scale unscales exactly");
        cr_assert_eq(m[i], rm[i]);
    }
    ls.found_inf = 1;
    scaled[0] = INFINITY;
    b->ops->sgd_step(b, p, scaled, m, 2, 0.1f, 0.9f, 5e-4f, true, 0.5f, &ls);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i], rp[i], "a skipped step changes no parameter");
        cr_assert_eq(m[i], rm[i], "nor the momentum");
    }
    b->mem->destroy(b);
}

Test(cpu_ops, softmax_xent_multiplies_the_gradient_by_the_loss_scale) {
    backend_t *b = backend_cpu_create(1);
    float logits[6] = {0.5f, -1.0f, 2.0f, 0.0f, 0.25f, -0.5f}, d[6], ds[6], loss = 0, loss_s = 0;
    int32_t labels[2] = {2, 0};
    loss_scale_t ls = {.scale = 65536.0f};
    b->ops->softmax_xent(b, 2, 3, T(logits), labels, 0.1f, 1.0f, NULL, T(d), &loss);
    b->ops->softmax_xent(b, 2, 3, T(logits), labels, 0.1f, 1.0f, &ls, T(ds), &loss_s);
    cr_assert_eq(loss, loss_s, "the loss itself is not scaled");
    for (int i = 0; i < 6; i++)
        cr_assert_eq(ds[i], d[i] * 65536.0f);
    b->mem->destroy(b);
}

/* The batch op is augment_sample per job, labels gathered alongside, in any order of indices. */
Test(cpu_ops, augment_batch_is_augment_sample_per_job) {
    backend_t *b = backend_cpu_create(2);
    int h = 6, w = 5, c = 3, samples = 40, n = 24;
    size_t per = (size_t)h * w * c;
    uint8_t *images = malloc(per * samples);
    int32_t labels[40];
    for (size_t i = 0; i < per * samples; i++)
        images[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < samples; i++)
        labels[i] = 997 - i; /* int32: beyond a byte's classes */
    augment_t a = {.is_random = true, .padding = 2, .seed = 5};
    for (int k = 0; k < c; k++) {
        a.mean[k] = 0.25f * (float)k;
        a.std[k] = 0.3f + 0.1f * (float)k;
    }
    augment_job_t jobs[24];
    for (int i = 0; i < n; i++) {
        jobs[i].index = (i * 7) % samples;
        jobs[i].choice = augment_choose(&a, 3, jobs[i].index);
    }
    float *out = malloc(per * n * sizeof *out), *want = malloc(per * sizeof *want);
    int32_t got_labels[24];
    b->ops->augment_batch(b, images, labels, h, w, c, jobs, n, augment_norm(&a, c), T(out),
                          got_labels);
    for (int i = 0; i < n; i++) {
        augment_sample(&a, 3, jobs[i].index, images + per * (size_t)jobs[i].index, h, w, c, want);
        cr_assert(memcmp(out + per * (size_t)i, want, per * sizeof *want) == 0, "sample %d", i);
        cr_assert_eq(got_labels[i], labels[jobs[i].index]);
    }
    free(images);
    free(out);
    free(want);
    b->mem->destroy(b);
}

/* ---- batch norm + residual add + ReLU fused (bn_act_*) ---- */

static void bn_act_fwd(op_check_t *c) {
    c->b->ops->bn_act_forward_train(c->b, (size_t)c->rows, c->ch, T(c->in[0]), c->in[1], c->in[2],
                                    T(c->in[3]), BN_ACT_RELU, T(c->y), c->save, c->save + c->ch,
                                    c->running, c->running + c->ch, 0.1f, 1e-5f);
}
static void bn_act_bwd(op_check_t *c) {
    c->b->ops->bn_act_backward(c->b, (size_t)c->rows, c->ch, T(c->in[0]), c->in[1], c->save,
                               c->save + c->ch, T(c->y), T(c->r), BN_ACT_RELU, T(c->grad[0]),
                               T(c->grad[3]), c->grad[1], c->grad[2]);
}

Test(cpu_ops, bn_add_relu_gradients) {
    op_check_t *c = new_check();
    c->rows = 12;
    c->ch = 3;
    add_input(c, 36, 2.0f);
    add_input(c, 3, 1.5f);
    add_input(c, 3, 1.0f);
    add_input(c, 36, 1.0f); /* the residual */
    set_output(c, 36);
    c->forward = bn_act_fwd;
    c->backward = bn_act_bwd;
    /* keep every output away from ReLU's kink, so that finite differences do not cross it */
    bn_act_fwd(c);
    for (int i = 0; i < 36; i++)
        if (fabsf(c->y[i]) < 0.1f) c->in[3][i] += 0.3f;
    check_gradients(c, 1e-3, 3e-3, 2e-2);
    free_check(c);
}

/* bn_act_* give the bits of the unfused ops they replace (batchnorm, add, relu forward; relu's
 * backward, the add's two accumulates and batch norm's backward onto zeroed gradients), in every
 * combination of residual and ReLU, adding to or writing its input gradients. */
Test(cpu_ops, bn_act_gives_the_unfused_ops_bits) {
    backend_t *b = backend_cpu_create(1);
    cr_assert_eq(b->mem->reserve_workspace(b, 1 << 20), 0);
    const backend_i *o = b->ops;
    size_t rows = 50;
    int ch = 7;
    size_t n = rows * (size_t)ch;
    float *x = random_buffer(n, 3.0f), *res = random_buffer(n, 1.0f), *dy = random_buffer(n, 1.0f);
    float *gamma = random_buffer((size_t)ch, 1.0f), *beta = random_buffer((size_t)ch, 1.0f);
    float *start = random_buffer(n, 1.0f); /* what the gradients hold before, when added to */
    for (int combo = 0; combo < 8; combo++) {
        bool has_res = combo & 1, has_relu = combo & 2, is_written = combo & 4;
        float run_a[14] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, run_b[14], save_a[14],
              save_b[14];
        memcpy(run_b, run_a, sizeof run_a);
        float *ya = calloc(n, 4), *yb = calloc(n, 4), *tmp = calloc(n, 4), *dz = calloc(n, 4);
        float *dxa = calloc(n, 4), *dxb = calloc(n, 4), *dra = calloc(n, 4), *drb = calloc(n, 4);
        float dga[7] = {0}, dba[7] = {0}, dgb[7] = {0}, dbb[7] = {0};
        /* unfused */
        o->batchnorm_forward_train(b, rows, ch, T(x), gamma, beta, T(ya), save_a, save_a + ch,
                                   run_a, run_a + ch, 0.1f, 1e-5f);
        if (has_res) {
            memcpy(tmp, ya, n * 4);
            o->add_forward(b, T(tmp), T(res), T(ya), n);
        }
        if (has_relu) {
            memcpy(tmp, ya, n * 4);
            o->relu_forward(b, T(tmp), T(ya), n);
            o->relu_backward(b, T(ya), T(dy), T(dz), n); /* dz was zero */
        } else {
            memcpy(dz, dy, n * 4);
        }
        if (!is_written) {
            memcpy(dxa, start, n * 4);
            memcpy(dra, start, n * 4);
        }
        if (has_res) o->accumulate(b, T(dz), T(dra), n);
        o->batchnorm_backward(b, rows, ch, T(x), gamma, save_a, save_a + ch, T(dz), T(dxa), dga,
                              dba);
        /* fused; written gradients start as garbage */
        unsigned flags = (has_relu ? BN_ACT_RELU : 0) |
                         (is_written ? BN_ACT_WRITE_DX | BN_ACT_WRITE_DRESIDUAL : 0);
        for (size_t i = 0; i < n; i++) {
            dxb[i] = is_written ? NAN : start[i];
            drb[i] = is_written ? NAN : start[i];
        }
        o->bn_act_forward_train(b, rows, ch, T(x), gamma, beta, T(has_res ? res : NULL), flags,
                                T(yb), save_b, save_b + ch, run_b, run_b + ch, 0.1f, 1e-5f);
        o->bn_act_backward(b, rows, ch, T(x), gamma, save_b, save_b + ch, T(yb), T(dy), flags,
                           T(dxb), T(has_res ? drb : NULL), dgb, dbb);
        cr_assert(memcmp(ya, yb, n * 4) == 0, "combo %d: forward", combo);
        cr_assert(memcmp(run_a, run_b, sizeof run_a) == 0, "combo %d: running statistics", combo);
        cr_assert(memcmp(save_a, save_b, sizeof save_a) == 0, "combo %d: saved statistics", combo);
        cr_assert(memcmp(dxa, dxb, n * 4) == 0, "combo %d: dx", combo);
        if (has_res) cr_assert(memcmp(dra, drb, n * 4) == 0, "combo %d: dresidual", combo);
        cr_assert(memcmp(dga, dgb, sizeof dga) == 0 && memcmp(dba, dbb, sizeof dba) == 0,
                  "combo %d: dgamma, dbeta", combo);
        /* evaluation */
        o->batchnorm_forward_eval(b, rows, ch, T(x), gamma, beta, T(ya), run_a, run_a + ch, 1e-5f);
        if (has_res) {
            memcpy(tmp, ya, n * 4);
            o->add_forward(b, T(tmp), T(res), T(ya), n);
        }
        if (has_relu) {
            memcpy(tmp, ya, n * 4);
            o->relu_forward(b, T(tmp), T(ya), n);
        }
        o->bn_act_forward_eval(b, rows, ch, T(x), gamma, beta, T(has_res ? res : NULL), flags,
                               T(yb), run_b, run_b + ch, 1e-5f);
        cr_assert(memcmp(ya, yb, n * 4) == 0, "combo %d: evaluation forward", combo);
        free(ya), free(yb), free(tmp), free(dz), free(dxa), free(dxb), free(dra), free(drb);
    }
    free(x), free(res), free(dy), free(gamma), free(beta), free(start);
    b->mem->destroy(b);
}

/* conv_shape_t.is_dx_written: the backward writes dx, bit for bit what adding onto zeros gives,
 * for the GEMM-only (1x1) path and the im2col one (DDP_CPU_ONEDNN=0), and through oneDNN (the
 * default) where the build has it. */
static void conv_written_cases(void);

Test(cpu_ops, conv_backward_writes_dx_when_told) {
    setenv("DDP_CPU_ONEDNN", "0", 1); /* this test's own process */
    conv_written_cases();
}

Test(cpu_ops, conv_backward_writes_dx_when_told_through_onednn) {
    unsetenv("DDP_CPU_ONEDNN"); /* the default; without oneDNN: im2col again */
    conv_written_cases();
}

static void conv_written_cases(void) {
    backend_t *b = backend_cpu_create(1);
    cr_assert_eq(b->mem->reserve_workspace(b, 1 << 20), 0);
    conv_shape_t shapes[2] = {
        {.n = 2,
         .h = 5,
         .w = 4,
         .c = 3,
         .k = 4,
         .r = 1,
         .s = 1,
         .stride = 1,
         .pad = 0,
         .oh = 5,
         .ow = 4},
        {.n = 2,
         .h = 5,
         .w = 4,
         .c = 3,
         .k = 4,
         .r = 3,
         .s = 3,
         .stride = 2,
         .pad = 1,
         .oh = 3,
         .ow = 2},
    };
    for (int k = 0; k < 2; k++) {
        conv_shape_t s = shapes[k];
        size_t nx = 2 * 5 * 4 * 3, nw = (size_t)4 * s.r * s.s * 3, ny = (size_t)2 * s.oh * s.ow * 4;
        float *x = random_buffer(nx, 1), *w = random_buffer(nw, 1), *dy = random_buffer(ny, 1);
        float *dxa = calloc(nx, 4), *dxb = random_buffer(nx, 5), *dwa = calloc(nw, 4),
              *dwb = calloc(nw, 4);
        b->ops->conv2d_backward(b, &s, T(x), w, T(dy), T(dxa), dwa);
        s.is_dx_written = true;
        b->ops->conv2d_backward(b, &s, T(x), w, T(dy), T(dxb), dwb);
        cr_assert(memcmp(dxa, dxb, nx * 4) == 0, "shape %d: written dx", k);
        cr_assert(memcmp(dwa, dwb, nw * 4) == 0, "shape %d: dw", k);
        free(x), free(w), free(dy), free(dxa), free(dxb), free(dwa), free(dwb);
    }
    b->mem->destroy(b);
}

/* The cpu backend stores fp32 only: a tensor described as narrow is its caller's bug and ends the
 * process (backend_cpu__f32), rather than being read as floats it is not. */
Test(cpu_ops, a_narrow_tensor_descriptor_is_refused, .signal = SIGABRT) {
    backend_t *b = backend_cpu_create(1);
    float x[4] = {1, -2, 3, -4}, y[4];
    b->ops->relu_forward(b, T(x), T(y), 4); /* fp32: fine */
    cr_assert_eq(y[1], 0.0f);
    b->ops->relu_forward(b, tensor_desc(x, DTYPE_BF16, 1, 1, 1, 4), T(y), 4);
}
