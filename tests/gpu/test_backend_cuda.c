/* The CUDA backend held against the CPU reference, op by op and for one whole training step of a
 * ResNet: the same inputs through backend_i on both, outputs compared within a per-op tolerance.
 * Every test skips where no GPU is visible (CI); they run for real on a GPU machine. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "model.h"
#include "narrow_tensor.h"
#include "rng.h"
#include "tensor_close.h"

static backend_t *cpu, *gpu;

static void setup(void) {
    if (backend_cuda_device_count() == 0) return;
    char err[256];
    cpu = backend_cpu_create(1);
    gpu = backend_cuda_create(0, 0, NULL, err, sizeof err);
    cr_assert_not_null(gpu, "%s", err);
    cr_assert_eq(cpu->mem->reserve_workspace(cpu, 64 << 20), 0);
}

static void teardown(void) {
    if (gpu) gpu->mem->destroy(gpu);
    if (cpu) cpu->mem->destroy(cpu);
}

TestSuite(backend_cuda, .init = setup, .fini = teardown, .timeout = 120);

#define SKIP_WITHOUT_GPU()                                                                         \
    do {                                                                                           \
        if (!gpu) cr_skip_test("no GPU visible");                                                  \
    } while (0)

static uint64_t seed = 99;

static float *random_host(size_t n, float scale) {
    float *p = malloc((n ? n : 1) * sizeof *p);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * ((float)(rng_next(&seed) >> 40) / (float)(1 << 24) * 2.0f - 1.0f);
    return p;
}

/* Backend copies of host arrays; `on` returns them back to the host. */
static float *up(backend_t *b, const float *host, size_t n) {
    float *d = b->mem->alloc(b, n * sizeof(float));
    b->mem->to_device(b, d, host, n * sizeof(float));
    return d;
}

static float *down(backend_t *b, const float *dev, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof *h);
    b->mem->to_host(b, h, dev, n * sizeof(float));
    return h;
}

/* Per element: |cuda - cpu| <= rtol * |cpu| + atol_rms * rms(cpu). The absolute part follows the
 * reference's rms because a reduction's rounding grows with the size of its terms, which the rms
 * of its outputs reflects; elementwise ops get a tiny one. A NaN or an infinity where the CPU's
 * value is finite fails (tensor_close.h). Each comparison logs how much of its tolerance it used,
 * so a GPU run's log shows the margins. */
static void expect_tensor_close(const float *want, const float *got, size_t n, double rtol,
                                double atol_rms, const char *what) {
    double sum2 = 0;
    size_t n_finite = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(want[i])) {
            sum2 += (double)want[i] * want[i];
            n_finite++;
        }
    double rms = n_finite ? sqrt(sum2 / (double)n_finite) : 0;
    tensor_tol_t tol = {.rtol = rtol, .atol = atol_rms * fmax(rms, 1e-30)};
    tensor_close_t r;
    char msg[512];
    tensor_close(want, got, n, tol, &r);
    tensor_close_describe(&r, n, tol, msg, sizeof msg);
    fprintf(stderr, "%s: %s\n", what, msg);
    cr_assert(r.n_bad == 0, "%s: cpu vs cuda: %s", what, msg);
}

/* Against the tensor's largest value (one absolute tolerance rtol * max|cpu| for every element),
 * still NaN- and inf-proof. The tests here use expect_tensor_close; this stays for coarse checks.
 */
static inline void expect_close(const float *want, const float *got, size_t n, double rtol,
                                const char *what) {
    double scale = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(want[i])) scale = fmax(scale, fabs(want[i]));
    tensor_tol_t tol = {.atol = rtol * fmax(scale, 1e-6)};
    tensor_close_t r;
    char msg[512];
    tensor_close(want, got, n, tol, &r);
    tensor_close_describe(&r, n, tol, msg, sizeof msg);
    cr_assert(r.n_bad == 0, "%s: cpu vs cuda: %s", what, msg);
}

/* Tolerances (rtol, atol_rms) per arithmetic.
 * TOL_EXACTISH: selection, copies and a few additions or one multiply-add per element, the same
 *   formula on both sides (FMA contraction, the order of a handful of additions): a few ulps.
 * TOL_FP32_REDUCE: sums over up to a few thousand terms in fp32 in another order.
 * TOL_CONV: cuDNN's timed search may pick Winograd or FFT algorithms, which round more. */
#define TOL_EXACTISH    1e-6, 1e-6
#define TOL_ELEMENTWISE 1e-5, 1e-6
#define TOL_FP32_REDUCE 1e-5, 1e-5
#define TOL_CONV        1e-4, 1e-4

/* conv forward and backward (dx and dw accumulate onto a non-zero start) on g against the cpu,
 * within (rtol, atol_rms) */
static void conv_case_on(backend_t *g, double rtol, double atol_rms, int n, int h, int w, int c,
                         int k, int size, int stride, int pad) {
    conv_shape_t s = {.n = n,
                      .h = h,
                      .w = w,
                      .c = c,
                      .k = k,
                      .r = size,
                      .s = size,
                      .stride = stride,
                      .pad = pad,
                      .oh = (h + 2 * pad - size) / stride + 1,
                      .ow = (w + 2 * pad - size) / stride + 1};
    size_t nx = (size_t)n * h * w * c, nw = (size_t)k * size * size * c,
           ny = (size_t)n * s.oh * s.ow * k;
    float *x = random_host(nx, 1), *wt = random_host(nw, 0.5f), *dy = random_host(ny, 1);
    float *dx0 = random_host(nx, 1), *dw0 = random_host(nw, 1);
    float *out[2][3];
    backend_t *bs[2] = {cpu, g};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        float *dx_ = up(b, x, nx), *dw_ = up(b, wt, nw), *dy_ = up(b, dy, ny), *y_ = up(b, dy, ny);
        float *gx = up(b, dx0, nx), *gw = up(b, dw0, nw);
        b->ops->conv2d_forward(b, &s, TD(b, dx_), dw_, TD(b, y_));
        b->ops->conv2d_backward(b, &s, TD(b, dx_), dw_, TD(b, dy_), TD(b, gx), gw);
        out[i][0] = down(b, y_, ny);
        out[i][1] = down(b, gx, nx);
        out[i][2] = down(b, gw, nw);
    }
    expect_tensor_close(out[0][0], out[1][0], ny, rtol, atol_rms, "conv forward");
    expect_tensor_close(out[0][1], out[1][1], nx, rtol, atol_rms, "conv backward data");
    expect_tensor_close(out[0][2], out[1][2], nw, rtol, atol_rms, "conv backward filter");
}

static void conv_case(int n, int h, int w, int c, int k, int size, int stride, int pad) {
    conv_case_on(gpu, TOL_CONV, n, h, w, c, k, size, stride, pad);
}

Test(backend_cuda, conv2d_matches_cpu) {
    SKIP_WITHOUT_GPU();
    conv_case(4, 9, 7, 3, 8, 3, 1, 1);
    conv_case(4, 9, 8, 16, 32, 3, 2, 1);
    conv_case(2, 8, 8, 16, 32, 1, 2, 0);
    conv_case(2, 8, 8, 16, 16, 1, 1, 0);
}

/* linear forward and backward (dx, dw, db accumulate onto a non-zero start) on g against the cpu */
static void linear_case_on(backend_t *g, double rtol, double atol_rms, int rows, int in, int outs) {
    size_t nx = (size_t)rows * in, nw = (size_t)outs * in, ny = (size_t)rows * outs;
    float *x = random_host(nx, 1), *wt = random_host(nw, 0.5f),
          *bias = random_host((size_t)outs, 1);
    float *dy = random_host(ny, 1), *dx0 = random_host(nx, 1), *dw0 = random_host(nw, 1);
    float *out[2][4];
    backend_t *bs[2] = {cpu, g};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        float *x_ = up(b, x, nx), *w_ = up(b, wt, nw), *b_ = up(b, bias, (size_t)outs),
              *y_ = up(b, dy, ny);
        float *dy_ = up(b, dy, ny), *dx_ = up(b, dx0, nx), *dw_ = up(b, dw0, nw),
              *db_ = up(b, bias, (size_t)outs);
        b->ops->linear_forward(b, rows, in, outs, TD(b, x_), w_, b_, TD(b, y_));
        b->ops->linear_backward(b, rows, in, outs, TD(b, x_), w_, TD(b, dy_), TD(b, dx_), dw_, db_);
        out[i][0] = down(b, y_, ny);
        out[i][1] = down(b, dx_, nx);
        out[i][2] = down(b, dw_, nw);
        out[i][3] = down(b, db_, (size_t)outs);
    }
    expect_tensor_close(out[0][0], out[1][0], ny, rtol, atol_rms, "linear forward");
    expect_tensor_close(out[0][1], out[1][1], nx, rtol, atol_rms, "linear dx");
    expect_tensor_close(out[0][2], out[1][2], nw, rtol, atol_rms, "linear dw");
    expect_tensor_close(out[0][3], out[1][3], (size_t)outs, TOL_FP32_REDUCE,
                        "linear dbias"); /* no GEMM */
}

/* TF32: fp32 storage, convolutions and GEMMs on tensor cores with inputs rounded (or truncated) to
 * 10 mantissa bits and fp32 accumulation. Each product is off by up to 2^-10 of itself: a bias of
 * that size relative to the element (rtol), and a random part of ~0.8 * 2^-11 of the output's rms
 * (atol, with 10 of those). Plain fp32 is held to TOL_CONV, about 40 times tighter, above. */
#define TOL_TF32 0x1p-10, 0x1p-8
Test(backend_cuda, conv2d_and_linear_in_tf32_match_cpu) {
    SKIP_WITHOUT_GPU();
    char err[256];
    backend_t *tf32 = backend_cuda_create(0, BACKEND_CUDA_TF32, NULL, err, sizeof err);
    cr_assert_not_null(tf32, "%s", err);
    conv_case_on(tf32, TOL_TF32, 4, 9, 7, 3, 8, 3, 1, 1);
    conv_case_on(tf32, TOL_TF32, 4, 9, 8, 16, 32, 3, 2, 1);
    conv_case_on(tf32, TOL_TF32, 2, 8, 8, 16, 32, 1, 2, 0);
    conv_case_on(tf32, TOL_TF32, 2, 8, 8, 16, 16, 1, 1, 0);
    linear_case_on(tf32, TOL_TF32, 64, 96, 40);
    linear_case_on(tf32, TOL_TF32, 6, 20, 7);
    tf32->mem->destroy(tf32);
}

/* The same linear cases in fp32 (cuBLAS's pedantic math: fp32 sums in another order) */
Test(backend_cuda, linear_matches_cpu) {
    SKIP_WITHOUT_GPU();
    linear_case_on(gpu, TOL_FP32_REDUCE, 64, 96, 40);
    linear_case_on(gpu, TOL_FP32_REDUCE, 6, 20, 7);
}

Test(backend_cuda, batchnorm_matches_cpu) {
    SKIP_WITHOUT_GPU();
    size_t rows = 300;
    int c = 24;
    size_t nx = rows * (size_t)c;
    float *x = random_host(nx, 3), *g = random_host((size_t)c, 1), *be = random_host((size_t)c, 1);
    float *dy = random_host(nx, 1), *dx0 = random_host(nx, 1);
    float *run = random_host(2 * (size_t)c, 1);
    for (int j = 0; j < c; j++)
        run[c + j] = fabsf(run[c + j]) + 0.5f;
    float *out[2][6];
    backend_t *bs[2] = {cpu, gpu};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        float *x_ = up(b, x, nx), *g_ = up(b, g, (size_t)c), *b_ = up(b, be, (size_t)c),
              *y_ = up(b, x, nx);
        float *save = up(b, run, 2 * (size_t)c), *run_ = up(b, run, 2 * (size_t)c),
              *dy_ = up(b, dy, nx);
        float *dx_ = up(b, dx0, nx), *dg = up(b, g, (size_t)c), *db = up(b, be, (size_t)c);
        b->ops->batchnorm_forward_train(b, rows, c, TD(b, x_), g_, b_, TD(b, y_), save, save + c,
                                        run_, run_ + c, 0.1f, 1e-5f);
        out[i][0] = down(b, y_, nx);
        out[i][1] = down(b, run_, 2 * (size_t)c);
        b->ops->batchnorm_backward(b, rows, c, TD(b, x_), g_, save, save + c, TD(b, dy_),
                                   TD(b, dx_), dg, db);
        out[i][2] = down(b, dx_, nx);
        out[i][3] = down(b, dg, (size_t)c);
        out[i][4] = down(b, db, (size_t)c);
        b->ops->batchnorm_forward_eval(b, rows, c, TD(b, x_), g_, b_, TD(b, y_), run_, run_ + c,
                                       1e-5f);
        out[i][5] = down(b, y_, nx);
    }
    const char *what[6] = {"bn train forward", "running stats", "bn dx",
                           "bn dgamma",        "bn dbeta",      "bn eval"};
    size_t sizes[6] = {nx, 2 * (size_t)c, nx, (size_t)c, (size_t)c, nx};
    /* the forward and the statistics are elementwise after the per-channel sums */
    double rtol[6] = {1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5},
           atol[6] = {1e-5, 1e-6, 1e-5, 1e-5, 1e-5, 1e-6};
    for (int k = 0; k < 6; k++)
        expect_tensor_close(out[0][k], out[1][k], sizes[k], rtol[k], atol[k], what[k]);
}

Test(backend_cuda, pooling_linear_loss_and_sgd_match_cpu) {
    SKIP_WITHOUT_GPU();
    pool_shape_t ps = {.n = 3, .h = 8, .w = 6, .c = 5, .size = 2, .stride = 2, .oh = 4, .ow = 3};
    size_t nx = 3 * 8 * 6 * 5, ny = 3 * 4 * 3 * 5, nl = 6 * 20, nw = 7 * 20, no = 6 * 7;
    float *x = random_host(nx, 1), *dy = random_host(ny, 1), *dx0 = random_host(nx, 1);
    float *lx = random_host(nl, 1), *lw = random_host(nw, 1), *lb = random_host(7, 1),
          *ldy = random_host(no, 1);
    float *p = random_host(1000, 1), *gr = random_host(1000, 1), *m = random_host(1000, 1);
    int32_t labels[6] = {0, 6, 3, 2, 5, 1};
    float *out[2][9];
    backend_t *bs[2] = {cpu, gpu};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        float *x_ = up(b, x, nx), *y_ = up(b, dy, ny), *dy_ = up(b, dy, ny), *dx_ = up(b, dx0, nx);
        int32_t *am = b->mem->alloc(b, ny * sizeof(int32_t));
        b->ops->maxpool_forward(b, &ps, TD(b, x_), TD(b, y_), am);
        b->ops->maxpool_backward(b, &ps, am, TD(b, dy_), TD(b, dx_));
        out[i][0] = down(b, y_, ny);
        out[i][1] = down(b, dx_, nx);
        float *gap = up(b, dy, 15);
        b->ops->avgpool_global_forward(b, 3, 48, 5, TD(b, x_), TD(b, gap));
        b->ops->avgpool_global_backward(b, 3, 48, 5, TD(b, gap), TD(b, dx_));
        out[i][2] = down(b, dx_, nx);
        float *lx_ = up(b, lx, nl), *lw_ = up(b, lw, nw), *lb_ = up(b, lb, 7), *ly = up(b, ldy, no);
        float *ldy_ = up(b, ldy, no), *ldx = up(b, lx, nl), *ldw = up(b, lw, nw),
              *ldb = up(b, lb, 7);
        b->ops->linear_forward(b, 6, 20, 7, TD(b, lx_), lw_, lb_, TD(b, ly));
        out[i][3] = down(b, ly, no);
        b->ops->linear_backward(b, 6, 20, 7, TD(b, lx_), lw_, TD(b, ldy_), TD(b, ldx), ldw, ldb);
        out[i][4] = down(b, ldx, nl);
        out[i][5] = down(b, ldw, nw);
        int32_t *lab = b->mem->alloc(b, sizeof labels);
        b->mem->to_device(b, lab, labels, sizeof labels);
        float *loss = up(b, lb, 1), *dlog = up(b, ldy, no);
        b->ops->softmax_xent(b, 6, 7, TD(b, ly), lab, 0.1f, 2.0f, NULL, TD(b, dlog), loss);
        out[i][6] = down(b, dlog, no);
        out[i][7] = down(b, loss, 1);
        float *p_ = up(b, p, 1000), *g_ = up(b, gr, 1000), *m_ = up(b, m, 1000);
        b->ops->sgd_step(b, p_, g_, m_, 1000, 0.1f, 0.9f, 5e-4f, true, 0.5f, NULL);
        out[i][8] = down(b, p_, 1000);
    }
    const char *what[9] = {
        "maxpool",   "maxpool backward",      "avgpool backward",  "linear", "linear dx",
        "linear dw", "softmax-xent gradient", "softmax-xent loss", "sgd"};
    size_t sizes[9] = {ny, nx, nx, no, nl, nw, no, 1, 1000};
    /* pooling and SGD per element (SGD's weight decay alone moves an element by lr * wd * p =
     * 5e-5 of it); linear and softmax-xent are sums */
    double rtol[9] = {0, 1e-6, 1e-6, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-6};
    double atol[9] = {0, 1e-6, 1e-6, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-6};
    for (int k = 0; k < 9; k++)
        expect_tensor_close(out[0][k], out[1][k], sizes[k], rtol[k], atol[k], what[k]);
}

/* The ops ResNet's ImageNet stem and VGG add: max-pool with padding, adaptive average pooling
 * (from a larger and from a smaller input), dropout (the very same mask) and the convolution bias
 * (its gradient over many rows: the chunked reduction). */
Test(backend_cuda, padded_maxpool_adaptive_pool_dropout_and_bias_match_cpu) {
    SKIP_WITHOUT_GPU();
    pool_shape_t mp = {
        .n = 3, .h = 9, .w = 8, .c = 5, .size = 3, .stride = 2, .pad = 1, .oh = 5, .ow = 4};
    pool_shape_t big = {.n = 2, .h = 15, .w = 11, .c = 6, .oh = 7, .ow = 7};
    pool_shape_t small = {.n = 2, .h = 3, .w = 2, .c = 6, .oh = 7, .ow = 7};
    size_t nx = 3 * 9 * 8 * 5, ny = 3 * 5 * 4 * 5, na = 2 * 15 * 11 * 6, ns = 2 * 3 * 2 * 6,
           no = 2 * 7 * 7 * 6;
    size_t nd = 100003, rows = 5000;
    int bc = 40;
    float *x = random_host(nx, 1), *dy = random_host(ny, 1), *dx0 = random_host(nx, 1);
    float *xa = random_host(na, 1), *xs = random_host(ns, 1), *dya = random_host(no, 1);
    float *xd = random_host(nd, 1), *dyd = random_host(nd, 1);
    float *bias = random_host((size_t)bc, 1), *yb = random_host(rows * bc, 1),
          *db0 = random_host((size_t)bc, 1);
    enum { K = 9 };
    float *out[2][K];
    backend_t *bs[2] = {cpu, gpu};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        float *x_ = up(b, x, nx), *y_ = up(b, dy, ny), *dy_ = up(b, dy, ny), *dx_ = up(b, dx0, nx);
        int32_t *am = b->mem->alloc(b, ny * sizeof(int32_t));
        b->ops->maxpool_forward(b, &mp, TD(b, x_), TD(b, y_), am);
        b->ops->maxpool_backward(b, &mp, am, TD(b, dy_), TD(b, dx_));
        out[i][0] = down(b, y_, ny);
        out[i][1] = down(b, dx_, nx);
        float *xa_ = up(b, xa, na), *ya = up(b, dya, no), *dya_ = up(b, dya, no),
              *dxa = up(b, xa, na);
        b->ops->avgpool_adaptive_forward(b, &big, TD(b, xa_), TD(b, ya));
        b->ops->avgpool_adaptive_backward(b, &big, TD(b, dya_), TD(b, dxa));
        out[i][2] = down(b, ya, no);
        out[i][3] = down(b, dxa, na);
        float *xs_ = up(b, xs, ns), *dxs = up(b, xs, ns);
        b->ops->avgpool_adaptive_forward(b, &small, TD(b, xs_), TD(b, ya));
        b->ops->avgpool_adaptive_backward(b, &small, TD(b, dya_), TD(b, dxs));
        out[i][4] = down(b, ya, no);
        out[i][5] = down(b, dxs, ns);
        float *xd_ = up(b, xd, nd), *yd = up(b, xd, nd), *dyd_ = up(b, dyd, nd),
              *dxd = up(b, dyd, nd);
        b->ops->dropout_forward(b, TD(b, xd_), TD(b, yd), nd, 0.5f, 0xfeedull);
        b->ops->dropout_backward(b, TD(b, dyd_), TD(b, dxd), nd, 0.5f, 0xfeedull);
        out[i][6] = down(b, yd, nd);
        out[i][7] = down(b, dxd, nd);
        float *yb_ = up(b, yb, rows * bc), *bias_ = up(b, bias, (size_t)bc),
              *db = up(b, db0, (size_t)bc);
        b->ops->bias_add(b, rows, bc, bias_, TD(b, yb_));
        b->ops->bias_backward(b, rows, bc, TD(b, yb_), db);
        out[i][8] = down(b, db, (size_t)bc);
    }
    const char *what[K] = {
        "padded maxpool", "padded maxpool backward",  "adaptive pool 15x11 -> 7x7",
        "its backward",   "adaptive pool 3x2 -> 7x7", "its backward",
        "dropout",        "dropout backward",         "bias add, then its gradient"};
    size_t sizes[K] = {ny, nx, no, na, no, ns, nd, nd, (size_t)bc};
    /* the bias gradient sums 5000 rows; the rest is selection and a few additions per element */
    for (int k = 0; k < K; k++)
        if (k == 8)
            expect_tensor_close(out[0][k], out[1][k], sizes[k], TOL_FP32_REDUCE, what[k]);
        else
            expect_tensor_close(out[0][k], out[1][k], sizes[k], TOL_EXACTISH, what[k]);
    cr_assert(memcmp(out[0][6], out[1][6], nd * sizeof(float)) == 0,
              "dropout: the same mask, the same bits");
}

/* A device copy of a loss scaler starting at scale. */
static loss_scale_t *device_loss_scale(backend_t *b, float scale) {
    loss_scale_t start = {.scale = scale}, *ls = b->mem->alloc(b, sizeof *ls);
    b->mem->to_device(b, ls, &start, sizeof start);
    return ls;
}

/* The whole-step tests' network and batch: ResNet-18 width 8 on 16x16x3, 10 classes, 8 samples. */
#define STEP_N     8
#define STEP_INPUT ((size_t)STEP_N * 16 * 16 * 3)

/* m on backend b: built, initialized from seed 5, one forward (logits read back into *logits
 * when not NULL), loss (with ls, scaled) and backward of x and labels. Returns the summed loss. */
static float resnet18_forward_backward(backend_t *b, model_t *m, const float *x,
                                       const int32_t *labels, const loss_scale_t *ls,
                                       float **logits) {
    char err[256];
    cr_assert_eq(model_init(m, b, "resnet18", 8, 16, 16, 3, 10, STEP_N, err, sizeof err), 0, "%s",
                 err);
    cr_assert_eq(model_init_params(m, 5), 0);
    b->mem->to_device(b, model_input(m), x, STEP_INPUT * sizeof(float));
    b->mem->to_device(b, m->labels, labels, STEP_N * sizeof(int32_t));
    model_forward(m, STEP_N, true);
    if (logits) *logits = down(b, model_logits(m), (size_t)STEP_N * 10);
    model_loss(m, STEP_N, 0.1f, 1.0f, ls);
    float loss = (float)model_take_loss(m);
    model_backward(m, STEP_N, NULL, NULL);
    return loss;
}

Test(backend_cuda, one_resnet18_training_step_matches_cpu) {
    SKIP_WITHOUT_GPU();
    model_t m[2];
    backend_t *bs[2] = {cpu, gpu};
    float *x = random_host(STEP_INPUT, 2);
    int32_t labels[STEP_N] = {1, 2, 3, 4, 5, 6, 7, 0};
    float *params[2], loss[2];
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        loss[i] = resnet18_forward_backward(b, &m[i], x, labels, NULL, NULL);
        b->ops->sgd_step(b, m[i].params, m[i].grads, m[i].momentum, m[i].n_params, 0.1f, 0.9f,
                         5e-4f, true, 1.0f, NULL);
        params[i] = down(b, m[i].params, m[i].n_params);
    }
    cr_assert_float_eq(loss[0], loss[1], 1e-3 * fabsf(loss[0]), "loss: cpu %g cuda %g", loss[0],
                       loss[1]);
    expect_tensor_close(params[0], params[1], m[0].n_params, 1e-3, 1e-3,
                        "parameters after one step");
    model_free(&m[0]);
    model_free(&m[1]);
}

/* ResNet-50 with the ImageNet stem (7x7/2 conv, padded max-pool, bottlenecks) and VGG-11 with batch
 * norm (conv bias, adaptive pool from 1x1, dropout with the same masks): one training step on the
 * GPU against the CPU reference. */
static void one_step_case(const char *name, model_stem_t stem, int side) {
    model_t m[2];
    backend_t *bs[2] = {cpu, gpu};
    enum { N = 8 };
    size_t n_in = (size_t)N * side * side * 3;
    float *x = random_host(n_in, 2);
    int32_t labels[N] = {1, 2, 3, 4, 5, 6, 7, 0};
    float *params[2], *logits[2], loss[2];
    model_opts_t o = model_opts_default(name, 8);
    o.stem = stem;
    o.fc_width = 64;
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        char err[256];
        cr_assert_eq(model_init_opts(&m[i], b, &o, side, side, 3, 10, N, err, sizeof err), 0, "%s",
                     err);
        cr_assert_eq(model_init_params(&m[i], 5), 0);
        b->mem->to_device(b, model_input(&m[i]), x, n_in * sizeof(float));
        b->mem->to_device(b, m[i].labels, labels, sizeof labels);
        model_set_step(&m[i], 3, 4, 0);
        model_forward(&m[i], N, true);
        logits[i] = down(b, model_logits(&m[i]), (size_t)N * 10);
        model_loss(&m[i], N, 0.0f, 1.0f, NULL);
        loss[i] = (float)model_take_loss(&m[i]);
        model_backward(&m[i], N, NULL, NULL);
        b->ops->sgd_step(b, m[i].params, m[i].grads, m[i].momentum, m[i].n_params, 0.05f, 0.9f,
                         5e-4f, false, 1.0f, NULL);
        params[i] = down(b, m[i].params, m[i].n_params);
    }
    expect_tensor_close(logits[0], logits[1], (size_t)N * 10, 1e-3, 1e-3, name);
    cr_assert_float_eq(loss[0], loss[1], 1e-3 * fabsf(loss[0]), "%s loss: cpu %g cuda %g", name,
                       loss[0], loss[1]);
    expect_tensor_close(params[0], params[1], m[0].n_params, 1e-3, 1e-3, name);
    model_free(&m[0]);
    model_free(&m[1]);
}

Test(backend_cuda, one_resnet50_and_vgg11_bn_step_match_cpu) {
    SKIP_WITHOUT_GPU();
    one_step_case("resnet50", MODEL_STEM_IMAGENET, 64);
    one_step_case("vgg11_bn", MODEL_STEM_AUTO, 32);
}

/* Narrow activations (parameters, gradients and statistics fp32): one step's loss and parameter
 * gradients against the fp32 CPU reference, within the narrow type's precision. fp16 runs at a loss
 * scale of 1024, as its training does, and the gradients are unscaled here. */
static void resnet18_step_low(unsigned flag, const char *name, double bound, double layer_bound) {
    char err[256];
    backend_t *gpu16 = backend_cuda_create(0, flag, NULL, err, sizeof err);
    cr_assert_not_null(gpu16, "%s", err);
    float loss_scale = flag == BACKEND_CUDA_FP16 ? 1024.0f : 1.0f;
    loss_scale_t *ls = device_loss_scale(gpu16, loss_scale);
    model_t m[2];
    backend_t *bs[2] = {cpu, gpu16};
    float *x = random_host(STEP_INPUT, 2);
    int32_t labels[STEP_N] = {1, 2, 3, 4, 5, 6, 7, 0};
    float *grads[2], *logits[2], loss[2];
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        loss[i] = resnet18_forward_backward(b, &m[i], x, labels, i ? ls : NULL, &logits[i]);
        grads[i] = down(b, m[i].grads, m[i].n_params);
    }
    for (size_t j = 0; j < m[1].n_params; j++)
        grads[1][j] /= loss_scale;
    cr_assert_float_eq(loss[0], loss[1], 3e-2 * fabsf(loss[0]), "loss: cpu %g cuda %s %g", loss[0],
                       name, loss[1]);
    expect_tensor_close(logits[0], logits[1], (size_t)STEP_N * 10, 5e-2, 5e-2, "narrow logits");
    /* Gradients by relative norm error, overall. Narrow storage alone moves this network's
     * gradients a lot at initialisation: PyTorch, with every activation and activation gradient
     * rounded to bf16 and fp32 math (what this backend does), differs from fp32 by 0.27-0.32 in
     * relative norm on this network at batch 8 to 64, and by 0.08-0.12 with fp16 at a scale of 1024
     * (tests/interop/low_storage_emulation.py); batch norm's backward cancels most of each
     * gradient, so its rounding error stays. The bound catches a wrong or missing term (errors near
     * 1); the op tests below catch the rest. Layer by layer the same emulation gives at most 0.56
     * (bf16) and 0.25 (fp16) over those batches and seeds: layer_bound catches one layer's wrong or
     * missing term, which the overall figure dilutes. */
    double diff2 = 0, ref2 = 0, worst = 0;
    int worst_layer = -1;
    for (int l = 0; l < m[0].n_layers; l++) {
        const layer_t *ly = &m[0].layers[l];
        double d2 = 0, r2 = 0;
        for (size_t j = ly->param_offset; j < ly->param_offset + ly->n_params; j++) {
            double d = (double)grads[0][j] - grads[1][j];
            d2 += d * d;
            r2 += (double)grads[0][j] * grads[0][j];
        }
        diff2 += d2;
        ref2 += r2;
        if (ly->n_params && r2 > 0 && !(sqrt(d2 / r2) <= worst)) { /* a NaN is the worst */
            worst = sqrt(d2 / r2);
            worst_layer = l;
        }
    }
    double overall = sqrt(diff2 / ref2);
    fprintf(stderr, "%s gradients: relative error %.4f overall, worst layer %d (kind %d) %.4f\n",
            name, overall, worst_layer, worst_layer >= 0 ? (int)m[0].layers[worst_layer].kind : -1,
            worst);
    cr_assert(overall <= bound,
              "%s parameter gradients: relative error %g overall (worst layer %d: %g)", name,
              overall, worst_layer, worst);
    cr_assert(worst_layer >= 0, "%s: no layer with a non-zero reference gradient", name);
    cr_assert(worst <= layer_bound,
              "%s parameter gradients: layer %d (kind %d) has relative error %g > %g", name,
              worst_layer, (int)m[0].layers[worst_layer].kind, worst, layer_bound);
    model_free(&m[0]);
    model_free(&m[1]);
    gpu16->mem->destroy(gpu16);
}

Test(backend_cuda, one_resnet18_step_in_bf16_is_close_to_cpu) {
    SKIP_WITHOUT_GPU();
    resnet18_step_low(BACKEND_CUDA_BF16, "bf16", 0.4, 0.8);
}

Test(backend_cuda, one_resnet18_step_in_fp16_is_close_to_cpu) {
    SKIP_WITHOUT_GPU();
    resnet18_step_low(BACKEND_CUDA_FP16, "fp16", 0.2, 0.4);
}

/* ---- bf16 and fp16 op by op: inputs rounded to the narrow type on the host, so the GPU's only
 * extra error is the rounding of its narrow outputs (a few ulps of the output's scale) ---- */

static unsigned low_flag = BACKEND_CUDA_BF16; /* the narrow type under test */

static float round_low(float v) {
    if (low_flag == BACKEND_CUDA_FP16) return (float)(_Float16)v; /* to nearest, ties to even */
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u); /* to nearest, ties to even */
    u &= 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The narrow type's unit roundoff (half an ulp at 1): rounding once moves a value by at most
 * this much of itself. */
static double low_eps(void) {
    return low_flag == BACKEND_CUDA_FP16 ? 0x1p-11 : 0x1p-8;
}

/* A narrow output against the fp32 reference: one rounding of a value whose fp32 computation may
 * differ in the last bits (so it may round the other way: 2 units), plus the accumulation order
 * of a reduction, bounded with one unit of the rms. */
static void expect_low_close(const float *want, const float *got, size_t n, const char *what) {
    expect_tensor_close(want, got, n, 2 * low_eps(), low_eps(), what);
}

static float *rounded(float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = round_low(p[i]);
    return p;
}

/* A narrow backend with arenas whose tensors are taken in order; weights go to the parameter arena
 * (of which the backend keeps a narrow copy), everything fp32 elsewhere. */
typedef struct {
    backend_t *b;
    float *arena[3]; /* params, acts, dacts */
    size_t used[3];
} low_t;

enum { PARAMS, ACTS, DACTS };

static low_t low_make(void) {
    char err[256];
    low_t l = {0};
    l.b = backend_cuda_create(0, low_flag, NULL, err, sizeof err);
    cr_assert_not_null(l.b, "%s", err);
    size_t n = (size_t)1 << 20;
    for (int i = 0; i < 3; i++)
        l.arena[i] = l.b->mem->alloc(l.b, n * sizeof(float));
    cr_assert_eq(l.b->mem->mark_arenas(l.b, l.arena[PARAMS], n, l.arena[ACTS], l.arena[DACTS], n),
                 0);
    narrow_arenas(l.b, l.arena[ACTS], l.arena[DACTS], n);
    return l;
}

static float *low_put(low_t *l, int which, const float *host, size_t n) {
    float *p = l->arena[which] + l->used[which];
    l->used[which] += n;
    l->b->mem->to_device(l->b, p, host, n * sizeof(float));
    return p;
}

static void conv_case_low(int n, int h, int w, int c, int k, int size, int stride, int pad) {
    conv_shape_t s = {.n = n,
                      .h = h,
                      .w = w,
                      .c = c,
                      .k = k,
                      .r = size,
                      .s = size,
                      .stride = stride,
                      .pad = pad,
                      .oh = (h + 2 * pad - size) / stride + 1,
                      .ow = (w + 2 * pad - size) / stride + 1};
    size_t nx = (size_t)n * h * w * c, nw = (size_t)k * size * size * c,
           ny = (size_t)n * s.oh * s.ow * k;
    float *x = rounded(random_host(nx, 1), nx), *wt = rounded(random_host(nw, 0.5f), nw);
    float *dy = rounded(random_host(ny, 1), ny), *dx0 = rounded(random_host(nx, 1), nx),
          *dw0 = random_host(nw, 1);
    float *want[3], *got[3];
    float *x_ = up(cpu, x, nx), *w_ = up(cpu, wt, nw), *y_ = up(cpu, dy, ny),
          *dy_ = up(cpu, dy, ny);
    float *gx = up(cpu, dx0, nx), *gw = up(cpu, dw0, nw);
    cpu->ops->conv2d_forward(cpu, &s, TD(cpu, x_), w_, TD(cpu, y_));
    cpu->ops->conv2d_backward(cpu, &s, TD(cpu, x_), w_, TD(cpu, dy_), TD(cpu, gx), gw);
    want[0] = down(cpu, y_, ny);
    want[1] = down(cpu, gx, nx);
    want[2] = down(cpu, gw, nw);
    low_t l = low_make();
    backend_t *b = l.b;
    float *lx = low_put(&l, ACTS, x, nx), *lw = low_put(&l, PARAMS, wt, nw),
          *ly = low_put(&l, ACTS, dy, ny);
    float *ldy = low_put(&l, DACTS, dy, ny), *ldx = low_put(&l, DACTS, dx0, nx),
          *ldw = up(b, dw0, nw);
    b->mem->prepare_forward(b);
    b->ops->conv2d_forward(b, &s, TD(b, lx), lw, TD(b, ly));
    b->ops->conv2d_backward(b, &s, TD(b, lx), lw, TD(b, ldy), TD(b, ldx), ldw);
    got[0] = down(b, ly, ny);
    got[1] = down(b, ldx, nx);
    got[2] = down(b, ldw, nw);
    expect_low_close(want[0], got[0], ny, "narrow conv forward");
    /* dx's values cancel: an output far below the rms sums terms as large as the rest, rounded
     * in the narrow type by some of cuDNN's deterministic dgrad algorithms (an fp16 run measured
     * 1.05x eps * rms at a value of 0.04 against a rms of 0.43) */
    expect_tensor_close(want[1], got[1], nx, 2 * low_eps(), 2 * low_eps(),
                        "narrow conv backward data");
    expect_low_close(want[2], got[2], nw, "narrow conv backward filter");
    b->mem->destroy(b);
}

static void conv_cases_low(unsigned flag) {
    low_flag = flag;
    conv_case_low(4, 9, 7, 3, 8, 3, 1, 1); /* 3 channels: run in fp32 on converted copies */
    conv_case_low(4, 9, 8, 16, 32, 3, 2, 1);
    conv_case_low(2, 8, 8, 16, 16, 1, 1, 0);
}

Test(backend_cuda, conv2d_in_bf16_matches_cpu) {
    SKIP_WITHOUT_GPU();
    conv_cases_low(BACKEND_CUDA_BF16);
}

Test(backend_cuda, conv2d_in_fp16_matches_cpu) {
    SKIP_WITHOUT_GPU();
    conv_cases_low(BACKEND_CUDA_FP16);
}

static void batchnorm_and_linear_low(unsigned flag) {
    low_flag = flag;
    size_t rows = 300;
    int c = 24;
    size_t nx = rows * (size_t)c;
    float *x = rounded(random_host(nx, 3), nx), *g = random_host((size_t)c, 1),
          *be = random_host((size_t)c, 1);
    float *dy = rounded(random_host(nx, 1), nx), *dx0 = rounded(random_host(nx, 1), nx);
    float *run = random_host(2 * (size_t)c, 1);
    for (int j = 0; j < c; j++)
        run[c + j] = fabsf(run[c + j]) + 0.5f;
    size_t nl = 6 * 24, nw = 7 * 24, no = 6 * 7;
    float *lx = rounded(random_host(nl, 1), nl), *lw = rounded(random_host(nw, 1), nw),
          *lb = random_host(7, 1);
    float *ldy = rounded(random_host(no, 1), no);
    float *out[2][9];
    low_t l = low_make();
    backend_t *bs[2] = {cpu, l.b};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        bool low = i == 1;
        float *x_ = low ? low_put(&l, ACTS, x, nx) : up(b, x, nx),
              *y_ = low ? low_put(&l, ACTS, x, nx) : up(b, x, nx);
        float *dy_ = low ? low_put(&l, DACTS, dy, nx) : up(b, dy, nx);
        float *dx_ = low ? low_put(&l, DACTS, dx0, nx) : up(b, dx0, nx);
        float *g_ = up(b, g, (size_t)c), *b_ = up(b, be, (size_t)c),
              *save = up(b, run, 2 * (size_t)c);
        float *run_ = up(b, run, 2 * (size_t)c), *dg = up(b, g, (size_t)c),
              *db = up(b, be, (size_t)c);
        b->ops->batchnorm_forward_train(b, rows, c, TD(b, x_), g_, b_, TD(b, y_), save, save + c,
                                        run_, run_ + c, 0.1f, 1e-5f);
        out[i][0] = down(b, y_, nx);
        out[i][1] = down(b, run_, 2 * (size_t)c);
        b->ops->batchnorm_backward(b, rows, c, TD(b, x_), g_, save, save + c, TD(b, dy_),
                                   TD(b, dx_), dg, db);
        out[i][2] = down(b, dx_, nx);
        out[i][3] = down(b, dg, (size_t)c);
        out[i][4] = down(b, db, (size_t)c);
        /* linear: x and y activations, the weight in the parameter arena, bias and grads fp32 */
        float *lx_ = low ? low_put(&l, ACTS, lx, nl) : up(b, lx, nl),
              *ly = low ? low_put(&l, ACTS, ldy, no) : up(b, ldy, no);
        float *lw_ = low ? low_put(&l, PARAMS, lw, nw) : up(b, lw, nw), *lb_ = up(b, lb, 7);
        float *ldy_ = low ? low_put(&l, DACTS, ldy, no) : up(b, ldy, no);
        float *ldx = low ? low_put(&l, DACTS, lx, nl) : up(b, lx, nl), *ldw = up(b, lw, nw),
              *ldb = up(b, lb, 7);
        if (low) b->mem->prepare_forward(b);
        b->ops->linear_forward(b, 6, 24, 7, TD(b, lx_), lw_, lb_, TD(b, ly));
        out[i][5] = down(b, ly, no);
        b->ops->linear_backward(b, 6, 24, 7, TD(b, lx_), lw_, TD(b, ldy_), TD(b, ldx), ldw, ldb);
        out[i][6] = down(b, ldx, nl);
        out[i][7] = down(b, ldw, nw);
        out[i][8] = down(b, ldb, 7);
    }
    const char *what[9] = {"narrow bn forward", "narrow bn running stats", "narrow bn dx",
                           "narrow bn dgamma",  "narrow bn dbeta",         "narrow linear",
                           "narrow linear dx",  "narrow linear dw",        "narrow linear dbias"};
    size_t sizes[9] = {nx, 2 * (size_t)c, nx, (size_t)c, (size_t)c, no, nl, nw, 7};
    /* narrow outputs: bn forward, bn dx, linear, linear dx; the rest are fp32 sums of narrow
     * inputs (the statistics elementwise after them) */
    bool is_low_out[9] = {true, false, true, false, false, true, true, false, false};
    double tol[9] = {0, 1e-4, 0, 1e-3, 1e-3, 0, 0, 1e-3, 1e-3};
    for (int k = 0; k < 9; k++)
        if (is_low_out[k])
            expect_low_close(out[0][k], out[1][k], sizes[k], what[k]);
        else
            expect_tensor_close(out[0][k], out[1][k], sizes[k], tol[k], tol[k], what[k]);
    l.b->mem->destroy(l.b);
}

Test(backend_cuda, batchnorm_and_linear_in_bf16_match_cpu) {
    SKIP_WITHOUT_GPU();
    batchnorm_and_linear_low(BACKEND_CUDA_BF16);
}

Test(backend_cuda, batchnorm_and_linear_in_fp16_match_cpu) {
    SKIP_WITHOUT_GPU();
    batchnorm_and_linear_low(BACKEND_CUDA_FP16);
}

/* The new ops on narrow activations: padded max-pool, adaptive pool, dropout and the conv bias,
 * inputs rounded to the narrow type so that only the outputs' rounding differs. */
static void pool_dropout_bias_low(unsigned flag) {
    low_flag = flag;
    pool_shape_t mp = {
        .n = 2, .h = 9, .w = 8, .c = 8, .size = 3, .stride = 2, .pad = 1, .oh = 5, .ow = 4};
    pool_shape_t ap = {.n = 2, .h = 3, .w = 5, .c = 8, .oh = 7, .ow = 7};
    size_t nx = 2 * 9 * 8 * 8, ny = 2 * 5 * 4 * 8, na = 2 * 3 * 5 * 8, no = 2 * 7 * 7 * 8,
           rows = 300;
    int bc = 16;
    float *x = rounded(random_host(nx, 1), nx), *dy = rounded(random_host(ny, 1), ny);
    float *xa = rounded(random_host(na, 1), na), *dya = rounded(random_host(no, 1), no);
    float *bias = random_host((size_t)bc, 1), *yb = rounded(random_host(rows * bc, 1), rows * bc);
    enum { K = 8 };
    float *out[2][K];
    low_t l = low_make();
    backend_t *bs[2] = {cpu, l.b};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        bool low = i == 1;
#define PUT(which, host, n) (low ? low_put(&l, which, host, n) : up(b, host, n))
        float *x_ = PUT(ACTS, x, nx), *y_ = PUT(ACTS, dy, ny), *dy_ = PUT(DACTS, dy, ny),
              *dx_ = PUT(DACTS, x, nx);
        int32_t *am = b->mem->alloc(b, ny * sizeof(int32_t));
        b->ops->maxpool_forward(b, &mp, TD(b, x_), TD(b, y_), am);
        b->ops->maxpool_backward(b, &mp, am, TD(b, dy_), TD(b, dx_));
        out[i][0] = down(b, y_, ny);
        out[i][1] = down(b, dx_, nx);
        float *xa_ = PUT(ACTS, xa, na), *ya = PUT(ACTS, dya, no), *dya_ = PUT(DACTS, dya, no);
        float *dxa = PUT(DACTS, xa, na);
        b->ops->avgpool_adaptive_forward(b, &ap, TD(b, xa_), TD(b, ya));
        b->ops->avgpool_adaptive_backward(b, &ap, TD(b, dya_), TD(b, dxa));
        out[i][2] = down(b, ya, no);
        out[i][3] = down(b, dxa, na);
        float *yd = PUT(ACTS, dya, no), *dxd = PUT(DACTS, dya, no);
        b->ops->dropout_forward(b, TD(b, ya), TD(b, yd), no, 0.5f, 77);
        b->ops->dropout_backward(b, TD(b, dya_), TD(b, dxd), no, 0.5f, 77);
        out[i][4] = down(b, yd, no);
        out[i][5] = down(b, dxd, no);
        float *yb_ = PUT(ACTS, yb, rows * bc), *bias_ = up(b, bias, (size_t)bc),
              *db = up(b, bias, (size_t)bc);
        b->ops->bias_add(b, rows, bc, bias_, TD(b, yb_));
        out[i][6] = down(b, yb_, rows * bc);
        b->ops->bias_backward(b, rows, bc, TD(b, PUT(DACTS, yb, rows * bc)), db);
        out[i][7] = down(b, db, (size_t)bc);
#undef PUT
    }
    const char *what[K] = {"narrow padded maxpool", "its backward",        "narrow adaptive pool",
                           "its backward",          "narrow dropout",      "its backward",
                           "narrow bias add",       "narrow bias gradient"};
    size_t sizes[K] = {ny, nx, no, na, no, no, rows * bc, (size_t)bc};
    for (int k = 0; k < K; k++)
        if (k == K - 1)
            expect_tensor_close(out[0][k], out[1][k], sizes[k], TOL_FP32_REDUCE,
                                what[k]); /* fp32 */
        else
            expect_low_close(out[0][k], out[1][k], sizes[k], what[k]);
    l.b->mem->destroy(l.b);
}

Test(backend_cuda, pool_dropout_and_bias_in_bf16_match_cpu) {
    SKIP_WITHOUT_GPU();
    pool_dropout_bias_low(BACKEND_CUDA_BF16);
}

Test(backend_cuda, pool_dropout_and_bias_in_fp16_match_cpu) {
    SKIP_WITHOUT_GPU();
    pool_dropout_bias_low(BACKEND_CUDA_FP16);
}

/* The loss scaler's ops on the GPU: the same flags, skips and scale sequence as the cpu backend,
 * and a softmax gradient scaled before it is stored. */
Test(backend_cuda, loss_scaling_ops_match_cpu) {
    SKIP_WITHOUT_GPU();
    size_t n = 300000; /* several blocks: the flag is set by whichever thread sees the inf */
    float *g = random_host(n, 1), *p = random_host(n, 1), *m = random_host(n, 1);
    backend_t *bs[2] = {cpu, gpu};
    loss_scale_t got[2][4];
    float *out[2][2];
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        loss_scale_t *ls = device_loss_scale(b, 1024.0f);
        float *g_ = up(b, g, n), *p_ = up(b, p, n), *m_ = up(b, m, n);
        b->ops->loss_scale_check(b, g_, n, ls); /* clean: a step with 1/1024 of the gradient */
        b->mem->to_host(b, &got[i][0], ls, sizeof *ls);
        b->ops->sgd_step(b, p_, g_, m_, n, 0.1f, 0.9f, 5e-4f, true, 0.5f, ls);
        b->ops->loss_scale_update(b, ls, 1); /* interval 1: doubles */
        b->mem->to_host(b, &got[i][1], ls, sizeof *ls);
        float bad = NAN;
        b->mem->to_device(b, g_ + n - 7, &bad, sizeof bad);
        b->ops->loss_scale_check(b, g_, n, ls);
        b->mem->to_host(b, &got[i][2], ls, sizeof *ls);
        b->ops->sgd_step(b, p_, g_, m_, n, 0.1f, 0.9f, 5e-4f, true, 0.5f, ls); /* skipped */
        b->ops->loss_scale_update(b, ls, 1);
        b->mem->to_host(b, &got[i][3], ls, sizeof *ls);
        out[i][0] = down(b, p_, n);
        out[i][1] = down(b, m_, n);
    }
    for (int k = 0; k < 4; k++)
        cr_assert(memcmp(&got[0][k], &got[1][k], sizeof got[0][k]) == 0,
                  "state %d: cpu scale %g flag %u good %u skipped %u, cuda %g %u %u %u", k,
                  got[0][k].scale, got[0][k].found_inf, got[0][k].good_steps,
                  got[0][k].skipped_steps, got[1][k].scale, got[1][k].found_inf,
                  got[1][k].good_steps, got[1][k].skipped_steps);
    cr_assert_eq(got[1][2].found_inf, 1);
    cr_assert_eq(got[1][3].scale, 1024.0f);
    expect_tensor_close(out[0][0], out[1][0], n, TOL_ELEMENTWISE,
                        "unscaled sgd (then a skipped one)");
    expect_tensor_close(out[0][1], out[1][1], n, TOL_ELEMENTWISE, "momentum");
    /* the logits' gradient of a mean over 4096 samples is ~1e-5: here it comes out scaled */
    int rows = 4096, k = 10;
    float *logits = random_host((size_t)rows * k, 2);
    int32_t *labels = malloc(rows * sizeof *labels);
    for (int r = 0; r < rows; r++)
        labels[r] = r % k;
    float *dl[2];
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        loss_scale_t *ls = device_loss_scale(b, 65536.0f);
        int32_t *lab = b->mem->alloc(b, rows * sizeof *lab);
        b->mem->to_device(b, lab, labels, rows * sizeof *lab);
        float *z = up(b, logits, (size_t)rows * k), *d = up(b, logits, (size_t)rows * k);
        float *loss = up(b, logits, 1);
        b->ops->softmax_xent(b, rows, k, TD(b, z), lab, 0.0f, 1.0f, ls, TD(b, d), loss);
        dl[i] = down(b, d, (size_t)rows * k);
    }
    expect_tensor_close(dl[0], dl[1], (size_t)rows * k, TOL_FP32_REDUCE,
                        "scaled softmax-xent gradient");
    cr_assert_gt(fabsf(dl[1][0]), 1.0f, "the scale was applied");
}

/* Adam and AdamW on the GPU: the cpu backend's parameters, moments and step count after three
 * steps of fresh gradients under DDP's 1/world and a loss scale, then a step the loss scaler
 * skips (a NaN), which changes nothing, the count included. */
static void adam_case(bool is_decoupled) {
    size_t n = 300001; /* several blocks, and a tail */
    float *grads[4], *p = random_host(n, 1), *zeros = calloc(n, sizeof *zeros);
    for (int s = 0; s < 4; s++)
        grads[s] = random_host(n, 1024.0f);
    grads[3][n - 7] = NAN;
    backend_t *bs[2] = {cpu, gpu};
    adam_count_t count[2];
    float *out[2][3];
    adam_hparams_t h = {.beta1 = 0.8,
                        .beta2 = 0.99,
                        .eps = 1e-6,
                        .weight_decay = 0.05,
                        .is_decoupled = is_decoupled};
    for (int i = 0; i < 2; i++) {
        backend_t *b = bs[i];
        loss_scale_t *ls = device_loss_scale(b, 1024.0f);
        float *p_ = up(b, p, n), *m_ = up(b, zeros, n), *v_ = up(b, zeros, n),
              *g_ = up(b, zeros, n);
        adam_count_t *c = b->mem->alloc(b, sizeof *c);
        for (int s = 0; s < 4; s++) {
            h.lr = 1e-3 * (s + 1);
            b->mem->to_device(b, g_, grads[s], n * sizeof(float));
            b->ops->loss_scale_check(b, g_, n, ls);
            b->ops->adam_step(b, p_, g_, m_, v_, n, &h, 0.5f, ls, c);
            b->ops->loss_scale_update(b, ls, 1000);
        }
        out[i][0] = down(b, p_, n);
        out[i][1] = down(b, m_, n);
        out[i][2] = down(b, v_, n);
        b->mem->to_host(b, &count[i], c, sizeof *c);
    }
    cr_assert(count[0].step == 3 && count[1].step == 3, "steps counted: cpu %llu, cuda %llu",
              (unsigned long long)count[0].step, (unsigned long long)count[1].step);
    /* the bias corrections: double pow on each side (glibc's, CUDA's), rounded to fp32 */
    cr_assert_float_eq(count[0].step_size, count[1].step_size, 1e-7 * count[0].step_size);
    cr_assert_float_eq(count[0].bias_correction2_sqrt, count[1].bias_correction2_sqrt, 1e-7);
    const char *what = is_decoupled ? "adamw parameters" : "adam parameters";
    expect_tensor_close(out[0][0], out[1][0], n, TOL_ELEMENTWISE, what);
    expect_tensor_close(out[0][1], out[1][1], n, TOL_ELEMENTWISE, "first moment");
    expect_tensor_close(out[0][2], out[1][2], n, TOL_ELEMENTWISE, "second moment");
}

Test(backend_cuda, adam_step_matches_cpu) {
    SKIP_WITHOUT_GPU();
    adam_case(false);
}

Test(backend_cuda, adamw_step_matches_cpu) {
    SKIP_WITHOUT_GPU();
    adam_case(true);
}

/* The data path on the GPU gives the cpu backend's bits: fp32 output exactly, and a narrow output
 * is the fp32 value rounded once (the same as uploading the host's batch). */
Test(backend_cuda, augment_batch_matches_cpu_bit_for_bit) {
    SKIP_WITHOUT_GPU();
    int h = 32, w = 32, c = 3, samples = 100, n = 64;
    size_t per = (size_t)h * w * c;
    uint8_t *images = malloc(per * samples);
    int32_t labels[100];
    for (size_t i = 0; i < per * samples; i++)
        images[i] = (uint8_t)(rng_next(&seed) >> 56);
    for (int i = 0; i < samples; i++)
        labels[i] = 999 - i; /* int32: beyond a byte's classes */
    augment_t a = {.is_random = true, .padding = 4, .seed = 9};
    for (int k = 0; k < c; k++) {
        a.mean[k] = 0.4914f - 0.01f * (float)k;
        a.std[k] = 0.247f + 0.002f * (float)k;
    }
    augment_job_t jobs[64];
    for (int i = 0; i < n; i++) {
        jobs[i].index = (i * 13 + 5) % samples;
        jobs[i].choice = augment_choose(&a, 2, jobs[i].index);
    }
    augment_norm_t norm = augment_norm(&a, c);
    float *want = malloc(per * n * sizeof *want), *got = malloc(per * n * sizeof *got);
    int32_t want_labels[64], got_labels[64];
    cpu->ops->augment_batch(cpu, images, labels, h, w, c, jobs, n, norm, TD(cpu, want),
                            want_labels);
    unsigned flags[3] = {0, BACKEND_CUDA_BF16, BACKEND_CUDA_FP16};
    for (int f = 0; f < 3; f++) {
        low_t l = {0};
        backend_t *b = gpu; /* fp32: the op's output is plain device memory */
        if (flags[f]) {
            low_flag = flags[f];
            l = low_make();
            b = l.b;
        }
        uint8_t *d_images = b->mem->alloc(b, per * samples);
        int32_t *d_labels = b->mem->alloc(b, sizeof labels);
        augment_job_t *d_jobs = b->mem->alloc(b, sizeof jobs);
        int32_t *d_out_labels = b->mem->alloc(b, sizeof got_labels);
        b->mem->to_device(b, d_images, images, per * samples);
        b->mem->to_device(b, d_labels, labels, sizeof labels);
        b->mem->to_device(b, d_jobs, jobs, sizeof jobs);
        float *out = flags[f] ? l.arena[ACTS] : b->mem->alloc(b, per * n * sizeof(float));
        b->ops->augment_batch(b, d_images, d_labels, h, w, c, d_jobs, n, norm, TD(b, out),
                              d_out_labels);
        b->mem->to_host(b, got, out, per * n * sizeof(float));
        b->mem->to_host(b, got_labels, d_out_labels, sizeof got_labels);
        for (size_t i = 0; i < per * n; i++) {
            float expect = flags[f] ? round_low(want[i]) : want[i];
            cr_assert(memcmp(&got[i], &expect, sizeof expect) == 0,
                      "flags %u value %zu: cpu %.9g cuda %.9g", flags[f], i, expect, got[i]);
        }
        cr_assert(memcmp(got_labels, want_labels, sizeof got_labels) == 0, "labels, flags %u",
                  flags[f]);
        if (flags[f]) b->mem->destroy(b);
    }
    free(images);
    free(want);
    free(got);
}
