/* cuda_conv_fusion: cuDNN's fp16 convolution fusion "ConvBNfprop" through its graph API (the
 * cudnnBackend* descriptors, no cudnn-frontend): y = conv(relu(x * scale + bias), w), with the sum
 * and the sum of squares of y per output channel from the convolution's epilogue. In a ResNet it
 * applies the batch norm + ReLU before a convolution while the convolution reads its input, and
 * gives the batch norm after it its statistics without another pass over y (NVIDIA's MLPerf
 * ResNet-50 runs its fp16 training this way). fp16 (cuDNN's runtime-fusion engines), and bf16 for
 * the statistics-only form where cuDNN has an engine for it (not yet seen run); C and K multiples
 * of 8, 16-byte aligned tensors; opt-in with DDP_CUDA_CONV_FUSION=1 until measured.
 * One execution plan per shape, built on first use and kept (CONV_FUSION_PLANS shapes); a shape
 * cuDNN offers no engine for is remembered as such and the op returns -1 for it. */
#include "cuda_common.cuh"

#include <cudnn_graph.h>

#define CHECK_BACKEND(x)                                                                           \
    do {                                                                                           \
        cudnnStatus_t rc_ = (x);                                                                   \
        if (rc_ != CUDNN_STATUS_SUCCESS) {                                                         \
            fusion_fail(#x, rc_, __LINE__);                                                        \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* A failure while building a plan: the shape is left to the unfused ops; said once on stderr so
 * that the GPU session sees why (DDP_CUDA_CONV_FUSION is opt-in: a user asked for it). */
static void fusion_fail(const char *what, cudnnStatus_t rc, int line) {
    fprintf(stderr, "ddpworker: cuda_conv_fusion.cu:%d: %s: %s (this shape runs unfused)\n", line,
            what, cudnnGetErrorString(rc));
}

enum {
    UID_X = 1,
    UID_W,
    UID_SCALE,
    UID_BIAS,
    UID_Y,
    UID_SUM,
    UID_SQSUM,
    UID_SCALED = 101,
    UID_BIASED,
    UID_RELU
};

/* An fp16 (or fp32) NHWC tensor of logical dimensions (n, c, h, w), as the graph API takes them. */
static cudnnBackendDescriptor_t nhwc_tensor(int64_t uid, cudnnDataType_t type, int64_t n, int64_t c,
                                            int64_t h, int64_t w, bool is_virtual) {
    cudnnBackendDescriptor_t t = NULL;
    int64_t dims[4] = {n, c, h, w}, strides[4] = {c * h * w, 1, w * c, c}, align = 16;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_TENSOR_DESCRIPTOR, &t) != CUDNN_STATUS_SUCCESS)
        return NULL;
    if (cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type) ||
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims) ||
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides) ||
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid) ||
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1,
                                 &align) ||
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1,
                                 &is_virtual) ||
        cudnnBackendFinalize(t)) {
        cudnnBackendDestroyDescriptor(t);
        return NULL;
    }
    return t;
}

/* A pointwise operation (mode on x, and b when not NULL) into y, computed in fp32. */
static cudnnBackendDescriptor_t pointwise(cudnnBackendDescriptor_t *pw_out,
                                          cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x,
                                          cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t pw = NULL, op = NULL;
    cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    *pw_out = NULL;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw)) goto fail;
    *pw_out = pw; /* the caller destroys it */
    if (cudnnBackendSetAttribute(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1,
                                 &mode) ||
        cudnnBackendSetAttribute(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1,
                                 &prec) ||
        cudnnBackendFinalize(pw))
        goto fail;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, &op) ||
        cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw) ||
        cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x) ||
        (b && cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
                                       CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b)) ||
        cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y) ||
        cudnnBackendFinalize(op))
        goto fail;
    return op;
fail:
    if (op) cudnnBackendDestroyDescriptor(op);
    return NULL;
}

/* Hands descriptor *d (if any) to the plan's keeper, which destroys it after the plan, as
 * cudnn-frontend keeps every descriptor a plan was made from alive as long as the plan. While they
 * were destroyed as soon as the plan was made, the fusion tests ended in "double free or
 * corruption" on the H100 (2026-11-27) and the H200 (2026-11-28); the next GPU run shows whether
 * this was why. */
static void keep(conv_fusion_plan_t *keeper, cudnnBackendDescriptor_t *d) {
    if (!*d) return;
    if (keeper->n_kept == CONV_FUSION_KEPT)
        fail_at("convolution fusion", "more descriptors than CONV_FUSION_KEPT", __FILE__, __LINE__);
    keeper->kept[keeper->n_kept++] = *d;
    *d = NULL;
}

/* The execution plan for shape s, or NULL when cuDNN has no engine for it (or a step failed).
 * has_affine: x * scale + bias and a ReLU before the convolution (else the convolution reads x). */
static cudnnBackendDescriptor_t build_plan(gpu_t *g, const conv_shape_t *s, bool has_affine,
                                           int64_t *workspace, conv_fusion_plan_t *keeper) {
    enum { N_TENSORS = 10, N_OPS = 5, N_CFGS = 16 };
    cudnnBackendDescriptor_t t[N_TENSORS] = {0}, pw[3] = {0}, ops[N_OPS] = {0}, conv = NULL,
                             graph = NULL, heur = NULL, cfgs[N_CFGS] = {0}, plan = NULL,
                             found = NULL;
    /* the activations' 16-bit type */
    cudnnDataType_t half = g->low == LOW_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF,
                    fp32 = CUDNN_DATA_FLOAT;
    int64_t n = s->n, c = s->c, k = s->k;
    t[0] = nhwc_tensor(UID_X, half, n, c, s->h, s->w, false);
    t[1] = nhwc_tensor(UID_SCALE, half, 1, c, 1, 1, false);
    t[2] = nhwc_tensor(UID_BIAS, half, 1, c, 1, 1, false);
    t[3] = nhwc_tensor(UID_SCALED, half, n, c, s->h, s->w, true);
    t[4] = nhwc_tensor(UID_BIASED, half, n, c, s->h, s->w, true);
    t[5] = nhwc_tensor(UID_RELU, half, n, c, s->h, s->w, true);
    t[6] = nhwc_tensor(UID_W, half, k, c, s->r, s->s, false);
    t[7] = nhwc_tensor(UID_Y, half, n, k, s->oh, s->ow, false);
    t[8] = nhwc_tensor(UID_SUM, fp32, 1, k, 1, 1, false);
    t[9] = nhwc_tensor(UID_SQSUM, fp32, 1, k, 1, 1, false);
    for (int i = 0; i < N_TENSORS; i++)
        if (!t[i]) {
            fusion_fail("a tensor descriptor", CUDNN_STATUS_BAD_PARAM, __LINE__);
            goto out;
        }
    if (has_affine) {
        ops[0] = pointwise(&pw[0], CUDNN_POINTWISE_MUL, t[0], t[1], t[3]);
        ops[1] = pointwise(&pw[1], CUDNN_POINTWISE_ADD, t[3], t[2], t[4]);
        ops[2] = pointwise(&pw[2], CUDNN_POINTWISE_RELU_FWD, t[4], NULL, t[5]);
        if (!ops[0] || !ops[1] || !ops[2]) {
            fusion_fail("the scale, bias and ReLU operations", CUDNN_STATUS_BAD_PARAM, __LINE__);
            goto out;
        }
    }
    {
        int64_t dims = 2, one[2] = {1, 1}, stride[2] = {s->stride, s->stride},
                pad[2] = {s->pad, s->pad};
        cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
        CHECK_BACKEND(cudnnBackendCreateDescriptor(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, &conv));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
                                               CUDNN_TYPE_DATA_TYPE, 1, &fp32));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE,
                                               CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS,
                                               CUDNN_TYPE_INT64, 1, &dims));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_DILATIONS,
                                               CUDNN_TYPE_INT64, 2, one));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
                                               CUDNN_TYPE_INT64, 2, stride));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS,
                                               CUDNN_TYPE_INT64, 2, pad));
        CHECK_BACKEND(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS,
                                               CUDNN_TYPE_INT64, 2, pad));
        CHECK_BACKEND(cudnnBackendFinalize(conv));
    }
    {
        float alpha = 1.0f, beta = 0.0f;
        CHECK_BACKEND(cudnnBackendCreateDescriptor(
            CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, &ops[3]));
        CHECK_BACKEND(cudnnBackendSetAttribute(
            ops[3], CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha));
        CHECK_BACKEND(cudnnBackendSetAttribute(
            ops[3], CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &beta));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[3],
                                               CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &conv));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[3], CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                               has_affine ? &t[5] : &t[0]));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[3], CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t[6]));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[3], CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t[7]));
        CHECK_BACKEND(cudnnBackendFinalize(ops[3]));
    }
    {
        cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
        CHECK_BACKEND(
            cudnnBackendCreateDescriptor(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR, &ops[4]));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[4], CUDNN_ATTR_OPERATION_GENSTATS_MODE,
                                               CUDNN_TYPE_GENSTATS_MODE, 1, &mode));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[4], CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC,
                                               CUDNN_TYPE_DATA_TYPE, 1, &fp32));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[4], CUDNN_ATTR_OPERATION_GENSTATS_XDESC,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t[7]));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[4], CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t[8]));
        CHECK_BACKEND(cudnnBackendSetAttribute(ops[4], CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t[9]));
        CHECK_BACKEND(cudnnBackendFinalize(ops[4]));
    }
    CHECK_BACKEND(cudnnBackendCreateDescriptor(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph));
    /* without the affine part only the convolution and the statistics (ops 3 and 4) */
    CHECK_BACKEND(cudnnBackendSetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS,
                                           CUDNN_TYPE_BACKEND_DESCRIPTOR, has_affine ? N_OPS : 2,
                                           has_affine ? ops : ops + 3));
    CHECK_BACKEND(cudnnBackendSetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
                                           CUDNN_TYPE_HANDLE, 1, &g->cudnn));
    CHECK_BACKEND(cudnnBackendFinalize(graph));
    /* the heuristics' engine configurations, best first: the first that makes a plan wins (mode
     * A, then the fallback list) */
    for (int pass = 0; pass < 2 && !found; pass++) {
        cudnnBackendHeurMode_t mode = pass == 0 ? CUDNN_HEUR_MODE_A : CUDNN_HEUR_MODE_FALLBACK;
        int64_t n_cfgs = 0;
        if (heur) cudnnBackendDestroyDescriptor(heur);
        heur = NULL;
        CHECK_BACKEND(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
        CHECK_BACKEND(cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph));
        CHECK_BACKEND(cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE,
                                               CUDNN_TYPE_HEUR_MODE, 1, &mode));
        if (cudnnBackendFinalize(heur) != CUDNN_STATUS_SUCCESS) continue;
        for (int i = 0; i < N_CFGS; i++) {
            if (cfgs[i]) cudnnBackendDestroyDescriptor(cfgs[i]);
            cfgs[i] = NULL;
            CHECK_BACKEND(
                cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfgs[i]));
        }
        if (cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, N_CFGS, &n_cfgs,
                                     cfgs) != CUDNN_STATUS_SUCCESS)
            continue;
        if (n_cfgs > N_CFGS) n_cfgs = N_CFGS; /* the count cuDNN has, not the count it wrote */
        for (int64_t i = 0; i < n_cfgs && !found; i++) {
            CHECK_BACKEND(
                cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
            CHECK_BACKEND(cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                                   CUDNN_TYPE_HANDLE, 1, &g->cudnn));
            CHECK_BACKEND(cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]));
            if (cudnnBackendFinalize(plan) == CUDNN_STATUS_SUCCESS) {
                int64_t count = 0;
                CHECK_BACKEND(cudnnBackendGetAttribute(plan,
                                                       CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                       CUDNN_TYPE_INT64, 1, &count, workspace));
                found = plan;
                keep(keeper, &cfgs[i]);
            } else {
                cudnnBackendDestroyDescriptor(plan);
            }
            plan = NULL;
        }
    }
    if (found) { /* what the plan was made from lives as long as the plan */
        keep(keeper, &graph);
        for (int i = 0; i < N_OPS; i++)
            keep(keeper, &ops[i]);
        for (int i = 0; i < 3; i++)
            keep(keeper, &pw[i]);
        keep(keeper, &conv);
        for (int i = 0; i < N_TENSORS; i++)
            keep(keeper, &t[i]);
    }
out:
    if (plan) cudnnBackendDestroyDescriptor(plan);
    for (int i = 0; i < N_CFGS; i++)
        if (cfgs[i]) cudnnBackendDestroyDescriptor(cfgs[i]);
    if (heur) cudnnBackendDestroyDescriptor(heur);
    if (graph) cudnnBackendDestroyDescriptor(graph);
    for (int i = 0; i < N_OPS; i++)
        if (ops[i]) cudnnBackendDestroyDescriptor(ops[i]);
    for (int i = 0; i < 3; i++)
        if (pw[i]) cudnnBackendDestroyDescriptor(pw[i]);
    if (conv) cudnnBackendDestroyDescriptor(conv);
    for (int i = 0; i < N_TENSORS; i++)
        if (t[i]) cudnnBackendDestroyDescriptor(t[i]);
    return found;
}

/* The plan of shape s (NULL: none can be had), built on first use, never while ops are being
 * recorded (a CUDA graph's capture: cuDNN's heuristics may not be capturable). */
static conv_fusion_plan_t *plan_for(gpu_t *g, const conv_shape_t *s, bool has_affine) {
    for (int i = 0; i < g->n_fusion_plans; i++) {
        const conv_shape_t *p = &g->fusion_plans[i].shape;
        if (p->n == s->n && p->h == s->h && p->w == s->w && p->c == s->c && p->k == s->k &&
            p->r == s->r && p->s == s->s && p->stride == s->stride && p->pad == s->pad &&
            g->fusion_plans[i].has_affine == has_affine)
            return &g->fusion_plans[i];
    }
    if (g->n_fusion_plans == CONV_FUSION_PLANS || g->is_recording)
        return NULL; /* more shapes than a ResNet has */
    conv_fusion_plan_t *p = &g->fusion_plans[g->n_fusion_plans++];
    memset(p, 0, sizeof *p);
    p->shape = *s;
    p->has_affine = has_affine;
    int64_t workspace = 0;
    p->plan = build_plan(g, s, has_affine, &workspace, p);
    p->workspace = (size_t)workspace;
    if (p->plan && p->workspace > g->workspace_bytes &&
        gpu_reserve_workspace(&g->base, p->workspace) < 0)
        fail_at("convolution fusion workspace", "out of GPU memory", __FILE__, __LINE__);
    return p;
}

__global__ void to_half_kernel(const float *scale, const float *bias, f16 *out, int c) {
    GRID_STRIDE(i, (size_t)c) {
        out[i] = __float2half(scale[i]);
        out[c + i] = __float2half(bias[i]);
    }
}

static bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

void gpu_conv_fusion_free(gpu_t *g) {
    for (int i = 0; i < g->n_fusion_plans; i++) {
        conv_fusion_plan_t *p = &g->fusion_plans[i];
        if (p->plan) cudnnBackendDestroyDescriptor((cudnnBackendDescriptor_t)p->plan);
        for (int k = 0; k < p->n_kept; k++) /* the configuration first, the tensors last */
            cudnnBackendDestroyDescriptor((cudnnBackendDescriptor_t)p->kept[k]);
    }
    g->n_fusion_plans = 0;
    if (g->fusion_affine) cudaFree(g->fusion_affine);
    g->fusion_affine = NULL;
}

int gpu_conv2d_bn_forward(backend_t *b, const conv_shape_t *s, tensor_desc_t x_d,
                          const float *scale, const float *bias, const float *w, tensor_desc_t y_d,
                          float *sum, float *sqsum) {
    gpu_t *g = gpu_of(b);
    bool has_affine = scale || bias;
    /* scale and bias go to the graph as fp16 (to_half_kernel): the affine form in fp16 only */
    if (!g->is_conv_fusion || g->low == LOW_NONE || (has_affine && g->low != LOW_FP16) ||
        !is_low(g, x_d) || !is_low(g, y_d) || s->c % 8 || s->k % 8 || s->c > BN_MAX_CHANNELS ||
        !aligned16(x_d.data) || !aligned16(y_d.data) || !aligned16(shadow_of(g, w)) ||
        !aligned16(sum) || !aligned16(sqsum) || (has_affine && (!scale || !bias)))
        return -1;
    conv_fusion_plan_t *p = plan_for(g, s, has_affine);
    if (!p || !p->plan) return -1;
    f16 *affine = NULL;
    if (has_affine) {
        if (!g->fusion_affine &&
            cudaMalloc(&g->fusion_affine, 2 * BN_MAX_CHANNELS * sizeof(f16)) != cudaSuccess)
            fail_at("convolution fusion", "out of GPU memory", __FILE__, __LINE__);
        affine = (f16 *)g->fusion_affine;
        LAUNCH(to_half_kernel, (size_t)s->c, scale, bias, affine, s->c);
    }
    /* the affine pair last: left out of the pack without it */
    void *ptrs[7] = {x_d.data, (void *)shadow_of(g, w),      y_d.data, sum, sqsum,
                     affine,   affine ? affine + s->c : NULL};
    int64_t uids[7] = {UID_X, UID_W, UID_Y, UID_SUM, UID_SQSUM, UID_SCALE, UID_BIAS};
    int64_t n_ptrs = has_affine ? 7 : 5;
    /* the statistics start from zero whether cuDNN's epilogue writes or adds them (they may be
     * a batch norm's saved slots, holding the last step's values) */
    CHECK_CUDA(cudaMemsetAsync(sum, 0, (size_t)s->k * sizeof(float), g->stream));
    CHECK_CUDA(cudaMemsetAsync(sqsum, 0, (size_t)s->k * sizeof(float), g->stream));
    void *workspace = g->workspace;
    cudnnBackendDescriptor_t pack = NULL;
    CHECK_CUDNN(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    CHECK_CUDNN(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                         CUDNN_TYPE_VOID_PTR, n_ptrs, ptrs));
    CHECK_CUDNN(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                         n_ptrs, uids));
    CHECK_CUDNN(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                         CUDNN_TYPE_VOID_PTR, 1, &workspace));
    CHECK_CUDNN(cudnnBackendFinalize(pack));
    CHECK_CUDNN(cudnnBackendExecute(g->cudnn, (cudnnBackendDescriptor_t)p->plan, pack));
    CHECK_CUDNN(cudnnBackendDestroyDescriptor(pack));
    return 0;
}
