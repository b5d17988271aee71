/* cuda_linear: linear layers through cuBLAS. */
#include "cuda_common.cuh"

/* ---- linear (cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose) ----
 * bf16/fp16: activations and the weights' narrow copy in, float accumulation; the weight gradient
 * is written straight into the fp32 arena (cuBLAS mixes narrow inputs with an fp32 output). */

static cudaDataType_t blas_type(const gpu_t *g, bool is_low) {
    return !is_low ? CUDA_R_32F : g->low == LOW_FP16 ? CUDA_R_16F : CUDA_R_16BF;
}

template <typename T>
__global__ void broadcast_rows_kernel(const float *bias, T *y, int n, int out) {
    GRID_STRIDE(i, (size_t)n * out) st(y, i, bias[i % out]);
}

template <typename T>
__global__ void column_sums_kernel(const T *dy, float *dbias, int n, int out) {
    GRID_STRIDE(o, (size_t)out) {
        float sum = 0.0f;
        for (int i = 0; i < n; i++)
            sum += ld(dy, (size_t)i * out + o);
        dbias[o] += sum;
    }
}

static void gemm(gpu_t *g, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                 const void *a, cudaDataType_t at, int lda, const void *b, cudaDataType_t bt,
                 int ldb, void *c, cudaDataType_t ct, int ldc) {
    const float one = 1.0f;
    cublasComputeType_t compute =
        at == CUDA_R_32F ? (g->is_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F)
                         : CUBLAS_COMPUTE_32F;
    CHECK_CUBLAS(cublasGemmEx(g->cublas, ta, tb, m, n, k, &one, a, at, lda, b, bt, ldb, &one, c, ct,
                              ldc, compute, CUBLAS_GEMM_DEFAULT));
}

void gpu_linear_forward(backend_t *b, int n, int in, int out, tensor_desc_t x_d, const float *w,
                        const float *bias, tensor_desc_t y_d) {
    const float *x = (const float *)x_d.data;
    float *y = (float *)y_d.data;
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x_d);
    cudaDataType_t t = blas_type(g, low);
    const void *weights = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (low)
        WITH_LOW(g, LAUNCH(broadcast_rows_kernel<Low>, (size_t)n * out, bias, LOW(y), n, out));
    else
        LAUNCH(broadcast_rows_kernel<float>, (size_t)n * out, bias, y, n, out);
    /* y^T (out, n) += W (out, in) . x^T (in, n) */
    gemm(g, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, weights, t, in, x, t, in, y, t, out);
}

void gpu_linear_backward(backend_t *b, int n, int in, int out, tensor_desc_t x_d, const float *w,
                         tensor_desc_t dy_d, tensor_desc_t dx_d, float *dw, float *dbias) {
    const float *x = (const float *)x_d.data;
    const float *dy = (const float *)dy_d.data;
    float *dx = (float *)dx_d.data;
    gpu_t *g = gpu_of(b);
    bool low = is_low(g, x_d);
    cudaDataType_t t = blas_type(g, low);
    /* dW^T (in, out) += x^T (in, n) . dy (n, out) */
    gemm(g, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, x, t, in, dy, t, out, dw, CUDA_R_32F, in);
    if (low)
        WITH_LOW(g, LAUNCH(column_sums_kernel<Low>, (size_t)out, CLOW(dy), dbias, n, out));
    else
        LAUNCH(column_sums_kernel<float>, (size_t)out, dy, dbias, n, out);
    /* dx^T (in, n) += W^T (in, out) . dy^T (out, n) */
    const void *weights = low ? (const void *)shadow_of(g, w) : (const void *)w;
    if (dx) gemm(g, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, weights, t, in, dy, t, out, dx, t, in);
}
