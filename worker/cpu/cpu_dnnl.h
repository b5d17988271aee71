/* cpu_dnnl: the cpu backend's convolutions and linear layers (matmuls) through oneDNN (Debian's
 * libdnnl), on by default where the build has it (DDP_CPU_ONEDNN=0: off). Batch norm and pooling
 * stay on the backend's loops: oneDNN's batch norm (tried, 2026-11-27) took as much CPU as they do
 * on one thread and 1.5x more on two (a CNN at batch 64), and sums its statistics in fp32 (a
 * channel whose mean dwarfs its spread lost 3x the tolerance test_cpu_ops allows); its max pooling
 * lets no NaN win and keeps its own workspace, where backend.h asks for PyTorch's NaN and an
 * argmax. Same layouts as the backend: x (N,H,W,C) NHWC, w (K,R,S,C), y (N,OH,OW,K). A primitive
 * per shape and direction is made on its first use and kept; oneDNN runs on the same OpenMP threads
 * as the rest of the backend (libdnnl is built on libgomp: omp_set_num_threads(train.threads) binds
 * both). The trainer's thread. Results differ from the im2col path in the last bits, and oneDNN's
 * backward-weights kernels split the sum over N*OH*OW between threads (oneDNN 2.6 has no
 * deterministic mode): the same train.threads repeats a run bit for bit, another thread count does
 * not. Tests that compare state hashes between jobs of different shapes pin train.threads for that
 * reason. */
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

/* The linear layer's matmuls (backend_i.linear_*): y = x w^T + bias, overwritten;
 * dw += dy^T x and dx += dy w (dx skipped when NULL); the bias's gradient is the caller's.
 * x: (n, in), w: (out, in), y: (n, out). Return 0, or -1 (nothing written). */
int cpu_dnnl_linear_forward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                            const float *bias, float *y);
int cpu_dnnl_linear_backward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                             const float *dy, float *dx, float *dw);

#endif
