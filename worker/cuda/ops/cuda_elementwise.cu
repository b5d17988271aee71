/* cuda_elementwise: fill, scale, ReLU, add, accumulate and dropout, one thread per value. */
#include "cuda_common.cuh"

/* ---- elementwise kernels (templates over the activation type: float, bf16 or fp16; math in float)
 * ---- */

template <typename T> __global__ void fill_kernel(T *x, float v, size_t n) {
    GRID_STRIDE(i, n) st(x, i, v);
}
__global__ void scale_kernel(float *x, float f, size_t n) {
    GRID_STRIDE(i, n) x[i] *= f;
}
template <typename T> __global__ void relu_kernel(const T *x, T *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, fmaxf(ld(x, i), 0.0f));
}
template <typename T>
__global__ void relu_backward_kernel(const T *y, const T *dy, T *dx, size_t n) {
    GRID_STRIDE(i, n) if (ld(y, i) > 0.0f) st(dx, i, ld(dx, i) + ld(dy, i));
}
template <typename T> __global__ void add_kernel(const T *a, const T *b, T *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, ld(a, i) + ld(b, i));
}
template <typename T> __global__ void accumulate_kernel(const T *dy, T *dx, size_t n) {
    GRID_STRIDE(i, n) st(dx, i, ld(dx, i) + ld(dy, i));
}

void gpu_fill(backend_t *b, float *x, float v, size_t n) {
    gpu_t *g = gpu_of(b);
    if (!n) return;
    if (v == 0.0f) /* zero is zero in every type, and an activation's slot is n floats wide */
        CHECK_CUDA(cudaMemsetAsync(x, 0, n * sizeof(float), g->stream));
    else /* backend.h: x is fp32 unless v is 0 */
        LAUNCH(fill_kernel<float>, n, x, v, n);
}
void gpu_scale(backend_t *b, float *x, float f, size_t n) {
    if (n) LAUNCH(scale_kernel, n, x, f, n);
}
void gpu_relu_forward(backend_t *b, tensor_desc_t x_d, tensor_desc_t y_d, size_t n) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    if (!n) return;
    if (is_low(gpu_of(b), x_d))
        WITH_LOW(gpu_of(b), LAUNCH(relu_kernel<Low>, n, CLOW(x), LOW(y), n));
    else
        LAUNCH(relu_kernel<float>, n, x, y, n);
}
void gpu_relu_backward(backend_t *b, tensor_desc_t y_d, tensor_desc_t dy_d, tensor_desc_t dx_d,
                       size_t n) {
    float *y = (float *)y_d.data;
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    if (!n) return;
    if (is_low(gpu_of(b), y_d))
        WITH_LOW(gpu_of(b), LAUNCH(relu_backward_kernel<Low>, n, CLOW(y), CLOW(dy), LOW(dx), n));
    else
        LAUNCH(relu_backward_kernel<float>, n, y, dy, dx, n);
}
void gpu_add_forward(backend_t *b, tensor_desc_t x1_d, tensor_desc_t x2_d, tensor_desc_t y_d,
                     size_t n) {
    const float *x1 = (const float *)x1_d.data;
    const float *x2 = (const float *)x2_d.data;
    float *y = (float *)y_d.data;
    if (!n) return;
    if (is_low(gpu_of(b), x1_d))
        WITH_LOW(gpu_of(b), LAUNCH(add_kernel<Low>, n, CLOW(x1), CLOW(x2), LOW(y), n));
    else
        LAUNCH(add_kernel<float>, n, x1, x2, y, n);
}
void gpu_accumulate(backend_t *b, tensor_desc_t dy_d, tensor_desc_t dx_d, size_t n) {
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    if (!n) return;
    if (is_low(gpu_of(b), dy_d))
        WITH_LOW(gpu_of(b), LAUNCH(accumulate_kernel<Low>, n, CLOW(dy), LOW(dx), n));
    else
        LAUNCH(accumulate_kernel<float>, n, dy, dx, n);
}

template <typename T>
__global__ void dropout_kernel(const T *x, T *y, size_t n, uint32_t threshold, float scale,
                               uint64_t key) {
    GRID_STRIDE(i, n) st(y, i, dropout_keeps(key, i, threshold) ? ld(x, i) * scale : 0.0f);
}

template <typename T>
__global__ void dropout_backward_kernel(const T *dy, T *dx, size_t n, uint32_t threshold,
                                        float scale, uint64_t key) {
    GRID_STRIDE(i, n)
    if (dropout_keeps(key, i, threshold)) st(dx, i, ld(dx, i) + ld(dy, i) * scale);
}

void gpu_dropout_forward(backend_t *b, tensor_desc_t x_d, tensor_desc_t y_d, size_t n, float p,
                         uint64_t key) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    if (!n) return;
    uint32_t t = dropout_threshold(p);
    float scale = dropout_scale(p);
    if (is_low(gpu_of(b), x_d))
        WITH_LOW(gpu_of(b), LAUNCH(dropout_kernel<Low>, n, CLOW(x), LOW(y), n, t, scale, key));
    else
        LAUNCH(dropout_kernel<float>, n, x, y, n, t, scale, key);
}

void gpu_dropout_backward(backend_t *b, tensor_desc_t dy_d, tensor_desc_t dx_d, size_t n, float p,
                          uint64_t key) {
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    if (!n) return;
    uint32_t t = dropout_threshold(p);
    float scale = dropout_scale(p);
    if (is_low(gpu_of(b), dy_d))
        WITH_LOW(gpu_of(b),
                 LAUNCH(dropout_backward_kernel<Low>, n, CLOW(dy), LOW(dx), n, t, scale, key));
    else
        LAUNCH(dropout_backward_kernel<float>, n, dy, dx, n, t, scale, key);
}
