/* bn_act: the per-value and per-channel arithmetic of batch norm + residual add + ReLU
 * (backend_i.bn_act_*), one source that the cuda kernels compile and the host tests run, as
 * adam.h and dropout.h are. The cpu backend's reference (cpu/backend_cpu_fused.c) is written as the
 * unfused ops and gives these values bit for bit on the host (no FMA contraction there; nvcc
 * contracts multiply-adds, so the GPU's values differ in the last bits).
 * Pure functions, no allocation; any thread. */
#ifndef DDP_WORKER_BN_ACT_H
#define DDP_WORKER_BN_ACT_H

#include <math.h>
#include <stdbool.h>

#ifdef __CUDACC__
#define BN_ACT_FN __host__ __device__ static inline
#else
#define BN_ACT_FN static inline
#endif

/* The forward of one value: batch norm as mul = invstd * gamma (train) or gamma / sqrt(var + eps)
 * (eval), plus the residual (when has_residual), then ReLU (when has_relu; NaN -> 0, as relu's
 * x > 0 ? x : 0). */
BN_ACT_FN float bn_act_value(float x, float mean, float mul, float beta, float residual,
                             bool has_residual, bool has_relu) {
    float v = (x - mean) * mul + beta;
    if (has_residual) v = v + residual;
    return has_relu ? (v > 0.0f ? v : 0.0f) : v;
}

/* The ReLU's backward of one value: dy where the output y is positive. */
BN_ACT_FN float bn_act_masked(float y, float dy, bool has_relu) {
    return !has_relu || y > 0.0f ? dy : 0.0f;
}

/* One channel's statistics from one pass over its n values: s1 = sum(x - shift), s2 =
 * sum((x - shift)^2), shift being one of its values (close to the mean, so no cancellation).
 * mean and 1/sqrt(biased var + eps) for the forward and backward; the running estimates move by
 * momentum towards the mean and the unbiased variance, as PyTorch's. */
BN_ACT_FN void bn_act_stats(double n, float shift, double s1, double s2, float momentum, float eps,
                            float *mean, float *invstd, float *running_mean, float *running_var) {
    double shifted_mean = s1 / n, var = s2 / n - shifted_mean * shifted_mean;
    var = var > 0 ? var : 0;
    double mu = (double)shift + shifted_mean, unbiased = n > 1 ? var * n / (n - 1) : var;
    *mean = (float)mu;
    *invstd = (float)(1.0 / sqrt(var + (double)eps));
    *running_mean = (float)((1.0 - momentum) * *running_mean + momentum * mu);
    *running_var = (float)((1.0 - momentum) * *running_var + momentum * unbiased);
}

/* One channel's backward coefficients from the sums of dz and dz * xhat over its n rows:
 * dx = gamma * invstd / n * (n dz - sum(dz) - xhat sum(dz xhat)) = k_dy dz + k_x (x - mean) + k_0
 * (x - mean first, as in the forward). The cpu backend's batchnorm_backward, term for term. */
BN_ACT_FN void bn_act_coeffs(float gamma, float invstd, double sum_dz, double sum_dz_xhat, double n,
                             float *k_dy, float *k_x, float *k_0) {
    double scale = gamma * invstd / n;
    *k_dy = (float)(scale * n);
    *k_x = (float)(-scale * sum_dz_xhat * invstd);
    *k_0 = (float)(-scale * sum_dz);
}

BN_ACT_FN float bn_act_dx(float k_dy, float k_x, float k_0, float dz, float x, float mean) {
    return k_dy * dz + k_x * (x - mean) + k_0;
}

#endif
