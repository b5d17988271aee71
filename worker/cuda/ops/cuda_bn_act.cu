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

#include "cuda_bn_act_kernels.cuh"

/* ---- dispatch: the type, then the vector width (16 bytes when C and every address allow) ---- */

static bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

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
static void forward_train_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma,
                             const float *beta, const T *res, bool has_relu, T *y, float *save_mean,
                             float *save_invstd, float *running_mean, float *running_var,
                             float momentum, float eps) {
    act_grid a = grid_for(c, V);
    dim3 block(a.bx, a.by);
    unsigned blocks = reduce_blocks(g, rows, c, a);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)blocks * c;
    size_t smem = 2 * sizeof(float) * a.bx * a.by * V;
    act_partials_kernel<T, V><<<blocks, block, smem, g->stream>>>(
        rows, c, a, x, (const T *)NULL, (const T *)NULL, false, NULL, NULL, p1, p2);
    CHECK_CUDA(cudaGetLastError());
    act_stats_kernel<T><<<c, 32, 0, g->stream>>>(c, (int)blocks, rows, x, p1, p2, save_mean,
                                                 save_invstd, running_mean, running_var, momentum,
                                                 eps);
    CHECK_CUDA(cudaGetLastError());
    act_apply_kernel<T, V><<<apply_blocks(g, rows, a), block, 0, g->stream>>>(
        rows, c, a, x, res, has_relu, save_mean, save_invstd, NULL, eps, gamma, beta, y);
    CHECK_CUDA(cudaGetLastError());
}

template <typename T, int V>
static void forward_eval_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma,
                            const float *beta, const T *res, bool has_relu, T *y,
                            const float *running_mean, const float *running_var, float eps) {
    act_grid a = grid_for(c, V);
    act_apply_kernel<T, V><<<apply_blocks(g, rows, a), dim3(a.bx, a.by), 0, g->stream>>>(
        rows, c, a, x, res, has_relu, running_mean, NULL, running_var, eps, gamma, beta, y);
    CHECK_CUDA(cudaGetLastError());
}

template <typename T, int V>
static void backward_as(gpu_t *g, size_t rows, int c, const T *x, const float *gamma,
                        const float *save_mean, const float *save_invstd, const T *y, const T *dy,
                        unsigned flags, T *dx, T *dres, float *dgamma, float *dbeta) {
    act_grid a = grid_for(c, V);
    dim3 block(a.bx, a.by);
    bool has_relu = flags & BN_ACT_RELU;
    unsigned blocks = reduce_blocks(g, rows, c, a);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)blocks * c;
    size_t smem = 2 * sizeof(float) * a.bx * a.by * V;
    act_partials_kernel<T, V><<<blocks, block, smem, g->stream>>>(rows, c, a, x, y, dy, has_relu,
                                                                  save_mean, save_invstd, p1, p2);
    CHECK_CUDA(cudaGetLastError());
    act_coeffs_kernel<<<c, 32, 0, g->stream>>>(c, (int)blocks, rows, p1, p2, gamma, save_invstd,
                                               g->bn_coeffs, dgamma, dbeta);
    CHECK_CUDA(cudaGetLastError());
    act_dx_kernel<T, V><<<apply_blocks(g, rows, a), block, 0, g->stream>>>(
        rows, c, a, x, y, dy, has_relu, save_mean, g->bn_coeffs, flags & BN_ACT_WRITE_DX, dx,
        flags & BN_ACT_WRITE_DRESIDUAL, dres);
    CHECK_CUDA(cudaGetLastError());
}

/* The statistics from per-channel sums of x and of its squares (conv2d_bn_forward's epilogue,
 * fp32), in double as act_stats_kernel finishes its own (shift 0). sum and sqsum may be save_mean
 * and save_invstd themselves: each channel's thread reads both before it writes. */
__global__ void sums_stats_kernel(int c, size_t rows, const float *sum, const float *sqsum,
                                  float *save_mean, float *save_invstd, float *running_mean,
                                  float *running_var, float momentum, float eps) {
    GRID_STRIDE(ch, (size_t)c) {
        double s1 = sum[ch], s2 = sqsum[ch];
        bn_act_stats((double)rows, 0.0f, s1, s2, momentum, eps, &save_mean[ch], &save_invstd[ch],
                     &running_mean[ch], &running_var[ch]);
    }
}

template <typename T, int V>
static void forward_sums_as(gpu_t *g, size_t rows, int c, const T *x, const float *sum,
                            const float *sqsum, const float *gamma, const float *beta, const T *res,
                            bool has_relu, T *y, float *save_mean, float *save_invstd,
                            float *running_mean, float *running_var, float momentum, float eps) {
    act_grid a = grid_for(c, V);
    sums_stats_kernel<<<blocks_for((size_t)c), 256, 0, g->stream>>>(
        c, rows, sum, sqsum, save_mean, save_invstd, running_mean, running_var, momentum, eps);
    CHECK_CUDA(cudaGetLastError());
    act_apply_kernel<T, V><<<apply_blocks(g, rows, a), dim3(a.bx, a.by), 0, g->stream>>>(
        rows, c, a, x, res, has_relu, save_mean, save_invstd, NULL, eps, gamma, beta, y);
    CHECK_CUDA(cudaGetLastError());
}

/* 16-byte vectors when C is a multiple of the width and every tensor is aligned; else one value. */
#define DISPATCH(g, ptrs_aligned, c, T, call)                                                      \
    do {                                                                                           \
        constexpr int vec_ = 16 / (int)sizeof(T);                                                  \
        if ((ptrs_aligned) && (c) % vec_ == 0) {                                                   \
            constexpr int V = vec_;                                                                \
            call;                                                                                  \
        } else {                                                                                   \
            constexpr int V = 1;                                                                   \
            call;                                                                                  \
        }                                                                                          \
    } while (0)

static void check_channels(int c) {
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
}

void gpu_bn_act_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                              const float *gamma, const float *beta, tensor_desc_t residual_d,
                              unsigned flags, tensor_desc_t y_d, float *save_mean,
                              float *save_invstd, float *running_mean, float *running_var,
                              float momentum, float eps) {
    const float *x = (const float *)x_d.data;
    const float *residual = (const float *)residual_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    check_channels(c);
    bool ok = aligned16(x) && aligned16(y) && (!residual || aligned16(residual)),
         relu = flags & BN_ACT_RELU;
    if (is_low(g, x_d))
        WITH_LOW(
            g, DISPATCH(g, ok, c, Low,
                        (forward_train_as<Low, V>(g, rows, c, CLOW(x), gamma, beta, CLOW(residual),
                                                  relu, LOW(y), save_mean, save_invstd,
                                                  running_mean, running_var, momentum, eps))));
    else
        DISPATCH(
            g, ok, c, float,
            (forward_train_as<float, V>(g, rows, c, x, gamma, beta, residual, relu, y, save_mean,
                                        save_invstd, running_mean, running_var, momentum, eps)));
}

void gpu_bn_act_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                             const float *gamma, const float *beta, tensor_desc_t residual_d,
                             unsigned flags, tensor_desc_t y_d, const float *running_mean,
                             const float *running_var, float eps) {
    const float *x = (const float *)x_d.data;
    const float *residual = (const float *)residual_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    bool ok = aligned16(x) && aligned16(y) && (!residual || aligned16(residual)),
         relu = flags & BN_ACT_RELU;
    if (is_low(g, x_d))
        WITH_LOW(g,
                 DISPATCH(g, ok, c, Low,
                          (forward_eval_as<Low, V>(g, rows, c, CLOW(x), gamma, beta, CLOW(residual),
                                                   relu, LOW(y), running_mean, running_var, eps))));
    else
        DISPATCH(g, ok, c, float,
                 (forward_eval_as<float, V>(g, rows, c, x, gamma, beta, residual, relu, y,
                                            running_mean, running_var, eps)));
}

void gpu_bn_act_backward(backend_t *b, size_t rows, int c, tensor_desc_t x_d, const float *gamma,
                         const float *save_mean, const float *save_invstd, tensor_desc_t y_d,
                         tensor_desc_t dy_d, unsigned flags, tensor_desc_t dx_d,
                         tensor_desc_t dresidual_d, float *dgamma, float *dbeta) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    float *dresidual = (float *)dresidual_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    check_channels(c);
    bool ok = aligned16(x) && aligned16(y) && aligned16(dy) && aligned16(dx) &&
              (!dresidual || aligned16(dresidual));
    if (is_low(g, x_d))
        WITH_LOW(g, DISPATCH(g, ok, c, Low,
                             (backward_as<Low, V>(g, rows, c, CLOW(x), gamma, save_mean,
                                                  save_invstd, CLOW(y), CLOW(dy), flags, LOW(dx),
                                                  LOW(dresidual), dgamma, dbeta))));
    else
        DISPATCH(g, ok, c, float,
                 (backward_as<float, V>(g, rows, c, x, gamma, save_mean, save_invstd, y, dy, flags,
                                        dx, dresidual, dgamma, dbeta)));
}

void gpu_bn_act_forward_train_sums(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                                   const float *sum, const float *sqsum, const float *gamma,
                                   const float *beta, tensor_desc_t residual_d, unsigned flags,
                                   tensor_desc_t y_d, float *save_mean, float *save_invstd,
                                   float *running_mean, float *running_var, float momentum,
                                   float eps) {
    const float *x = (const float *)x_d.data;
    const float *residual = (const float *)residual_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    check_channels(c);
    bool ok = aligned16(x) && aligned16(y) && (!residual || aligned16(residual)),
         relu = flags & BN_ACT_RELU;
    if (is_low(g, x_d))
        WITH_LOW(g, DISPATCH(g, ok, c, Low,
                             (forward_sums_as<Low, V>(g, rows, c, CLOW(x), sum, sqsum, gamma, beta,
                                                      CLOW(residual), relu, LOW(y), save_mean,
                                                      save_invstd, running_mean, running_var,
                                                      momentum, eps))));
    else
        DISPATCH(g, ok, c, float,
                 (forward_sums_as<float, V>(g, rows, c, x, sum, sqsum, gamma, beta, residual, relu,
                                            y, save_mean, save_invstd, running_mean, running_var,
                                            momentum, eps)));
}
