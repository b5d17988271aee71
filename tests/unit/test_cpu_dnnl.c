/* worker/cpu/cpu_dnnl: oneDNN's convolutions against the cpu backend's plain path (im2col +
 * SGEMM; DDP_CPU_ONEDNN=0) on shapes the models use (3x3 same padding, the 7x7/2 stem, 1x1/2
 * projections, a stride that does not divide the input): forward, and the backward's += contract
 * on prefilled dx and dw, with and without dx; the linear layers' matmuls alike. Built only where
 * the build has oneDNN. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/cpu_dnnl.h"
#include "rng.h"

/* An fp32 tensor as the ops take it (backend.h); the ops take sizes from their own arguments. */
#define T(p) tensor_f32((p), 0)

#define PREFILL 0.25f

static uint64_t rng_state = 777;

static float *random_buffer(size_t n) {
    float *p = malloc(n * sizeof(float));
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (float)((double)(rng_next(&rng_state) >> 11) / 9007199254740992.0 * 2 - 1);
    return p;
}

static float *filled(size_t n, float v) {
    float *p = malloc(n * sizeof(float));
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = v;
    return p;
}

static void assert_close(const float *got, const float *want, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        cr_assert(fabsf(got[i] - want[i]) <= 1e-4f * (1 + fabsf(want[i])),
                  "%s[%zu]: oneDNN %.8g, im2col %.8g", what, i, got[i], want[i]);
}

static conv_shape_t shape(int n, int h, int w, int c, int k, int r, int stride, int pad) {
    conv_shape_t s = {
        .n = n, .h = h, .w = w, .c = c, .k = k, .r = r, .s = r, .stride = stride, .pad = pad};
    s.oh = (h + 2 * pad - r) / stride + 1;
    s.ow = (w + 2 * pad - r) / stride + 1;
    return s;
}

/* The cpu backend without oneDNN: the reference here (the default would use oneDNN itself). */
static backend_t *plain_backend(void) {
    setenv("DDP_CPU_ONEDNN", "0", 1); /* this test's own process */
    backend_t *b = backend_cpu_create(0);
    cr_assert_not_null(b);
    return b;
}

static void check(conv_shape_t s, bool with_dx) {
    backend_t *ref = plain_backend();
    cpu_dnnl_t *d = cpu_dnnl_create();
    cr_assert_not_null(ref);
    cr_assert_not_null(d, "oneDNN's CPU engine did not start");
    size_t nx = (size_t)s.n * s.h * s.w * s.c, nw = (size_t)s.k * s.r * s.s * s.c,
           ny = (size_t)s.n * s.oh * s.ow * s.k;
    cr_assert_eq(ref->mem->reserve_workspace(ref, 1 << 22), 0);
    float *x = random_buffer(nx), *w = random_buffer(nw), *dy = random_buffer(ny);
    float *y_ref = filled(ny, NAN), *y = filled(ny, NAN);
    ref->ops->conv2d_forward(ref, &s, T(x), w, T(y_ref));
    cr_assert_eq(cpu_dnnl_conv_forward(d, &s, x, w, y), 0, "oneDNN refused the shape");
    assert_close(y, y_ref, ny, "y");

    float *dx_ref = filled(nx, PREFILL), *dx = filled(nx, PREFILL);
    float *dw_ref = filled(nw, PREFILL), *dw = filled(nw, PREFILL);
    ref->ops->conv2d_backward(ref, &s, T(x), w, T(dy), T(with_dx ? dx_ref : NULL), dw_ref);
    cr_assert_eq(cpu_dnnl_conv_backward(d, &s, x, w, dy, with_dx ? dx : NULL, dw), 0);
    assert_close(dw, dw_ref, nw, "dw");
    assert_close(dx, dx_ref, nx, "dx"); /* without dx: both still hold the prefill */
    /* the cache: the same shape again gives the same bits */
    float *y2 = filled(ny, NAN);
    cr_assert_eq(cpu_dnnl_conv_forward(d, &s, x, w, y2), 0);
    cr_assert_arr_eq(y2, y, ny * sizeof(float));
    free(x), free(w), free(dy), free(y_ref), free(y), free(y2);
    free(dx_ref), free(dx), free(dw_ref), free(dw);
    cpu_dnnl_destroy(d);
    ref->mem->destroy(ref);
}

Test(cpu_dnnl, same_padding_3x3) {
    check(shape(2, 9, 7, 5, 6, 3, 1, 1), true);
}
Test(cpu_dnnl, imagenet_stem_7x7_stride_2) {
    check(shape(2, 16, 16, 3, 8, 7, 2, 3), true);
}
Test(cpu_dnnl, pointwise_projection_stride_2) {
    check(shape(3, 8, 8, 16, 32, 1, 2, 0), true);
}
Test(cpu_dnnl, stride_that_does_not_divide) {
    check(shape(2, 6, 5, 4, 4, 3, 2, 0), true);
}
Test(cpu_dnnl, first_layer_without_dx) {
    check(shape(2, 8, 8, 3, 16, 3, 1, 1), false);
}
Test(cpu_dnnl, resnet50_imagenet_stem_64x64) {
    check(shape(8, 64, 64, 3, 4, 7, 2, 3), false);
}

/* every convolution of a ResNet-50 of width 4 on 64x64 images, batch 8 (the interop test's case) */
Test(cpu_dnnl, resnet50_width_4_shapes) {
    const conv_shape_t shapes[] = {
        shape(8, 16, 16, 4, 4, 1, 1, 0),  shape(8, 16, 16, 4, 4, 3, 1, 1),
        shape(8, 16, 16, 4, 16, 1, 1, 0), shape(8, 16, 16, 16, 4, 1, 1, 0),
        shape(8, 16, 16, 16, 8, 1, 1, 0), shape(8, 16, 16, 8, 8, 3, 2, 1),
        shape(8, 8, 8, 8, 32, 1, 1, 0),   shape(8, 16, 16, 16, 32, 1, 2, 0),
        shape(8, 8, 8, 32, 8, 1, 1, 0),   shape(8, 8, 8, 8, 8, 3, 1, 1),
        shape(8, 8, 8, 32, 16, 1, 1, 0),  shape(8, 8, 8, 16, 16, 3, 2, 1),
        shape(8, 4, 4, 16, 64, 1, 1, 0),  shape(8, 8, 8, 32, 64, 1, 2, 0),
        shape(8, 4, 4, 64, 16, 1, 1, 0),  shape(8, 4, 4, 16, 16, 3, 1, 1),
        shape(8, 4, 4, 64, 32, 1, 1, 0),  shape(8, 4, 4, 32, 32, 3, 2, 1),
        shape(8, 2, 2, 32, 128, 1, 1, 0), shape(8, 4, 4, 64, 128, 1, 2, 0),
        shape(8, 2, 2, 128, 32, 1, 1, 0), shape(8, 2, 2, 32, 32, 3, 1, 1),
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        cr_log_info("shape %zu", i);
        check(shapes[i], true);
    }
}

/* y = x w^T + bias; dw += dy^T x, dx += dy w onto prefilled buffers (or no dx), as SGEMM does */
static void check_linear(int n, int in, int out, bool with_dx) {
    backend_t *ref = plain_backend();
    cpu_dnnl_t *d = cpu_dnnl_create();
    cr_assert_not_null(d, "oneDNN's CPU engine did not start");
    size_t nx = (size_t)n * in, nw = (size_t)out * in, ny = (size_t)n * out;
    float *x = random_buffer(nx), *w = random_buffer(nw), *bias = random_buffer((size_t)out);
    float *dy = random_buffer(ny), *y_ref = filled(ny, NAN), *y = filled(ny, NAN);
    ref->ops->linear_forward(ref, n, in, out, tensor_f32(x, nx), w, bias, tensor_f32(y_ref, ny));
    cr_assert_eq(cpu_dnnl_linear_forward(d, n, in, out, x, w, bias, y), 0);
    assert_close(y, y_ref, ny, "y");
    float *dx_ref = filled(nx, PREFILL), *dx = filled(nx, PREFILL);
    float *dw_ref = filled(nw, PREFILL), *dw = filled(nw, PREFILL), *db = filled((size_t)out, 0);
    ref->ops->linear_backward(ref, n, in, out, tensor_f32(x, nx), w, tensor_f32(dy, ny),
                              tensor_f32(with_dx ? dx_ref : NULL, nx), dw_ref, db);
    cr_assert_eq(cpu_dnnl_linear_backward(d, n, in, out, x, w, dy, with_dx ? dx : NULL, dw), 0);
    assert_close(dw, dw_ref, nw, "dw");
    assert_close(dx, dx_ref, nx, "dx");
    free(x), free(w), free(bias), free(dy), free(y_ref), free(y);
    free(dx_ref), free(dx), free(dw_ref), free(dw), free(db);
    cpu_dnnl_destroy(d);
    ref->mem->destroy(ref);
}

Test(cpu_dnnl, linear_classifier) {
    check_linear(64, 512, 10, true);
}
Test(cpu_dnnl, linear_odd_sizes) {
    check_linear(7, 33, 5, true);
}
Test(cpu_dnnl, linear_first_layer_without_dx) {
    check_linear(16, 784, 256, false);
}
