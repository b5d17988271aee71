/* cuda_bn_act: batch norm + residual add + ReLU fused (backend_i.bn_act_*), NHWC, fp32, bf16 or
 * fp16 tensors with fp32 statistics. Each thread keeps its channels (a 16-byte vector of them:
 * 4 fp32 or 8 bf16/fp16 values, else one value when C or an address does not allow it) for all
 * the rows it visits, so per-channel values are loaded once per thread.
 * Forward: one pass gathers the shifted sums per channel (partials per block, then a warp per
 * channel in double, in a fixed order: deterministic), one pass reads x and the residual and
 * writes y. Backward: one pass gathers the sums of dz and dz * xhat (dz = dy masked by y > 0: the
 * ReLU's mask is recomputed from the output, never stored), one pass writes (or adds to) dx and
 * the residual's gradient. Per-value and per-channel arithmetic: nn/bn_act.h. */
#include "cuda_common.cuh"

#include "bn_act.h"

#define ACT_THREADS 256

/* ---- vectors of V values of T in registers as floats ---- */

template <typename T> static __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(f16 v) { return __half2float(v); }
template <typename T> static __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ f16 from_f(float v) { return __float2half(v); }

/* V values at p (16-byte aligned when V * sizeof(T) == 16) */
template <typename T, int V> static __device__ __forceinline__ void load(const T *p, float *out) {
    if constexpr (V * sizeof(T) == 16) {
        uint4 u = *reinterpret_cast<const uint4 *>(p);
        const T *t = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int i = 0; i < V; i++) out[i] = to_f(t[i]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) out[i] = to_f(p[i]);
    }
}

template <typename T, int V> static __device__ __forceinline__ void store(T *p, const float *in) {
    if constexpr (V * sizeof(T) == 16) {
        uint4 u;
        T *t = reinterpret_cast<T *>(&u);
#pragma unroll
        for (int i = 0; i < V; i++) t[i] = from_f<T>(in[i]);
        *reinterpret_cast<uint4 *>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) p[i] = from_f<T>(in[i]);
    }
}

/* The launch shape: threadIdx.x walks the row's channel vectors (cv of them: contiguous, so a warp
 * reads whole rows), threadIdx.y rows; a thread covers channel vectors j0 + threadIdx.x for j0 =
 * 0, bx, 2 bx ... and rows blockIdx.x * by + threadIdx.y + k * gridDim.x * by. */
struct act_grid {
    int cv, bx, by;
};

static act_grid grid_for(int c, int v) {
    act_grid a;
    a.cv = c / v;
    a.bx = a.cv < ACT_THREADS ? a.cv : ACT_THREADS;
    a.by = ACT_THREADS / a.bx;
    return a;
}

/* ---- pass 1: per-channel partial sums of a block's rows ----
 * forward (dy NULL): sums of (x - shift) and (x - shift)^2, shift = x's first row;
 * backward: sums of dz and dz * (x - mean) * invstd. partial: [block][c], partial2 the same. */
template <typename T, int V>
__global__ void act_partials_kernel(size_t rows, int c, act_grid a, const T *x, const T *y, const T *dy,
                                    bool has_relu, const float *mean, const float *invstd, float *partial,
                                    float *partial2) {
    extern __shared__ float smem[]; /* by x bx x V, twice */
    float *s1 = smem, *s2 = smem + (size_t)a.by * a.bx * V;
    for (int j0 = 0; j0 < a.cv; j0 += a.bx) {
        int j = j0 + threadIdx.x;
        bool is_valid = j < a.cv;
        float acc1[V], acc2[V], shift[V], is[V];
#pragma unroll
        for (int i = 0; i < V; i++) acc1[i] = acc2[i] = shift[i] = is[i] = 0.0f;
        if (is_valid) {
            if (dy) {
#pragma unroll
                for (int i = 0; i < V; i++) {
                    shift[i] = mean[j * V + i];
                    is[i] = invstd[j * V + i];
                }
            } else {
                load<T, V>(x + (size_t)j * V, shift);
            }
            for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows; r += (size_t)gridDim.x * a.by) {
                size_t at = r * c + (size_t)j * V;
                float xv[V];
                load<T, V>(x + at, xv);
                if (!dy) {
#pragma unroll
                    for (int i = 0; i < V; i++) {
                        float d = xv[i] - shift[i];
                        acc1[i] += d;
                        acc2[i] += d * d;
                    }
                } else {
                    float dyv[V], yv[V];
                    load<T, V>(dy + at, dyv);
                    if (has_relu) load<T, V>(y + at, yv);
#pragma unroll
                    for (int i = 0; i < V; i++) {
                        float dz = bn_act_masked(has_relu ? yv[i] : 1.0f, dyv[i], has_relu);
                        acc1[i] += dz;
                        acc2[i] += dz * (xv[i] - shift[i]) * is[i];
                    }
                }
            }
        }
        size_t me = ((size_t)threadIdx.y * a.bx + threadIdx.x) * V;
#pragma unroll
        for (int i = 0; i < V; i++) {
            s1[me + i] = acc1[i];
            s2[me + i] = acc2[i];
        }
        __syncthreads();
        if (threadIdx.y == 0 && is_valid) { /* the block's rows in a fixed order */
            for (int t = 1; t < a.by; t++) {
                size_t at = ((size_t)t * a.bx + threadIdx.x) * V;
#pragma unroll
                for (int i = 0; i < V; i++) {
                    acc1[i] += s1[at + i];
                    acc2[i] += s2[at + i];
                }
            }
#pragma unroll
            for (int i = 0; i < V; i++) {
                partial[(size_t)blockIdx.x * c + (size_t)j * V + i] = acc1[i];
                partial2[(size_t)blockIdx.x * c + (size_t)j * V + i] = acc2[i];
            }
        }
        __syncthreads();
    }
}

/* ---- pass 1's finish: a warp per channel sums the blocks' partials in double, in order ---- */

static __device__ void sum_blocks(int c, int blocks, const float *partial, const float *partial2, double *a,
                                  double *b) {
    int ch = blockIdx.x;
    double s1 = 0, s2 = 0;
    for (int i = threadIdx.x; i < blocks; i += 32) {
        s1 += partial[(size_t)i * c + ch];
        s2 += partial2[(size_t)i * c + ch];
    }
    for (int off = 16; off > 0; off /= 2) {
        s1 += __shfl_xor_sync(0xffffffffu, s1, off);
        s2 += __shfl_xor_sync(0xffffffffu, s2, off);
    }
    *a = s1;
    *b = s2;
}

template <typename T>
__global__ void act_stats_kernel(int c, int blocks, size_t rows, const T *x, const float *partial,
                                 const float *partial2, float *mean, float *invstd, float *running_mean,
                                 float *running_var, float momentum, float eps) {
    double s1, s2;
    sum_blocks(c, blocks, partial, partial2, &s1, &s2);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    bn_act_stats((double)rows, ld(x, ch), s1, s2, momentum, eps, &mean[ch], &invstd[ch], &running_mean[ch],
                 &running_var[ch]);
}

/* coeffs: k_dy, k_x, k_0 (c each) */
__global__ void act_coeffs_kernel(int c, int blocks, size_t rows, const float *partial, const float *partial2,
                                  const float *gamma, const float *invstd, float *coeffs, float *dgamma,
                                  float *dbeta) {
    double sum_dz, sum_dz_xhat;
    sum_blocks(c, blocks, partial, partial2, &sum_dz, &sum_dz_xhat);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    dgamma[ch] += (float)sum_dz_xhat;
    dbeta[ch] += (float)sum_dz;
    bn_act_coeffs(gamma[ch], invstd[ch], sum_dz, sum_dz_xhat, (double)rows, &coeffs[ch], &coeffs[c + ch],
                  &coeffs[2 * c + ch]);
}

/* ---- pass 2 ---- */

/* y = act(batchnorm(x) + residual): train with invstd, eval with var (invstd NULL) */
template <typename T, int V>
__global__ void act_apply_kernel(size_t rows, int c, act_grid a, const T *x, const T *res, bool has_relu,
                                 const float *mean, const float *invstd, const float *var, float eps,
                                 const float *gamma, const float *beta, T *y) {
    for (int j0 = 0; j0 < a.cv; j0 += a.bx) {
        int j = j0 + threadIdx.x;
        if (j >= a.cv) return;
        float mu[V], mul[V], be[V];
#pragma unroll
        for (int i = 0; i < V; i++) {
            int ch = j * V + i;
            mu[i] = mean[ch];
            mul[i] = invstd ? invstd[ch] * gamma[ch] : gamma[ch] / sqrtf(var[ch] + eps);
            be[i] = beta[ch];
        }
        for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows; r += (size_t)gridDim.x * a.by) {
            size_t at = r * c + (size_t)j * V;
            float xv[V], rv[V], out[V];
            load<T, V>(x + at, xv);
            if (res) load<T, V>(res + at, rv);
#pragma unroll
            for (int i = 0; i < V; i++) out[i] = bn_act_value(xv[i], mu[i], mul[i], be[i], res ? rv[i] : 0.0f,
                                                              res != NULL, has_relu);
            store<T, V>(y + at, out);
        }
    }
}

/* dx (=|+=) k_dy dz + k_x (x - mean) + k_0; dres (=|+=) dz */
template <typename T, int V>
__global__ void act_dx_kernel(size_t rows, int c, act_grid a, const T *x, const T *y, const T *dy,
                              bool has_relu, const float *mean, const float *coeffs, bool is_dx_written,
                              T *dx, bool is_dres_written, T *dres) {
    for (int j0 = 0; j0 < a.cv; j0 += a.bx) {
        int j = j0 + threadIdx.x;
        if (j >= a.cv) return;
        float mu[V], k_dy[V], k_x[V], k_0[V];
#pragma unroll
        for (int i = 0; i < V; i++) {
            int ch = j * V + i;
            mu[i] = mean[ch];
            k_dy[i] = coeffs[ch];
            k_x[i] = coeffs[c + ch];
            k_0[i] = coeffs[2 * c + ch];
        }
        for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows; r += (size_t)gridDim.x * a.by) {
            size_t at = r * c + (size_t)j * V;
            float xv[V], yv[V], dyv[V], dz[V], out[V], old[V];
            load<T, V>(x + at, xv);
            load<T, V>(dy + at, dyv);
            if (has_relu) load<T, V>(y + at, yv);
#pragma unroll
            for (int i = 0; i < V; i++) dz[i] = bn_act_masked(has_relu ? yv[i] : 1.0f, dyv[i], has_relu);
            if (!is_dx_written) load<T, V>(dx + at, old);
#pragma unroll
            for (int i = 0; i < V; i++) {
                out[i] = bn_act_dx(k_dy[i], k_x[i], k_0[i], dz[i], xv[i], mu[i]);
                if (!is_dx_written) out[i] += old[i];
            }
            store<T, V>(dx + at, out);
            if (!dres) continue;
            if (!is_dres_written) {
                load<T, V>(dres + at, old);
#pragma unroll
                for (int i = 0; i < V; i++) dz[i] += old[i];
            }
            store<T, V>(dres + at, dz);
        }
    }
}

/* ---- dispatch: the type, then the vector width (16 bytes when C and every address allow) ---- */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* blocks for pass 1 (each writes one partial per channel) and for pass 2 */
static unsigned reduce_blocks(const gpu_t *g, size_t rows, int c, const act_grid &a) {
    size_t want = 4 * (size_t)g->sm_count, most = (rows + a.by - 1) / a.by;
    size_t room = BN_PARTIALS_FLOATS / (2 * (size_t)c);
    size_t n = want < most ? want : most;
    n = n < room ? n : room;
    return (unsigned)(n < 1 ? 1 : n);
}

static unsigned apply_blocks(const gpu_t *g, size_t rows, const act_grid &a) {
    size_t want = 16 * (size_t)g->sm_count, most = (rows + a.by - 1) / a.by;
    size_t n = want < most ? want : most;
    return (unsigned)(n < 1 ? 1 : n);
}

template <typename T, int V>
static void forward_train_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma, const float *beta,
                             const T *res, bool has_relu, T *y, float *save_mean, float *save_invstd,
                             float *running_mean, float *running_var, float momentum, float eps) {
    act_grid a = grid_for(c, V);
    dim3 block(a.bx, a.by);
    unsigned blocks = reduce_blocks(g, rows, c, a);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)blocks * c;
    size_t smem = 2 * sizeof(float) * a.bx * a.by * V;
    act_partials_kernel<T, V><<<blocks, block, smem, g->stream>>>(rows, c, a, x, (const T *)NULL,
                                                                  (const T *)NULL, false, NULL, NULL, p1, p2);
    CHECK_CUDA(cudaGetLastError());
    act_stats_kernel<T><<<c, 32, 0, g->stream>>>(c, (int)blocks, rows, x, p1, p2, save_mean, save_invstd,
                                                 running_mean, running_var, momentum, eps);
    CHECK_CUDA(cudaGetLastError());
    act_apply_kernel<T, V><<<apply_blocks(g, rows, a), block, 0, g->stream>>>(
        rows, c, a, x, res, has_relu, save_mean, save_invstd, NULL, eps, gamma, beta, y);
    CHECK_CUDA(cudaGetLastError());
}

template <typename T, int V>
static void forward_eval_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma, const float *beta,
                            const T *res, bool has_relu, T *y, const float *running_mean,
                            const float *running_var, float eps) {
    act_grid a = grid_for(c, V);
    act_apply_kernel<T, V><<<apply_blocks(g, rows, a), dim3(a.bx, a.by), 0, g->stream>>>(
        rows, c, a, x, res, has_relu, running_mean, NULL, running_var, eps, gamma, beta, y);
    CHECK_CUDA(cudaGetLastError());
}

template <typename T, int V>
static void backward_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma, const float *save_mean,
                        const float *save_invstd, const T *y, const T *dy, unsigned flags, T *dx, T *dres,
                        float *dgamma, float *dbeta) {
    act_grid a = grid_for(c, V);
    dim3 block(a.bx, a.by);
    bool has_relu = flags & BN_ACT_RELU;
    unsigned blocks = reduce_blocks(g, rows, c, a);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)blocks * c;
    size_t smem = 2 * sizeof(float) * a.bx * a.by * V;
    act_partials_kernel<T, V><<<blocks, block, smem, g->stream>>>(rows, c, a, x, y, dy, has_relu, save_mean,
                                                                  save_invstd, p1, p2);
    CHECK_CUDA(cudaGetLastError());
    act_coeffs_kernel<<<c, 32, 0, g->stream>>>(c, (int)blocks, rows, p1, p2, gamma, save_invstd, g->bn_coeffs,
                                               dgamma, dbeta);
    CHECK_CUDA(cudaGetLastError());
    act_dx_kernel<T, V><<<apply_blocks(g, rows, a), block, 0, g->stream>>>(
        rows, c, a, x, y, dy, has_relu, save_mean, g->bn_coeffs, flags & BN_ACT_WRITE_DX, dx,
        flags & BN_ACT_WRITE_DRESIDUAL, dres);
    CHECK_CUDA(cudaGetLastError());
}

/* 16-byte vectors when C is a multiple of the width and every tensor is aligned; else one value. */
#define DISPATCH(g, ptrs_aligned, c, T, call) \
    do { \
        constexpr int vec_ = 16 / (int)sizeof(T); \
        if ((ptrs_aligned) && (c) % vec_ == 0) { \
            constexpr int V = vec_; \
            call; \
        } else { \
            constexpr int V = 1; \
            call; \
        } \
    } while (0)

static void check_channels(int c) {
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
}

void gpu_bn_act_forward_train(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                              const float *beta, const float *residual, unsigned flags, float *y,
                              float *save_mean, float *save_invstd, float *running_mean, float *running_var,
                              float momentum, float eps) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    check_channels(c);
    bool ok = aligned16(x) && aligned16(y) && (!residual || aligned16(residual)), relu = flags & BN_ACT_RELU;
    if (is_low(g, x))
        WITH_LOW(g, DISPATCH(g, ok, c, Low,
                             (forward_train_as<Low, V>(g, rows, c, CLOW(x), gamma, beta, CLOW(residual), relu,
                                                       LOW(y), save_mean, save_invstd, running_mean, running_var,
                                                       momentum, eps))));
    else
        DISPATCH(g, ok, c, float,
                 (forward_train_as<float, V>(g, rows, c, x, gamma, beta, residual, relu, y, save_mean, save_invstd,
                                             running_mean, running_var, momentum, eps)));
}

void gpu_bn_act_forward_eval(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                             const float *beta, const float *residual, unsigned flags, float *y,
                             const float *running_mean, const float *running_var, float eps) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    bool ok = aligned16(x) && aligned16(y) && (!residual || aligned16(residual)), relu = flags & BN_ACT_RELU;
    if (is_low(g, x))
        WITH_LOW(g, DISPATCH(g, ok, c, Low,
                             (forward_eval_as<Low, V>(g, rows, c, CLOW(x), gamma, beta, CLOW(residual), relu,
                                                      LOW(y), running_mean, running_var, eps))));
    else
        DISPATCH(g, ok, c, float,
                 (forward_eval_as<float, V>(g, rows, c, x, gamma, beta, residual, relu, y, running_mean,
                                            running_var, eps)));
}

void gpu_bn_act_backward(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                         const float *save_mean, const float *save_invstd, const float *y, const float *dy,
                         unsigned flags, float *dx, float *dresidual, float *dgamma, float *dbeta) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    check_channels(c);
    bool ok = aligned16(x) && aligned16(y) && aligned16(dy) && aligned16(dx) && (!dresidual || aligned16(dresidual));
    if (is_low(g, x))
        WITH_LOW(g, DISPATCH(g, ok, c, Low,
                             (backward_as<Low, V>(g, rows, c, CLOW(x), gamma, save_mean, save_invstd, CLOW(y),
                                                  CLOW(dy), flags, LOW(dx), LOW(dresidual), dgamma, dbeta))));
    else
        DISPATCH(g, ok, c, float,
                 (backward_as<float, V>(g, rows, c, x, gamma, save_mean, save_invstd, y, dy, flags, dx, dresidual,
                                        dgamma, dbeta)));
}
