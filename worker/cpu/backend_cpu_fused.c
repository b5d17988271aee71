/* backend_cpu_fused: the cpu backend's reference for the fused batch norm + residual add + ReLU
 * (backend_i.bn_act_*), written as the unfused ops it replaces so that it gives their very bits:
 * the forward is batch norm into y, then y + residual, then ReLU, in place; the backward folds
 * the ReLU's mask and the add's fan-out into batch norm's backward (cpu_batchnorm_backward's
 * arithmetic and summation order, on dz = the masked dy). Same OpenMP rules as backend_cpu.c. */
#include "backend.h"
#include "backend_cpu_internal.h"
#include "bn_act.h"

#include <stdint.h>
#include <string.h>

/* y = act(y + residual) in place: add_forward then relu_forward, element by element */
static void add_act(size_t n, const float *residual, unsigned flags, float *y) {
    if (!residual && !(flags & BN_ACT_RELU)) return;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++) {
        float v = residual ? y[i] + residual[i] : y[i];
        y[i] = flags & BN_ACT_RELU ? (v > 0.0f ? v : 0.0f) : v;
    }
}

void backend_cpu__bn_act_forward_train(backend_t *b, size_t rows, int c, const float *x,
                                       const float *gamma, const float *beta, const float *residual,
                                       unsigned flags, float *y, float *save_mean,
                                       float *save_invstd, float *running_mean, float *running_var,
                                       float momentum, float eps) {
    size_t n = rows * (size_t)c;
    b->ops->batchnorm_forward_train(b, rows, c, tensor_f32(x, n), gamma, beta, tensor_f32(y, n),
                                    save_mean, save_invstd, running_mean, running_var, momentum,
                                    eps);
    add_act(rows * (size_t)c, residual, flags, y);
}

void backend_cpu__bn_act_forward_eval(backend_t *b, size_t rows, int c, const float *x,
                                      const float *gamma, const float *beta, const float *residual,
                                      unsigned flags, float *y, const float *running_mean,
                                      const float *running_var, float eps) {
    size_t n = rows * (size_t)c;
    b->ops->batchnorm_forward_eval(b, rows, c, tensor_f32(x, n), gamma, beta, tensor_f32(y, n),
                                   running_mean, running_var, eps);
    add_act(rows * (size_t)c, residual, flags, y);
}

void backend_cpu__bn_act_backward(backend_t *b, size_t rows, int c, const float *x,
                                  const float *gamma, const float *save_mean,
                                  const float *save_invstd, const float *y, const float *dy,
                                  unsigned flags, float *dx, float *dresidual, float *dgamma,
                                  float *dbeta) {
    /* per channel: two double sums, then three float coefficients (the model reserves room) */
    double *sum_dy =
        backend_cpu__workspace(b, (2 * sizeof(double) + 3 * sizeof(float)) * (size_t)c);
    double *sum_dy_xhat = sum_dy + c;
    bool has_relu = flags & BN_ACT_RELU;
#pragma omp parallel
    {
        FOR_CHANNEL_BLOCK(c, j0, j1)
        /* BN_SUM_BLOCK channels at a time in local sums, which gcc vectorizes (the workspace's
         * could alias the inputs); each channel still sums its rows in order */
        for (int jb = j0; jb < j1; jb += BN_SUM_BLOCK) {
            int nb = j1 - jb < BN_SUM_BLOCK ? j1 - jb : BN_SUM_BLOCK;
            double s_dz[BN_SUM_BLOCK] = {0}, s_dz_xhat[BN_SUM_BLOCK] = {0};
            for (size_t i = 0; i < rows; i++) {
                size_t at = i * (size_t)c + (size_t)jb;
                const float *xi = x + at, *yi = y + at, *dyi = dy + at, *m = save_mean + jb,
                            *is = save_invstd + jb;
                /* bn_act_masked, one loop per case and as a bit mask (+0.0f where y <= 0, the
                 * same bits): gcc left the selects scalar */
                if (has_relu) {
                    for (int j = 0; j < nb; j++) {
                        uint32_t bits;
                        float dz;
                        memcpy(&bits, &dyi[j], sizeof bits);
                        bits &= 0u - (uint32_t)(yi[j] > 0.0f);
                        memcpy(&dz, &bits, sizeof dz);
                        s_dz[j] += dz;
                        s_dz_xhat[j] += (double)dz * (xi[j] - m[j]) * is[j];
                    }
                } else {
                    for (int j = 0; j < nb; j++) {
                        s_dz[j] += dyi[j];
                        s_dz_xhat[j] += (double)dyi[j] * (xi[j] - m[j]) * is[j];
                    }
                }
            }
            for (int j = 0; j < nb; j++) {
                sum_dy[jb + j] = s_dz[j];
                sum_dy_xhat[jb + j] = s_dz_xhat[j];
            }
        }
    }
    /* dx = gamma * invstd / M * (M dz - sum(dz) - xhat sum(dz xhat)), as cpu_batchnorm_backward */
    float *k_dy = (float *)(sum_dy_xhat + c), *k_x = k_dy + c, *k_0 = k_x + c;
    for (int j = 0; j < c; j++) {
        dgamma[j] += (float)sum_dy_xhat[j];
        dbeta[j] += (float)sum_dy[j];
        bn_act_coeffs(gamma[j], save_invstd[j], sum_dy[j], sum_dy_xhat[j], (double)rows, &k_dy[j],
                      &k_x[j], &k_0[j]);
    }
    bool is_dx_written = flags & BN_ACT_WRITE_DX, is_dres_written = flags & BN_ACT_WRITE_DRESIDUAL;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < rows; i++) {
        const float *xi = x + i * (size_t)c, *yi = y + i * (size_t)c, *dyi = dy + i * (size_t)c;
        float *dxi = dx + i * (size_t)c, *dri = dresidual ? dresidual + i * (size_t)c : NULL;
        for (int j = 0; j < c; j++) {
            float dz = bn_act_masked(yi[j], dyi[j], has_relu);
            float v = bn_act_dx(k_dy[j], k_x[j], k_0[j], dz, xi[j], save_mean[j]);
            dxi[j] = is_dx_written ? v : dxi[j] + v;
            if (dri) dri[j] = is_dres_written ? dz : dri[j] + dz;
        }
    }
}
