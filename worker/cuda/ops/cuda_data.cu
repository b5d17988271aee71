/* cuda_data: the input batch built on the GPU from the dataset held there. */
#include "cuda_common.cuh"

/* ---- the data path: a batch from the dataset held on the GPU (uint8), one thread per value ----
 */

/* augment_apply's arithmetic: the same rounded multiply and add (never an FMA), so the same bits.
 */
template <typename T>
__global__ void augment_kernel(const uint8_t *images, const int32_t *labels, int h, int w, int c,
                               const augment_job_t *jobs, int n, augment_norm_t norm, T *out,
                               int32_t *labels_out) {
    size_t per = (size_t)h * w * c;
    GRID_STRIDE(o, per * n) {
        size_t i = o / per, r = o % per, p = r / c;
        int k = (int)(r % c), x = (int)(p % w), y = (int)(p / w);
        const augment_job_t *job = &jobs[i];
        int sy = y + job->choice.dy, sx = (job->choice.is_flipped ? w - 1 - x : x) + job->choice.dx;
        bool is_inside = sy >= 0 && sy < h && sx >= 0 && sx < w;
        float v = is_inside
                      ? (float)images[(size_t)job->index * per + ((size_t)sy * w + sx) * c + k]
                      : 0.0f;
        st(out, o, __fadd_rn(__fmul_rn(v, norm.scale[k]), norm.shift[k]));
        if (r == 0) labels_out[i] = labels[job->index];
    }
}

void gpu_augment_batch(backend_t *b, const uint8_t *images, const int32_t *labels, int h, int w,
                       int c, const augment_job_t *jobs, int n, augment_norm_t norm,
                       tensor_desc_t out_d, int32_t *labels_out) {
    float *out = (float *)out_d.data;
    size_t total = (size_t)h * w * c * n;
    if (!total) return;
    if (is_low(gpu_of(b), out_d))
        WITH_LOW(gpu_of(b), LAUNCH(augment_kernel<Low>, total, images, labels, h, w, c, jobs, n,
                                   norm, LOW(out), labels_out));
    else
        LAUNCH(augment_kernel<float>, total, images, labels, h, w, c, jobs, n, norm, out,
               labels_out);
}
