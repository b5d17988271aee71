/* backend_cpu_pool: the cpu backend's pooling (max with padding, global and adaptive average),
 * dropout and convolution-bias ops (backend.h's contracts), split off backend_cpu.c, which puts
 * them in its table. Plain loops over NHWC on OpenMP threads, each sample or channel block on one
 * thread so that no result depends on the thread count. */
#include <math.h>
#include <omp.h>
#include <stdbool.h>

#include "backend_cpu_internal.h"
#include "dropout.h"

/* ---- pooling ---- */

void backend_cpu__maxpool_forward(backend_t *b, const pool_shape_t *s, const float *x, float *y,
                                  int32_t *argmax) {
    (void)b;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < s->n; n++) {
        const float *xn = x + (size_t)n * s->h * s->w * s->c;
        for (int oy = 0; oy < s->oh; oy++) {
            /* the window's rows and columns inside the input: the padding is -inf */
            int y0 = oy * s->stride - s->pad, y1 = y0 + s->size;
            y0 = y0 < 0 ? 0 : y0;
            y1 = y1 > s->h ? s->h : y1;
            for (int ox = 0; ox < s->ow; ox++) {
                int x0 = ox * s->stride - s->pad, x1 = x0 + s->size;
                x0 = x0 < 0 ? 0 : x0;
                x1 = x1 > s->w ? s->w : x1;
                size_t o = (((size_t)n * s->oh + oy) * s->ow + ox) * s->c;
                /* cell by cell in row-major order, all channels at once (vectorized); each
                 * channel sees its cells in the same order as one at a time would */
                float *restrict best = y + o;
                int32_t *restrict best_at = argmax + o;
                int c = s->c, first = (y0 * s->w + x0) * c;
                for (int ch = 0; ch < c; ch++) {
                    best[ch] = -INFINITY;
                    best_at[ch] = first + ch;
                }
                for (int iy = y0; iy < y1; iy++) {
                    for (int ix = x0; ix < x1; ix++) {
                        int at = (iy * s->w + ix) * c;
                        const float *restrict cell = xn + at;
                        for (int ch = 0; ch < c; ch++) {
                            float v = cell[ch];
                            bool is_taken = v > best[ch] || v != v; /* as PyTorch: a NaN wins */
                            best[ch] = is_taken ? v : best[ch];
                            best_at[ch] = is_taken ? at + ch : best_at[ch];
                        }
                    }
                }
            }
        }
    }
}

void backend_cpu__maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                                   const float *dy, float *dx) {
    (void)b;
    size_t per_out = (size_t)s->oh * s->ow * s->c, per_in = (size_t)s->h * s->w * s->c;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < s->n; n++)
        for (size_t i = 0; i < per_out; i++)
            dx[n * per_in + argmax[n * per_out + i]] += dy[n * per_out + i];
}

void backend_cpu__avgpool_global_forward(backend_t *b, int n, int hw, int c, const float *x,
                                         float *y) {
    (void)b;
    for (int i = 0; i < n; i++) {
        float *yi = y + (size_t)i * c;
        for (int j = 0; j < c; j++)
            yi[j] = 0.0f;
        for (int p = 0; p < hw; p++) {
            const float *xp = x + ((size_t)i * hw + p) * c;
            for (int j = 0; j < c; j++)
                yi[j] += xp[j];
        }
        for (int j = 0; j < c; j++)
            yi[j] /= (float)hw;
    }
}

void backend_cpu__avgpool_global_backward(backend_t *b, int n, int hw, int c, const float *dy,
                                          float *dx) {
    (void)b;
    for (int i = 0; i < n; i++) {
        const float *dyi = dy + (size_t)i * c;
        for (int p = 0; p < hw; p++) {
            float *dxp = dx + ((size_t)i * hw + p) * c;
            for (int j = 0; j < c; j++)
                dxp[j] += dyi[j] / (float)hw;
        }
    }
}

/* Adaptive average pooling's bins, as PyTorch: [floor(i * in / out), ceil((i + 1) * in / out)). */
static inline int bin_start(int i, int in, int out) {
    return (int)((int64_t)i * in / out);
}
static inline int bin_end(int i, int in, int out) {
    return (int)(((int64_t)(i + 1) * in + out - 1) / out);
}

void backend_cpu__avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, const float *x,
                                           float *y) {
    (void)b;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < s->n; n++) {
        const float *xn = x + (size_t)n * s->h * s->w * s->c;
        for (int oy = 0; oy < s->oh; oy++) {
            int y0 = bin_start(oy, s->h, s->oh), y1 = bin_end(oy, s->h, s->oh);
            for (int ox = 0; ox < s->ow; ox++) {
                int x0 = bin_start(ox, s->w, s->ow), x1 = bin_end(ox, s->w, s->ow);
                float *yo = y + (((size_t)n * s->oh + oy) * s->ow + ox) * s->c;
                float area = (float)((y1 - y0) * (x1 - x0));
                for (int ch = 0; ch < s->c; ch++) {
                    float sum = 0.0f;
                    for (int iy = y0; iy < y1; iy++)
                        for (int ix = x0; ix < x1; ix++)
                            sum += xn[((size_t)iy * s->w + ix) * s->c + ch];
                    yo[ch] = sum / area;
                }
            }
        }
    }
}

void backend_cpu__avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, const float *dy,
                                            float *dx) {
    (void)b;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < s->n; n++) {
        float *dxn = dx + (size_t)n * s->h * s->w * s->c;
        for (int oy = 0; oy < s->oh; oy++) {
            int y0 = bin_start(oy, s->h, s->oh), y1 = bin_end(oy, s->h, s->oh);
            for (int ox = 0; ox < s->ow; ox++) {
                int x0 = bin_start(ox, s->w, s->ow), x1 = bin_end(ox, s->w, s->ow);
                const float *dyo = dy + (((size_t)n * s->oh + oy) * s->ow + ox) * s->c;
                float area = (float)((y1 - y0) * (x1 - x0));
                for (int iy = y0; iy < y1; iy++)
                    for (int ix = x0; ix < x1; ix++) {
                        float *d = dxn + ((size_t)iy * s->w + ix) * s->c;
                        for (int ch = 0; ch < s->c; ch++)
                            d[ch] += dyo[ch] / area;
                    }
            }
        }
    }
}

/* ---- dropout and convolution bias ---- */

void backend_cpu__dropout_forward(backend_t *b, const float *x, float *y, size_t n, float p,
                                  uint64_t key) {
    (void)b;
    uint32_t threshold = dropout_threshold(p);
    float scale = dropout_scale(p);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        y[i] = dropout_keeps(key, i, threshold) ? x[i] * scale : 0.0f;
}

void backend_cpu__dropout_backward(backend_t *b, const float *dy, float *dx, size_t n, float p,
                                   uint64_t key) {
    (void)b;
    uint32_t threshold = dropout_threshold(p);
    float scale = dropout_scale(p);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        if (dropout_keeps(key, i, threshold)) dx[i] += dy[i] * scale;
}

void backend_cpu__bias_add(backend_t *b, size_t rows, int c, const float *bias, float *y) {
    (void)b;
#pragma omp parallel for schedule(static) if (rows * (size_t)c > 32768)
    for (size_t i = 0; i < rows; i++) {
        float *yi = y + i * (size_t)c;
        for (int j = 0; j < c; j++)
            yi[j] += bias[j];
    }
}

/* Each thread sums its channels over every row in order, 64 channels at a time. */
void backend_cpu__bias_backward(backend_t *b, size_t rows, int c, const float *dy, float *dbias) {
    (void)b;
#pragma omp parallel
    {
        FOR_CHANNEL_BLOCK(c, j0, j1)
        for (int jb = j0; jb < j1; jb += 64) {
            int je = jb + 64 < j1 ? jb + 64 : j1;
            double sum[64] = {0};
            for (size_t i = 0; i < rows; i++) {
                const float *dyi = dy + i * (size_t)c;
                for (int j = jb; j < je; j++)
                    sum[j - jb] += dyi[j];
            }
            for (int j = jb; j < je; j++)
                dbias[j] += (float)sum[j - jb];
        }
    }
}
