/* cuda_conv: convolutions through cuDNN (NHWC, KRSC filters), their algorithms from cuDNN's
 * timed search kept in a cache file across runs. */
#include "cuda_common.cuh"

#include "startup_trace.h"

/* ---- convolution (cuDNN, NHWC, KRSC filters) ---- */

/* is_low: narrow tensors and filters (float accumulation, tensor cores); else fp32, FMA or TF32.
 * In a narrow mode the fp32 fallback (a first convolution on 3 channels) takes TF32 too: its
 * inputs are narrow values already (exact in TF32) and TF32's filter is finer than the narrow copy
 * every other convolution uses (FMA would keep the 7x7 ImageNet stem off the tensor cores). */
static void describe_conv(gpu_t *g, const conv_shape_t *s, bool is_low) {
    cudnnDataType_t t = !is_low              ? CUDNN_DATA_FLOAT
                        : g->low == LOW_FP16 ? CUDNN_DATA_HALF
                                             : CUDNN_DATA_BFLOAT16;
    CHECK_CUDNN(
        cudnnSetTensor4dDescriptor(g->x_desc, CUDNN_TENSOR_NHWC, t, s->n, s->c, s->h, s->w));
    CHECK_CUDNN(
        cudnnSetTensor4dDescriptor(g->y_desc, CUDNN_TENSOR_NHWC, t, s->n, s->k, s->oh, s->ow));
    CHECK_CUDNN(
        cudnnSetFilter4dDescriptor(g->w_desc, t, CUDNN_TENSOR_NHWC, s->k, s->c, s->r, s->s));
    CHECK_CUDNN(cudnnSetConvolution2dDescriptor(g->conv_desc, s->pad, s->pad, s->stride, s->stride,
                                                1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CHECK_CUDNN(cudnnSetConvolutionMathType(g->conv_desc, is_low || g->is_tf32 || g->low != LOW_NONE
                                                              ? CUDNN_TENSOR_OP_MATH
                                                              : CUDNN_FMA_MATH));
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
        snprintf(g->tag, sizeof g->tag, "cudnn%zu:sm%d%d:", cudnnGetVersion(), prop.major,
                 prop.minor);
        size_t at = strlen(g->tag);
        for (const char *c = prop.name; *c && at + 1 < sizeof g->tag; c++)
            g->tag[at++] = *c == ' ' ? '_' : *c;
        g->tag[at] = '\0';
    }
    return g->tag;
}

static bool same_shape(const conv_shape_t *a, const conv_shape_t *b);

static conv_algos_t *cached(gpu_t *g, const conv_shape_t *s) {
    for (int i = 0; i < g->n_algos; i++)
        if (same_shape(&g->algos[i].shape, s)) return &g->algos[i];
    return NULL;
}

/* The lines of `path` for this GPU, cuDNN, math mode and determinism whose shapes are not known
 * yet; is_shared: the file is the shared one. */
static void algo_cache_read(gpu_t *g, const char *path, bool is_shared) {
    FILE *f = path[0] ? fopen(path, "r") : NULL;
    if (!f) return;
    char line[512], tag[160];
    /* the shared file (every model run here) leaves room for the shapes this run searches */
    int most = is_shared ? CONV_CACHE * 3 / 4 : CONV_CACHE;
    while (fgets(line, sizeof line, f) && g->n_algos < most) {
        conv_algos_t a;
        memset(&a, 0, sizeof a);
        conv_shape_t *s = &a.shape;
        int mode, fwd, bd, bf, det;
        /* lines of 16 fields (before the determinism field) do not match: searched again */
        if (sscanf(line, "%159s %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d", tag, &s->n, &s->h,
                   &s->w, &s->c, &s->k, &s->r, &s->s, &s->stride, &s->pad, &s->oh, &s->ow, &mode,
                   &fwd, &bd, &bf, &det) != 17 ||
            strcmp(tag, cache_tag(g)) != 0 || mode != math_mode(g) ||
            det != !g->is_nondeterministic)
            continue; /* another GPU, cuDNN, math mode or determinism: not ours to use */
        if (cached(g, s)) continue; /* the run's own file first: what its earlier attempts used */
        a.fwd = (cudnnConvolutionFwdAlgo_t)fwd;
        a.bwd_data = (cudnnConvolutionBwdDataAlgo_t)bd;
        a.bwd_filter = (cudnnConvolutionBwdFilterAlgo_t)bf;
        a.is_shared_only = is_shared;
        g->algos[g->n_algos++] = a;
    }
    fclose(f);
}

void gpu_algo_cache_load(gpu_t *g) {
    algo_cache_read(g, g->cache_path, false);
    algo_cache_read(g, g->shared_cache_path, true);
}

static void algo_cache_append(gpu_t *g, const char *path, const conv_algos_t *a) {
    FILE *f = path[0] ? fopen(path, "a") : NULL;
    if (!f) return; /* a cache is an optimisation: without one the next start searches again */
    const conv_shape_t *s = &a->shape;
    fprintf(f, "%s %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", cache_tag(g), s->n, s->h,
            s->w, s->c, s->k, s->r, s->s, s->stride, s->pad, s->oh, s->ow, math_mode(g),
            (int)a->fwd, (int)a->bwd_data, (int)a->bwd_filter, !g->is_nondeterministic);
    fclose(f);
}

#define CONV_WORKSPACE_MAX ((size_t)512 << 20)

/* The first (fastest) result that succeeded within the workspace limit and, unless
 * g->is_nondeterministic, is deterministic (no atomics: the same bits in every run with the same
 * algorithms, which a run resumed from a snapshot compared with an uninterrupted one needs: cuDNN
 * marks backward-filter ALGO_0 / ALGO_3 and backward-data ALGO_0 non-deterministic). The fallbacks
 * are deterministic algorithms every shape has. */
#define FASTEST(g, perf, n, fallback)                                                              \
    ({                                                                                             \
        int pick_ = -1;                                                                            \
        for (int i_ = 0; i_ < (n) && pick_ < 0; i_++)                                              \
            if ((perf)[i_].status == CUDNN_STATUS_SUCCESS &&                                       \
                (perf)[i_].memory <= CONV_WORKSPACE_MAX &&                                         \
                ((g)->is_nondeterministic || (perf)[i_].determinism == CUDNN_DETERMINISTIC))       \
                pick_ = i_;                                                                        \
        pick_ >= 0 ? (perf)[pick_].algo : (fallback);                                              \
    })

static void ensure_workspace(gpu_t *g, size_t n_bytes) {
    if (n_bytes > g->workspace_bytes && gpu_reserve_workspace(&g->base, n_bytes) < 0)
        fail_at("convolution workspace", "out of GPU memory", __FILE__, __LINE__);
}

/* The shape's numbers (not is_dx_written, nor padding bytes): what the algorithms depend on. */
static bool same_shape(const conv_shape_t *a, const conv_shape_t *b) {
    return a->n == b->n && a->h == b->h && a->w == b->w && a->c == b->c && a->k == b->k &&
           a->r == b->r && a->s == b->s && a->stride == b->stride && a->pad == b->pad &&
           a->oh == b->oh && a->ow == b->ow;
}

static const conv_algos_t *conv_algos(gpu_t *g, const conv_shape_t *s) {
    conv_algos_t *a = cached(g, s);
    if (a && a->is_shared_only) { /* the run's own file holds every algorithm the run used */
        algo_cache_append(g, g->cache_path, a);
        a->is_shared_only = false;
    }
    if (!a) {
        /* more shapes than any model here has: replace the entries in turn (the others stay
         * found) */
        if (g->n_algos < CONV_CACHE) {
            a = &g->algos[g->n_algos++];
        } else {
            a = &g->algos[g->algo_victim];
            g->algo_victim = (g->algo_victim + 1) % CONV_CACHE;
        }
        memset(a, 0, sizeof *a);
        a->shape = *s;
        a->shape.is_dx_written = false;
        double t = startup_trace_now();
        int n = 0;
        cudnnConvolutionFwdAlgoPerf_t fwd[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionForwardAlgorithm(
            g->cudnn, g->x_desc, g->w_desc, g->conv_desc, g->y_desc,
            CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, fwd));
        a->fwd = FASTEST(g, fwd, n, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
        cudnnConvolutionBwdDataAlgoPerf_t bd[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionBackwardDataAlgorithm(
            g->cudnn, g->w_desc, g->y_desc, g->conv_desc, g->x_desc,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, bd));
        a->bwd_data = FASTEST(g, bd, n, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
        cudnnConvolutionBwdFilterAlgoPerf_t bf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
        CHECK_CUDNN(cudnnFindConvolutionBackwardFilterAlgorithm(
            g->cudnn, g->x_desc, g->y_desc, g->conv_desc, g->w_desc,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, bf));
        a->bwd_filter = FASTEST(g, bf, n, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
        algo_cache_append(g, g->cache_path, a);
        algo_cache_append(g, g->shared_cache_path, a);
        g->search_seconds += startup_trace_now() - t;
        g->searched_shapes++;
    }
    if (!a->is_sized) { /* found now or read from the cache file: make room for its workspace */
        size_t need = 0, bytes = 0;
        CHECK_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(
            g->cudnn, g->x_desc, g->w_desc, g->conv_desc, g->y_desc, a->fwd, &bytes));
        need = bytes > need ? bytes : need;
        CHECK_CUDNN(cudnnGetConvolutionBackwardDataWorkspaceSize(
            g->cudnn, g->w_desc, g->y_desc, g->conv_desc, g->x_desc, a->bwd_data, &bytes));
        need = bytes > need ? bytes : need;
        CHECK_CUDNN(cudnnGetConvolutionBackwardFilterWorkspaceSize(
            g->cudnn, g->x_desc, g->y_desc, g->conv_desc, g->w_desc, a->bwd_filter, &bytes));
        need = bytes > need ? bytes : need;
        ensure_workspace(g, need);
        a->is_sized = true;
    }
    return a;
}

/* bf16 or fp16 mode, input channels not a multiple of 8 (a network's first convolution, on 1 or 3
 * channels): cuDNN's narrow kernels want channel counts in multiples of 8, so such a convolution
 * runs in fp32 on converted copies; it is a small part of the network's work. */
static bool is_narrow(const conv_shape_t *s) {
    return s->c % 8 != 0;
}

static float *widened(backend_t *b, int slot, const float *low_src, size_t n) {
    gpu_t *g = gpu_of(b);
    float *w = gpu_grown(g, &g->wide[slot], &g->wide_bytes[slot], n * sizeof(float));
    if (low_src) WITH_LOW(g, LAUNCH((convert_kernel<Low, float>), n, CLOW(low_src), w, n));
    return w;
}

static void narrow_conv_forward(backend_t *b, const conv_shape_t *s, const float *x, const float *w,
                                float *y) {
    gpu_t *g = gpu_of(b);
    size_t nx = (size_t)s->n * s->h * s->w * s->c, ny = (size_t)s->n * s->oh * s->ow * s->k;
    float *x32 = widened(b, 0, x, nx), *y32 = widened(b, 1, NULL, ny);
    describe_conv(g, s, false);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDNN(cudnnConvolutionForward(g->cudnn, &one, g->x_desc, x32, g->w_desc, w, g->conv_desc,
                                        a->fwd, g->workspace, g->workspace_bytes, &zero, g->y_desc,
                                        y32));
    WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), ny, y32, LOW(y), ny));
}

static void narrow_conv_backward(backend_t *b, const conv_shape_t *s, const float *x,
                                 const float *w, const float *dy, float *dx, float *dw) {
    gpu_t *g = gpu_of(b);
    size_t nx = (size_t)s->n * s->h * s->w * s->c, ny = (size_t)s->n * s->oh * s->ow * s->k;
    float *x32 = widened(b, 0, x, nx), *dy32 = widened(b, 1, dy, ny);
    describe_conv(g, s, false);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x32, g->y_desc, dy32,
                                               g->conv_desc, a->bwd_filter, g->workspace,
                                               g->workspace_bytes, &one, g->w_desc, dw));
    if (!dx) return;
    float *dx32 = widened(b, 2, NULL, nx);
    CHECK_CUDNN(cudnnConvolutionBackwardData(g->cudnn, &one, g->w_desc, w, g->y_desc, dy32,
                                             g->conv_desc, a->bwd_data, g->workspace,
                                             g->workspace_bytes, &zero, g->x_desc, dx32));
    if (s->is_dx_written)
        WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), nx, dx32, LOW(dx), nx));
    else
        WITH_LOW(g, LAUNCH(add_wide_kernel<Low>, nx, dx32, LOW(dx), nx));
}

void gpu_conv2d_forward(backend_t *b, const conv_shape_t *s, tensor_desc_t x_d, const float *w,
                        tensor_desc_t y_d) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x_d);
    if (low && is_narrow(s)) {
        narrow_conv_forward(b, s, x, w, y);
        return;
    }
    describe_conv(g, s, low);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f;
    const void *filter = low ? (const void *)shadow_of(g, w) : (const void *)w;
    CHECK_CUDNN(cudnnConvolutionForward(g->cudnn, &one, g->x_desc, x, g->w_desc, filter,
                                        g->conv_desc, a->fwd, g->workspace, g->workspace_bytes,
                                        &zero, g->y_desc, y));
}

void gpu_conv2d_backward(backend_t *b, const conv_shape_t *s, tensor_desc_t x_d, const float *w,
                         tensor_desc_t dy_d, tensor_desc_t dx_d, float *dw) {
    const float *x = (const float *)x_d.data;
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x_d);
    if (low && is_narrow(s)) {
        narrow_conv_backward(b, s, x, w, dy, dx, dw);
        return;
    }
    describe_conv(g, s, low);
    const conv_algos_t *a = conv_algos(g, s);
    const float one = 1.0f, zero = 0.0f; /* beta 1: accumulate, as backend_i asks */
    if (low) { /* cuDNN's filter gradient has the filter's type: narrow first, then into the fp32
                  arena */
        void *dw_low = (char *)g->dw_scratch + (size_t)(w - g->params) * LOW_BYTES;
        size_t n_w = (size_t)s->k * s->r * s->s * s->c;
        CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x, g->y_desc, dy,
                                                   g->conv_desc, a->bwd_filter, g->workspace,
                                                   g->workspace_bytes, &zero, g->w_desc, dw_low));
        WITH_LOW(g, LAUNCH(add_low_kernel<Low>, n_w, CLOW(dw_low), dw, n_w));
    } else {
        CHECK_CUDNN(cudnnConvolutionBackwardFilter(g->cudnn, &one, g->x_desc, x, g->y_desc, dy,
                                                   g->conv_desc, a->bwd_filter, g->workspace,
                                                   g->workspace_bytes, &one, g->w_desc, dw));
    }
    const void *filter = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (dx) /* beta 0 where this is dx's first producer: no zeroing pass, no read of zeros */
        CHECK_CUDNN(cudnnConvolutionBackwardData(
            g->cudnn, &one, g->w_desc, filter, g->y_desc, dy, g->conv_desc, a->bwd_data,
            g->workspace, g->workspace_bytes, s->is_dx_written ? &zero : &one, g->x_desc, dx));
}
