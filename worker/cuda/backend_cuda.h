/* backend_cuda: backend_i on one NVIDIA GPU: cuDNN convolutions (NHWC), cuBLAS for
 * linear layers, own kernels for the rest, all on one stream. Built when CMake finds CUDA and cuDNN
 * (DDP_HAVE_CUDA_BACKEND); held op by op against the CPU reference by tests/gpu/test_backend_cuda.c
 * (skipped without a GPU). fp32, tf32, bf16 and fp16. */
#ifndef DDP_WORKER_BACKEND_CUDA_H
#define DDP_WORKER_BACKEND_CUDA_H

#include <stddef.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The number of GPUs this process can use (0 when there is no driver or device). */
int backend_cuda_device_count(void);
/* flags. TF32: fp32 convolutions and GEMMs may use TF32 tensor cores. BF16, FP16: activations and
 * their gradients in bf16 or fp16 (activation_dtype; the model's arenas, mark_arenas); parameters,
 * their gradients, momentum and batch-norm statistics stay fp32, as under PyTorch's autocast. FP16
 * needs the trainer's dynamic loss scaling (loss_scale.h) to keep small gradients from flushing to
 * zero. */
enum { BACKEND_CUDA_TF32 = 1, BACKEND_CUDA_BF16 = 2, BACKEND_CUDA_FP16 = 4 };
/* Text files of the convolution algorithms cuDNN's timed search chose (per GPU, cuDNN version,
 * shape and math mode). */
typedef struct {
    /* the run's own (NULL: none): read at start, appended to with every algorithm the run uses,
     * so that a run resumed from its snapshots uses the same ones */
    const char *own;
    /* shared by the runs on this machine (NULL: none): read for the shapes `own` lacks, appended
     * to with what this run searched */
    const char *shared;
} backend_cuda_algo_cache_t;

/* A backend on GPU `device`; algo_cache NULL: none, every start searches. Returns NULL with the
 * error in err. */
backend_t *backend_cuda_create(int device, unsigned flags,
                               const backend_cuda_algo_cache_t *algo_cache, char *err,
                               size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
