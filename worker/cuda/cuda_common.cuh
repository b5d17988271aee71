/* cuda_common: what every file of the CUDA backend shares (backend_cuda.cu, cuda_memory.cu and
 * ops/: cuda_elementwise.cu, cuda_data.cu, cuda_conv.cu, cuda_norm.cu, cuda_bn_act.cu,
 * cuda_pool.cu, cuda_linear.cu, cuda_loss_optim.cu, cuda_conv_fusion.cu): the backend's state
 * (gpu_t), the narrow-type dispatch, the checked-call macros, the element access and launch
 * helpers, and each file's ops for the table that backend_cuda.cu assembles. Files are split by op
 * family, as llm.c splits its llmc/ headers.
 */
#ifndef DDP_WORKER_CUDA_COMMON_CUH
#define DDP_WORKER_CUDA_COMMON_CUH

#include "backend_cuda.h"
#include "backend_cuda_internal.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exit_codes.h"

#define CHECK_CUDA(x)   check_cuda((x), #x, __FILE__, __LINE__)
#define CHECK_CUDNN(x)  check_cudnn((x), #x, __FILE__, __LINE__)
#define CHECK_CUBLAS(x) check_cublas((x), #x, __FILE__, __LINE__)

static inline void fail_at(const char *what, const char *msg, const char *file, int line) {
    fprintf(stderr, "ddpworker: %s:%d: %s: %s\n", file, line, what, msg);
    exit(DDP_EXIT_BUG);
}
static inline void check_cuda(cudaError_t rc, const char *what, const char *file, int line) {
    if (rc != cudaSuccess) fail_at(what, cudaGetErrorString(rc), file, line);
}
static inline void check_cudnn(cudnnStatus_t rc, const char *what, const char *file, int line) {
    if (rc != CUDNN_STATUS_SUCCESS) fail_at(what, cudnnGetErrorString(rc), file, line);
}
static inline void check_cublas(cublasStatus_t rc, const char *what, const char *file, int line) {
    if (rc != CUBLAS_STATUS_SUCCESS) fail_at(what, cublasGetStatusString(rc), file, line);
}

#define CONV_CACHE 256

/* cuda_conv_fusion.cu: one shape's execution plan (a cudnnBackendDescriptor_t; NULL: cuDNN has
 * none for it, the op returns -1) */
#define CONV_FUSION_KEPT 24 /* the descriptors a plan is made from: 10 tensors, 5 ops, ... */
typedef struct {
    conv_shape_t shape;
    bool has_affine; /* scale, bias and ReLU before the convolution */
    void *plan;
    size_t workspace;
    void *kept[CONV_FUSION_KEPT]; /* what the plan was made from, destroyed after it */
    int n_kept;
} conv_fusion_plan_t;

#define CONV_FUSION_PLANS 64

/* copies out per generation through a device buffer (cuda_memory.cu): a memory snapshot makes up
 * to 5 (the loss scale, the buffers, the parameters, the momentum, the second moment) */
#define COPY_STAGES 8

typedef __nv_bfloat16 bf16;
typedef __half f16;

/* The narrow type activations and their gradients are stored in, if any. */
typedef enum { LOW_NONE, LOW_BF16, LOW_FP16 } low_kind_t;

typedef struct {
    conv_shape_t shape;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd_data;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter;
    bool is_sized;       /* the workspace has room for these */
    bool is_shared_only; /* read from the shared cache file, not yet in the run's own */
} conv_algos_t;

typedef struct {
    backend_t base;
    int device;
    cudaStream_t stream;
    cudnnHandle_t cudnn;
    cublasHandle_t cublas;
    void *workspace;
    size_t workspace_bytes;
    cudnnTensorDescriptor_t x_desc, y_desc;
    cudnnFilterDescriptor_t w_desc;
    cudnnConvolutionDescriptor_t conv_desc;
    conv_algos_t algos[CONV_CACHE];
    int n_algos;
    int algo_victim;    /* the entry a new shape replaces once all CONV_CACHE are taken */
    float *bn_partials; /* batch-norm reductions: chunks x C partial sums, twice */
    size_t bn_partials_len;
    float *bn_sums;   /* 2 x BN_MAX_CHANNELS */
    float *bn_coeffs; /* 3 x BN_MAX_CHANNELS: bn_act's backward coefficients */
    bool is_tf32;
    low_kind_t low; /* activations and their gradients in bf16 or fp16 (BACKEND_CUDA_BF16/FP16) */
    int sm_count;
    /* the model's arenas (mark_arenas): the parameters' narrow shadow; to_device / to_host convert
     * in the activation arenas (ops know their tensors' types from their descriptors) */
    const float *params;
    size_t n_params;
    const char *acts, *dacts;
    size_t act_bytes;
    void *shadow;     /* low: the parameters in the narrow type, refreshed before each forward */
    void *dw_scratch; /* low: a convolution's filter gradient before it joins the fp32 arena */
    float *stage;     /* low: fp32 staging for uploads and read-backs of activations */
    size_t stage_bytes;
    float *wide[3]; /* low: fp32 copies for a convolution run in fp32 (x, y or dy, dx) */
    size_t wide_bytes[3];
    /* convolution algorithms found earlier: the run's own file and one shared by runs on this
     * machine (empty: none) */
    char cache_path[1024], shared_cache_path[1024];
    char tag[160]; /* cuDNN version, compute capability and GPU name: the cache's key */
    /* DDP_CUDA_PROFILE="FIRST,COUNT": the profiler's capture range (cudaProfilerStart/Stop, which
     * nsys --capture-range=cudaProfilerApi and ncu --profile-from-start off honour) covers forward
     * passes FIRST .. FIRST+COUNT-1 (1-based, from the forward's start to the next one's): the
     * warm-up and cuDNN's timed algorithm search stay outside it. 0: off. */
    long profile_first, profile_count, forwards;
    /* graph_begin records, unless DDP_CUDA_GRAPHS=0 or while profiling (the capture range is
     * counted in forwards that a recording would skip). scratch_generation counts the replacements
     * of scratch a recording may hold (workspace, wide copies): a recording of an older one is
     * stale.
     */
    bool is_graphs, is_recording;
    /* DDP_CUDA_NONDETERMINISTIC=1: convolution algorithms that sum with atomics may be chosen (a
     * little faster for some shapes; two runs then differ in the last bits). Default: only
     * deterministic ones, as torch.backends.cudnn.deterministic. */
    bool is_nondeterministic;
    /* DDP_STARTUP_TRACE=1 (startup_trace.h): the first step's time (from the first forward to the
     * second) and the part of it cuDNN's timed search took, printed at the second forward */
    /* DDP_CUDA_CONV_FUSION=1 (fp16 only): conv2d_bn_forward runs cuDNN's fused graph */
    bool is_conv_fusion;
    conv_fusion_plan_t fusion_plans[CONV_FUSION_PLANS];
    int n_fusion_plans;
    void *fusion_affine; /* scale and bias in fp16, 2 x BN_MAX_CHANNELS */
    long trace_forwards;
    double trace_first_forward, search_seconds;
    int searched_shapes;
    uint64_t scratch_generation;
    /* copy_out_*: the side stream memory snapshots are copied out on, created at first use;
     * copy_start marks the main stream where copies start, copy_end where they end */
    cudaStream_t copy_stream;
    cudaEvent_t copy_start, copy_end;
    /* the device buffers copies out go through (copy_out: one per copy of a generation), and
     * whether a copy of this generation read its source directly (no buffer: the fence waits) */
    void *copy_stage[COPY_STAGES];
    size_t copy_stage_bytes[COPY_STAGES];
    int copy_stages_used;
    bool is_copy_direct;
    bool is_copy_staging_off; /* given back when training ran out of memory (device_malloc) */
} gpu_t;

#define BN_PARTIALS_FLOATS ((size_t)2 << 20)
#define BN_MAX_CHANNELS    65536

static inline gpu_t *gpu_of(backend_t *b) {
    return (gpu_t *)b;
}

static inline bool in_range(const void *p, const char *base, size_t n_bytes) {
    return base && (const char *)p >= base && (const char *)p < base + n_bytes;
}

/* Whether p lies in the model's activation arenas (mark_arenas) while they are narrow: to_device
 * and to_host convert there (the host always sees fp32). Ops are told by their tensors'
 * descriptors instead (is_low). Every activation keeps the slot of n floats the model gave it;
 * narrow, its n values fill the first half. */
static inline bool in_low_arena(const gpu_t *g, const void *p) {
    return g->low != LOW_NONE &&
           (in_range(p, g->acts, g->act_bytes) || in_range(p, g->dacts, g->act_bytes));
}

static inline dtype_t low_dtype(const gpu_t *g) {
    return g->low == LOW_FP16 ? DTYPE_F16 : g->low == LOW_BF16 ? DTYPE_BF16 : DTYPE_F32;
}

/* Whether tensor t is stored in the backend's narrow type (else fp32), as its descriptor says; a
 * narrow type that is not the backend's, or another layout, is the caller's bug. */
static inline bool is_low(const gpu_t *g, tensor_desc_t t) {
    if (t.layout != LAYOUT_NHWC)
        fail_at("tensor descriptor", "a layout other than NHWC", __FILE__, __LINE__);
    if (t.dtype == DTYPE_F32) return false;
    if (t.dtype != low_dtype(g))
        fail_at("tensor descriptor",
                g->low == LOW_NONE ? "a narrow tensor on an fp32 backend"
                                   : "a narrow type other than the backend's",
                __FILE__, __LINE__);
    return true;
}

/* Runs the statement with `Low` naming the narrow type of this backend (bf16 or fp16); LOW and
 * CLOW cast to it. Both types are 2 bytes, so every buffer of them is sized alike. */
#define WITH_LOW(g, ...)                                                                           \
    do {                                                                                           \
        if ((g)->low == LOW_FP16) {                                                                \
            typedef f16 Low;                                                                       \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            typedef bf16 Low;                                                                      \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)
#define LOW(p)    ((Low *)(p))
#define CLOW(p)   ((const Low *)(p))
#define LOW_BYTES 2

/* The narrow copy of parameters at w (inside the parameter arena). */
static const void *shadow_of(const gpu_t *g, const float *w) {
    return (const char *)g->shadow + (size_t)(w - g->params) * LOW_BYTES;
}

static inline unsigned blocks_for(size_t n) {
    size_t blocks = (n + 255) / 256;
    return (unsigned)(blocks > 65535 * 16 ? 65535 * 16 : blocks < 1 ? 1 : blocks);
}

/* ---- element access and launches (templates over the activation type: float, bf16 or fp16;
 * math in float) ---- */

#define GRID_STRIDE(i, n)                                                                          \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

static __device__ __forceinline__ float ld(const float *p, size_t i) {
    return p[i];
}
static __device__ __forceinline__ float ld(const bf16 *p, size_t i) {
    return __bfloat162float(p[i]);
}
static __device__ __forceinline__ float ld(const f16 *p, size_t i) {
    return __half2float(p[i]);
}
static __device__ __forceinline__ void st(float *p, size_t i, float v) {
    p[i] = v;
}
static __device__ __forceinline__ void st(bf16 *p, size_t i, float v) {
    p[i] = __float2bfloat16(v);
}
static __device__ __forceinline__ void st(f16 *p, size_t i, float v) {
    p[i] = __float2half(v);
}
static __device__ __forceinline__ void add_at(float *p, float v) {
    atomicAdd(p, v);
}
static __device__ __forceinline__ void add_at(bf16 *p, float v) {
    atomicAdd(p, __float2bfloat16(v));
}
static __device__ __forceinline__ void add_at(f16 *p, float v) {
    atomicAdd(p, __float2half(v));
}

template <typename S, typename D> __global__ void convert_kernel(const S *x, D *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, ld(x, i));
}
/* an fp32 gradient joins a narrow one */
template <typename T> __global__ void add_wide_kernel(const float *x, T *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, ld(y, i) + x[i]);
}
/* a narrow filter gradient joins the fp32 gradient arena */
template <typename T> __global__ void add_low_kernel(const T *x, float *y, size_t n) {
    GRID_STRIDE(i, n) y[i] += ld(x, i);
}

#define LAUNCH(kernel, n, ...)                                                                     \
    do {                                                                                           \
        kernel<<<blocks_for(n), 256, 0, gpu_of(b)->stream>>>(__VA_ARGS__);                         \
        CHECK_CUDA(cudaGetLastError());                                                            \
    } while (0)

/* ---- ops, by file ---- */

/* cuda_memory.cu */
void *gpu_alloc(backend_t *b, size_t n_bytes);
void gpu_release(backend_t *b, void *p);
bool gpu_is_device(backend_t *b, const void *p);
int gpu_reserve_workspace(backend_t *b, size_t n_bytes);
/* Device scratch grown on first use (the first step) and kept. */
float *gpu_grown(gpu_t *g, float **buf, size_t *have, size_t n_bytes);
/* Make g's device current on the calling thread (once per thread): CUDA's current device is per
 * thread and starts at 0, and a thread other than the trainer's (the gradient buckets' all-reduce)
 * would otherwise make GPU 0's context for a rank of another GPU. */
void gpu_bind_thread(gpu_t *g);
void gpu_to_device(backend_t *b, void *dst, const void *src, size_t n_bytes);
void gpu_to_host(backend_t *b, void *dst, const void *src, size_t n_bytes);
int gpu_pin_host(backend_t *b, void *p, size_t n_bytes);
void gpu_unpin_host(backend_t *b, void *p);
void gpu_copy_out_begin(backend_t *b);
void gpu_copy_out(backend_t *b, void *dst, const void *src, size_t n_bytes);
void gpu_copy_out_fence(backend_t *b);
void gpu_copy_out_wait(backend_t *b);
int gpu_mark_arenas(backend_t *b, float *params, size_t n_params, float *acts, float *dacts,
                    size_t n_acts);
void gpu_prepare_forward(backend_t *b);
int gpu_graph_begin(backend_t *b);
void *gpu_graph_end(backend_t *b);
int gpu_graph_run(backend_t *b, void *graph);
void gpu_graph_free(backend_t *b, void *graph);
/* cuda_elementwise.cu */
void gpu_fill(backend_t *b, float *x, float v, size_t n);
void gpu_scale(backend_t *b, float *x, float f, size_t n);
void gpu_relu_forward(backend_t *b, tensor_desc_t x_d, tensor_desc_t y_d, size_t n);
void gpu_relu_backward(backend_t *b, tensor_desc_t y_d, tensor_desc_t dy_d, tensor_desc_t dx_d,
                       size_t n);
void gpu_add_forward(backend_t *b, tensor_desc_t x1_d, tensor_desc_t x2_d, tensor_desc_t y_d,
                     size_t n);
void gpu_accumulate(backend_t *b, tensor_desc_t dy_d, tensor_desc_t dx_d, size_t n);
void gpu_dropout_forward(backend_t *b, tensor_desc_t x_d, tensor_desc_t y_d, size_t n, float p,
                         uint64_t key);
void gpu_dropout_backward(backend_t *b, tensor_desc_t dy_d, tensor_desc_t dx_d, size_t n, float p,
                          uint64_t key);
/* cuda_data.cu */
void gpu_augment_batch(backend_t *b, const uint8_t *images, const int32_t *labels, int h, int w,
                       int c, const augment_job_t *jobs, int n, augment_norm_t norm,
                       tensor_desc_t out_d, int32_t *labels_out);
/* cuda_conv.cu */
/* The convolution algorithms found in earlier runs (g->cache_path, then g->shared_cache_path), at
 * start. */
void gpu_algo_cache_load(gpu_t *g);
void gpu_conv2d_forward(backend_t *b, const conv_shape_t *s, tensor_desc_t x_d, const float *w,
                        tensor_desc_t y_d);
void gpu_conv2d_backward(backend_t *b, const conv_shape_t *s, tensor_desc_t x_d, const float *w,
                         tensor_desc_t dy_d, tensor_desc_t dx_d, float *dw);
/* cuda_norm.cu */
void gpu_batchnorm_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                                 const float *gamma, const float *beta, tensor_desc_t y_d,
                                 float *save_mean, float *save_invstd, float *running_mean,
                                 float *running_var, float momentum, float eps);
void gpu_batchnorm_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                                const float *gamma, const float *beta, tensor_desc_t y_d,
                                const float *running_mean, const float *running_var, float eps);
void gpu_batchnorm_backward(backend_t *b, size_t rows, int c, tensor_desc_t x_d, const float *gamma,
                            const float *save_mean, const float *save_invstd, tensor_desc_t dy_d,
                            tensor_desc_t dx_d, float *dgamma, float *dbeta);
void gpu_bias_add(backend_t *b, size_t rows, int c, const float *bias, tensor_desc_t y_d);
void gpu_bias_backward(backend_t *b, size_t rows, int c, tensor_desc_t dy_d, float *dbias);
/* cuda_bn_act.cu */
void gpu_bn_act_forward_train(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                              const float *gamma, const float *beta, tensor_desc_t residual_d,
                              unsigned flags, tensor_desc_t y_d, float *save_mean,
                              float *save_invstd, float *running_mean, float *running_var,
                              float momentum, float eps);
void gpu_bn_act_forward_eval(backend_t *b, size_t rows, int c, tensor_desc_t x_d,
                             const float *gamma, const float *beta, tensor_desc_t residual_d,
                             unsigned flags, tensor_desc_t y_d, const float *running_mean,
                             const float *running_var, float eps);
void gpu_bn_act_backward(backend_t *b, size_t rows, int c, tensor_desc_t x_d, const float *gamma,
                         const float *save_mean, const float *save_invstd, tensor_desc_t y_d,
                         tensor_desc_t dy_d, unsigned flags, tensor_desc_t dx_d,
                         tensor_desc_t dresidual_d, float *dgamma, float *dbeta);
void gpu_bn_act_forward_train_sums(backend_t *b, size_t rows, int c, tensor_desc_t x,
                                   const float *sum, const float *sqsum, const float *gamma,
                                   const float *beta, tensor_desc_t residual, unsigned flags,
                                   tensor_desc_t y, float *save_mean, float *save_invstd,
                                   float *running_mean, float *running_var, float momentum,
                                   float eps);
/* cuda_conv_fusion.cu */
int gpu_conv2d_bn_forward(backend_t *b, const conv_shape_t *s, tensor_desc_t x, const float *scale,
                          const float *bias, const float *w, tensor_desc_t y, float *sum,
                          float *sqsum);
void gpu_conv_fusion_free(gpu_t *g);
/* cuda_pool.cu */
void gpu_maxpool_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x_d, tensor_desc_t y_d,
                         int32_t *argmax);
void gpu_maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax,
                          tensor_desc_t dy_d, tensor_desc_t dx_d);
void gpu_avgpool_global_forward(backend_t *b, int n, int hw, int c, tensor_desc_t x_d,
                                tensor_desc_t y_d);
void gpu_avgpool_global_backward(backend_t *b, int n, int hw, int c, tensor_desc_t dy_d,
                                 tensor_desc_t dx_d);
void gpu_avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, tensor_desc_t x_d,
                                  tensor_desc_t y_d);
void gpu_avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, tensor_desc_t dy_d,
                                   tensor_desc_t dx_d);
/* cuda_linear.cu */
void gpu_linear_forward(backend_t *b, int n, int in, int out, tensor_desc_t x_d, const float *w,
                        const float *bias, tensor_desc_t y_d);
void gpu_linear_backward(backend_t *b, int n, int in, int out, tensor_desc_t x_d, const float *w,
                         tensor_desc_t dy_d, tensor_desc_t dx_d, float *dw, float *dbias);
/* cuda_loss_optim.cu */
void gpu_softmax_xent(backend_t *b, int n, int k, tensor_desc_t logits_d, const int32_t *labels,
                      float smoothing, float grad_scale, const loss_scale_t *ls,
                      tensor_desc_t dlogits_d, float *loss_sum);
void gpu_sgd_step(backend_t *b, float *params, const float *grads, float *momentum_buf, size_t n,
                  float lr, float momentum, float wd, bool is_nesterov, float grad_scale,
                  const loss_scale_t *ls);
void gpu_adam_step(backend_t *b, float *params, const float *grads, float *exp_avg,
                   float *exp_avg_sq, size_t n, const adam_hparams_t *h, float grad_scale,
                   const loss_scale_t *ls, adam_count_t *count);
void gpu_loss_scale_check(backend_t *b, const float *x, size_t n, loss_scale_t *ls);
void gpu_loss_scale_update(backend_t *b, loss_scale_t *ls, uint32_t growth_interval);

#endif
