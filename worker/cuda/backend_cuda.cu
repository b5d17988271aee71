/* backend_cuda: see backend_cuda.h. One stream per backend; cuDNN and cuBLAS run on it, and so do
 * the kernels here (batch norm included); only to_host waits. Convolution algorithms come from cuDNN's timed search,
 * once per shape, kept in a cache file across runs. Every CUDA,
 * cuDNN and cuBLAS call is checked: a failure prints file:line and the library's message and ends
 * the worker (exit 70), as llm.c does. fp32 math (FMA), or TF32 tensor cores when asked. */
#include "backend_cuda.h"
#include "backend_cuda_internal.h"

#include <cublas_v2.h>
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
    int sm_count;
    char cache_path[1024]; /* convolution algorithms found earlier (empty: none) */
    char tag[160];         /* cuDNN version, compute capability and GPU name: the cache's key */
} gpu_t;

#define BN_PARTIALS_FLOATS ((size_t)2 << 20)
#define BN_MAX_CHANNELS 65536

static gpu_t *gpu_of(backend_t *b) { return (gpu_t *)b; }

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

static void gpu_to_device(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    /* from pageable memory the copy has read src before it returns, so src may be reused */
    if (n_bytes)
        CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, gpu_of(b)->stream));
}

static void gpu_to_host(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (n_bytes) CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, g->stream));
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
}

/* ---- elementwise kernels ---- */

#define GRID_STRIDE(i, n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
                               i += (size_t)gridDim.x * blockDim.x)

__global__ void fill_kernel(float *x, float v, size_t n) { GRID_STRIDE(i, n) x[i] = v; }
__global__ void scale_kernel(float *x, float f, size_t n) { GRID_STRIDE(i, n) x[i] *= f; }
__global__ void relu_kernel(const float *x, float *y, size_t n) { GRID_STRIDE(i, n) y[i] = fmaxf(x[i], 0.0f); }
__global__ void relu_backward_kernel(const float *y, const float *dy, float *dx, size_t n) {
    GRID_STRIDE(i, n) dx[i] += y[i] > 0.0f ? dy[i] : 0.0f;
}
__global__ void add_kernel(const float *a, const float *b, float *y, size_t n) { GRID_STRIDE(i, n) y[i] = a[i] + b[i]; }
__global__ void accumulate_kernel(const float *dy, float *dx, size_t n) { GRID_STRIDE(i, n) dx[i] += dy[i]; }

#define LAUNCH(kernel, n, ...) \
    do { \
        kernel<<<blocks_for(n), 256, 0, gpu_of(b)->stream>>>(__VA_ARGS__); \
        CHECK_CUDA(cudaGetLastError()); \
    } while (0)

static void gpu_fill(backend_t *b, float *x, float v, size_t n) { if (n) LAUNCH(fill_kernel, n, x, v, n); }
static void gpu_scale(backend_t *b, float *x, float f, size_t n) { if (n) LAUNCH(scale_kernel, n, x, f, n); }
static void gpu_relu_forward(backend_t *b, const float *x, float *y, size_t n) { if (n) LAUNCH(relu_kernel, n, x, y, n); }
static void gpu_relu_backward(backend_t *b, const float *y, const float *dy, float *dx, size_t n) {
    if (n) LAUNCH(relu_backward_kernel, n, y, dy, dx, n);
}
static void gpu_add_forward(backend_t *b, const float *x1, const float *x2, float *y, size_t n) {
    if (n) LAUNCH(add_kernel, n, x1, x2, y, n);
}
static void gpu_accumulate(backend_t *b, const float *dy, float *dx, size_t n) {
    if (n) LAUNCH(accumulate_kernel, n, dy, dx, n);
}

/* ---- convolution (cuDNN, NHWC, KRSC filters) ---- */

static void describe_conv(gpu_t *g, const conv_shape_t *s) {
    CHECK_CUDNN(cudnnSetTensor4dDescriptor(g->x_desc, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, s->n, s->c, s->h, s->w));
    CHECK_CUDNN(cudnnSetTensor4dDescriptor(g->y_desc, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, s->n, s->k, s->oh, s->ow));
    CHECK_CUDNN(cudnnSetFilter4dDescriptor(g->w_desc, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC, s->k, s->c, s->r, s->s));
    CHECK_CUDNN(cudnnSetConvolution2dDescriptor(g->conv_desc, s->pad, s->pad, s->stride, s->stride, 1, 1,
                                                CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CHECK_CUDNN(cudnnSetConvolutionMathType(g->conv_desc, g->is_tf32 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH));
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
        int tf32, fwd, bd, bf;
        if (sscanf(line, "%159s %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d", tag, &s->n, &s->h, &s->w, &s->c,
                   &s->k, &s->r, &s->s, &s->stride, &s->pad, &s->oh, &s->ow, &tf32, &fwd, &bd, &bf) != 16 ||
            strcmp(tag, cache_tag(g)) != 0 || tf32 != (int)g->is_tf32)
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
            s->r, s->s, s->stride, s->pad, s->oh, s->ow, (int)g->is_tf32, (int)a->fwd, (int)a->bwd_data,
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

static void gpu_conv2d_forward(backend_t *b, const conv_shape_t *s, const float *x, const float *w, float *y) {
    gpu_t *g = gpu_of(b);
    describe_conv(g, s);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDNN(cudnnConvolutionForward(g->cudnn, &one, g->x_desc, x, g->w_desc, w, g->conv_desc, a->fwd,
                                        g->workspace, g->workspace_bytes, &zero, g->y_desc, y));
}

static void gpu_conv2d_backward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                                const float *dy, float *dx, float *dw) {
    gpu_t *g = gpu_of(b);
    describe_conv(g, s);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f; /* beta 1: accumulate, as backend_i asks */
    CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x, g->y_desc, dy, g->conv_desc,
                                               a->bwd_filter, g->workspace, g->workspace_bytes, &one,
                                               g->w_desc, dw));
    if (dx)
        CHECK_CUDNN(cudnnConvolutionBackwardData(g->cudnn, &one, g->w_desc, w, g->y_desc, dy, g->conv_desc,
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
__global__ void bn_partials_kernel(int mode, size_t rows, int c, const float *x, const float *dy,
                                   const float *mean, const float *invstd, float *partial, float *partial2) {
    __shared__ float s1[BN_ROWS_PER_BLOCK][BN_TILE], s2[BN_ROWS_PER_BLOCK][BN_TILE];
    int ch = blockIdx.x * BN_TILE + threadIdx.x;
    size_t per_chunk = (rows + gridDim.y - 1) / gridDim.y;
    size_t begin = blockIdx.y * per_chunk, end = begin + per_chunk < rows ? begin + per_chunk : rows;
    float a = 0.0f, b = 0.0f;
    if (ch < c) {
        float shift = mode == 0 ? x[ch] : mean[ch], is = mode == 1 ? invstd[ch] : 0.0f;
        for (size_t r = begin + threadIdx.y; r < end; r += BN_ROWS_PER_BLOCK) {
            float v = x[r * c + ch] - shift;
            if (mode == 0) {
                a += v;
                b += v * v;
            } else {
                float d = dy[r * c + ch];
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
    bn_partials_kernel<<<grid, block, 0, g->stream>>>(mode, rows, c, x, dy, mean, invstd, g->bn_partials,
                                                      g->bn_partials + (size_t)chunks * c);
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

__global__ void bn_stats_kernel(int c, int chunks, size_t rows, const float *x, const float *partial, float *mean,
                                float *invstd, float *running_mean, float *running_var, float momentum, float eps) {
    double sum, sq;
    bn_sum_chunks(c, chunks, partial, &sum, &sq);
    if (threadIdx.x != 0) return;
    int ch = blockIdx.x;
    double n = (double)rows, shifted_mean = sum / n, var = sq / n - shifted_mean * shifted_mean;
    var = var > 0 ? var : 0;
    double mu = x[ch] + shifted_mean, unbiased = rows > 1 ? var * n / (n - 1) : var;
    mean[ch] = (float)mu;
    invstd[ch] = (float)(1.0 / sqrt(var + eps));
    running_mean[ch] = (float)((1.0 - momentum) * running_mean[ch] + momentum * mu);
    running_var[ch] = (float)((1.0 - momentum) * running_var[ch] + momentum * unbiased);
}

/* y = (x - mean) * invstd * gamma + beta; eval passes the running variance as var (invstd NULL). */
__global__ void bn_apply_kernel(size_t n, int c, const float *x, const float *mean, const float *invstd,
                                const float *var, float eps, const float *gamma, const float *beta, float *y) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float is = invstd ? invstd[ch] : rsqrtf(var[ch] + eps);
        y[i] = (x[i] - mean[ch]) * is * gamma[ch] + beta[ch];
    }
}

static void gpu_batchnorm_forward_train(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                                        const float *beta, float *y, float *save_mean, float *save_invstd,
                                        float *running_mean, float *running_var, float momentum, float eps) {
    gpu_t *g = gpu_of(b);
    if (!rows || !c) return;
    if (c > BN_MAX_CHANNELS) fail_at("batch norm", "more than 65536 channels", __FILE__, __LINE__);
    int chunks = bn_chunks(g, rows, c);
    bn_reduce(g, 0, rows, c, chunks, x, NULL, NULL, NULL);
    bn_stats_kernel<<<c, 32, 0, g->stream>>>(c, chunks, rows, x, g->bn_partials, save_mean, save_invstd,
                                             running_mean, running_var, momentum, eps);
    CHECK_CUDA(cudaGetLastError());
    LAUNCH(bn_apply_kernel, rows * c, rows * c, c, x, save_mean, save_invstd, NULL, eps, gamma, beta, y);
}

static void gpu_batchnorm_forward_eval(backend_t *b, size_t rows, int c, const float *x, const float *gamma,
                                       const float *beta, float *y, const float *running_mean,
                                       const float *running_var, float eps) {
    if (rows && c)
        LAUNCH(bn_apply_kernel, rows * c, rows * c, c, x, running_mean, NULL, running_var, eps, gamma, beta, y);
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
__global__ void bn_backward_dx_kernel(size_t n, size_t rows, int c, const float *x, const float *dy,
                                      const float *gamma, const float *mean, const float *invstd,
                                      const float *sums, float *dx) {
    GRID_STRIDE(i, n) {
        int ch = (int)(i % c);
        float xhat = (x[i] - mean[ch]) * invstd[ch];
        float k = gamma[ch] * invstd[ch] / (float)rows;
        dx[i] += k * ((float)rows * dy[i] - sums[ch] - xhat * sums[c + ch]);
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
    LAUNCH(bn_backward_dx_kernel, rows * c, rows * c, rows, c, x, dy, gamma, save_mean, save_invstd, sums, dx);
}

/* ---- pooling ---- */

__global__ void maxpool_kernel(pool_shape_t s, const float *x, float *y, int32_t *argmax) {
    size_t n_out = (size_t)s.n * s.oh * s.ow * s.c;
    GRID_STRIDE(o, n_out) {
        int ch = (int)(o % s.c);
        size_t pix = o / s.c;
        int ox = (int)(pix % s.ow), oy = (int)(pix / s.ow % s.oh), n = (int)(pix / ((size_t)s.ow * s.oh));
        const float *xn = x + (size_t)n * s.h * s.w * s.c;
        float best = -INFINITY;
        int32_t best_at = 0;
        for (int ky = 0; ky < s.size; ky++)
            for (int kx = 0; kx < s.size; kx++) {
                int at = ((oy * s.stride + ky) * s.w + ox * s.stride + kx) * s.c + ch;
                if (xn[at] > best) {
                    best = xn[at];
                    best_at = at;
                }
            }
        y[o] = best;
        argmax[o] = best_at;
    }
}

__global__ void maxpool_backward_kernel(pool_shape_t s, const int32_t *argmax, const float *dy, float *dx) {
    size_t per_out = (size_t)s.oh * s.ow * s.c, per_in = (size_t)s.h * s.w * s.c;
    GRID_STRIDE(o, per_out * s.n) atomicAdd(&dx[o / per_out * per_in + argmax[o]], dy[o]);
}

static void gpu_maxpool_forward(backend_t *b, const pool_shape_t *s, const float *x, float *y, int32_t *argmax) {
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (n) LAUNCH(maxpool_kernel, n, *s, x, y, argmax);
}

static void gpu_maxpool_backward(backend_t *b, const pool_shape_t *s, const int32_t *argmax, const float *dy,
                                 float *dx) {
    size_t n = (size_t)s->n * s->oh * s->ow * s->c;
    if (n) LAUNCH(maxpool_backward_kernel, n, *s, argmax, dy, dx);
}

__global__ void avgpool_kernel(int n, int hw, int c, const float *x, float *y) {
    GRID_STRIDE(o, (size_t)n * c) {
        size_t i = o / c, ch = o % c;
        float sum = 0.0f;
        for (int p = 0; p < hw; p++) sum += x[(i * hw + p) * c + ch];
        y[o] = sum / (float)hw;
    }
}

__global__ void avgpool_backward_kernel(int n, int hw, int c, const float *dy, float *dx) {
    GRID_STRIDE(o, (size_t)n * hw * c) {
        size_t ch = o % c, i = o / ((size_t)hw * c);
        dx[o] += dy[i * c + ch] / (float)hw;
    }
}

static void gpu_avgpool_global_forward(backend_t *b, int n, int hw, int c, const float *x, float *y) {
    if (n && c) LAUNCH(avgpool_kernel, (size_t)n * c, n, hw, c, x, y);
}

static void gpu_avgpool_global_backward(backend_t *b, int n, int hw, int c, const float *dy, float *dx) {
    if (n && c) LAUNCH(avgpool_backward_kernel, (size_t)n * hw * c, n, hw, c, dy, dx);
}

/* ---- linear (cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose) ---- */

__global__ void broadcast_rows_kernel(const float *bias, float *y, int n, int out) {
    GRID_STRIDE(i, (size_t)n * out) y[i] = bias[i % out];
}

__global__ void column_sums_kernel(const float *dy, float *dbias, int n, int out) {
    GRID_STRIDE(o, (size_t)out) {
        float sum = 0.0f;
        for (int i = 0; i < n; i++) sum += dy[(size_t)i * out + o];
        dbias[o] += sum;
    }
}

static void gpu_linear_forward(backend_t *b, int n, int in, int out, const float *x, const float *w,
                               const float *bias, float *y) {
    gpu_t *g = gpu_of(b);
    LAUNCH(broadcast_rows_kernel, (size_t)n * out, bias, y, n, out);
    const float one = 1.0f;
    /* y^T (out, n) = W (out, in) . x^T (in, n) */
    CHECK_CUBLAS(cublasSgemm(g->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, in, x, in, &one, y, out));
}

static void gpu_linear_backward(backend_t *b, int n, int in, int out, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *dbias) {
    gpu_t *g = gpu_of(b);
    const float one = 1.0f;
    /* dW^T (in, out) += x^T (in, n) . dy (n, out) */
    CHECK_CUBLAS(cublasSgemm(g->cublas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, &one, x, in, dy, out, &one, dw, in));
    LAUNCH(column_sums_kernel, (size_t)out, dy, dbias, n, out);
    /* dx^T (in, n) += W^T (in, out) . dy^T (out, n) */
    if (dx) CHECK_CUBLAS(cublasSgemm(g->cublas, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, &one, w, in, dy, out, &one, dx, in));
}

/* ---- loss: one thread per sample (class counts here are small) ---- */

__global__ void softmax_xent_kernel(int n, int k, const float *logits, const int32_t *labels, float smoothing,
                                    float grad_scale, float *dlogits, float *loss_sum) {
    GRID_STRIDE(i, (size_t)n) {
        const float *z = logits + i * k;
        float zmax = z[0];
        for (int j = 1; j < k; j++) zmax = fmaxf(zmax, z[j]);
        double sum_exp = 0, sum_z = 0;
        for (int j = 0; j < k; j++) {
            sum_exp += exp((double)z[j] - zmax);
            sum_z += z[j];
        }
        double log_sum = log(sum_exp) + zmax, off = (double)smoothing / k;
        int label = labels[i];
        atomicAdd(loss_sum, (float)((1.0 - smoothing) * (log_sum - z[label]) + off * (k * log_sum - sum_z)));
        if (!dlogits) continue;
        for (int j = 0; j < k; j++) {
            double q = j == label ? 1.0 - smoothing + off : off;
            dlogits[i * k + j] = (float)((exp((double)z[j] - log_sum) - q) * grad_scale / n);
        }
    }
}

static void gpu_softmax_xent(backend_t *b, int n, int k, const float *logits, const int32_t *labels,
                             float smoothing, float grad_scale, float *dlogits, float *loss_sum) {
    if (n) LAUNCH(softmax_xent_kernel, (size_t)n, n, k, logits, labels, smoothing, grad_scale, dlogits, loss_sum);
}

/* ---- optimizer: one fused pass over the arenas ---- */

__global__ void sgd_kernel(float *p, const float *grads, float *m, size_t n, float lr, float momentum, float wd,
                           bool is_nesterov, float grad_scale) {
    GRID_STRIDE(i, n) {
        float g = grads[i] * grad_scale + wd * p[i];
        float v = momentum * m[i] + g;
        m[i] = v;
        p[i] -= lr * (is_nesterov ? g + momentum * v : v);
    }
}

static void gpu_sgd_step(backend_t *b, float *params, const float *grads, float *momentum_buf, size_t n, float lr,
                         float momentum, float weight_decay, bool is_nesterov, float grad_scale) {
    if (n) LAUNCH(sgd_kernel, n, params, grads, momentum_buf, n, lr, momentum, weight_decay, is_nesterov, grad_scale);
}

static void gpu_destroy(backend_t *b) {
    gpu_t *g = gpu_of(b);
    cudaStreamSynchronize(g->stream);
    if (g->workspace) cudaFree(g->workspace);
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
    o.reserve_workspace = gpu_reserve_workspace;
    o.to_device = gpu_to_device;
    o.to_host = gpu_to_host;
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
    o.linear_forward = gpu_linear_forward;
    o.linear_backward = gpu_linear_backward;
    o.softmax_xent = gpu_softmax_xent;
    o.sgd_step = gpu_sgd_step;
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
    /* fp32 means fp32 unless TF32 was asked for */
    CHECK_CUBLAS(cublasSetMathMode(g->cublas, g->is_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH));
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
