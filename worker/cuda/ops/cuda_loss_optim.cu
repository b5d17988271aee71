/* cuda_loss_optim: softmax cross-entropy, the fused SGD and Adam passes, loss scaling. */
#include "cuda_common.cuh"

/* ---- loss: one thread per sample (class counts here are small) ---- */

template <typename T>
__global__ void softmax_xent_kernel(int n, int k, const T *logits, const int32_t *labels,
                                    float smoothing, float grad_scale, const loss_scale_t *ls,
                                    T *dlogits, float *loss_sum) {
    double d_scale = (double)grad_scale * (ls ? ls->scale : 1.0f);
    GRID_STRIDE(i, (size_t)n) {
        const T *z = logits + i * k;
        float zmax = ld(z, 0);
        for (int j = 1; j < k; j++)
            zmax = fmaxf(zmax, ld(z, j));
        double sum_exp = 0, sum_z = 0;
        for (int j = 0; j < k; j++) {
            sum_exp += exp((double)ld(z, j) - zmax);
            sum_z += ld(z, j);
        }
        double log_sum = log(sum_exp) + zmax, off = (double)smoothing / k;
        int label = labels[i];
        atomicAdd(loss_sum, (float)((1.0 - smoothing) * (log_sum - ld(z, label)) +
                                    off * (k * log_sum - sum_z)));
        if (!dlogits) continue;
        for (int j = 0; j < k; j++) {
            double q = j == label ? 1.0 - smoothing + off : off;
            st(dlogits, i * k + j, (float)((exp((double)ld(z, j) - log_sum) - q) * d_scale / n));
        }
    }
}

void gpu_softmax_xent(backend_t *b, int n, int k, tensor_desc_t logits_d, const int32_t *labels,
                      float smoothing, float grad_scale, const loss_scale_t *ls,
                      tensor_desc_t dlogits_d, float *loss_sum) {
    const float *logits = (const float *)logits_d.data;
    float *dlogits = (float *)dlogits_d.data;
    if (!n) return;
    if (is_low(gpu_of(b), logits_d))
        WITH_LOW(gpu_of(b), LAUNCH(softmax_xent_kernel<Low>, (size_t)n, n, k, CLOW(logits), labels,
                                   smoothing, grad_scale, ls, LOW(dlogits), loss_sum));
    else
        LAUNCH(softmax_xent_kernel<float>, (size_t)n, n, k, logits, labels, smoothing, grad_scale,
               ls, dlogits, loss_sum);
}

/* ---- optimizer: one fused pass over the arenas ---- */

__global__ void sgd_kernel(float *p, const float *grads, float *m, size_t n, float lr,
                           float momentum, float wd, bool is_nesterov, float grad_scale,
                           const loss_scale_t *ls) {
    if (ls && ls->found_inf) return; /* GradScaler's skipped step */
    if (ls) grad_scale /= ls->scale;
    GRID_STRIDE(i, n) {
        float g = grads[i] * grad_scale + wd * p[i];
        float v = momentum * m[i] + g;
        m[i] = v;
        p[i] -= lr * (is_nesterov ? g + momentum * v : v);
    }
}

void gpu_sgd_step(backend_t *b, float *params, const float *grads, float *momentum_buf, size_t n,
                  float lr, float momentum, float weight_decay, bool is_nesterov, float grad_scale,
                  const loss_scale_t *ls) {
    if (n)
        LAUNCH(sgd_kernel, n, params, grads, momentum_buf, n, lr, momentum, weight_decay,
               is_nesterov, grad_scale, ls);
}

/* Adam: one thread counts the step and derives its bias corrections (adam_count_next), then the
 * fused pass reads them from the count, so the host never reads the count back. */
__global__ void adam_count_kernel(adam_count_t *count, adam_hparams_t h, const loss_scale_t *ls) {
    adam_count_next(count, &h, ls);
}

__global__ void adam_kernel(float *p, const float *grads, float *m, float *v, size_t n,
                            adam_scalars_t s, float grad_scale, const loss_scale_t *ls,
                            const adam_count_t *count) {
    if (ls && ls->found_inf) return; /* GradScaler's skipped step: the count did not move either */
    if (ls) grad_scale /= ls->scale;
    const adam_count_t c = *count;
    GRID_STRIDE(i, n) adam_update(&p[i], &m[i], &v[i], grads[i] * grad_scale, &c, &s);
}

void gpu_adam_step(backend_t *b, float *params, const float *grads, float *exp_avg,
                   float *exp_avg_sq, size_t n, const adam_hparams_t *h, float grad_scale,
                   const loss_scale_t *ls, adam_count_t *count) {
    adam_count_kernel<<<1, 1, 0, gpu_of(b)->stream>>>(count, *h, ls);
    CHECK_CUDA(cudaGetLastError());
    if (n)
        LAUNCH(adam_kernel, n, params, grads, exp_avg, exp_avg_sq, n, adam_scalars(h), grad_scale,
               ls, count);
}

/* Every thread that sees an inf or a NaN stores the same 1: the race is harmless. */
__global__ void nonfinite_kernel(const float *x, size_t n, loss_scale_t *ls) {
    bool is_bad = false;
    GRID_STRIDE(i, n) is_bad |= !isfinite(x[i]);
    if (__any_sync(0xffffffffu, is_bad) && (threadIdx.x & 31) == 0) ls->found_inf = 1;
}

__global__ void loss_scale_update_kernel(loss_scale_t *ls, uint32_t growth_interval) {
    loss_scale_next(ls, growth_interval);
}

void gpu_loss_scale_check(backend_t *b, const float *x, size_t n, loss_scale_t *ls) {
    if (n) LAUNCH(nonfinite_kernel, n, x, n, ls);
}

void gpu_loss_scale_update(backend_t *b, loss_scale_t *ls, uint32_t growth_interval) {
    loss_scale_update_kernel<<<1, 1, 0, gpu_of(b)->stream>>>(ls, growth_interval);
}
