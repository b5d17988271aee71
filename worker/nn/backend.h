/* backend: the compute a training step needs, behind two tables of function pointers (memory,
 * backend_memory_i: where tensors live, copies, the arenas, the backend's lifetime; compute,
 * backend_i: the ops) plus an opaque context, so the model and the trainer run unchanged on the CPU
 * reference backend (cpu/backend_cpu.c) and on the CUDA backend. Only a backend's own files include
 * vendor headers.
 *
 * Conventions every backend keeps:
 * - Tensors are NHWC in memory the backend allocated ("device" memory; host memory on cpu).
 *   Parameters, their gradients and optimizer state are fp32. Activations and their gradients are
 *   stored in the backend's activation_dtype (fp32, or cuda's bf16 / fp16): an op is told each
 *   one's storage type, shape and layout by its tensor_desc_t; each keeps its slot of n floats
 *   (narrow, its n values fill the first half). to_device / to_host convert the activation arenas
 *   (which the backend knows from mark_arenas) so that the host always sees fp32.
 *   Conv filters are (K, R, S, C) (cuDNN's NHWC filter layout), linear weights (out, in) as
 *   PyTorch stores them.
 * - Every backward op ACCUMULATES (+=) into its input gradients and parameter gradients, unless
 *   told to write (=) them: conv_shape_t.is_dx_written and bn_act_backward's BN_ACT_WRITE_* flags,
 *   which the model sets where an op is the first to produce a tensor's gradient (no zeroing pass,
 *   no read of zeros); the model zeroes only the gradients whose first producer adds, and the
 *   parameter gradients once per step. Fan-out (a residual's input) needs no special case.
 * - Calls are ordered on the backend's stream; only to_host synchronizes. Nothing allocates after
 *   start-up: workspace is sized once by backend_create's caller through reserve_workspace.
 * - Numerics follow PyTorch: batch norm uses the biased variance to normalize and the unbiased one
 *   for the running estimate; softmax cross-entropy with label smoothing as nn.CrossEntropyLoss.
 */
#ifndef DDP_WORKER_BACKEND_H
#define DDP_WORKER_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adam.h"
#include "augment.h"
#include "dropout.h"
#include "loss_scale.h"

typedef struct backend backend_t;

/* How a tensor's values are stored. */
typedef enum { DTYPE_F32, DTYPE_BF16, DTYPE_F16 } dtype_t;
/* The order of a tensor's dimensions in memory: NHWC, the only one (cuDNN's fast layout). */
typedef enum { LAYOUT_NHWC } layout_t;

/* An activation or an activation gradient as an op receives it: where, stored how, its shape.
 * Ops take their sizes from their own arguments (conv_shape_t, rows, n_elems); n, h, w, c say
 * what the tensor is (the model sets them; (n_elems, 1, 1, 1) where only the count is known).
 * data is never written through by an op that takes the tensor as an input. */
typedef struct {
    void *data;
    dtype_t dtype;
    layout_t layout;
    int n, h, w, c;
} tensor_desc_t;

static inline tensor_desc_t tensor_desc(const void *data, dtype_t dtype, int n, int h, int w,
                                        int c) {
    tensor_desc_t t = {(void *)(uintptr_t)data, dtype, LAYOUT_NHWC, n, h, w, c};
    return t;
}

/* n_elems fp32 values (a test's tensor, the cpu backend's): shape (n_elems, 1, 1, 1). */
static inline tensor_desc_t tensor_f32(const float *data, size_t n_elems) {
    return tensor_desc(data, DTYPE_F32, (int)n_elems, 1, 1, 1);
}

typedef struct {
    int n, h, w, c; /* input (N, H, W, C) */
    int k, r, s;    /* K filters of R x S x C */
    int stride, pad;
    int oh, ow; /* output (N, OH, OW, K) */
    /* backward writes dx (=) instead of adding to it (+=); dw is always added to */
    bool is_dx_written;
} conv_shape_t;

/* bn_act_*'s flags. */
enum {
    BN_ACT_RELU = 1,            /* y = relu(...) (backward: the mask is y > 0) */
    BN_ACT_WRITE_DX = 2,        /* backward writes dx instead of adding to it */
    BN_ACT_WRITE_DRESIDUAL = 4, /* backward writes dresidual instead of adding to it */
};

typedef struct {
    int n, h, w, c; /* input; output (N, OH, OW, C) */
    int size, stride;
    int pad; /* max pooling: implicit -inf border of this width, as nn.MaxPool2d's padding */
    int oh, ow;
} pool_shape_t;

/* The backend's memory and lifetime: where tensors live, how bytes cross to and from the host,
 * the model's arenas. */
typedef struct {
    const char *name;
    /* Zeroed memory for the whole run, or NULL when out of memory. */
    void *(*alloc)(backend_t *b, size_t n_bytes);
    void (*release)(backend_t *b, void *p);
    /* Optional (NULL: nothing to do). The model's arenas, once, after allocating them: parameters,
     * activations and activation gradients (n_acts floats each). Returns 0 or -ENOMEM. */
    int (*mark_arenas)(backend_t *b, float *params, size_t n_params, float *acts, float *dacts,
                       size_t n_acts);
    /* Optional (NULL: DTYPE_F32): the type activations and their gradients are stored in. */
    dtype_t (*activation_dtype)(backend_t *b);
    /* Optional: before each forward pass, since the parameters may have changed. */
    void (*prepare_forward)(backend_t *b);
    /* Whether p is memory only the device can address (false on the cpu backend). */
    bool (*is_device)(backend_t *b, const void *p);
    /* Grow the scratch space ops may use to at least n_bytes (start-up only). Returns 0 or -ENOMEM.
     */
    int (*reserve_workspace)(backend_t *b, size_t n_bytes);
    /* Optional (NULL: none; cuda: unless DDP_CUDA_GRAPHS=0): recordings of queued ops, run
     * again as a whole with the pointers and scalars they were recorded with (CUDA graphs).
     * graph_begin: from now on ops are recorded instead of run; 0, or -1 when the backend does not
     * record now (nothing changed). graph_end: stops recording; returns the recording, or NULL
     * when it could not be made (none of the recorded ops ran: the caller runs them itself).
     * graph_run queues a recording: 0, or -1 when it is stale (scratch it used was replaced by a
     * bigger one since: nothing ran; free it, run the ops, record again). graph_free releases
     * one. An op that cannot be recorded ends the worker naming the call, as any failed call
     * does. */
    int (*graph_begin)(backend_t *b);
    void *(*graph_end)(backend_t *b);
    int (*graph_run)(backend_t *b, void *graph);
    void (*graph_free)(backend_t *b, void *graph);
    void (*to_device)(backend_t *b, void *dst, const void *src, size_t n_bytes);
    /* Waits for every queued op, then copies. */
    void (*to_host)(backend_t *b, void *dst, const void *src, size_t n_bytes);
    /* Optional (NULL on cpu, where to_host is a memcpy): copies out of fp32 device memory on a
     * side stream, overlapped with the ops queued after them (memory snapshots).
     * pin_host: page-lock host memory (n_bytes at p, e.g. a shared mapping) so copies into it are
     * DMA; 0 or -1 (then copies still work, slower). unpin_host undoes it.
     * copy_out_begin: later copy_out calls start after every op queued so far (the host waits
     * for the last generation's copies to leave the backend's buffers, if they have not). copy_out:
     * queue one copy to dst (host): on the cuda backend a copy of the source into a device buffer
     * queued with the ops (the first call of a size allocates it), then the slow copy from there
     * on a side stream. copy_out_fence: ops queued from now on wait (on the device, the host does
     * not) for copies that read their source directly (no buffer could be had): call it before
     * anything overwrites their sources. copy_out_wait: the host waits for the copies; callable
     * from any thread. */
    int (*pin_host)(backend_t *b, void *p, size_t n_bytes);
    void (*unpin_host)(backend_t *b, void *p);
    void (*copy_out_begin)(backend_t *b);
    void (*copy_out)(backend_t *b, void *dst, const void *src, size_t n_bytes);
    void (*copy_out_fence)(backend_t *b);
    void (*copy_out_wait)(backend_t *b);
    void (*destroy)(backend_t *b);
} backend_memory_i;

/* The compute: every op of a training step, on tensors in the backend's memory. */
typedef struct {
    /* A batch assembled where the dataset lives, so only the jobs cross to the device: for i < n,
     * sample i of out = augment_apply(&jobs[i].choice, norm, images' sample jobs[i].index) and
     * labels_out[i] = labels[jobs[i].index]. images: (samples, h, w, c) uint8 NHWC, labels: int32,
     * jobs: backend memory; out: (n, h, w, c), an activation. Every backend gives the same bits. */
    void (*augment_batch)(backend_t *b, const uint8_t *images, const int32_t *labels, int h, int w,
                          int c, const augment_job_t *jobs, int n, augment_norm_t norm,
                          tensor_desc_t out, int32_t *labels_out);
    /* x: fp32, or any tensor when value is 0 (all-zero bits in every type; n_elems floats of
     * memory either way) */
    void (*fill)(backend_t *b, float *x, float value, size_t n_elems);
    void (*scale)(backend_t *b, float *x, float factor, size_t n_elems);

    /* x: (N,H,W,C), w: (K,R,S,C) -> y: (N,OH,OW,K). */
    void (*conv2d_forward)(backend_t *b, const conv_shape_t *s, tensor_desc_t x, const float *w,
                           tensor_desc_t y);
    /* dx += dL/dx (skipped when dx.data is NULL), dw += dL/dw. */
    void (*conv2d_backward)(backend_t *b, const conv_shape_t *s, tensor_desc_t x, const float *w,
                            tensor_desc_t dy, tensor_desc_t dx, float *dw);
    /* Optional (NULL: not offered; cuda: in fp16, and bf16 without scale and bias, with
     * DDP_CUDA_CONV_FUSION=1): y = the convolution
     * of relu(x * scale + bias) (scale, bias: C fp32, per input channel: a batch norm folded into
     * a scale and a shift, and its ReLU, applied as the convolution reads x; x is not changed;
     * both NULL: of x itself, no ReLU),
     * and sum, sqsum (K fp32, written): the sums of y and of its squares per output channel over
     * (N, OH, OW), the statistics the batch norm after it needs. cuDNN's ConvBNfprop fusion.
     * Returns 0, or -1 when it cannot run this shape, type or alignment (nothing written: run
     * the ops one by one). */
    int (*conv2d_bn_forward)(backend_t *b, const conv_shape_t *s, tensor_desc_t x,
                             const float *scale, const float *bias, const float *w, tensor_desc_t y,
                             float *sum, float *sqsum);
    /* Training: normalize with the batch's statistics over (N,H,W) per channel, save mean and
     * 1/sqrt(var+eps) for backward, update the running estimates with momentum. */
    void (*batchnorm_forward_train)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                    const float *gamma, const float *beta, tensor_desc_t y,
                                    float *save_mean, float *save_invstd, float *running_mean,
                                    float *running_var, float momentum, float eps);
    void (*batchnorm_forward_eval)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                   const float *gamma, const float *beta, tensor_desc_t y,
                                   const float *running_mean, const float *running_var, float eps);
    void (*batchnorm_backward)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                               const float *gamma, const float *save_mean, const float *save_invstd,
                               tensor_desc_t dy, tensor_desc_t dx, float *dgamma, float *dbeta);
    /* Batch norm fused with what follows it in a ResNet: y = act(batchnorm(x) + residual), over
     * rows = N*H*W of C channels, residual (rows, C) or data NULL (nothing added), act ReLU with
     * BN_ACT_RELU, else none. Statistics, saved values and running estimates as
     * batchnorm_forward_train. The same values as batchnorm_forward_train, add_forward and
     * relu_forward in turn (the cpu backend gives their very bits); y is the only tensor written.
     */
    void (*bn_act_forward_train)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                 const float *gamma, const float *beta, tensor_desc_t residual,
                                 unsigned flags, tensor_desc_t y, float *save_mean,
                                 float *save_invstd, float *running_mean, float *running_var,
                                 float momentum, float eps);
    /* Optional (NULL: not offered; cuda): bn_act_forward_train with x's statistics given as the
     * sums of x and of its squares per channel over the rows (sum, sqsum: C fp32, e.g.
     * conv2d_bn_forward's), instead of a pass over x. sum and sqsum may be save_mean and
     * save_invstd themselves (they are then replaced). */
    void (*bn_act_forward_train_sums)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                      const float *sum, const float *sqsum, const float *gamma,
                                      const float *beta, tensor_desc_t residual, unsigned flags,
                                      tensor_desc_t y, float *save_mean, float *save_invstd,
                                      float *running_mean, float *running_var, float momentum,
                                      float eps);
    void (*bn_act_forward_eval)(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                const float *gamma, const float *beta, tensor_desc_t residual,
                                unsigned flags, tensor_desc_t y, const float *running_mean,
                                const float *running_var, float eps);
    /* The backward of bn_act_forward_train, y its output: dz = dy where y > 0 (BN_ACT_RELU; else
     * dz = dy); dresidual += dz (skipped when its data is NULL); batch norm's backward of dz: dx +=
     * dL/dx, dgamma += , dbeta += . BN_ACT_WRITE_DX / _DRESIDUAL write those two instead of adding.
     */
    void (*bn_act_backward)(backend_t *b, size_t rows, int c, tensor_desc_t x, const float *gamma,
                            const float *save_mean, const float *save_invstd, tensor_desc_t y,
                            tensor_desc_t dy, unsigned flags, tensor_desc_t dx,
                            tensor_desc_t dresidual, float *dgamma, float *dbeta);
    /* The elementwise ops' tensors share one type. */
    void (*relu_forward)(backend_t *b, tensor_desc_t x, tensor_desc_t y, size_t n_elems);
    /* dx += dy where y > 0 */
    void (*relu_backward)(backend_t *b, tensor_desc_t y, tensor_desc_t dy, tensor_desc_t dx,
                          size_t n_elems);
    void (*add_forward)(backend_t *b, tensor_desc_t x1, tensor_desc_t x2, tensor_desc_t y,
                        size_t n_elems);
    /* dx += dy (the add's backward, once per input) */
    void (*accumulate)(backend_t *b, tensor_desc_t dy, tensor_desc_t dx, size_t n_elems);
    /* Max pooling as nn.MaxPool2d(size, stride, pad): a window's cells outside the input are
     * -inf (never chosen), ties go to the first cell in row-major order, a NaN wins.
     * argmax: (N,OH,OW,C) int32 scratch the forward fills for the backward (an offset into the
     * sample's (H, W, C) input). */
    void (*maxpool_forward)(backend_t *b, const pool_shape_t *s, tensor_desc_t x, tensor_desc_t y,
                            int32_t *argmax);
    void (*maxpool_backward)(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                             tensor_desc_t dy, tensor_desc_t dx);
    /* x: (N, HW, C) -> y: (N, C) mean over HW */
    void (*avgpool_global_forward)(backend_t *b, int n, int hw, int c, tensor_desc_t x,
                                   tensor_desc_t y);
    void (*avgpool_global_backward)(backend_t *b, int n, int hw, int c, tensor_desc_t dy,
                                    tensor_desc_t dx);
    /* nn.AdaptiveAvgPool2d((OH, OW)) on x: (N, H, W, C) -> y: (N, OH, OW, C): output row oy
     * averages input rows [floor(oy * H / OH), ceil((oy + 1) * H / OH)), columns alike, so cells
     * overlap, and repeat inputs when the input is smaller than the output (VGG's 7x7 on small
     * images). Uses n, h, w, c, oh, ow of s (size, stride and pad are ignored). */
    void (*avgpool_adaptive_forward)(backend_t *b, const pool_shape_t *s, tensor_desc_t x,
                                     tensor_desc_t y);
    /* dx += the adjoint of the forward applied to dy */
    void (*avgpool_adaptive_backward)(backend_t *b, const pool_shape_t *s, tensor_desc_t dy,
                                      tensor_desc_t dx);
    /* Inverted dropout as nn.Dropout in training: y[i] = dropout_keeps(key, i, p) ? x[i] * (1 / (1
     * - p)) : 0 (dropout.h: the same mask on every backend, drawn again by the backward, never
     * stored). p = 0 copies x (evaluation). p in [0, 1). */
    void (*dropout_forward)(backend_t *b, tensor_desc_t x, tensor_desc_t y, size_t n_elems, float p,
                            uint64_t key);
    /* dx += dy * the forward's mask and scale (the same key and p) */
    void (*dropout_backward)(backend_t *b, tensor_desc_t dy, tensor_desc_t dx, size_t n_elems,
                             float p, uint64_t key);
    /* A convolution's bias, in place: y: (rows, C) += bias (C) per channel. */
    void (*bias_add)(backend_t *b, size_t rows, int c, const float *bias, tensor_desc_t y);
    /* dbias (C) += the sums of dy: (rows, C) over the rows */
    void (*bias_backward)(backend_t *b, size_t rows, int c, tensor_desc_t dy, float *dbias);
    /* x: (N, I), w: (O, I), bias: (O) -> y: (N, O); dx skipped when its data is NULL */
    void (*linear_forward)(backend_t *b, int n, int in, int out, tensor_desc_t x, const float *w,
                           const float *bias, tensor_desc_t y);
    void (*linear_backward)(backend_t *b, int n, int in, int out, tensor_desc_t x, const float *w,
                            tensor_desc_t dy, tensor_desc_t dx, float *dw, float *dbias);
    /* logits: (N, K), labels: (N) int32 in [0, K). loss_sum: one float, += the summed loss of
     * the batch; dlogits = d(mean loss)/dlogits * grad_scale (mean over N), times ls->scale too
     * when ls (device memory) is not NULL: scaled before a narrow type stores it. */
    void (*softmax_xent)(backend_t *b, int n, int k, tensor_desc_t logits, const int32_t *labels,
                         float smoothing, float grad_scale, const loss_scale_t *ls,
                         tensor_desc_t dlogits, float *loss_sum);
    /* One SGD step over a flat arena, as torch.optim.SGD (dampening 0):
     * g = grad * grad_scale + wd * p; m = momentum * m + g; p -= lr * (nesterov ? g + momentum * m
     * : m) With ls (device memory, NULL: none), grad_scale is divided by ls->scale and nothing at
     * all changes when ls->found_inf is set: GradScaler's unscale and skipped step. */
    void (*sgd_step)(backend_t *b, float *params, const float *grads, float *momentum_buf,
                     size_t n_elems, float lr, float momentum, float weight_decay, bool is_nesterov,
                     float grad_scale, const loss_scale_t *ls);
    /* One Adam or AdamW step over a flat arena, as torch.optim.Adam / AdamW (adam.h's arithmetic):
     * g = grad * grad_scale; Adam: g += wd * p; AdamW: p *= 1 - lr * wd;
     * m = beta1 * m + (1 - beta1) * g; v = beta2 * v + (1 - beta2) * g * g; t = ++count->step;
     * p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
     * exp_avg, exp_avg_sq: (n_elems) backend memory; count: backend memory (zeroed before the
     * first step), advanced here so that no step reads it back; h: host memory. With ls as in
     * sgd_step: unscaled by ls->scale, and when ls->found_inf nothing at all changes, the count
     * included (GradScaler skipping optimizer.step()). */
    void (*adam_step)(backend_t *b, float *params, const float *grads, float *exp_avg,
                      float *exp_avg_sq, size_t n_elems, const adam_hparams_t *h, float grad_scale,
                      const loss_scale_t *ls, adam_count_t *count);
    /* ls->found_inf = 1 if any of x[0..n) is an inf or a NaN (left as it was otherwise). */
    void (*loss_scale_check)(backend_t *b, const float *x, size_t n_elems, loss_scale_t *ls);
    /* loss_scale_next on the device's copy, after the step's sgd_step. */
    void (*loss_scale_update)(backend_t *b, loss_scale_t *ls, uint32_t growth_interval);
} backend_i;

struct backend {
    const backend_memory_i *mem;
    const backend_i *ops;
};

/* The CPU reference backend; threads: GEMM threads (0: as many as the machine has). Returns NULL
 * when out of memory. */
backend_t *backend_cpu_create(int threads);

#endif
