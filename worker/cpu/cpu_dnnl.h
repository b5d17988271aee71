/* cpu_dnnl: the cpu backend's convolutions through oneDNN (Debian's libdnnl), where the build has
 * it and DDP_CPU_ONEDNN=1 asks for it (off by default until the rest of issue 28's part 3 lands:
 * results differ from the im2col path in the last bits, which the tests that pin state hashes
 * would see). Same layouts as the backend: x (N,H,W,C) NHWC, w (K,R,S,C), y (N,OH,OW,K). A
 * primitive per shape and direction is made on its first use and kept; oneDNN runs on the same
 * OpenMP threads as the rest of the backend (train.threads). The trainer's thread. */
#ifndef DDP_WORKER_CPU_DNNL_H
#define DDP_WORKER_CPU_DNNL_H

#include "backend.h"

typedef struct cpu_dnnl cpu_dnnl_t;

/* The convolutions' engine and primitive cache; NULL where the build has no oneDNN or its
 * engine cannot start (the backend then keeps im2col + SGEMM). */
cpu_dnnl_t *cpu_dnnl_create(void);
void cpu_dnnl_destroy(cpu_dnnl_t *d);
/* y = conv(x, w). Returns 0, or -1 when oneDNN cannot take this shape (nothing written: the caller
 * computes it its own way). */
int cpu_dnnl_conv_forward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                          float *y);
/* dx += dL/dx (dx = with s->is_dx_written; skipped when dx is NULL), dw += dL/dw; returns as
 * cpu_dnnl_conv_forward. */
int cpu_dnnl_conv_backward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                           const float *dy, float *dx, float *dw);

#endif
