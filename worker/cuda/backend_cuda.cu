/* backend_cuda: see backend_cuda.h. One stream per backend; cuDNN, cuBLAS and the kernels here
 * (batch norm included) run on it; only to_host waits. Convolution algorithms come from cuDNN's
 * timed search, once per shape, kept in a cache file across runs. Every CUDA, cuDNN and cuBLAS
 * call is checked: a failure prints file:line and the library's message and ends the worker
 * (exit 70), as llm.c does. Arithmetic: fp32 (FMA), TF32 tensor cores, or bf16 activations with
 * fp32 parameters, gradients, optimizer and batch-norm statistics. */
#include "cuda_common.cuh"

#include <pthread.h>

#include "startup_trace.h"

static void gpu_destroy(backend_t *b) {
    gpu_t *g = gpu_of(b);
    cudaStreamSynchronize(g->stream);
    if (g->copy_stream) {
        cudaStreamSynchronize(g->copy_stream);
        cudaEventDestroy(g->copy_start);
        cudaEventDestroy(g->copy_end);
        cudaStreamDestroy(g->copy_stream);
    }
    for (int i = 0; i < COPY_STAGES; i++)
        if (g->copy_stage[i]) cudaFree(g->copy_stage[i]);
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
    if (g->bn_coeffs) cudaFree(g->bn_coeffs);
    gpu_conv_fusion_free(g);
    cudnnDestroyFilterDescriptor(g->w_desc);
    cudnnDestroyConvolutionDescriptor(g->conv_desc);
    cudnnDestroy(g->cudnn);
    cublasDestroy(g->cublas);
    cudaStreamDestroy(g->stream);
    free(g);
}

static dtype_t gpu_activation_dtype(backend_t *b) {
    return low_dtype(gpu_of(b));
}

static backend_memory_i make_mem(void) {
    backend_memory_i m;
    memset(&m, 0, sizeof m);
    m.name = "cuda";
    m.alloc = gpu_alloc;
    m.release = gpu_release;
    m.is_device = gpu_is_device;
    m.mark_arenas = gpu_mark_arenas;
    m.activation_dtype = gpu_activation_dtype;
    m.prepare_forward = gpu_prepare_forward;
    m.graph_begin = gpu_graph_begin;
    m.graph_end = gpu_graph_end;
    m.graph_run = gpu_graph_run;
    m.graph_free = gpu_graph_free;
    m.reserve_workspace = gpu_reserve_workspace;
    m.to_device = gpu_to_device;
    m.to_host = gpu_to_host;
    m.pin_host = gpu_pin_host;
    m.unpin_host = gpu_unpin_host;
    m.copy_out_begin = gpu_copy_out_begin;
    m.copy_out = gpu_copy_out;
    m.copy_out_fence = gpu_copy_out_fence;
    m.copy_out_wait = gpu_copy_out_wait;
    m.destroy = gpu_destroy;
    return m;
}

static backend_i make_ops(void) {
    backend_i o;
    memset(&o, 0, sizeof o);
    o.augment_batch = gpu_augment_batch;
    o.fill = gpu_fill;
    o.scale = gpu_scale;
    o.conv2d_forward = gpu_conv2d_forward;
    o.conv2d_backward = gpu_conv2d_backward;
    o.conv2d_bn_forward = gpu_conv2d_bn_forward;
    o.bn_act_forward_train_sums = gpu_bn_act_forward_train_sums;
    o.batchnorm_forward_train = gpu_batchnorm_forward_train;
    o.batchnorm_forward_eval = gpu_batchnorm_forward_eval;
    o.batchnorm_backward = gpu_batchnorm_backward;
    o.bn_act_forward_train = gpu_bn_act_forward_train;
    o.bn_act_forward_eval = gpu_bn_act_forward_eval;
    o.bn_act_backward = gpu_bn_act_backward;
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
    return o;
}

static const backend_memory_i gpu_mem = make_mem();
static const backend_i gpu_ops = make_ops();

cudaStream_t backend_cuda_stream(backend_t *b) {
    gpu_bind_thread(gpu_of(b)); /* NCCL's calls come from the gradient buckets' thread too */
    return gpu_of(b)->stream;
}

extern "C" int backend_cuda_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

/* cuBLAS's handle, made on a thread of its own while the calling thread makes cuDNN's (and loads
 * its sub-libraries): the two libraries' start-ups overlap instead of adding up. */
typedef struct {
    int device;
    cublasHandle_t handle;
    cudaError_t cuda_rc;
    cublasStatus_t rc;
    double seconds;
} cublas_start_t;

static void *start_cublas(void *arg) {
    cublas_start_t *c = (cublas_start_t *)arg;
    double t = startup_trace_now();
    c->cuda_rc = cudaSetDevice(c->device); /* the primary context, made current on this thread */
    if (c->cuda_rc == cudaSuccess) c->rc = cublasCreate(&c->handle);
    c->seconds = startup_trace_now() - t;
    return NULL;
}

extern "C" backend_t *backend_cuda_create(int device, unsigned flags,
                                          const backend_cuda_algo_cache_t *algo_cache, char *err,
                                          size_t err_len) {
    int count = backend_cuda_device_count();
    if (device < 0 || device >= count) {
        snprintf(err, err_len, "GPU %d requested, %d present", device, count);
        return NULL;
    }
    double t = startup_trace_now();
    cudaError_t rc = cudaSetDevice(device); /* CUDA >= 12: makes the primary context */
    if (rc != cudaSuccess) {
        snprintf(err, err_len, "cudaSetDevice(%d): %s", device, cudaGetErrorString(rc));
        return NULL;
    }
    t = startup_trace_end("cuda context", t);
    gpu_t *g = (gpu_t *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    g->base.mem = &gpu_mem;
    g->base.ops = &gpu_ops;
    g->device = device;
    cublas_start_t cb = {.device = device};
    pthread_t cublas_thread;
    bool is_threaded = pthread_create(&cublas_thread, NULL, start_cublas, &cb) == 0;
    if (!is_threaded) start_cublas(&cb);
    CHECK_CUDA(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CHECK_CUDNN(cudnnCreate(&g->cudnn));
    CHECK_CUDNN(cudnnSetStream(g->cudnn, g->stream));
    /* cuDNN 9 loads its convolution and ops sub-libraries on first use; load them now, beside
     * cuBLAS's start, rather than in the first step (a version mismatch shows there anyway, with
     * the call that failed: the results are not checked here) */
    (void)cudnnOpsVersionCheck();
    (void)cudnnCnnVersionCheck();
    startup_trace_end("cudnn handle and sub-libraries", t);
    if (is_threaded) pthread_join(cublas_thread, NULL);
    CHECK_CUDA(cb.cuda_rc);
    CHECK_CUBLAS(cb.rc);
    g->cublas = cb.handle;
    if (startup_trace_is_on())
        fprintf(stderr, "ddpworker: startup: cublas handle (beside cudnn's) %.3f s\n", cb.seconds);
    t = startup_trace_now();
    CHECK_CUBLAS(cublasSetStream(g->cublas, g->stream));
    g->is_tf32 = flags & BACKEND_CUDA_TF32;
    g->low = flags & BACKEND_CUDA_FP16 ? LOW_FP16 : flags & BACKEND_CUDA_BF16 ? LOW_BF16 : LOW_NONE;
    /* fp32 means fp32 unless TF32 was asked for */
    CHECK_CUBLAS(cublasSetMathMode(g->cublas, g->is_tf32           ? CUBLAS_TF32_TENSOR_OP_MATH
                                              : g->low != LOW_NONE ? CUBLAS_DEFAULT_MATH
                                                                   : CUBLAS_PEDANTIC_MATH));
    CHECK_CUDNN(cudnnCreateTensorDescriptor(&g->x_desc));
    CHECK_CUDNN(cudnnCreateTensorDescriptor(&g->y_desc));
    CHECK_CUDNN(cudnnCreateFilterDescriptor(&g->w_desc));
    CHECK_CUDNN(cudnnCreateConvolutionDescriptor(&g->conv_desc));
    if (gpu_reserve_workspace(&g->base, (size_t)64 << 20) < 0 ||
        cudaMalloc(&g->bn_partials, BN_PARTIALS_FLOATS * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&g->bn_sums, 2 * BN_MAX_CHANNELS * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&g->bn_coeffs, 3 * BN_MAX_CHANNELS * sizeof(float)) != cudaSuccess) {
        snprintf(err, err_len, "GPU %d: cannot allocate the workspace", device);
        gpu_destroy(&g->base);
        return NULL;
    }
    g->bn_partials_len = BN_PARTIALS_FLOATS / 2;
    CHECK_CUDA(cudaDeviceGetAttribute(&g->sm_count, cudaDevAttrMultiProcessorCount, device));
    const char *graphs = getenv("DDP_CUDA_GRAPHS");
    g->is_graphs = !graphs || strcmp(graphs, "0") != 0; /* on unless DDP_CUDA_GRAPHS=0 */
    const char *nondet = getenv("DDP_CUDA_NONDETERMINISTIC");
    g->is_nondeterministic = nondet && strcmp(nondet, "1") == 0;
    const char *fusion = getenv("DDP_CUDA_CONV_FUSION");
    g->is_conv_fusion = fusion && strcmp(fusion, "1") == 0;
    const char *profile = getenv("DDP_CUDA_PROFILE");
    if (profile && (sscanf(profile, "%ld,%ld", &g->profile_first, &g->profile_count) != 2 ||
                    g->profile_first < 1 || g->profile_count < 1)) {
        snprintf(err, err_len, "DDP_CUDA_PROFILE=%s: expected FIRST,COUNT (forward passes, from 1)",
                 profile);
        gpu_destroy(&g->base);
        return NULL;
    }
    if (algo_cache && algo_cache->own)
        snprintf(g->cache_path, sizeof g->cache_path, "%s", algo_cache->own);
    if (algo_cache && algo_cache->shared)
        snprintf(g->shared_cache_path, sizeof g->shared_cache_path, "%s", algo_cache->shared);
    gpu_algo_cache_load(g);
    startup_trace_end("cuda buffers and algorithm cache", t);
    return &g->base;
}
