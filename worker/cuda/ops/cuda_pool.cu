/* cuda_pool: max pooling, global and adaptive average pooling. */
#include "cuda_common.cuh"

/* ---- pooling ---- */

/* The pools' index arithmetic in I: uint32_t where the tensors have fewer than 2^31 values,
 * else size_t. A 64-bit division costs the GPU dozens of instructions, and with five per value
 * the stem pool's backward took 1.1 ms of ResNet-50's step on the H100 (bf16, batch 256, 128 px:
 * 67M values). */
static __device__ __forceinline__ bool fits_in_31_bits(size_t n) {
    return n < ((size_t)1 << 31);
}

/* cells of the window outside the input are -inf (nn.MaxPool2d's padding); a NaN wins, as on cpu */
template <typename T, typename I>
static __device__ __forceinline__ void maxpool_at(const pool_shape_t &s, I o, const T *x, T *y,
                                                  int32_t *argmax) {
    int ch = (int)(o % (I)s.c);
    I pix = o / (I)s.c;
    int ox = (int)(pix % (I)s.ow);
    I rows = pix / (I)s.ow;
    int oy = (int)(rows % (I)s.oh), n = (int)(rows / (I)s.oh);
    const T *xn = x + (size_t)n * s.h * s.w * s.c;
    int y0 = oy * s.stride - s.pad, y1 = min(y0 + s.size, s.h), x0 = ox * s.stride - s.pad;
    int x1 = min(x0 + s.size, s.w);
    y0 = max(y0, 0);
    x0 = max(x0, 0);
    float best = -INFINITY;
    int32_t best_at = (y0 * s.w + x0) * s.c + ch;
    for (int iy = y0; iy < y1; iy++)
        for (int ix = x0; ix < x1; ix++) {
            int at = (iy * s.w + ix) * s.c + ch;
            float v = ld(xn, at);
            if (v > best || isnan(v)) {
                best = v;
                best_at = at;
            }
        }
    st(y, o, best);
    argmax[o] = best_at;
}

template <typename T>
__global__ void maxpool_kernel(pool_shape_t s, const T *x, T *y, int32_t *argmax) {
    size_t n_out = (size_t)s.n * s.oh * s.ow * s.c;
    if (fits_in_31_bits(n_out)) {
        for (uint32_t o = blockIdx.x * blockDim.x + threadIdx.x; o < (uint32_t)n_out;
             o += gridDim.x * blockDim.x)
            maxpool_at<T, uint32_t>(s, o, x, y, argmax);
    } else {
        GRID_STRIDE(o, n_out) maxpool_at<T, size_t>(s, o, x, y, argmax);
    }
}

/* A gather, one thread per input cell: it adds the gradients of the windows that chose it, in the
 * order the cpu backend adds them (output rows, then columns), in float. No atomics: overlapping
 * windows (ResNet's 3x3/2 stem pool) give the same bits in every run, which a resumed run compared
 * with an uninterrupted one needs (and fp32 gives the cpu backend's bits). */
template <typename T, typename I>
static __device__ __forceinline__ void
maxpool_backward_at(const pool_shape_t &s, I i, const int32_t *argmax, const T *dy, T *dx) {
    int ch = (int)(i % (I)s.c);
    I pix = i / (I)s.c;
    int ix = (int)(pix % (I)s.w);
    I rows = pix / (I)s.w;
    int iy = (int)(rows % (I)s.h), n = (int)(rows / (I)s.h);
    int32_t at = (int32_t)((iy * s.w + ix) * s.c + ch);
    /* windows oy with oy * stride - pad <= iy < oy * stride - pad + size, likewise ox */
    int lo_y = iy + s.pad - s.size + 1, lo_x = ix + s.pad - s.size + 1;
    int oy0 = lo_y <= 0 ? 0 : (lo_y + s.stride - 1) / s.stride,
        oy1 = min(s.oh - 1, (iy + s.pad) / s.stride);
    int ox0 = lo_x <= 0 ? 0 : (lo_x + s.stride - 1) / s.stride,
        ox1 = min(s.ow - 1, (ix + s.pad) / s.stride);
    float acc = ld(dx, i);
    bool hit = false;
    for (int oy = oy0; oy <= oy1; oy++)
        for (int ox = ox0; ox <= ox1; ox++) {
            I o = (((I)n * (I)s.oh + (I)oy) * (I)s.ow + (I)ox) * (I)s.c + (I)ch;
            if (argmax[o] == at) {
                acc += ld(dy, o);
                hit = true;
            }
        }
    if (hit) st(dx, i, acc);
}

template <typename T>
__global__ void maxpool_backward_kernel(pool_shape_t s, const int32_t *argmax, const T *dy, T *dx) {
    size_t n_in = (size_t)s.n * s.h * s.w * s.c, n_out = (size_t)s.n * s.oh * s.ow * s.c;
    if (fits_in_31_bits(n_in) && fits_in_31_bits(n_out)) {
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (uint32_t)n_in;
             i += gridDim.x * blockDim.x)
            maxpool_backward_at<T, uint32_t>(s, i, argmax, dy, dx);
    } else {
        GRID_STRIDE(i, n_in) maxpool_backward_at<T, size_t>(s, i, argmax, dy, dx);
    }
}

void gpu_maxpool_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x_d, tensor_desc_t y_d,
                         int32_t *argmax) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), x_d))
        WITH_LOW(gpu_of(b), LAUNCH(maxpool_kernel<Low>, n, *s, CLOW(x), LOW(y), argmax));
    else
        LAUNCH(maxpool_kernel<float>, n, *s, x, y, argmax);
}

void gpu_maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                          tensor_desc_t dy_d, tensor_desc_t dx_d) {
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    size_t n = (size_t)s->n * s->h * s->w * s->c;
    if (!n || !s->oh || !s->ow) return;
    if (is_low(gpu_of(b), dy_d))
        WITH_LOW(gpu_of(b), LAUNCH(maxpool_backward_kernel<Low>, n, *s, argmax, CLOW(dy), LOW(dx)));
    else
        LAUNCH(maxpool_backward_kernel<float>, n, *s, argmax, dy, dx);
}

template <typename T> __global__ void avgpool_kernel(int n, int hw, int c, const T *x, T *y) {
    GRID_STRIDE(o, (size_t)n * c) {
        size_t i = o / c, ch = o % c;
        float sum = 0.0f;
        for (int p = 0; p < hw; p++)
            sum += ld(x, (i * hw + p) * c + ch);
        st(y, o, sum / (float)hw);
    }
}

template <typename T>
__global__ void avgpool_backward_kernel(int n, int hw, int c, const T *dy, T *dx) {
    GRID_STRIDE(o, (size_t)n * hw * c) {
        size_t ch = o % c, i = o / ((size_t)hw * c);
        st(dx, o, ld(dx, o) + ld(dy, i * c + ch) / (float)hw);
    }
}

void gpu_avgpool_global_forward(backend_t *b, int n, int hw, int c, tensor_desc_t x_d,
                                tensor_desc_t y_d) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    if (!n || !c) return;
    if (is_low(gpu_of(b), x_d))
        WITH_LOW(gpu_of(b), LAUNCH(avgpool_kernel<Low>, (size_t)n * c, n, hw, c, CLOW(x), LOW(y)));
    else
        LAUNCH(avgpool_kernel<float>, (size_t)n * c, n, hw, c, x, y);
}

void gpu_avgpool_global_backward(backend_t *b, int n, int hw, int c, tensor_desc_t dy_d,
                                 tensor_desc_t dx_d) {
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    if (!n || !c) return;
    if (is_low(gpu_of(b), dy_d))
        WITH_LOW(gpu_of(b), LAUNCH(avgpool_backward_kernel<Low>, (size_t)n * hw * c, n, hw, c,
                                   CLOW(dy), LOW(dx)));
    else
        LAUNCH(avgpool_backward_kernel<float>, (size_t)n * hw * c, n, hw, c, dy, dx);
}

/* ---- adaptive average pooling (PyTorch's bins), dropout, convolution bias ---- */

__device__ __forceinline__ int bin_start(int i, int in, int out) {
    return (int)((long long)i * in / out);
}
__device__ __forceinline__ int bin_end(int i, int in, int out) {
    return (int)(((long long)(i + 1) * in + out - 1) / out);
}

template <typename T> __global__ void avgpool_adaptive_kernel(pool_shape_t s, const T *x, T *y) {
    GRID_STRIDE(o, (size_t)s.n * s.oh * s.ow * s.c) {
        int ch = (int)(o % s.c);
        size_t pix = o / s.c;
        int ox = (int)(pix % s.ow), oy = (int)(pix / s.ow % s.oh),
            n = (int)(pix / ((size_t)s.ow * s.oh));
        int y0 = bin_start(oy, s.h, s.oh), y1 = bin_end(oy, s.h, s.oh);
        int x0 = bin_start(ox, s.w, s.ow), x1 = bin_end(ox, s.w, s.ow);
        const T *xn = x + (size_t)n * s.h * s.w * s.c;
        float sum = 0.0f; /* the cpu backend's order: rows, then columns */
        for (int iy = y0; iy < y1; iy++)
            for (int ix = x0; ix < x1; ix++)
                sum += ld(xn, ((size_t)iy * s.w + ix) * s.c + ch);
        st(y, o, sum / (float)((y1 - y0) * (x1 - x0)));
    }
}

/* One thread per input value gathers from the output cells whose bins hold it: rows
 * [floor(iy * OH / H), ceil((iy + 1) * OH / H)), columns alike. No atomics. */
template <typename T>
__global__ void avgpool_adaptive_backward_kernel(pool_shape_t s, const T *dy, T *dx) {
    GRID_STRIDE(i, (size_t)s.n * s.h * s.w * s.c) {
        int ch = (int)(i % s.c);
        size_t pix = i / s.c;
        int ix = (int)(pix % s.w), iy = (int)(pix / s.w % s.h),
            n = (int)(pix / ((size_t)s.w * s.h));
        const T *dyn = dy + (size_t)n * s.oh * s.ow * s.c;
        float sum = 0.0f;
        for (int oy = bin_start(iy, s.oh, s.h); oy < bin_end(iy, s.oh, s.h); oy++) {
            int y0 = bin_start(oy, s.h, s.oh), y1 = bin_end(oy, s.h, s.oh);
            for (int ox = bin_start(ix, s.ow, s.w); ox < bin_end(ix, s.ow, s.w); ox++) {
                int x0 = bin_start(ox, s.w, s.ow), x1 = bin_end(ox, s.w, s.ow);
                sum +=
                    ld(dyn, ((size_t)oy * s.ow + ox) * s.c + ch) / (float)((y1 - y0) * (x1 - x0));
            }
        }
        st(dx, i, ld(dx, i) + sum);
    }
}

void gpu_avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x_d,
                                  tensor_desc_t y_d) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), x_d))
        WITH_LOW(gpu_of(b), LAUNCH(avgpool_adaptive_kernel<Low>, n, *s, CLOW(x), LOW(y)));
    else
        LAUNCH(avgpool_adaptive_kernel<float>, n, *s, x, y);
}

void gpu_avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, tensor_desc_t dy_d,
                                   tensor_desc_t dx_d) {
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    size_t n = (size_t)s->n * s->h * s->w * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), dy_d))
        WITH_LOW(gpu_of(b),
                 LAUNCH(avgpool_adaptive_backward_kernel<Low>, n, *s, CLOW(dy), LOW(dx)));
    else
        LAUNCH(avgpool_adaptive_backward_kernel<float>, n, *s, dy, dx);
}
