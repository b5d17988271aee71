/* backend_cuda: see backend_cuda.h. One stream per backend; cuDNN, cuBLAS and the kernels here
 * (batch norm included) run on it; only to_host waits. Convolution algorithms come from cuDNN's
 * timed search, once per shape, kept in a cache file across runs. Every CUDA, cuDNN and cuBLAS
 * call is checked: a failure prints file:line and the library's message and ends the worker
 * (exit 70), as llm.c does. Arithmetic: fp32 (FMA), TF32 tensor cores, or bf16 activations with
 * fp32 parameters, gradients, optimizer and batch-norm statistics. */
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

#define CHECK_CUDA(x) check_cuda((x), #x, __FILE__, __LINE__)
#define CHECK_CUDNN(x) check_cudnn((x), #x, __FILE__, __LINE__)
#define CHECK_CUBLAS(x) check_cublas((x), #x, __FILE__, __LINE__)

static void fail_at(const char *what, const char *msg, const char *file, int line) {
    fprintf(stderr, "ddpworker: %s:%d: %s: %s\n", file, line, what, msg);
    exit(DDP_EXIT_BUG);
}
static void check_cuda(cudaError_t rc, const char *what, const char *file, int line) {
    if (rc != cudaSuccess) fail_at(what, cudaGetErrorString(rc), file, line);
}
static void check_cudnn(cudnnStatus_t rc, const char *what, const char *file, int line) {
    if (rc != CUDNN_STATUS_SUCCESS) fail_at(what, cudnnGetErrorString(rc), file, line);
}
static void check_cublas(cublasStatus_t rc, const char *what, const char *file, int line) {
    if (rc != CUBLAS_STATUS_SUCCESS) fail_at(what, cublasGetStatusString(rc), file, line);
}

#define CONV_CACHE 128

typedef __nv_bfloat16 bf16;
typedef __half f16;

/* The narrow type activations and their gradients are stored in, if any. */
typedef enum { LOW_NONE, LOW_BF16, LOW_FP16 } low_kind_t;

typedef struct {
    conv_shape_t shape;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd_data;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter;
    bool is_sized; /* the workspace has room for these */
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
    float *bn_partials; /* batch-norm reductions: chunks x C partial sums, twice */
    size_t bn_partials_len;
    float *bn_sums;     /* 2 x BN_MAX_CHANNELS */
    bool is_tf32;
    low_kind_t low;        /* activations and their gradients in bf16 or fp16 (BACKEND_CUDA_BF16/FP16) */
    int sm_count;
    /* the model's arenas (mark_arenas): activations are recognised by address */
    const float *params;
    size_t n_params;
    const char *acts, *dacts;
    size_t act_bytes;
    void *shadow;          /* low: the parameters in the narrow type, refreshed before each forward */
    void *dw_scratch;      /* low: a convolution's filter gradient before it joins the fp32 arena */
    float *stage;          /* low: fp32 staging for uploads and read-backs of activations */
    size_t stage_bytes;
    float *wide[3];        /* low: fp32 copies for a convolution run in fp32 (x, y or dy, dx) */
    size_t wide_bytes[3];
    char cache_path[1024]; /* convolution algorithms found earlier (empty: none) */
    char tag[160];         /* cuDNN version, compute capability and GPU name: the cache's key */
} gpu_t;

#define BN_PARTIALS_FLOATS ((size_t)2 << 20)
#define BN_MAX_CHANNELS 65536

static gpu_t *gpu_of(backend_t *b) { return (gpu_t *)b; }

static bool in_range(const void *p, const char *base, size_t n_bytes) {
    return base && (const char *)p >= base && (const char *)p < base + n_bytes;
}

/* Whether p is an activation (or its gradient) stored in the narrow type. Every activation tensor
 * keeps the slot of n floats the model gave it; narrow, its n values fill the first half. */
static bool is_low(const gpu_t *g, const void *p) {
    return g->low != LOW_NONE && (in_range(p, g->acts, g->act_bytes) || in_range(p, g->dacts, g->act_bytes));
}

/* Runs the statement with `Low` naming the narrow type of this backend (bf16 or fp16); LOW and
 * CLOW cast to it. Both types are 2 bytes, so every buffer of them is sized alike. */
#define WITH_LOW(g, ...) \
    do { \
        if ((g)->low == LOW_FP16) { \
            typedef f16 Low; \
            __VA_ARGS__; \
        } else { \
            typedef bf16 Low; \
            __VA_ARGS__; \
        } \
    } while (0)
#define LOW(p) ((Low *)(p))
#define CLOW(p) ((const Low *)(p))
#define LOW_BYTES 2

/* The narrow copy of parameters at w (inside the parameter arena). */
static const void *shadow_of(const gpu_t *g, const float *w) {
    return (const char *)g->shadow + (size_t)(w - g->params) * LOW_BYTES;
}

static unsigned blocks_for(size_t n) {
    size_t blocks = (n + 255) / 256;
    return (unsigned)(blocks > 65535 * 16 ? 65535 * 16 : blocks < 1 ? 1 : blocks);
}

/* ---- memory ---- */

static void *gpu_alloc(backend_t *b, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    void *p = NULL;
    if (cudaMalloc(&p, n_bytes ? n_bytes : 1) != cudaSuccess) return NULL;
    CHECK_CUDA(cudaMemsetAsync(p, 0, n_bytes, g->stream));
    return p;
}

static void gpu_release(backend_t *b, void *p) {
    CHECK_CUDA(cudaStreamSynchronize(gpu_of(b)->stream));
    CHECK_CUDA(cudaFree(p));
}

static bool gpu_is_device(backend_t *b, const void *p) {
    (void)b;
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError(); /* not a pointer CUDA knows: host memory */
        return false;
    }
    return attr.type == cudaMemoryTypeDevice;
}

static int gpu_reserve_workspace(backend_t *b, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (n_bytes <= g->workspace_bytes) return 0;
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
    if (g->workspace) CHECK_CUDA(cudaFree(g->workspace));
    g->workspace = NULL;
    g->workspace_bytes = 0;
    if (cudaMalloc(&g->workspace, n_bytes) != cudaSuccess) return -12; /* -ENOMEM */
    g->workspace_bytes = n_bytes;
    return 0;
}


/* ---- elementwise kernels (templates over the activation type: float, bf16 or fp16; math in float) ---- */

#define GRID_STRIDE(i, n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
                               i += (size_t)gridDim.x * blockDim.x)

__device__ __forceinline__ float ld(const float *p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16 *p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const f16 *p, size_t i) { return __half2float(p[i]); }
__device__ __forceinline__ void st(float *p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16 *p, size_t i, float v) { p[i] = __float2bfloat16(v); }
__device__ __forceinline__ void st(f16 *p, size_t i, float v) { p[i] = __float2half(v); }
__device__ __forceinline__ void add_at(float *p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void add_at(bf16 *p, float v) { atomicAdd(p, __float2bfloat16(v)); }
__device__ __forceinline__ void add_at(f16 *p, float v) { atomicAdd(p, __float2half(v)); }

template <typename T> __global__ void fill_kernel(T *x, float v, size_t n) { GRID_STRIDE(i, n) st(x, i, v); }
__global__ void scale_kernel(float *x, float f, size_t n) { GRID_STRIDE(i, n) x[i] *= f; }
template <typename T> __global__ void relu_kernel(const T *x, T *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, fmaxf(ld(x, i), 0.0f));
}
template <typename T> __global__ void relu_backward_kernel(const T *y, const T *dy, T *dx, size_t n) {
    GRID_STRIDE(i, n) if (ld(y, i) > 0.0f) st(dx, i, ld(dx, i) + ld(dy, i));
}
template <typename T> __global__ void add_kernel(const T *a, const T *b, T *y, size_t n) {
    GRID_STRIDE(i, n) st(y, i, ld(a, i) + ld(b, i));
}
template <typename T> __global__ void accumulate_kernel(const T *dy, T *dx, size_t n) {
    GRID_STRIDE(i, n) st(dx, i, ld(dx, i) + ld(dy, i));
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

#define LAUNCH(kernel, n, ...) \
    do { \
        kernel<<<blocks_for(n), 256, 0, gpu_of(b)->stream>>>(__VA_ARGS__); \
        CHECK_CUDA(cudaGetLastError()); \
    } while (0)

static void gpu_fill(backend_t *b, float *x, float v, size_t n) {
    gpu_t *g = gpu_of(b);
    if (!n) return;
    if (v == 0.0f) /* zero is zero in every type, and an activation's slot is n floats wide */
        CHECK_CUDA(cudaMemsetAsync(x, 0, n * sizeof(float), g->stream));
    else if (is_low(g, x))
        WITH_LOW(g, LAUNCH(fill_kernel<Low>, n, LOW(x), v, n));
    else
        LAUNCH(fill_kernel<float>, n, x, v, n);
}
static void gpu_scale(backend_t *b, float *x, float f, size_t n) { if (n) LAUNCH(scale_kernel, n, x, f, n); }
static void gpu_relu_forward(backend_t *b, const float *x, float *y, size_t n) {
    if (!n) return;
    if (is_low(gpu_of(b), x)) WITH_LOW(gpu_of(b), LAUNCH(relu_kernel<Low>, n, CLOW(x), LOW(y), n));
    else LAUNCH(relu_kernel<float>, n, x, y, n);
}
static void gpu_relu_backward(backend_t *b, const float *y, const float *dy, float *dx, size_t n) {
    if (!n) return;
    if (is_low(gpu_of(b), y)) WITH_LOW(gpu_of(b), LAUNCH(relu_backward_kernel<Low>, n, CLOW(y), CLOW(dy), LOW(dx), n));
    else LAUNCH(relu_backward_kernel<float>, n, y, dy, dx, n);
}
static void gpu_add_forward(backend_t *b, const float *x1, const float *x2, float *y, size_t n) {
    if (!n) return;
    if (is_low(gpu_of(b), x1)) WITH_LOW(gpu_of(b), LAUNCH(add_kernel<Low>, n, CLOW(x1), CLOW(x2), LOW(y), n));
    else LAUNCH(add_kernel<float>, n, x1, x2, y, n);
}
static void gpu_accumulate(backend_t *b, const float *dy, float *dx, size_t n) {
    if (!n) return;
    if (is_low(gpu_of(b), dy)) WITH_LOW(gpu_of(b), LAUNCH(accumulate_kernel<Low>, n, CLOW(dy), LOW(dx), n));
    else LAUNCH(accumulate_kernel<float>, n, dy, dx, n);
}

/* ---- copies: fp32 on the host side always; narrow activations are converted on the device ---- */

/* Device scratch grown on first use (the first step) and kept. */
static float *grown(gpu_t *g, float **buf, size_t *have, size_t n_bytes) {
    if (n_bytes > *have) {
        CHECK_CUDA(cudaStreamSynchronize(g->stream));
        if (*buf) CHECK_CUDA(cudaFree(*buf));
        *buf = NULL;
        *have = 0;
        CHECK_CUDA(cudaMalloc(buf, n_bytes));
        *have = n_bytes;
    }
    return *buf;
}

/* fp32 staging for converting copies. */
static float *stage(gpu_t *g, size_t n_bytes) { return grown(g, &g->stage, &g->stage_bytes, n_bytes); }

static void gpu_to_device(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (!n_bytes) return;
    /* from pageable memory the copy has read src before it returns, so src may be reused */
    if (!is_low(g, dst)) {
        CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, g->stream));
        return;
    }
    float *s = stage(g, n_bytes);
    CHECK_CUDA(cudaMemcpyAsync(s, src, n_bytes, cudaMemcpyHostToDevice, g->stream));
    size_t n = n_bytes / sizeof(float);
    WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), n, s, LOW(dst), n));
}

static void gpu_to_host(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (n_bytes && is_low(g, src)) {
        float *s = stage(g, n_bytes);
        size_t n = n_bytes / sizeof(float);
        WITH_LOW(g, LAUNCH((convert_kernel<Low, float>), n, CLOW(src), s, n));
        src = s;
    }
    if (n_bytes) CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, g->stream));
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
}

/* ---- the data path: a batch from the dataset held on the GPU (uint8), one thread per value ---- */

/* augment_apply's arithmetic: the same rounded multiply and add (never an FMA), so the same bits. */
template <typename T>
__global__ void augment_kernel(const uint8_t *images, const int32_t *labels, int h, int w, int c,
                               const augment_job_t *jobs, int n, augment_norm_t norm, T *out, int32_t *labels_out) {
    size_t per = (size_t)h * w * c;
    GRID_STRIDE(o, per * n) {
        size_t i = o / per, r = o % per, p = r / c;
        int k = (int)(r % c), x = (int)(p % w), y = (int)(p / w);
        const augment_job_t *job = &jobs[i];
        int sy = y + job->choice.dy, sx = (job->choice.is_flipped ? w - 1 - x : x) + job->choice.dx;
        bool is_inside = sy >= 0 && sy < h && sx >= 0 && sx < w;
        float v = is_inside ? (float)images[(size_t)job->index * per + ((size_t)sy * w + sx) * c + k] : 0.0f;
        st(out, o, __fadd_rn(__fmul_rn(v, norm.scale[k]), norm.shift[k]));
        if (r == 0) labels_out[i] = labels[job->index];
    }
}

static void gpu_augment_batch(backend_t *b, const uint8_t *images, const int32_t *labels, int h, int w, int c,
                              const augment_job_t *jobs, int n, augment_norm_t norm, float *out, int32_t *labels_out) {
    size_t total = (size_t)h * w * c * n;
    if (!total) return;
    if (is_low(gpu_of(b), out))
        WITH_LOW(gpu_of(b), LAUNCH(augment_kernel<Low>, total, images, labels, h, w, c, jobs, n, norm, LOW(out),
                                   labels_out));
    else
        LAUNCH(augment_kernel<float>, total, images, labels, h, w, c, jobs, n, norm, out, labels_out);
}

/* ---- convolution (cuDNN, NHWC, KRSC filters) ---- */

/* is_low: narrow tensors and filters (float accumulation, tensor cores); else fp32, FMA or TF32. */
static void describe_conv(gpu_t *g, const conv_shape_t *s, bool is_low) {
    cudnnDataType_t t = !is_low ? CUDNN_DATA_FLOAT : g->low == LOW_FP16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
    CHECK_CUDNN(cudnnSetTensor4dDescriptor(g->x_desc, CUDNN_TENSOR_NHWC, t, s->n, s->c, s->h, s->w));
    CHECK_CUDNN(cudnnSetTensor4dDescriptor(g->y_desc, CUDNN_TENSOR_NHWC, t, s->n, s->k, s->oh, s->ow));
    CHECK_CUDNN(cudnnSetFilter4dDescriptor(g->w_desc, t, CUDNN_TENSOR_NHWC, s->k, s->c, s->r, s->s));
    CHECK_CUDNN(cudnnSetConvolution2dDescriptor(g->conv_desc, s->pad, s->pad, s->stride, s->stride, 1, 1,
                                                CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CHECK_CUDNN(cudnnSetConvolutionMathType(g->conv_desc,
                                            is_low || g->is_tf32 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH));
}

/* The arithmetic the algorithm cache is keyed by: 0 fp32, 1 tf32, 2 bf16, 3 fp16. */
static int math_mode(const gpu_t *g) {
    return g->low == LOW_FP16 ? 3 : g->low == LOW_BF16 ? 2 : g->is_tf32 ? 1 : 0;
}

/* The convolution algorithms: cuDNN's timed search (cudnnFind*, which runs each candidate on
 * scratch memory of its own) the first time a shape is seen, remembered in memory and, when the
 * backend has a cache file, there too, so later starts skip the search. cuDNN's heuristics alone
 * picked a direct NHWC kernel 20x slower than the best for ResNet-18's backward data pass. */

static const char *cache_tag(gpu_t *g) {
    if (!g->tag[0]) {
        cudaDeviceProp prop;
        CHECK_CUDA(cudaGetDeviceProperties(&prop, g->device));
        snprintf(g->tag, sizeof g->tag, "cudnn%zu:sm%d%d:", cudnnGetVersion(), prop.major, prop.minor);
        size_t at = strlen(g->tag);
        for (const char *c = prop.name; *c && at + 1 < sizeof g->tag; c++) g->tag[at++] = *c == ' ' ? '_' : *c;
        g->tag[at] = '\0';
    }
    return g->tag;
}

static void algo_cache_load(gpu_t *g) {
    FILE *f = g->cache_path[0] ? fopen(g->cache_path, "r") : NULL;
    if (!f) return;
    char line[512], tag[160];
    while (fgets(line, sizeof line, f) && g->n_algos < CONV_CACHE) {
        conv_algos_t a;
        memset(&a, 0, sizeof a);
        conv_shape_t *s = &a.shape;
        int mode, fwd, bd, bf;
        if (sscanf(line, "%159s %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d", tag, &s->n, &s->h, &s->w, &s->c,
                   &s->k, &s->r, &s->s, &s->stride, &s->pad, &s->oh, &s->ow, &mode, &fwd, &bd, &bf) != 16 ||
            strcmp(tag, cache_tag(g)) != 0 || mode != math_mode(g))
            continue; /* another GPU, cuDNN or math mode: not ours to use */
        a.fwd = (cudnnConvolutionFwdAlgo_t)fwd;
        a.bwd_data = (cudnnConvolutionBwdDataAlgo_t)bd;
        a.bwd_filter = (cudnnConvolutionBwdFilterAlgo_t)bf;
        g->algos[g->n_algos++] = a;
    }
    fclose(f);
}

static void algo_cache_append(gpu_t *g, const conv_algos_t *a) {
    FILE *f = g->cache_path[0] ? fopen(g->cache_path, "a") : NULL;
    if (!f) return; /* a cache is an optimisation: without one the next start searches again */
    const conv_shape_t *s = &a->shape;
    fprintf(f, "%s %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", cache_tag(g), s->n, s->h, s->w, s->c, s->k,
            s->r, s->s, s->stride, s->pad, s->oh, s->ow, math_mode(g), (int)a->fwd, (int)a->bwd_data,
            (int)a->bwd_filter);
    fclose(f);
}

#define CONV_WORKSPACE_MAX ((size_t)512 << 20)

/* The first (fastest) result that succeeded within the workspace limit. */
#define FASTEST(perf, n, fallback) \
    ({ \
        int pick_ = -1; \
        for (int i_ = 0; i_ < (n) && pick_ < 0; i_++) \
            if ((perf)[i_].status == CUDNN_STATUS_SUCCESS && (perf)[i_].memory <= CONV_WORKSPACE_MAX) pick_ = i_; \
        pick_ >= 0 ? (perf)[pick_].algo : (fallback); \
    })

static void ensure_workspace(gpu_t *g, size_t n_bytes) {
    if (n_bytes > g->workspace_bytes && gpu_reserve_workspace(&g->base, n_bytes) < 0)
        fail_at("convolution workspace", "out of GPU memory", __FILE__, __LINE__);
}

static const conv_algos_t *conv_algos(gpu_t *g, const conv_shape_t *s) {
    conv_algos_t *a = NULL;
    for (int i = 0; i < g->n_algos && !a; i++)
        if (memcmp(&g->algos[i].shape, s, sizeof *s) == 0) a = &g->algos[i];
    if (!a) {
        if (g->n_algos == CONV_CACHE) g->n_algos = 0; /* more shapes than any model here has */
        a = &g->algos[g->n_algos++];
        memset(a, 0, sizeof *a);
        a->shape = *s;
        int n = 0;
        cudnnConvolutionFwdAlgoPerf_t fwd[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionForwardAlgorithm(g->cudnn, g->x_desc, g->w_desc, g->conv_desc, g->y_desc,
                                                         CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, fwd));
        a->fwd = FASTEST(fwd, n, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
        cudnnConvolutionBwdDataAlgoPerf_t bd[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionBackwardDataAlgorithm(g->cudnn, g->w_desc, g->y_desc, g->conv_desc,
                                                              g->x_desc, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                                              &n, bd));
        a->bwd_data = FASTEST(bd, n, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
        cudnnConvolutionBwdFilterAlgoPerf_t bf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionBackwardFilterAlgorithm(g->cudnn, g->x_desc, g->y_desc, g->conv_desc,
                                                                g->w_desc, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                                                                &n, bf));
        a->bwd_filter = FASTEST(bf, n, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
        algo_cache_append(g, a);
    }
    if (!a->is_sized) { /* found now or read from the cache file: make room for its workspace */
        size_t need = 0, bytes = 0;
        CHECK_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(g->cudnn, g->x_desc, g->w_desc, g->conv_desc,
                                                            g->y_desc, a->fwd, &bytes));
        need = bytes > need ? bytes : need;
        CHECK_CUDNN(cudnnGetConvolutionBackwardDataWorkspaceSize(g->cudnn, g->w_desc, g->y_desc, g->conv_desc,
                                                                 g->x_desc, a->bwd_data, &bytes));
        need = bytes > need ? bytes : need;
        CHECK_CUDNN(cudnnGetConvolutionBackwardFilterWorkspaceSize(g->cudnn, g->x_desc, g->y_desc, g->conv_desc,
                                                                   g->w_desc, a->bwd_filter, &bytes));
        need = bytes > need ? bytes : need;
        ensure_workspace(g, need);
        a->is_sized = true;
    }
    return a;
}

/* bf16 or fp16 mode, input channels not a multiple of 8 (a network's first convolution, on 1 or 3
 * channels): cuDNN's narrow kernels want channel counts in multiples of 8, so such a convolution runs
 * in fp32 on converted copies; it is a small part of the network's work. */
static bool is_narrow(const conv_shape_t *s) { return s->c % 8 != 0; }

static float *widened(backend_t *b, int slot, const float *low_src, size_t n) {
    gpu_t *g = gpu_of(b);
    float *w = grown(g, &g->wide[slot], &g->wide_bytes[slot], n * sizeof(float));
    if (low_src) WITH_LOW(g, LAUNCH((convert_kernel<Low, float>), n, CLOW(low_src), w, n));
    return w;
}

static void narrow_conv_forward(backend_t *b, const conv_shape_t *s, const float *x, const float *w, float *y) {
    gpu_t *g = gpu_of(b);
    size_t nx = (size_t)s->n * s->h * s->w * s->c, ny = (size_t)s->n * s->oh * s->ow * s->k;
    float *x32 = widened(b, 0, x, nx), *y32 = widened(b, 1, NULL, ny);
    describe_conv(g, s, false);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDNN(cudnnConvolutionForward(g->cudnn, &one, g->x_desc, x32, g->w_desc, w, g->conv_desc, a->fwd,
                                        g->workspace, g->workspace_bytes, &zero, g->y_desc, y32));
    WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), ny, y32, LOW(y), ny));
}

static void narrow_conv_backward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                                 const float *dy, float *dx, float *dw) {
    gpu_t *g = gpu_of(b);
    size_t nx = (size_t)s->n * s->h * s->w * s->c, ny = (size_t)s->n * s->oh * s->ow * s->k;
    float *x32 = widened(b, 0, x, nx), *dy32 = widened(b, 1, dy, ny);
    describe_conv(g, s, false);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x32, g->y_desc, dy32, g->conv_desc,
                                               a->bwd_filter, g->workspace, g->workspace_bytes, &one, g->w_desc,
                                               dw));
    if (!dx) return;
    float *dx32 = widened(b, 2, NULL, nx);
    CHECK_CUDNN(cudnnConvolutionBackwardData(g->cudnn, &one, g->w_desc, w, g->y_desc, dy32, g->conv_desc,
                                             a->bwd_data, g->workspace, g->workspace_bytes, &zero, g->x_desc,
                                             dx32));
    WITH_LOW(g, LAUNCH(add_wide_kernel<Low>, nx, dx32, LOW(dx), nx));
}

static void gpu_conv2d_forward(backend_t *b, const conv_shape_t *s, const float *x, const float *w, float *y) {
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x);
    if (low && is_narrow(s)) {
        narrow_conv_forward(b, s, x, w, y);
        return;
    }
    describe_conv(g, s, low);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    const void *filter = low ? (const void *)shadow_of(g, w) : (const void *)w;
    CHECK_CUDNN(cudnnConvolutionForward(g->cudnn, &one, g->x_desc, x, g->w_desc, filter, g->conv_desc, a->fwd,
                                        g->workspace, g->workspace_bytes, &zero, g->y_desc, y));
}

static void gpu_conv2d_backward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                                const float *dy, float *dx, float *dw) {
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x);
    if (low && is_narrow(s)) {
        narrow_conv_backward(b, s, x, w, dy, dx, dw);
        return;
    }
    describe_conv(g, s, low);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f; /* beta 1: accumulate, as backend_i asks */
    if (low) { /* cuDNN's filter gradient has the filter's type: narrow first, then into the fp32 arena */
        void *dw_low = (char *)g->dw_scratch + (size_t)(w - g->params) * LOW_BYTES;
        size_t n_w = (size_t)s->k * s->r * s->s * s->c;
        CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x, g->y_desc, dy, g->conv_desc,
                                                   a->bwd_filter, g->workspace, g->workspace_bytes, &zero,
                                                   g->w_desc, dw_low));
        WITH_LOW(g, LAUNCH(add_low_kernel<Low>, n_w, CLOW(dw_low), dw, n_w));
    } else {
        CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x, g->y_desc, dy, g->conv_desc,
                                                   a->bwd_filter, g->workspace, g->workspace_bytes, &one,
                                                   g->w_desc, dw));
    }
    const void *filter = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (dx)
        CHECK_CUDNN(cudnnConvolutionBackwardData(g->cudnn, &one, g->w_desc, filter, g->y_desc, dy, g->conv_desc,
                                                 a->bwd_data, g->workspace, g->workspace_bytes, &one,
                                                 g->x_desc, dx));
}

/* ---- batch norm: own kernels over rows = N*H*W of C channels (NHWC) ----
 * cuDNN's spatial batch norm sees such a tensor as (rows, C, 1, 1) and is slow there, and its
 * inference call refuses large row counts. One pass gathers per-channel sums of (x - shift) and
 * (x - shift)^2, shift being the channel's first value (close to the mean, so no cancellation),
 * reduced deterministically: each block of BN_TILE channels x a chunk of rows writes one partial
 * per channel, then a warp per channel sums the partials in a fixed order, in double. */

#define BN_TILE 32
#define BN_ROWS_PER_BLOCK 8 /* blockDim.y */

/* Row chunks: about four blocks per multiprocessor in all, at least 64 rows each. */
static int bn_chunks(const gpu_t *g, size_t rows, int c) {
    size_t tiles = (size_t)(c + BN_TILE - 1) / BN_TILE, want = (4 * (size_t)g->sm_count + tiles - 1) / tiles;
    size_t most = rows / 64, room = g->bn_partials_len / (2 * (size_t)c);
    size_t n = want < most ? want : most;
    n = n < room ? n : room;
    return (int)(n < 1 ? 1 : n);
}

/* partial[chunk][ch], partial2[chunk][ch]: mode 0: sums of (x - x[0]) and (x - x[0])^2;
 * mode 1 (backward): sums of dy and dy * (x - mean) * invstd. */
template <typename T>
__global__ void bn_partials_kernel(int mode, size_t rows, int c, const T *x, const T *dy,
                                   const float *mean, const float *invstd, float *partial, float *partial2) {
    __shared__ float s1[BN_ROWS_PER_BLOCK][BN_TILE], s2[BN_ROWS_PER_BLOCK][BN_TILE];
    int ch = blockIdx.x * BN_TILE + threadIdx.x;
    size_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
    size_t begin = blockIdx.y * per_chunk, end = begin + per_chunk < rows ? begin + per_chunk : rows;
    float a = 0.0f, b = 0.0f;
    if (ch < c) {
        float shift = mode == 0 ? ld(x, ch) : mean[ch], is = mode == 1 ? invstd[ch] : 0.0f;
        for (size_t r = begin + threadIdx.y; r < end; r += BN_ROWS_PER_BLOCK) {
            float v = ld(x, r * c + ch) - shift;
            if (mode == 0) {
                a += v;
                b += v * v;
            } else {
                float d = ld(dy, r * c + ch);
                a += d;
                b += d * v * is;
            }
        }
    }
    s1[threadIdx.y][threadIdx.x] = a;
    s2[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && ch < c) {
        for (int i = 1; i < BN_ROWS_PER_BLOCK; i++) {
            a += s1[i][threadIdx.x];
            b += s2[i][threadIdx.x];
        }
        partial[(size_t)blockIdx.y * c + ch] = a;
        partial2[(size_t)blockIdx.y * c + ch] = b;
    }
}

static void bn_reduce(gpu_t *g, int mode, size_t rows, int c, int chunks, const float *x, const float *dy,
                      const float *mean, const float *invstd) {
    dim3 grid((unsigned)((c + BN_TILE - 1) / BN_TILE), (unsigned)chunks), block(BN_TILE, BN_ROWS_PER_BLOCK);
    float *p1 = g->bn_partials, *p2 = g->bn_partials + (size_t)chunks * c;
    if (is_low(g, x))
        WITH_LOW(g, bn_partials_kernel<Low><<<grid, block, 0, g->stream>>>(mode, rows, c, CLOW(x), CLOW(dy), mean,
                                                                          invstd, p1, p2));
    else
        bn_partials_kernel<float><<<grid, block, 0, g->stream>>>(mode, rows, c, x, dy, mean, invstd, p1, p2);
    CHECK_CUDA(cudaGetLastError());
}

/* The two partial sums of channel blockIdx.x over every chunk, by one warp, in a fixed order. */
__device__ void bn_sum_chunks(int c, int chunks, const float *partial, double *s1, double *s2) {
    int ch = blockIdx.x;
    double a = 0, b = 0;
    for (int i = threadIdx.x; i < chunks; i += 32) {
        a += partial[(size_t)i * c + ch];
        b += partial[(size_t)(chunks + i) * c + ch];
    }
    for (int off = 16; off > 0; off /= 2) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
    }
    *s1 = a;
    *s2 = b;
}

template <typename T>
__global__ void bn_stats_kernel(int c, int chunks, size_t rows, const T *x, const float *partial, float *mean,
                                float *invstd, float *running_mean, float *running_var, float momentum, float eps) {
    double sum, sq;
    bn_sum_chunks(c, chunks, partial, &sum, &sq);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    double n = (double)rows, shifted_mean = sum / n, var = sq / n - shifted_mean * shifted_mean;
    var = var > 0 ? var : 0;
    double mu = ld(x, ch) + shifted_mean, unbiased = rows > 1 ? var * n / (n - 1) : var;
    mean[ch] = (float)mu;
    invstd[ch] = (float)(1.0 / sqrt(var + eps));
    running_mean[ch] = (float)((1.0 - momentum) * running_mean[ch] + momentum * mu);
    running_var[ch] = (float)((1.0 - momentum) * running_var[ch] + momentum * unbiased);
}

/* y = (x - mean) * invstd * gamma + beta; eval passes the running variance as var (invstd NULL). */
template <typename T>
__global__ void bn_apply_kernel(size_t n, int c, const T *x, const float *mean, const float *invstd,
                                const float *var, float eps, const float *gamma, const float *beta, T *y) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float is = invstd ? invstd[ch] : rsqrtf(var[ch] + eps);
        st(y, i, (ld(x, i) - mean[ch]) * is * gamma[ch] + beta[ch]);
    }
}

static void bn_apply(backend_t *b, size_t rows, int c, const float *x, const float *mean, const float *invstd,
                     const float *var, float eps, const float *gamma, const float *beta, float *y) {
    size_t n = rows * c;
    if (is_low(gpu_of(b), x))
        WITH_LOW(gpu_of(b), LAUNCH(bn_apply_kernel<Low>, n, n, c, CLOW(x), mean, invstd, var, eps, gamma, beta, LOW(y)));
    else
        LAUNCH(bn_apply_kernel<float>, n, n, c, x, mean, invstd, var, eps, gamma, beta, y);
}

static void gpu_batchnorm_forward_train(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                                        const float *beta, float *y, float *save_mean, float *save_invstd,
                                        float *running_mean, float *running_var, float momentum, float eps) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
    int chunks = bn_chunks(g, rows, c);
    bn_reduce(g, 0, rows, c, chunks, x, NULL, NULL, NULL);
    if (is_low(g, x))
        WITH_LOW(g, bn_stats_kernel<Low><<<c, 32, 0, g->stream>>>(c, chunks, rows, CLOW(x), g->bn_partials, save_mean,
                                                                  save_invstd, running_mean, running_var, momentum,
                                                                  eps));
    else
        bn_stats_kernel<float><<<c, 32, 0, g->stream>>>(c, chunks, rows, x, g->bn_partials, save_mean,
                                                        save_invstd, running_mean, running_var, momentum, eps);
    CHECK_CUDA(cudaGetLastError());
    bn_apply(b, rows, c, x, save_mean, save_invstd, NULL, eps, gamma, beta, y);
}

static void gpu_batchnorm_forward_eval(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                                       const float *beta, float *y, const float *running_mean,
                                       const float *running_var, float eps) {
    if (rows && c) bn_apply(b, rows, c, x, running_mean, NULL, running_var, eps, gamma, beta, y);
}

__global__ void bn_grad_params_kernel(int c, int chunks, const float *partial, float *dgamma, float *dbeta,
                                      float *sums) {
    double sum_dy, sum_dy_xhat;
    bn_sum_chunks(c, chunks, partial, &sum_dy, &sum_dy_xhat);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    dbeta[ch] += (float)sum_dy;
    dgamma[ch] += (float)sum_dy_xhat;
    sums[ch] = (float)sum_dy;
    sums[c + ch] = (float)sum_dy_xhat;
}

/* dx += gamma * invstd / rows * (rows * dy - sum(dy) - xhat * sum(dy * xhat)) */
template <typename T>
__global__ void bn_backward_dx_kernel(size_t n, size_t rows, int c, const T *x, const T *dy,
                                      const float *gamma, const float *mean, const float *invstd,
                                      const float *sums, T *dx) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float xhat = (ld(x, i) - mean[ch]) * invstd[ch];
        float k = gamma[ch] * invstd[ch] / (float)rows;
        st(dx, i, ld(dx, i) + k * ((float)rows * ld(dy, i) - sums[ch] - xhat * sums[c + ch]));
    }
}

static void gpu_batchnorm_backward(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                                   const float *save_mean, const float *save_invstd, const float *dy, float *dx,
                                   float *dgamma, float *dbeta) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
    int chunks = bn_chunks(g, rows, c);
    bn_reduce(g, 1, rows, c, chunks, x, dy, save_mean, save_invstd);
    float *sums = g->bn_sums;
    bn_grad_params_kernel<<<c, 32, 0, g->stream>>>(c, chunks, g->bn_partials, dgamma, dbeta, sums);
    CHECK_CUDA(cudaGetLastError());
    size_t n = rows * c;
    if (is_low(g, x))
        WITH_LOW(g, LAUNCH(bn_backward_dx_kernel<Low>, n, n, rows, c, CLOW(x), CLOW(dy), gamma, save_mean, save_invstd,
                           sums, LOW(dx)));
    else
        LAUNCH(bn_backward_dx_kernel<float>, n, n, rows, c, x, dy, gamma, save_mean, save_invstd, sums, dx);
}

/* ---- pooling ---- */

/* cells of the window outside the input are -inf (nn.MaxPool2d's padding); a NaN wins, as on cpu */
template <typename T> __global__ void maxpool_kernel(pool_shape_t s, const T *x, T *y, int32_t *argmax) {
    size_t n_out = (size_t)s.n * s.oh * s.ow * s.c;
    GRID_STRIDE(o, n_out) {
        int ch = (int)(o % s.c);
        size_t pix = o / s.c;
        int ox = (int)(pix % s.ow), oy = (int)(pix / s.ow % s.oh), n = (int)(pix / ((size_t)s.ow * s.oh));
        const T *xn = x + (size_t)n * s.h * s.w * s.c;
        int y0 = oy * s.stride - s.pad, y1 = min(y0 + s.size, s.h), x0 = ox * s.stride - s.pad;
        int x1 = min(x0 + s.size, s.w);
        y0 = max(y0, 0);
        x0 = max(x0, 0);
        float best = -INFINITY;
        int32_t best_at = (y0 * s.w + x0) * s.c + ch;
        for (int iy = y0; iy < y1; iy++)
            for (int ix = x0; ix < x1; ix++) {
                int at = (iy * s.w + ix) * s.c + ch;
                float v = ld(xn, at);
                if (v > best || isnan(v)) {
                    best = v;
                    best_at = at;
                }
            }
        st(y, o, best);
        argmax[o] = best_at;
    }
}

template <typename T>
__global__ void maxpool_backward_kernel(pool_shape_t s, const int32_t *argmax, const T *dy, T *dx) {
    size_t per_out = (size_t)s.oh * s.ow * s.c, per_in = (size_t)s.h * s.w * s.c;
    GRID_STRIDE(o, per_out * s.n) add_at(&dx[o / per_out * per_in + argmax[o]], ld(dy, o));
}

static void gpu_maxpool_forward(backend_t *b, const pool_shape_t *s, const float *x, float *y, int32_t *argmax) {
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), x)) WITH_LOW(gpu_of(b), LAUNCH(maxpool_kernel<Low>, n, *s, CLOW(x), LOW(y), argmax));
    else LAUNCH(maxpool_kernel<float>, n, *s, x, y, argmax);
}

static void gpu_maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax, const float *dy,
                                 float *dx) {
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), dy)) WITH_LOW(gpu_of(b), LAUNCH(maxpool_backward_kernel<Low>, n, *s, argmax, CLOW(dy), LOW(dx)));
    else LAUNCH(maxpool_backward_kernel<float>, n, *s, argmax, dy, dx);
}

template <typename T> __global__ void avgpool_kernel(int n, int hw, int c, const T *x, T *y) {
    GRID_STRIDE(o, (size_t)n * c) {
        size_t i = o / c, ch = o % c;
        float sum = 0.0f;
        for (int p = 0; p < hw; p++) sum += ld(x, (i * hw + p) * c + ch);
        st(y, o, sum / (float)hw);
    }
}

template <typename T> __global__ void avgpool_backward_kernel(int n, int hw, int c, const T *dy, T *dx) {
    GRID_STRIDE(o, (size_t)n * hw * c) {
        size_t ch = o % c, i = o / ((size_t)hw * c);
        st(dx, o, ld(dx, o) + ld(dy, i * c + ch) / (float)hw);
    }
}

static void gpu_avgpool_global_forward(backend_t *b, int n, int hw, int c, const float *x, float *y) {
    if (!n || !c) return;
    if (is_low(gpu_of(b), x)) WITH_LOW(gpu_of(b), LAUNCH(avgpool_kernel<Low>, (size_t)n * c, n, hw, c, CLOW(x), LOW(y)));
    else LAUNCH(avgpool_kernel<float>, (size_t)n * c, n, hw, c, x, y);
}

static void gpu_avgpool_global_backward(backend_t *b, int n, int hw, int c, const float *dy, float *dx) {
    if (!n || !c) return;
    if (is_low(gpu_of(b), dy))
        WITH_LOW(gpu_of(b), LAUNCH(avgpool_backward_kernel<Low>, (size_t)n * hw * c, n, hw, c, CLOW(dy), LOW(dx)));
    else LAUNCH(avgpool_backward_kernel<float>, (size_t)n * hw * c, n, hw, c, dy, dx);
}

/* ---- adaptive average pooling (PyTorch's bins), dropout, convolution bias ---- */

__device__ __forceinline__ int bin_start(int i, int in, int out) { return (int)((long long)i * in / out); }
__device__ __forceinline__ int bin_end(int i, int in, int out) {
    return (int)(((long long)(i + 1) * in + out - 1) / out);
}

template <typename T> __global__ void avgpool_adaptive_kernel(pool_shape_t s, const T *x, T *y) {
    GRID_STRIDE(o, (size_t)s.n * s.oh * s.ow * s.c) {
        int ch = (int)(o % s.c);
        size_t pix = o / s.c;
        int ox = (int)(pix % s.ow), oy = (int)(pix / s.ow % s.oh), n = (int)(pix / ((size_t)s.ow * s.oh));
        int y0 = bin_start(oy, s.h, s.oh), y1 = bin_end(oy, s.h, s.oh);
        int x0 = bin_start(ox, s.w, s.ow), x1 = bin_end(ox, s.w, s.ow);
        const T *xn = x + (size_t)n * s.h * s.w * s.c;
        float sum = 0.0f; /* the cpu backend's order: rows, then columns */
        for (int iy = y0; iy < y1; iy++)
            for (int ix = x0; ix < x1; ix++) sum += ld(xn, ((size_t)iy * s.w + ix) * s.c + ch);
        st(y, o, sum / (float)((y1 - y0) * (x1 - x0)));
    }
}

/* One thread per input value gathers from the output cells whose bins hold it: rows
 * [floor(iy * OH / H), ceil((iy + 1) * OH / H)), columns alike. No atomics. */
template <typename T> __global__ void avgpool_adaptive_backward_kernel(pool_shape_t s, const T *dy, T *dx) {
    GRID_STRIDE(i, (size_t)s.n * s.h * s.w * s.c) {
        int ch = (int)(i % s.c);
        size_t pix = i / s.c;
        int ix = (int)(pix % s.w), iy = (int)(pix / s.w % s.h), n = (int)(pix / ((size_t)s.w * s.h));
        const T *dyn = dy + (size_t)n * s.oh * s.ow * s.c;
        float sum = 0.0f;
        for (int oy = bin_start(iy, s.oh, s.h); oy < bin_end(iy, s.oh, s.h); oy++) {
            int y0 = bin_start(oy, s.h, s.oh), y1 = bin_end(oy, s.h, s.oh);
            for (int ox = bin_start(ix, s.ow, s.w); ox < bin_end(ix, s.ow, s.w); ox++) {
                int x0 = bin_start(ox, s.w, s.ow), x1 = bin_end(ox, s.w, s.ow);
                sum += ld(dyn, ((size_t)oy * s.ow + ox) * s.c + ch) / (float)((y1 - y0) * (x1 - x0));
            }
        }
        st(dx, i, ld(dx, i) + sum);
    }
}

static void gpu_avgpool_adaptive_forward(backend_t *b, const pool_shape_t *s, const float *x, float *y) {
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), x)) WITH_LOW(gpu_of(b), LAUNCH(avgpool_adaptive_kernel<Low>, n, *s, CLOW(x), LOW(y)));
    else LAUNCH(avgpool_adaptive_kernel<float>, n, *s, x, y);
}

static void gpu_avgpool_adaptive_backward(backend_t *b, const pool_shape_t *s, const float *dy, float *dx) {
    size_t n = (size_t)s->n * s->h * s->w * s->c;
    if (!n) return;
    if (is_low(gpu_of(b), dy))
        WITH_LOW(gpu_of(b), LAUNCH(avgpool_adaptive_backward_kernel<Low>, n, *s, CLOW(dy), LOW(dx)));
    else LAUNCH(avgpool_adaptive_backward_kernel<float>, n, *s, dy, dx);
}

template <typename T>
__global__ void dropout_kernel(const T *x, T *y, size_t n, uint32_t threshold, float scale, uint64_t key) {
    GRID_STRIDE(i, n) st(y, i, dropout_keeps(key, i, threshold) ? ld(x, i) * scale : 0.0f);
}

template <typename T>
__global__ void dropout_backward_kernel(const T *dy, T *dx, size_t n, uint32_t threshold, float scale,
                                        uint64_t key) {
    GRID_STRIDE(i, n) if (dropout_keeps(key, i, threshold)) st(dx, i, ld(dx, i) + ld(dy, i) * scale);
}

static void gpu_dropout_forward(backend_t *b, const float *x, float *y, size_t n, float p, uint64_t key) {
    if (!n) return;
    uint32_t t = dropout_threshold(p);
    float scale = dropout_scale(p);
    if (is_low(gpu_of(b), x)) WITH_LOW(gpu_of(b), LAUNCH(dropout_kernel<Low>, n, CLOW(x), LOW(y), n, t, scale, key));
    else LAUNCH(dropout_kernel<float>, n, x, y, n, t, scale, key);
}

static void gpu_dropout_backward(backend_t *b, const float *dy, float *dx, size_t n, float p, uint64_t key) {
    if (!n) return;
    uint32_t t = dropout_threshold(p);
    float scale = dropout_scale(p);
    if (is_low(gpu_of(b), dy))
        WITH_LOW(gpu_of(b), LAUNCH(dropout_backward_kernel<Low>, n, CLOW(dy), LOW(dx), n, t, scale, key));
    else LAUNCH(dropout_backward_kernel<float>, n, dy, dx, n, t, scale, key);
}

template <typename T> __global__ void bias_add_kernel(size_t n, int c, const float *bias, T *y) {
    GRID_STRIDE(i, n) st(y, i, ld(y, i) + bias[i % c]);
}

static void gpu_bias_add(backend_t *b, size_t rows, int c, const float *bias, float *y) {
    size_t n = rows * (size_t)c;
    if (!n) return;
    if (is_low(gpu_of(b), y)) WITH_LOW(gpu_of(b), LAUNCH(bias_add_kernel<Low>, n, n, c, bias, LOW(y)));
    else LAUNCH(bias_add_kernel<float>, n, n, c, bias, y);
}

/* The bias gradient: batch norm's deterministic two-pass reduction (partials per row chunk, then a
 * warp per channel), on the column sums alone. */
template <typename T>
__global__ void column_partials_kernel(size_t rows, int c, const T *dy, float *partial) {
    __shared__ float s1[BN_ROWS_PER_BLOCK][BN_TILE];
    int ch = blockIdx.x * BN_TILE + threadIdx.x;
    size_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
    size_t begin = blockIdx.y * per_chunk, end = begin + per_chunk < rows ? begin + per_chunk : rows;
    float a = 0.0f;
    if (ch < c)
        for (size_t r = begin + threadIdx.y; r < end; r += BN_ROWS_PER_BLOCK) a += ld(dy, r * c + ch);
    s1[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && ch < c) {
        for (int i = 1; i < BN_ROWS_PER_BLOCK; i++) a += s1[i][threadIdx.x];
        partial[(size_t)blockIdx.y * c + ch] = a;
    }
}

__global__ void column_partials_sum_kernel(int c, int chunks, const float *partial, float *dbias) {
    int ch = blockIdx.x;
    double a = 0;
    for (int i = threadIdx.x; i < chunks; i += 32) a += partial[(size_t)i * c + ch];
    for (int off = 16; off > 0; off /= 2) a += __shfl_xor_sync(0xffffffffu, a, off);
    if (threadIdx.x == 0) dbias[ch] += (float)a;
}

static void gpu_bias_backward(backend_t *b, size_t rows, int c, const float *dy, float *dbias) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    int chunks = bn_chunks(g, rows, c);
    dim3 grid((unsigned)((c + BN_TILE - 1) / BN_TILE), (unsigned)chunks), block(BN_TILE, BN_ROWS_PER_BLOCK);
    if (is_low(g, dy))
        WITH_LOW(g, column_partials_kernel<Low><<<grid, block, 0, g->stream>>>(rows, c, CLOW(dy), g->bn_partials));
    else
        column_partials_kernel<float><<<grid, block, 0, g->stream>>>(rows, c, dy, g->bn_partials);
    CHECK_CUDA(cudaGetLastError());
    column_partials_sum_kernel<<<c, 32, 0, g->stream>>>(c, chunks, g->bn_partials, dbias);
    CHECK_CUDA(cudaGetLastError());
}

/* ---- linear (cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose) ----
 * bf16/fp16: activations and the weights' narrow copy in, float accumulation; the weight gradient
 * is written straight into the fp32 arena (cuBLAS mixes narrow inputs with an fp32 output). */

static cudaDataType_t blas_type(const gpu_t *g, bool is_low) {
    return !is_low ? CUDA_R_32F : g->low == LOW_FP16 ? CUDA_R_16F : CUDA_R_16BF;
}

template <typename T> __global__ void broadcast_rows_kernel(const float *bias, T *y, int n, int out) {
    GRID_STRIDE(i, (size_t)n * out) st(y, i, bias[i % out]);
}

template <typename T> __global__ void column_sums_kernel(const T *dy, float *dbias, int n, int out) {
    GRID_STRIDE(o, (size_t)out) {
        float sum = 0.0f;
        for (int i = 0; i < n; i++) sum += ld(dy, (size_t)i * out + o);
        dbias[o] += sum;
    }
}

static void gemm(gpu_t *g, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *a,
                 cudaDataType_t at, int lda, const void *b, cudaDataType_t bt, int ldb, void *c,
                 cudaDataType_t ct, int ldc) {
    const float one = 1.0f;
    cublasComputeType_t compute = at == CUDA_R_32F ? (g->is_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F)
                                                   : CUBLAS_COMPUTE_32F;
    CHECK_CUBLAS(cublasGemmEx(g->cublas, ta, tb, m, n, k, &one, a, at, lda, b, bt, ldb, &one, c, ct, ldc, compute,
                              CUBLAS_GEMM_DEFAULT));
}

static void gpu_linear_forward(backend_t *b, int n, int in, int out, const float *x, const float *w,
                               const float *bias, float *y) {
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x);
    cudaDataType_t t = blas_type(g, low);
    const void *weights = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (low) WITH_LOW(g, LAUNCH(broadcast_rows_kernel<Low>, (size_t)n * out, bias, LOW(y), n, out));
    else LAUNCH(broadcast_rows_kernel<float>, (size_t)n * out, bias, y, n, out);
    /* y^T (out, n) += W (out, in) . x^T (in, n) */
    gemm(g, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, weights, t, in, x, t, in, y, t, out);
}

static void gpu_linear_backward(backend_t *b, int n, int in, int out, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *dbias) {
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x);
    cudaDataType_t t = blas_type(g, low);
    /* dW^T (in, out) += x^T (in, n) . dy (n, out) */
    gemm(g, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, x, t, in, dy, t, out, dw, CUDA_R_32F, in);
    if (low) WITH_LOW(g, LAUNCH(column_sums_kernel<Low>, (size_t)out, CLOW(dy), dbias, n, out));
    else LAUNCH(column_sums_kernel<float>, (size_t)out, dy, dbias, n, out);
    /* dx^T (in, n) += W^T (in, out) . dy^T (out, n) */
    const void *weights = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (dx) gemm(g, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, weights, t, in, dy, t, out, dx, t, in);
}

/* ---- loss: one thread per sample (class counts here are small) ---- */

template <typename T>
__global__ void softmax_xent_kernel(int n, int k, const T *logits, const int32_t *labels, float smoothing,
                                    float grad_scale, const loss_scale_t *ls, T *dlogits, float *loss_sum) {
    double d_scale = (double)grad_scale * (ls ? ls->scale : 1.0f);
    GRID_STRIDE(i, (size_t)n) {
        const T *z = logits + i * k;
        float zmax = ld(z, 0);
        for (int j = 1; j < k; j++) zmax = fmaxf(zmax, ld(z, j));
        double sum_exp = 0, sum_z = 0;
        for (int j = 0; j < k; j++) {
            sum_exp += exp((double)ld(z, j) - zmax);
            sum_z += ld(z, j);
        }
        double log_sum = log(sum_exp) + zmax, off = (double)smoothing / k;
        int label = labels[i];
        atomicAdd(loss_sum, (float)((1.0 - smoothing) * (log_sum - ld(z, label)) + off * (k * log_sum - sum_z)));
        if (!dlogits) continue;
        for (int j = 0; j < k; j++) {
            double q = j == label ? 1.0 - smoothing + off : off;
            st(dlogits, i * k + j, (float)((exp((double)ld(z, j) - log_sum) - q) * d_scale / n));
        }
    }
}

static void gpu_softmax_xent(backend_t *b, int n, int k, const float *logits, const int32_t *labels,
                             float smoothing, float grad_scale, const loss_scale_t *ls, float *dlogits,
                             float *loss_sum) {
    if (!n) return;
    if (is_low(gpu_of(b), logits))
        WITH_LOW(gpu_of(b), LAUNCH(softmax_xent_kernel<Low>, (size_t)n, n, k, CLOW(logits), labels, smoothing,
                                   grad_scale, ls, LOW(dlogits), loss_sum));
    else
        LAUNCH(softmax_xent_kernel<float>, (size_t)n, n, k, logits, labels, smoothing, grad_scale, ls, dlogits,
               loss_sum);
}

/* ---- optimizer: one fused pass over the arenas ---- */

__global__ void sgd_kernel(float *p, const float *grads, float *m, size_t n, float lr, float momentum, float wd,
                           bool is_nesterov, float grad_scale, const loss_scale_t *ls) {
    if (ls && ls->found_inf) return; /* GradScaler's skipped step */
    if (ls) grad_scale /= ls->scale;
    GRID_STRIDE(i, n) {
        float g = grads[i] * grad_scale + wd * p[i];
        float v = momentum * m[i] + g;
        m[i] = v;
        p[i] -= lr * (is_nesterov ? g + momentum * v : v);
    }
}

static void gpu_sgd_step(backend_t *b, float *params, const float *grads, float *momentum_buf, size_t n, float lr,
                         float momentum, float weight_decay, bool is_nesterov, float grad_scale,
                         const loss_scale_t *ls) {
    if (n)
        LAUNCH(sgd_kernel, n, params, grads, momentum_buf, n, lr, momentum, weight_decay, is_nesterov, grad_scale, ls);
}

/* Adam: one thread counts the step and derives its bias corrections (adam_count_next), then the
 * fused pass reads them from the count, so the host never reads the count back. */
__global__ void adam_count_kernel(adam_count_t *count, adam_hparams_t h, const loss_scale_t *ls) {
    adam_count_next(count, &h, ls);
}

__global__ void adam_kernel(float *p, const float *grads, float *m, float *v, size_t n, adam_scalars_t s,
                            float grad_scale, const loss_scale_t *ls, const adam_count_t *count) {
    if (ls && ls->found_inf) return; /* GradScaler's skipped step: the count did not move either */
    if (ls) grad_scale /= ls->scale;
    const adam_count_t c = *count;
    GRID_STRIDE(i, n) adam_update(&p[i], &m[i], &v[i], grads[i] * grad_scale, &c, &s);
}

static void gpu_adam_step(backend_t *b, float *params, const float *grads, float *exp_avg, float *exp_avg_sq,
                          size_t n, const adam_hparams_t *h, float grad_scale, const loss_scale_t *ls,
                          adam_count_t *count) {
    adam_count_kernel<<<1, 1, 0, gpu_of(b)->stream>>>(count, *h, ls);
    CHECK_CUDA(cudaGetLastError());
    if (n) LAUNCH(adam_kernel, n, params, grads, exp_avg, exp_avg_sq, n, adam_scalars(h), grad_scale, ls, count);
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

static void gpu_loss_scale_check(backend_t *b, const float *x, size_t n, loss_scale_t *ls) {
    if (n) LAUNCH(nonfinite_kernel, n, x, n, ls);
}

static void gpu_loss_scale_update(backend_t *b, loss_scale_t *ls, uint32_t growth_interval) {
    loss_scale_update_kernel<<<1, 1, 0, gpu_of(b)->stream>>>(ls, growth_interval);
}

/* ---- the model's arenas (bf16 and fp16 modes) ---- */

static int gpu_mark_arenas(backend_t *b, float *params, size_t n_params, float *acts, float *dacts, size_t n_acts) {
    gpu_t *g = gpu_of(b);
    g->params = params;
    g->n_params = n_params;
    g->acts = (const char *)acts;
    g->dacts = (const char *)dacts;
    g->act_bytes = n_acts * sizeof(float);
    if (g->low == LOW_NONE) return 0;
    size_t bytes = (n_params ? n_params : 1) * LOW_BYTES;
    if (cudaMalloc(&g->shadow, bytes) != cudaSuccess || cudaMalloc(&g->dw_scratch, bytes) != cudaSuccess) {
        cudaGetLastError();
        return -12; /* -ENOMEM */
    }
    return 0;
}

/* The parameters may have changed (an optimizer step, a broadcast, a resume): refresh their copy. */
static void gpu_prepare_forward(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (g->low != LOW_NONE && g->n_params)
        WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), g->n_params, g->params, LOW(g->shadow), g->n_params));
}

static void gpu_destroy(backend_t *b) {
    gpu_t *g = gpu_of(b);
    cudaStreamSynchronize(g->stream);
    if (g->workspace) cudaFree(g->workspace);
    if (g->shadow) cudaFree(g->shadow);
    if (g->dw_scratch) cudaFree(g->dw_scratch);
    if (g->stage) cudaFree(g->stage);
    for (int i = 0; i < 3; i++)
        if (g->wide[i]) cudaFree(g->wide[i]);
    cudnnDestroyTensorDescriptor(g->x_desc);
    cudnnDestroyTensorDescriptor(g->y_desc);
    if (g->bn_partials) cudaFree(g->bn_partials);
    if (g->bn_sums) cudaFree(g->bn_sums);
    cudnnDestroyFilterDescriptor(g->w_desc);
    cudnnDestroyConvolutionDescriptor(g->conv_desc);
    cudnnDestroy(g->cudnn);
    cublasDestroy(g->cublas);
    cudaStreamDestroy(g->stream);
    free(g);
}

static backend_i make_ops(void) {
    backend_i o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.alloc = gpu_alloc;
    o.release = gpu_release;
    o.is_device = gpu_is_device;
    o.mark_arenas = gpu_mark_arenas;
    o.prepare_forward = gpu_prepare_forward;
    o.reserve_workspace = gpu_reserve_workspace;
    o.to_device = gpu_to_device;
    o.to_host = gpu_to_host;
    o.augment_batch = gpu_augment_batch;
    o.fill = gpu_fill;
    o.scale = gpu_scale;
    o.conv2d_forward = gpu_conv2d_forward;
    o.conv2d_backward = gpu_conv2d_backward;
    o.batchnorm_forward_train = gpu_batchnorm_forward_train;
    o.batchnorm_forward_eval = gpu_batchnorm_forward_eval;
    o.batchnorm_backward = gpu_batchnorm_backward;
    o.relu_forward = gpu_relu_forward;
    o.relu_backward = gpu_relu_backward;
    o.add_forward = gpu_add_forward;
    o.accumulate = gpu_accumulate;
    o.maxpool_forward = gpu_maxpool_forward;
    o.maxpool_backward = gpu_maxpool_backward;
    o.avgpool_global_forward = gpu_avgpool_global_forward;
    o.avgpool_global_backward = gpu_avgpool_global_backward;
    o.avgpool_adaptive_forward = gpu_avgpool_adaptive_forward;
    o.avgpool_adaptive_backward = gpu_avgpool_adaptive_backward;
    o.dropout_forward = gpu_dropout_forward;
    o.dropout_backward = gpu_dropout_backward;
    o.bias_add = gpu_bias_add;
    o.bias_backward = gpu_bias_backward;
    o.linear_forward = gpu_linear_forward;
    o.linear_backward = gpu_linear_backward;
    o.softmax_xent = gpu_softmax_xent;
    o.sgd_step = gpu_sgd_step;
    o.adam_step = gpu_adam_step;
    o.loss_scale_check = gpu_loss_scale_check;
    o.loss_scale_update = gpu_loss_scale_update;
    o.destroy = gpu_destroy;
    return o;
}

static const backend_i gpu_ops = make_ops();

cudaStream_t backend_cuda_stream(backend_t *b) { return gpu_of(b)->stream; }

extern "C" int backend_cuda_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

extern "C" backend_t *backend_cuda_create(int device, unsigned flags, const char *algo_cache_path, char *err,
                                          size_t err_len) {
    int count = backend_cuda_device_count();
    if (device < 0 || device >= count) {
        snprintf(err, err_len, "GPU %d requested, %d present", device, count);
        return NULL;
    }
    cudaError_t rc = cudaSetDevice(device);
    if (rc != cudaSuccess) {
        snprintf(err, err_len, "cudaSetDevice(%d): %s", device, cudaGetErrorString(rc));
        return NULL;
    }
    gpu_t *g = (gpu_t *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    g->base.ops = &gpu_ops;
    g->device = device;
    CHECK_CUDA(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CHECK_CUDNN(cudnnCreate(&g->cudnn));
    CHECK_CUDNN(cudnnSetStream(g->cudnn, g->stream));
    CHECK_CUBLAS(cublasCreate(&g->cublas));
    CHECK_CUBLAS(cublasSetStream(g->cublas, g->stream));
    g->is_tf32 = flags & BACKEND_CUDA_TF32;
    g->low = flags & BACKEND_CUDA_FP16 ? LOW_FP16 : flags & BACKEND_CUDA_BF16 ? LOW_BF16 : LOW_NONE;
    /* fp32 means fp32 unless TF32 was asked for */
    CHECK_CUBLAS(cublasSetMathMode(g->cublas, g->is_tf32              ? CUBLAS_TF32_TENSOR_OP_MATH
                                              : g->low != LOW_NONE ? CUBLAS_DEFAULT_MATH
                                                                   : CUBLAS_PEDANTIC_MATH));
    CHECK_CUDNN(cudnnCreateTensorDescriptor(&g->x_desc));
    CHECK_CUDNN(cudnnCreateTensorDescriptor(&g->y_desc));
    CHECK_CUDNN(cudnnCreateFilterDescriptor(&g->w_desc));
    CHECK_CUDNN(cudnnCreateConvolutionDescriptor(&g->conv_desc));
    if (gpu_reserve_workspace(&g->base, (size_t)64 << 20) < 0 ||
        cudaMalloc(&g->bn_partials, BN_PARTIALS_FLOATS * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&g->bn_sums, 2 * BN_MAX_CHANNELS * sizeof(float)) != cudaSuccess) {
        snprintf(err, err_len, "GPU %d: cannot allocate the workspace", device);
        gpu_destroy(&g->base);
        return NULL;
    }
    g->bn_partials_len = BN_PARTIALS_FLOATS / 2;
    CHECK_CUDA(cudaDeviceGetAttribute(&g->sm_count, cudaDevAttrMultiProcessorCount, device));
    if (algo_cache_path) snprintf(g->cache_path, sizeof g->cache_path, "%s", algo_cache_path);
    algo_cache_load(g);
    return &g->base;
}
