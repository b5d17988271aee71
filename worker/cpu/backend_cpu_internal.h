/* backend_cpu_internal: what backend_cpu.c and backend_cpu_pool.c share (not part of backend_i):
 * the ops backend_cpu_pool.c implements for the cpu backend's table, and the channel split of the
 * per-channel reductions. */
#ifndef DDP_WORKER_BACKEND_CPU_INTERNAL_H
#define DDP_WORKER_BACKEND_CPU_INTERNAL_H

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"

/* Each thread owns a block of channels and walks every row for them in order. */
#define FOR_CHANNEL_BLOCK(c, j0, j1)                                                               \
    int j0 = (c)*omp_get_thread_num() / omp_get_num_threads();                                     \
    int j1 = (c) * (omp_get_thread_num() + 1) / omp_get_num_threads();

/* The fp32 values a tensor descriptor points at: the cpu backend stores nothing else, so another
 * type is its caller's bug (ends the process naming it). */
static inline float *backend_cpu__f32(tensor_desc_t t) {
    if (t.dtype != DTYPE_F32 || t.layout != LAYOUT_NHWC) {
        fprintf(
            stderr,
            "ddpworker: cpu backend: a tensor of type %d, layout %d: it stores fp32 NHWC only\n",
            (int)t.dtype, (int)t.layout);
        abort();
    }
    return (float *)t.data;
}

/* Channels per block of the per-channel sums that a thread keeps in local arrays. */
#define BN_SUM_BLOCK 32

/* The backend's scratch space, at least n_bytes (reserve_workspace made room; aborts otherwise:
 * a bug in the caller's sizing). */
void *backend_cpu__workspace(backend_t *b, size_t n_bytes);

/* backend_cpu_fused.c: backend_i's bn_act_* */
void backend_cpu__bn_act_forward_train(backend_t *b, size_t rows, int c, const float *x,
                                       const float *gamma, const float *beta, const float *residual,
                                       unsigned flags, float *y, float *save_mean,
                                       float *save_invstd, float *running_mean, float *running_var,
                                       float momentum, float eps);
void backend_cpu__bn_act_forward_eval(backend_t *b, size_t rows, int c, const float *x,
                                      const float *gamma, const float *beta, const float *residual,
                                      unsigned flags, float *y, const float *running_mean,
                                      const float *running_var, float eps);
void backend_cpu__bn_act_backward(backend_t *b, size_t rows, int c, const float *x,
                                  const float *gamma, const float *save_mean,
                                  const float *save_invstd, const float *y, const float *dy,
                                  unsigned flags, float *dx, float *dresidual, float *dgamma,
                                  float *dbeta);

/* backend_cpu_pool.c: backend_i's ops of the same names */
void backend_cpu__maxpool_forward(backend_t *b, const pool_shape_t *s, const float *x, float *y,
                                  int32_t *argmax);
void backend_cpu__maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                                   const float *dy, float *dx);
void backend_cpu__avgpool_global_forward(backend_t *b, int n, int hw, int c, const float *x,
                                         float *y);
void backend_cpu__avgpool_global_backward(backend_t *b, int n, int hw, int c, const float *dy,
                                          float *dx);
void backend_cpu__avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, const float *x,
                                           float *y);
void backend_cpu__avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, const float *dy,
                                            float *dx);
void backend_cpu__dropout_forward(backend_t *b, const float *x, float *y, size_t n, float p,
                                  uint64_t key);
void backend_cpu__dropout_backward(backend_t *b, const float *dy, float *dx, size_t n, float p,
                                   uint64_t key);
void backend_cpu__bias_add(backend_t *b, size_t rows, int c, const float *bias, float *y);
void backend_cpu__bias_backward(backend_t *b, size_t rows, int c, const float *dy, float *dbias);

#endif
