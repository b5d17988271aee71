/* cuda_norm: batch norm and the convolution bias: per-channel reductions over rows = N*H*W,
 * deterministic (fixed-order partial sums). */
#include "cuda_common.cuh"

/* ---- batch norm: own kernels over rows = N*H*W of C channels (NHWC) ----
 * cuDNN's spatial batch norm sees such a tensor as (rows, C, 1, 1) and is slow there, and its
 * inference call refuses large row counts. One pass gathers per-channel sums of (x - shift) and
 * (x - shift)^2, shift being the channel's first value (close to the mean, so no cancellation),
 * reduced deterministically: each block of BN_TILE channels x a chunk of rows writes one partial
 * per channel, then a warp per channel sums the partials in a fixed order, in double. */

#define BN_TILE           32
#define BN_ROWS_PER_BLOCK 8 /* blockDim.y */

/* Row chunks: about four blocks per multiprocessor in all, at least 64 rows each. */
static int bn_chunks(const gpu_t *g, size_t rows, int c) {
    size_t tiles = (size_t)(c + BN_TILE - 1) / BN_TILE,
           want = (4 * (size_t)g->sm_count + tiles - 1) / tiles;
    size_t most = rows / 64, room = g->bn_partials_len / (2 * (size_t)c);
    size_t n = want < most ? want : most;
    n = n < room ? n : room;
    return (int)(n < 1 ? 1 : n);
}

/* partial[chunk][ch], partial2[chunk][ch]: mode 0: sums of (x - x[0]) and (x - x[0])^2;
 * mode 1 (backward): sums of dy and dy * (x - mean) * invstd. */
template <typename T>
__global__ void bn_partials_kernel(int mode, size_t rows, int c, const T *x, const T *dy,
                                   const float *mean, const float *invstd, float *partial,
                                   float *partial2) {
    __shared__ float s1[BN_ROWS_PER_BLOCK][BN_TILE], s2[BN_ROWS_PER_BLOCK][BN_TILE];
    int ch = blockIdx.x * BN_TILE + threadIdx.x;
    size_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
    size_t begin = blockIdx.y * per_chunk,
           end = begin + per_chunk < rows ? begin + per_chunk : rows;
    float a = 0.0f, b = 0.0f;
    if (ch < c) {
        float shift = mode == 0 ? ld(x, ch) : mean[ch], is = mode == 1 ? invstd[ch] : 0.0f;
        for (size_t r = begin + threadIdx.y; r < end; r += BN_ROWS_PER_BLOCK) {
            float v = ld(x, r * c + ch) - shift;
            if (mode == 0) {
                a += v;
                b += v * v;
            } else {
                float d = ld(dy, r * c + ch);
                a += d;
                b += d * v * is;
            }
        }
    }
    s1[threadIdx.y][threadIdx.x] = a;
    s2[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && ch < c) {
        for (int i = 1; i < BN_ROWS_PER_BLOCK; i++) {
            a += s1[i][threadIdx.x];
            b += s2[i][threadIdx.x];
        }
        partial[(size_t)blockIdx.y * c + ch] = a;
        partial2[(size_t)blockIdx.y * c + ch] = b;
    }
}

/* low: x and dy are narrow */
static void bn_reduce(gpu_t *g, bool low, int mode, size_t rows, int c, int chunks, const float *x,
                      const float *dy, const float *mean, const float *invstd) {
    dim3 grid((unsigned)((c + BN_TILE - 1) / BN_TILE), (unsigned)chunks),
        block(BN_TILE, BN_ROWS_PER_BLOCK);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)chunks * c;
    if (low)
        WITH_LOW(g, bn_partials_kernel<Low><<<grid, block, 0, g->stream>>>(
                        mode, rows, c, CLOW(x), CLOW(dy), mean, invstd, p1, p2));
    else
        bn_partials_kernel<float>
            <<<grid, block, 0, g->stream>>>(mode, rows, c, x, dy, mean, invstd, p1, p2);
    CHECK_CUDA(cudaGetLastError());
}

/* The two partial sums of channel blockIdx.x over every chunk, by one warp, in a fixed order. */
__device__ void bn_sum_chunks(int c, int chunks, const float *partial, double *s1, double *s2) {
    int ch = blockIdx.x;
    double a = 0, b = 0;
    for (int i = threadIdx.x; i < chunks; i += 32) {
        a += partial[(size_t)i * c + ch];
        b += partial[(size_t)(chunks + i) * c + ch];
    }
    for (int off = 16; off > 0; off /= 2) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
    }
    *s1 = a;
    *s2 = b;
}

template <typename T>
__global__ void bn_stats_kernel(int c, int chunks, size_t rows, const T *x, const float *partial,
                                float *mean, float *invstd, float *running_mean, float *running_var,
                                float momentum, float eps) {
    double sum, sq;
    bn_sum_chunks(c, chunks, partial, &sum, &sq);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    double n = (double)rows, shifted_mean = sum / n, var = sq / n - shifted_mean * shifted_mean;
    var = var > 0 ? var : 0;
    double mu = ld(x, ch) + shifted_mean, unbiased = rows > 1 ? var * n / (n - 1) : var;
    mean[ch] = (float)mu;
    invstd[ch] = (float)(1.0 / sqrt(var + eps));
    running_mean[ch] = (float)((1.0 - momentum) * running_mean[ch] + momentum * mu);
    running_var[ch] = (float)((1.0 - momentum) * running_var[ch] + momentum * unbiased);
}

/* y = (x - mean) * invstd * gamma + beta; eval passes the running variance as var (invstd NULL). */
template <typename T>
__global__ void bn_apply_kernel(size_t n, int c, const T *x, const float *mean, const float *invstd,
                                const float *var, float eps, const float *gamma, const float *beta,
                                T *y) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float is = invstd ? invstd[ch] : rsqrtf(var[ch] + eps);
        st(y, i, (ld(x, i) - mean[ch]) * is * gamma[ch] + beta[ch]);
    }
}

/* low: x and y are narrow */
static void bn_apply(backend_t *b, bool low, size_t rows, int c, const float *x, const float *mean,
                     const float *invstd, const float *var, float eps, const float *gamma,
                     const float *beta, float *y) {
    size_t n = rows * c;
    if (low)
        WITH_LOW(gpu_of(b), LAUNCH(bn_apply_kernel<Low>, n, n, c, CLOW(x), mean, invstd, var, eps,
                                   gamma, beta, LOW(y)));
    else
        LAUNCH(bn_apply_kernel<float>, n, n, c, x, mean, invstd, var, eps, gamma, beta, y);
}

void gpu_batchnorm_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                                 const float *gamma, const float *beta, tensor_desc_t y_d,
                                 float *save_mean, float *save_invstd, float *running_mean,
                                 float *running_var, float momentum, float eps) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
    int chunks = bn_chunks(g, rows, c);
    bn_reduce(g, is_low(g, x_d), 0, rows, c, chunks, x, NULL, NULL, NULL);
    if (is_low(g, x_d))
        WITH_LOW(g, bn_stats_kernel<Low>
                 <<<c, 32, 0, g->stream>>>(c, chunks, rows, CLOW(x), g->bn_partials, save_mean,
                                           save_invstd, running_mean, running_var, momentum, eps));
    else
        bn_stats_kernel<float><<<c, 32, 0, g->stream>>>(c, chunks, rows, x, g->bn_partials,
                                                        save_mean, save_invstd, running_mean,
                                                        running_var, momentum, eps);
    CHECK_CUDA(cudaGetLastError());
    bn_apply(b, is_low(g, x_d), rows, c, x, save_mean, save_invstd, NULL, eps, gamma, beta, y);
}

void gpu_batchnorm_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                                const float *gamma, const float *beta, tensor_desc_t y_d,
                                const float *running_mean, const float *running_var, float eps) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    if (rows && c)
        bn_apply(b, is_low(gpu_of(b), x_d), rows, c, x, running_mean, NULL, running_var, eps, gamma,
                 beta, y);
}

__global__ void bn_grad_params_kernel(int c, int chunks, const float *partial, float *dgamma,
                                      float *dbeta, float *sums) {
    double sum_dy, sum_dy_xhat;
    bn_sum_chunks(c, chunks, partial, &sum_dy, &sum_dy_xhat);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    dbeta[ch] += (float)sum_dy;
    dgamma[ch] += (float)sum_dy_xhat;
    sums[ch] = (float)sum_dy;
    sums[c + ch] = (float)sum_dy_xhat;
}

/* dx += gamma * invstd / rows * (rows * dy - sum(dy) - xhat * sum(dy * xhat)) */
template <typename T>
__global__ void bn_backward_dx_kernel(size_t n, size_t rows, int c, const T *x, const T *dy,
                                      const float *gamma, const float *mean, const float *invstd,
                                      const float *sums, T *dx) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float xhat = (ld(x, i) - mean[ch]) * invstd[ch];
        float k = gamma[ch] * invstd[ch] / (float)rows;
        st(dx, i, ld(dx, i) + k * ((float)rows * ld(dy, i) - sums[ch] - xhat * sums[c + ch]));
    }
}

void gpu_batchnorm_backward(backend_t *b, size_t rows, int c, tensor_desc_t x_d, const float *gamma,
                            const float *save_mean, const float *save_invstd, tensor_desc_t dy_d,
                            tensor_desc_t dx_d, float *dgamma, float *dbeta) {
    const float *x = (const float *)x_d.data;
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
    int chunks = bn_chunks(g, rows, c);
    bn_reduce(g, is_low(g, x_d), 1, rows, c, chunks, x, dy, save_mean, save_invstd);
    float *sums = g->bn_sums;
    bn_grad_params_kernel<<<c, 32, 0, g->stream>>>(c, chunks, g->bn_partials, dgamma, dbeta, sums);
    CHECK_CUDA(cudaGetLastError());
    size_t n = rows * c;
    if (is_low(g, x_d))
        WITH_LOW(g, LAUNCH(bn_backward_dx_kernel<Low>, n, n, rows, c, CLOW(x), CLOW(dy), gamma,
                           save_mean, save_invstd, sums, LOW(dx)));
    else
        LAUNCH(bn_backward_dx_kernel<float>, n, n, rows, c, x, dy, gamma, save_mean, save_invstd,
               sums, dx);
}

template <typename T> __global__ void bias_add_kernel(size_t n, int c, const float *bias, T *y) {
    GRID_STRIDE(i, n) st(y, i, ld(y, i) + bias[i % c]);
}

void gpu_bias_add(backend_t *b, size_t rows, int c, const float *bias, tensor_desc_t y_d) {
    float *y = (float *)y_d.data;
    size_t n = rows * (size_t)c;
    if (!n) return;
    if (is_low(gpu_of(b), y_d))
        WITH_LOW(gpu_of(b), LAUNCH(bias_add_kernel<Low>, n, n, c, bias, LOW(y)));
    else
        LAUNCH(bias_add_kernel<float>, n, n, c, bias, y);
}

/* The bias gradient: batch norm's deterministic two-pass reduction (partials per row chunk, then a
 * warp per channel), on the column sums alone. */
template <typename T>
__global__ void column_partials_kernel(size_t rows, int c, const T *dy, float *partial) {
    __shared__ float s1[BN_ROWS_PER_BLOCK][BN_TILE];
    int ch = blockIdx.x * BN_TILE + threadIdx.x;
    size_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
    size_t begin = blockIdx.y * per_chunk,
           end = begin + per_chunk < rows ? begin + per_chunk : rows;
    float a = 0.0f;
    if (ch < c)
        for (size_t r = begin + threadIdx.y; r < end; r += BN_ROWS_PER_BLOCK)
            a += ld(dy, r * c + ch);
    s1[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && ch < c) {
        for (int i = 1; i < BN_ROWS_PER_BLOCK; i++)
            a += s1[i][threadIdx.x];
        partial[(size_t)blockIdx.y * c + ch] = a;
    }
}

__global__ void column_partials_sum_kernel(int c, int chunks, const float *partial, float *dbias) {
    int ch = blockIdx.x;
    double a = 0;
    for (int i = threadIdx.x; i < chunks; i += 32)
        a += partial[(size_t)i * c + ch];
    for (int off = 16; off > 0; off /= 2)
        a += __shfl_xor_sync(0xffffffffu, a, off);
    if (threadIdx.x == 0) dbias[ch] += (float)a;
}

void gpu_bias_backward(backend_t *b, size_t rows, int c, tensor_desc_t dy_d, float *dbias) {
    const float *dy = (const float *)dy_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    int chunks = bn_chunks(g, rows, c);
    dim3 grid((unsigned)((c + BN_TILE - 1) / BN_TILE), (unsigned)chunks),
        block(BN_TILE, BN_ROWS_PER_BLOCK);
    if (is_low(g, dy_d))
        WITH_LOW(g, column_partials_kernel<Low>
                 <<<grid, block, 0, g->stream>>>(rows, c, CLOW(dy), g->bn_partials));
    else
        column_partials_kernel<float><<<grid, block, 0, g->stream>>>(rows, c, dy, g->bn_partials);
    CHECK_CUDA(cudaGetLastError());
    column_partials_sum_kernel<<<c, 32, 0, g->stream>>>(c, chunks, g->bn_partials, dbias);
    CHECK_CUDA(cudaGetLastError());
}
