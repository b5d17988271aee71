/* cuda_bn_act_kernels: the kernels of cuda_bn_act.cu (see there), in a header so that they also
 * compile as host C++ for tests/unit/test_cuda_bn_act_emulated.cpp, which runs them on CPU threads
 * (a barrier for __syncthreads, an exchange for the shuffles) against a reference: the kernels'
 * indexing and reductions are checked where no GPU is. Needs bf16 / f16 (cuda_common.cuh's
 * typedefs), bn_act.h, and BN_ACT_SHARED_FLOATS(name): the block's dynamic shared memory as
 * `float name[]`. */
#ifndef DDP_WORKER_CUDA_BN_ACT_KERNELS_CUH
#define DDP_WORKER_CUDA_BN_ACT_KERNELS_CUH

#ifndef BN_ACT_SHARED_FLOATS
#define BN_ACT_SHARED_FLOATS(name) extern __shared__ float name[]
#endif

#define ACT_THREADS 256

/* ---- vectors of V values of T in registers as floats ---- */

template <typename T> static __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(float v) {
    return v;
}
template <> __device__ __forceinline__ float to_f(bf16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_f(f16 v) {
    return __half2float(v);
}
template <typename T> static __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f(float v) {
    return v;
}
template <> __device__ __forceinline__ bf16 from_f(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ f16 from_f(float v) {
    return __float2half(v);
}

/* V values at p (16-byte aligned when V * sizeof(T) == 16): one 16-byte access, its bits moved
 * with memcpy (registers on the GPU; no type punning for an optimizer to exploit) */
template <typename T, int V> static __device__ __forceinline__ void load(const T *p, float *out) {
    if constexpr (V * sizeof(T) == 16) {
        uint4 u = *reinterpret_cast<const uint4 *>(p);
        T t[V];
        memcpy(t, &u, sizeof u);
#pragma unroll
        for (int i = 0; i < V; i++)
            out[i] = to_f(t[i]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++)
            out[i] = to_f(p[i]);
    }
}

template <typename T, int V> static __device__ __forceinline__ void store(T *p, const float *in) {
    if constexpr (V * sizeof(T) == 16) {
        T t[V];
#pragma unroll
        for (int i = 0; i < V; i++)
            t[i] = from_f<T>(in[i]);
        uint4 u;
        memcpy(&u, t, sizeof u);
        *reinterpret_cast<uint4 *>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < V; i++)
            p[i] = from_f<T>(in[i]);
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
__global__ void act_partials_kernel(size_t rows, int c, act_grid a, const T *x, const T *y,
                                    const T *dy, bool has_relu, const float *mean,
                                    const float *invstd, float *partial, float *partial2) {
    BN_ACT_SHARED_FLOATS(smem); /* by x bx x V, twice */
    float *s1 = smem, *s2 = smem + (size_t)a.by * a.bx * V;
    for (int j0 = 0; j0 < a.cv; j0 += a.bx) {
        int j = j0 + threadIdx.x;
        bool is_valid = j < a.cv;
        float acc1[V], acc2[V], shift[V], is[V];
#pragma unroll
        for (int i = 0; i < V; i++)
            acc1[i] = acc2[i] = shift[i] = is[i] = 0.0f;
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
            for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows;
                 r += (size_t)gridDim.x * a.by) {
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

static __device__ void sum_blocks(int c, int blocks, const float *partial, const float *partial2,
                                  double *a, double *b) {
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
                                 const float *partial2, float *mean, float *invstd,
                                 float *running_mean, float *running_var, float momentum,
                                 float eps) {
    double s1, s2;
    sum_blocks(c, blocks, partial, partial2, &s1, &s2);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    bn_act_stats((double)rows, to_f(x[ch]), s1, s2, momentum, eps, &mean[ch], &invstd[ch],
                 &running_mean[ch], &running_var[ch]);
}

/* coeffs: k_dy, k_x, k_0 (c each) */
__global__ void act_coeffs_kernel(int c, int blocks, size_t rows, const float *partial,
                                  const float *partial2, const float *gamma, const float *invstd,
                                  float *coeffs, float *dgamma, float *dbeta) {
    double sum_dz, sum_dz_xhat;
    sum_blocks(c, blocks, partial, partial2, &sum_dz, &sum_dz_xhat);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    dgamma[ch] += (float)sum_dz_xhat;
    dbeta[ch] += (float)sum_dz;
    bn_act_coeffs(gamma[ch], invstd[ch], sum_dz, sum_dz_xhat, (double)rows, &coeffs[ch],
                  &coeffs[c + ch], &coeffs[2 * c + ch]);
}

/* ---- pass 2 ---- */

/* y = act(batchnorm(x) + residual): train with invstd, eval with var (invstd NULL) */
template <typename T, int V>
__global__ void act_apply_kernel(size_t rows, int c, act_grid a, const T *x, const T *res,
                                 bool has_relu, const float *mean, const float *invstd,
                                 const float *var, float eps, const float *gamma, const float *beta,
                                 T *y) {
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
        for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows;
             r += (size_t)gridDim.x * a.by) {
            size_t at = r * c + (size_t)j * V;
            float xv[V], rv[V], out[V];
            load<T, V>(x + at, xv);
            if (res) load<T, V>(res + at, rv);
#pragma unroll
            for (int i = 0; i < V; i++)
                out[i] = bn_act_value(xv[i], mu[i], mul[i], be[i], res ? rv[i] : 0.0f, res != NULL,
                                      has_relu);
            store<T, V>(y + at, out);
        }
    }
}

/* dx (=|+=) k_dy dz + k_x (x - mean) + k_0; dres (=|+=) dz */
template <typename T, int V>
__global__ void act_dx_kernel(size_t rows, int c, act_grid a, const T *x, const T *y, const T *dy,
                              bool has_relu, const float *mean, const float *coeffs,
                              bool is_dx_written, T *dx, bool is_dres_written, T *dres) {
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
        for (size_t r = (size_t)blockIdx.x * a.by + threadIdx.y; r < rows;
             r += (size_t)gridDim.x * a.by) {
            size_t at = r * c + (size_t)j * V;
            float xv[V], yv[V], dyv[V], dz[V], out[V], old[V];
            load<T, V>(x + at, xv);
            load<T, V>(dy + at, dyv);
            if (has_relu) load<T, V>(y + at, yv);
#pragma unroll
            for (int i = 0; i < V; i++)
                dz[i] = bn_act_masked(has_relu ? yv[i] : 1.0f, dyv[i], has_relu);
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
                for (int i = 0; i < V; i++)
                    dz[i] += old[i];
            }
            store<T, V>(dres + at, dz);
        }
    }
}

#endif
