/* backend_cpu: the reference backend. fp32, NHWC, host memory. Where the build has oneDNN
 * (cpu_dnnl.h; DDP_CPU_ONEDNN=0 turns it off) its primitives take the ops it has; the plain path
 * below stays for the rest and for builds without it: convolutions as im2col + SGEMM, linear
 * layers SGEMM through OpenBLAS, everything else loops written to be read and checked (tests hold
 * every op against finite differences, and the CUDA backend against these). Reductions accumulate
 * in double. Loops run on OpenMP threads, split so that no result depends on the thread count (a
 * channel's sum always runs over the rows in order); GEMMs on OpenBLAS's. oneDNN's kernels split
 * some sums by thread, so with oneDNN a run repeats bit for bit at the same train.threads only. */
#include "backend.h"
#include "backend_cpu_internal.h"
#include "cpu_dnnl.h"

#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    backend_t base;
    float *workspace; /* im2col columns of one image */
    size_t workspace_bytes;
    cpu_dnnl_t *dnnl; /* oneDNN's primitives (cpu_dnnl.h), or NULL: im2col and the plain loops */
} cpu_t;

void openblas_set_num_threads(int num_threads); /* not in every cblas.h */

static cpu_t *cpu_of(backend_t *b) {
    return (cpu_t *)b;
}

static void *cpu_alloc(backend_t *b, size_t n_bytes) {
    (void)b;
    return calloc(1, n_bytes ? n_bytes : 1);
}

static void cpu_release(backend_t *b, void *p) {
    (void)b;
    free(p);
}

static bool cpu_is_device(backend_t *b, const void *p) {
    (void)b, (void)p;
    return false;
}

static int cpu_reserve_workspace(backend_t *b, size_t n_bytes) {
    cpu_t *c = cpu_of(b);
    if (n_bytes <= c->workspace_bytes) return 0;
    float *w = realloc(c->workspace, n_bytes);
    if (!w) return -ENOMEM;
    c->workspace = w;
    c->workspace_bytes = n_bytes;
    return 0;
}

void *backend_cpu__workspace(backend_t *b, size_t n_bytes) {
    cpu_t *c = cpu_of(b);
    if (n_bytes > c->workspace_bytes) {
        fprintf(stderr, "ddpworker: %s:%d: cpu workspace of %zu bytes, %zu needed\n", __FILE__,
                __LINE__, c->workspace_bytes, n_bytes);
        abort();
    }
    return c->workspace;
}

static void cpu_copy(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    (void)b;
    if (n_bytes) memcpy(dst, src, n_bytes);
}

static void cpu_fill(backend_t *b, float *x, float value, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        x[i] = value;
}

static void cpu_scale(backend_t *b, float *x, float factor, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        x[i] *= factor;
}

/* ---- convolution: per image, columns (OH*OW, R*S*C) then one GEMM ---- */

static bool conv_is_pointwise(const conv_shape_t *s) {
    return s->r == 1 && s->s == 1 && s->stride == 1 && s->pad == 0;
}

/* col[(oy*OW + ox), (ky*S + kx)*C + ci] = x[iy, ix, ci] or 0 outside the image */
static void im2col(const conv_shape_t *s, const float *x, float *col) {
    size_t row_len = (size_t)s->r * s->s * s->c;
    for (int oy = 0; oy < s->oh; oy++) {
        for (int ox = 0; ox < s->ow; ox++) {
            float *dst = col + ((size_t)oy * s->ow + ox) * row_len;
            for (int ky = 0; ky < s->r; ky++) {
                int iy = oy * s->stride - s->pad + ky;
                for (int kx = 0; kx < s->s; kx++, dst += s->c) {
                    int ix = ox * s->stride - s->pad + kx;
                    if (iy < 0 || iy >= s->h || ix < 0 || ix >= s->w) {
                        memset(dst, 0, sizeof(float) * (size_t)s->c);
                    } else {
                        memcpy(dst, x + ((size_t)iy * s->w + ix) * s->c,
                               sizeof(float) * (size_t)s->c);
                    }
                }
            }
        }
    }
}

/* The adjoint of im2col: dx[iy, ix, ci] += col[...] */
static void col2im_add(const conv_shape_t *s, const float *col, float *dx) {
    size_t row_len = (size_t)s->r * s->s * s->c;
    for (int oy = 0; oy < s->oh; oy++) {
        for (int ox = 0; ox < s->ow; ox++) {
            const float *src = col + ((size_t)oy * s->ow + ox) * row_len;
            for (int ky = 0; ky < s->r; ky++) {
                int iy = oy * s->stride - s->pad + ky;
                for (int kx = 0; kx < s->s; kx++, src += s->c) {
                    int ix = ox * s->stride - s->pad + kx;
                    if (iy < 0 || iy >= s->h || ix < 0 || ix >= s->w) continue;
                    float *d = dx + ((size_t)iy * s->w + ix) * s->c;
                    for (int ci = 0; ci < s->c; ci++)
                        d[ci] += src[ci];
                }
            }
        }
    }
}

/* Images per GEMM: as many as the workspace holds columns for (bigger GEMMs run faster). */
static int conv_chunk(const cpu_t *c, const conv_shape_t *s) {
    size_t per_image = sizeof(float) * (size_t)s->oh * s->ow * s->r * s->s * s->c;
    size_t fit = per_image ? c->workspace_bytes / per_image : 1;
    return fit < 1 ? 1 : fit > (size_t)s->n ? s->n : (int)fit;
}

static void cpu_conv2d_forward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                               float *y) {
    cpu_t *c = cpu_of(b);
    if (c->dnnl && cpu_dnnl_conv_forward(c->dnnl, s, x, w, y) == 0) return;
    int rsc = s->r * s->s * s->c, p = s->oh * s->ow;
    size_t in_image = (size_t)s->h * s->w * s->c, col_image = (size_t)p * rsc;
    if (conv_is_pointwise(s)) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->n * p, s->k, rsc, 1.0f, x, rsc, w,
                    rsc, 0.0f, y, s->k);
        return;
    }
    int chunk = conv_chunk(c, s);
    for (int i = 0; i < s->n; i += chunk) {
        int m = s->n - i < chunk ? s->n - i : chunk;
#pragma omp parallel for schedule(static)
        for (int j = 0; j < m; j++)
            im2col(s, x + (size_t)(i + j) * in_image, c->workspace + j * col_image);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m * p, s->k, rsc, 1.0f, c->workspace,
                    rsc, w, rsc, 0.0f, y + (size_t)i * p * s->k, s->k);
    }
}

static void cpu_conv2d_backward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                                const float *dy, float *dx, float *dw) {
    cpu_t *c = cpu_of(b);
    if (c->dnnl && cpu_dnnl_conv_backward(c->dnnl, s, x, w, dy, dx, dw) == 0) return;
    int rsc = s->r * s->s * s->c, p = s->oh * s->ow;
    size_t in_image = (size_t)s->h * s->w * s->c, col_image = (size_t)p * rsc;
    if (conv_is_pointwise(s)) {
        int m = s->n * p;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s->k, rsc, m, 1.0f, dy, s->k, x, rsc,
                    1.0f, dw, rsc);
        if (dx)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rsc, s->k, 1.0f, dy, s->k, w,
                        rsc, s->is_dx_written ? 0.0f : 1.0f, dx, rsc);
        return;
    }
    int chunk = conv_chunk(c, s);
    for (int i = 0; i < s->n; i += chunk) {
        int m = s->n - i < chunk ? s->n - i : chunk;
        const float *dyi = dy + (size_t)i * p * s->k;
#pragma omp parallel for schedule(static)
        for (int j = 0; j < m; j++)
            im2col(s, x + (size_t)(i + j) * in_image, c->workspace + j * col_image);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s->k, rsc, m * p, 1.0f, dyi, s->k,
                    c->workspace, rsc, 1.0f, dw, rsc);
        if (!dx) continue;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m * p, rsc, s->k, 1.0f, dyi, s->k, w,
                    rsc, 0.0f, c->workspace, rsc);
#pragma omp parallel for schedule(static)
        for (int j = 0; j < m; j++) {
            float *dxj = dx + (size_t)(i + j) * in_image;
            if (s->is_dx_written) memset(dxj, 0, sizeof(float) * in_image);
            col2im_add(s, c->workspace + j * col_image, dxj);
        }
    }
}

/* ---- batch norm over rows = N*H*W, channels innermost ---- */

static void cpu_batchnorm_forward_train(backend_t *b, size_t rows, int c, const float *x,
                                        const float *gamma, const float *beta, float *y,
                                        float *save_mean, float *save_invstd, float *running_mean,
                                        float *running_var, float momentum, float eps) {
    cpu_t *cb = cpu_of(b);
    double *sum = (double *)cb->workspace, *sq = sum + c;
#pragma omp parallel
    {
        FOR_CHANNEL_BLOCK(c, j0, j1)
        /* restrict: vectorized over the channels (backend_cpu_fused.c says why) */
        double *restrict s1 = sum, *restrict s2 = sq;
        for (int j = j0; j < j1; j++)
            s1[j] = s2[j] = 0;
        for (size_t i = 0; i < rows; i++) {
            const float *xi = x + i * (size_t)c;
            for (int j = j0; j < j1; j++)
                s1[j] += xi[j];
        }
        for (int j = j0; j < j1; j++)
            s1[j] /= (double)rows;
        for (size_t i = 0; i < rows; i++) {
            const float *xi = x + i * (size_t)c;
            for (int j = j0; j < j1; j++) {
                double d = xi[j] - s1[j];
                s2[j] += d * d;
            }
        }
    }
    for (int j = 0; j < c; j++) {
        double var = sq[j] / (double)rows;
        save_mean[j] = (float)sum[j];
        save_invstd[j] = (float)(1.0 / sqrt(var + eps));
        double unbiased = rows > 1 ? sq[j] / (double)(rows - 1) : var;
        running_mean[j] = (float)((1.0 - momentum) * running_mean[j] + momentum * sum[j]);
        running_var[j] = (float)((1.0 - momentum) * running_var[j] + momentum * unbiased);
    }
    /* (x - mean) first: folding the mean into the offset (x * mul + beta - mean * mul) cancels
     * catastrophically when a channel's mean is large next to its spread */
    float *mul = (float *)(sq + c);
    for (int j = 0; j < c; j++)
        mul[j] = save_invstd[j] * gamma[j];
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < rows; i++) {
        const float *xi = x + i * (size_t)c;
        float *yi = y + i * (size_t)c;
        for (int j = 0; j < c; j++)
            yi[j] = (xi[j] - save_mean[j]) * mul[j] + beta[j];
    }
}

static void cpu_batchnorm_forward_eval(backend_t *b, size_t rows, int c, const float *x,
                                       const float *gamma, const float *beta, float *y,
                                       const float *running_mean, const float *running_var,
                                       float eps) {
    cpu_t *cb = cpu_of(b);
    float *mul = cb->workspace;
    for (int j = 0; j < c; j++)
        mul[j] = gamma[j] / sqrtf(running_var[j] + eps);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < rows; i++) {
        const float *xi = x + i * (size_t)c;
        float *yi = y + i * (size_t)c;
        for (int j = 0; j < c; j++)
            yi[j] = (xi[j] - running_mean[j]) * mul[j] + beta[j];
    }
}

static void cpu_batchnorm_backward(backend_t *b, size_t rows, int c, const float *x,
                                   const float *gamma, const float *save_mean,
                                   const float *save_invstd, const float *dy, float *dx,
                                   float *dgamma, float *dbeta) {
    cpu_t *cb = cpu_of(b);
    double *sum_dy = (double *)cb->workspace, *sum_dy_xhat = sum_dy + c;
#pragma omp parallel
    {
        FOR_CHANNEL_BLOCK(c, j0, j1)
        double *restrict s_dy = sum_dy, *restrict s_dy_xhat =
                                            sum_dy_xhat; /* vectorized, as above */
        for (int j = j0; j < j1; j++)
            s_dy[j] = s_dy_xhat[j] = 0;
        for (size_t i = 0; i < rows; i++) {
            const float *xi = x + i * (size_t)c, *dyi = dy + i * (size_t)c;
            for (int j = j0; j < j1; j++) {
                s_dy[j] += dyi[j];
                s_dy_xhat[j] += (double)dyi[j] * (xi[j] - save_mean[j]) * save_invstd[j];
            }
        }
    }
    /* dx = gamma * invstd / M * (M dy - sum(dy) - xhat sum(dy xhat)), per channel:
     * dx += k_dy * dy + k_x * (x - mean) + k_0 (x - mean first, as in the forward) */
    float *k_dy = (float *)(sum_dy_xhat + c), *k_x = k_dy + c, *k_0 = k_x + c;
    double m = (double)rows;
    for (int j = 0; j < c; j++) {
        dgamma[j] += (float)sum_dy_xhat[j];
        dbeta[j] += (float)sum_dy[j];
        double scale = gamma[j] * save_invstd[j] / m;
        k_dy[j] = (float)(scale * m);
        k_x[j] = (float)(-scale * sum_dy_xhat[j] * save_invstd[j]);
        k_0[j] = (float)(-scale * sum_dy[j]);
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < rows; i++) {
        const float *xi = x + i * (size_t)c, *dyi = dy + i * (size_t)c;
        float *dxi = dx + i * (size_t)c;
        for (int j = 0; j < c; j++)
            dxi[j] += k_dy[j] * dyi[j] + k_x[j] * (xi[j] - save_mean[j]) + k_0[j];
    }
}

/* ---- elementwise ---- */

static void cpu_relu_forward(backend_t *b, const float *x, float *y, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void cpu_relu_backward(backend_t *b, const float *y, const float *dy, float *dx, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++) {
        float d = dy[i]; /* loaded whatever y says: a load in only one arm keeps the loop scalar */
        dx[i] += y[i] > 0.0f ? d : 0.0f;
    }
}

static void cpu_add_forward(backend_t *b, const float *x1, const float *x2, float *y, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        y[i] = x1[i] + x2[i];
}

static void cpu_accumulate(backend_t *b, const float *dy, float *dx, size_t n) {
    (void)b;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        dx[i] += dy[i];
}

/* ---- linear ---- */

static void cpu_linear_forward(backend_t *b, int n, int in, int out, const float *x, const float *w,
                               const float *bias, float *y) {
    cpu_t *c = cpu_of(b);
    if (c->dnnl && cpu_dnnl_linear_forward(c->dnnl, n, in, out, x, w, bias, y) == 0) return;
    for (int i = 0; i < n; i++)
        memcpy(y + (size_t)i * out, bias, sizeof(float) * (size_t)out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 1.0f, y,
                out);
}

static void cpu_linear_backward(backend_t *b, int n, int in, int out, const float *x,
                                const float *w, const float *dy, float *dx, float *dw,
                                float *dbias) {
    cpu_t *c = cpu_of(b);
    for (int i = 0; i < n; i++)
        for (int o = 0; o < out; o++)
            dbias[o] += dy[(size_t)i * out + o];
    if (c->dnnl && cpu_dnnl_linear_backward(c->dnnl, n, in, out, x, w, dy, dx, dw) == 0) return;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw,
                in);
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dy, out, w, in,
                    1.0f, dx, in);
}

/* ---- loss ---- */

static void cpu_softmax_xent(backend_t *b, int n, int k, const float *logits, const int32_t *labels,
                             float smoothing, float grad_scale, const loss_scale_t *ls,
                             float *dlogits, float *loss_sum) {
    (void)b;
    double total = 0, d_scale = (double)grad_scale * (ls ? ls->scale : 1.0f);
    for (int i = 0; i < n; i++) {
        const float *z = logits + (size_t)i * k;
        float zmax = z[0];
        for (int j = 1; j < k; j++)
            zmax = z[j] > zmax ? z[j] : zmax;
        double sum_exp = 0, sum_z = 0;
        for (int j = 0; j < k; j++) {
            sum_exp += exp((double)z[j] - zmax);
            sum_z += z[j];
        }
        double log_sum = log(sum_exp) + zmax;
        /* q = (1 - eps) onehot + eps / K; loss = -sum q log p */
        double off = smoothing / k, on = 1.0 - smoothing + off;
        total += (1.0 - smoothing) * (log_sum - z[labels[i]]) + off * ((double)k * log_sum - sum_z);
        if (!dlogits) continue;
        float *d = dlogits + (size_t)i * k;
        for (int j = 0; j < k; j++) {
            double p = exp((double)z[j] - log_sum);
            double q = j == labels[i] ? on : off;
            d[j] = (float)((p - q) * d_scale / n);
        }
    }
    *loss_sum += (float)total;
}

/* ---- optimizer ---- */

static void cpu_sgd_step(backend_t *b, float *params, const float *grads, float *momentum_buf,
                         size_t n, float lr, float momentum, float weight_decay, bool is_nesterov,
                         float grad_scale, const loss_scale_t *ls) {
    (void)b;
    if (ls && ls->found_inf) return;
    if (ls) grad_scale /= ls->scale;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale + weight_decay * params[i];
        float m = momentum * momentum_buf[i] + g;
        momentum_buf[i] = m;
        params[i] -= lr * (is_nesterov ? g + momentum * m : m);
    }
}

/* adam.h's arithmetic element by element; the count lives in host memory here. */
static void cpu_adam_step(backend_t *b, float *params, const float *grads, float *exp_avg,
                          float *exp_avg_sq, size_t n, const adam_hparams_t *h, float grad_scale,
                          const loss_scale_t *ls, adam_count_t *count) {
    (void)b;
    if (!adam_count_next(count, h, ls)) return; /* GradScaler's skipped step */
    if (ls) grad_scale /= ls->scale;
    const adam_scalars_t s = adam_scalars(h);
    const adam_count_t c = *count;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        adam_update(&params[i], &exp_avg[i], &exp_avg_sq[i], grads[i] * grad_scale, &c, &s);
}

static void cpu_loss_scale_check(backend_t *b, const float *x, size_t n, loss_scale_t *ls) {
    (void)b;
    int has_nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(| : has_nonfinite) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        has_nonfinite |= !isfinite(x[i]);
    if (has_nonfinite) ls->found_inf = 1;
}

static void cpu_loss_scale_update(backend_t *b, loss_scale_t *ls, uint32_t growth_interval) {
    (void)b;
    loss_scale_next(ls, growth_interval);
}

static void cpu_augment_batch(backend_t *b, const uint8_t *images, const int32_t *labels, int h,
                              int w, int c, const augment_job_t *jobs, int n, augment_norm_t norm,
                              float *out, int32_t *labels_out) {
    (void)b;
    size_t sample = (size_t)h * w * c;
#pragma omp parallel for schedule(static) if (n > 16)
    for (int i = 0; i < n; i++) {
        augment_apply(&jobs[i].choice, &norm, images + sample * (size_t)jobs[i].index, h, w, c,
                      out + sample * (size_t)i);
        labels_out[i] = labels[jobs[i].index];
    }
}

static void cpu_destroy(backend_t *b) {
    cpu_t *c = cpu_of(b);
    cpu_dnnl_destroy(c->dnnl);
    free(c->workspace);
    free(c);
}

static const backend_memory_i cpu_mem = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .release = cpu_release,
    .is_device = cpu_is_device,
    .reserve_workspace = cpu_reserve_workspace,
    .to_device = cpu_copy,
    .to_host = cpu_copy,
    .destroy = cpu_destroy,
};

/* ---- the table's ops: tensor descriptors (backend.h) to the fp32 pointers the code above takes
 * ---- */

#define F32 backend_cpu__f32

static void op_conv2d_forward(backend_t *b, const conv_shape_t *s, tensor_desc_t x, const float *w,
                              tensor_desc_t y) {
    cpu_conv2d_forward(b, s, F32(x), w, F32(y));
}
static void op_conv2d_backward(backend_t *b, const conv_shape_t *s, tensor_desc_t x, const float *w,
                               tensor_desc_t dy, tensor_desc_t dx, float *dw) {
    cpu_conv2d_backward(b, s, F32(x), w, F32(dy), dx.data ? F32(dx) : NULL, dw);
}
static void op_batchnorm_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                       const float *gamma, const float *beta, tensor_desc_t y,
                                       float *save_mean, float *save_invstd, float *running_mean,
                                       float *running_var, float momentum, float eps) {
    cpu_batchnorm_forward_train(b, rows, c, F32(x), gamma, beta, F32(y), save_mean, save_invstd,
                                running_mean, running_var, momentum, eps);
}
static void op_batchnorm_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                      const float *gamma, const float *beta, tensor_desc_t y,
                                      const float *running_mean, const float *running_var,
                                      float eps) {
    cpu_batchnorm_forward_eval(b, rows, c, F32(x), gamma, beta, F32(y), running_mean, running_var,
                               eps);
}
static void op_batchnorm_backward(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                  const float *gamma, const float *save_mean,
                                  const float *save_invstd, tensor_desc_t dy, tensor_desc_t dx,
                                  float *dgamma, float *dbeta) {
    cpu_batchnorm_backward(b, rows, c, F32(x), gamma, save_mean, save_invstd, F32(dy), F32(dx),
                           dgamma, dbeta);
}
static void op_bn_act_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                    const float *gamma, const float *beta, tensor_desc_t residual,
                                    unsigned flags, tensor_desc_t y, float *save_mean,
                                    float *save_invstd, float *running_mean, float *running_var,
                                    float momentum, float eps) {
    backend_cpu__bn_act_forward_train(
        b, rows, c, F32(x), gamma, beta, residual.data ? F32(residual) : NULL, flags, F32(y),
        save_mean, save_invstd, running_mean, running_var, momentum, eps);
}
static void op_bn_act_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                   const float *gamma, const float *beta, tensor_desc_t residual,
                                   unsigned flags, tensor_desc_t y, const float *running_mean,
                                   const float *running_var, float eps) {
    backend_cpu__bn_act_forward_eval(b, rows, c, F32(x), gamma, beta,
                                     residual.data ? F32(residual) : NULL, flags, F32(y),
                                     running_mean, running_var, eps);
}
static void op_bn_act_backward(backend_t *b, size_t rows, int c, tensor_desc_t x,
                               const float *gamma, const float *save_mean, const float *save_invstd,
                               tensor_desc_t y, tensor_desc_t dy, unsigned flags, tensor_desc_t dx,
                               tensor_desc_t dresidual, float *dgamma, float *dbeta) {
    backend_cpu__bn_act_backward(b, rows, c, F32(x), gamma, save_mean, save_invstd, F32(y), F32(dy),
                                 flags, F32(dx), dresidual.data ? F32(dresidual) : NULL, dgamma,
                                 dbeta);
}
static void op_relu_forward(backend_t *b, tensor_desc_t x, tensor_desc_t y, size_t n) {
    cpu_relu_forward(b, F32(x), F32(y), n);
}
static void op_relu_backward(backend_t *b, tensor_desc_t y, tensor_desc_t dy, tensor_desc_t dx,
                             size_t n) {
    cpu_relu_backward(b, F32(y), F32(dy), F32(dx), n);
}
static void op_add_forward(backend_t *b, tensor_desc_t x1, tensor_desc_t x2, tensor_desc_t y,
                           size_t n) {
    cpu_add_forward(b, F32(x1), F32(x2), F32(y), n);
}
static void op_accumulate(backend_t *b, tensor_desc_t dy, tensor_desc_t dx, size_t n) {
    cpu_accumulate(b, F32(dy), F32(dx), n);
}
static void op_maxpool_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x,
                               tensor_desc_t y, int32_t *argmax) {
    backend_cpu__maxpool_forward(b, s, F32(x), F32(y), argmax);
}
static void op_maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                                tensor_desc_t dy, tensor_desc_t dx) {
    backend_cpu__maxpool_backward(b, s, argmax, F32(dy), F32(dx));
}
static void op_avgpool_global_forward(backend_t *b, int n, int hw, int c, tensor_desc_t x,
                                      tensor_desc_t y) {
    backend_cpu__avgpool_global_forward(b, n, hw, c, F32(x), F32(y));
}
static void op_avgpool_global_backward(backend_t *b, int n, int hw, int c, tensor_desc_t dy,
                                       tensor_desc_t dx) {
    backend_cpu__avgpool_global_backward(b, n, hw, c, F32(dy), F32(dx));
}
static void op_avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x,
                                        tensor_desc_t y) {
    backend_cpu__avgpool_adaptive_forward(b, s, F32(x), F32(y));
}
static void op_avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, tensor_desc_t dy,
                                         tensor_desc_t dx) {
    backend_cpu__avgpool_adaptive_backward(b, s, F32(dy), F32(dx));
}
static void op_dropout_forward(backend_t *b, tensor_desc_t x, tensor_desc_t y, size_t n, float p,
                               uint64_t key) {
    backend_cpu__dropout_forward(b, F32(x), F32(y), n, p, key);
}
static void op_dropout_backward(backend_t *b, tensor_desc_t dy, tensor_desc_t dx, size_t n, float p,
                                uint64_t key) {
    backend_cpu__dropout_backward(b, F32(dy), F32(dx), n, p, key);
}
static void op_bias_add(backend_t *b, size_t rows, int c, const float *bias, tensor_desc_t y) {
    backend_cpu__bias_add(b, rows, c, bias, F32(y));
}
static void op_bias_backward(backend_t *b, size_t rows, int c, tensor_desc_t dy, float *dbias) {
    backend_cpu__bias_backward(b, rows, c, F32(dy), dbias);
}
static void op_linear_forward(backend_t *b, int n, int in, int out, tensor_desc_t x, const float *w,
                              const float *bias, tensor_desc_t y) {
    cpu_linear_forward(b, n, in, out, F32(x), w, bias, F32(y));
}
static void op_linear_backward(backend_t *b, int n, int in, int out, tensor_desc_t x,
                               const float *w, tensor_desc_t dy, tensor_desc_t dx, float *dw,
                               float *dbias) {
    cpu_linear_backward(b, n, in, out, F32(x), w, F32(dy), dx.data ? F32(dx) : NULL, dw, dbias);
}
static void op_softmax_xent(backend_t *b, int n, int k, tensor_desc_t logits, const int32_t *labels,
                            float smoothing, float grad_scale, const loss_scale_t *ls,
                            tensor_desc_t dlogits, float *loss_sum) {
    cpu_softmax_xent(b, n, k, F32(logits), labels, smoothing, grad_scale, ls, F32(dlogits),
                     loss_sum);
}
static void op_augment_batch(backend_t *b, const uint8_t *images, const int32_t *labels, int h,
                             int w, int c, const augment_job_t *jobs, int n, augment_norm_t norm,
                             tensor_desc_t out, int32_t *labels_out) {
    cpu_augment_batch(b, images, labels, h, w, c, jobs, n, norm, F32(out), labels_out);
}

#undef F32

static const backend_i cpu_ops = {
    .fill = cpu_fill,
    .scale = cpu_scale,
    .conv2d_forward = op_conv2d_forward,
    .conv2d_backward = op_conv2d_backward,
    .batchnorm_forward_train = op_batchnorm_forward_train,
    .batchnorm_forward_eval = op_batchnorm_forward_eval,
    .batchnorm_backward = op_batchnorm_backward,
    .bn_act_forward_train = op_bn_act_forward_train,
    .bn_act_forward_eval = op_bn_act_forward_eval,
    .bn_act_backward = op_bn_act_backward,
    .relu_forward = op_relu_forward,
    .relu_backward = op_relu_backward,
    .add_forward = op_add_forward,
    .accumulate = op_accumulate,
    .maxpool_forward = op_maxpool_forward,
    .maxpool_backward = op_maxpool_backward,
    .avgpool_global_forward = op_avgpool_global_forward,
    .avgpool_global_backward = op_avgpool_global_backward,
    .avgpool_adaptive_forward = op_avgpool_adaptive_forward,
    .avgpool_adaptive_backward = op_avgpool_adaptive_backward,
    .dropout_forward = op_dropout_forward,
    .dropout_backward = op_dropout_backward,
    .bias_add = op_bias_add,
    .bias_backward = op_bias_backward,
    .linear_forward = op_linear_forward,
    .linear_backward = op_linear_backward,
    .softmax_xent = op_softmax_xent,
    .sgd_step = cpu_sgd_step,
    .adam_step = cpu_adam_step,
    .loss_scale_check = cpu_loss_scale_check,
    .loss_scale_update = cpu_loss_scale_update,
    .augment_batch = op_augment_batch,
};

backend_t *backend_cpu_create(int threads) {
    cpu_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->base.mem = &cpu_mem;
    c->base.ops = &cpu_ops;
    if (threads > 0) {
        openblas_set_num_threads(threads);
        omp_set_num_threads(threads);
    }
    if (cpu_reserve_workspace(&c->base, 1 << 16) < 0) {
        free(c);
        return NULL;
    }
    /* oneDNN where the build has it, unless DDP_CPU_ONEDNN=0 asks for the plain loops (cpu_dnnl.h)
     */
    const char *onednn = getenv("DDP_CPU_ONEDNN");
    if (!onednn || strcmp(onednn, "0")) c->dnnl = cpu_dnnl_create();
    return &c->base;
}
