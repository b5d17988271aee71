/* backend_cuda: backend_i on one NVIDIA GPU: cuDNN convolutions and batch norm (NHWC), cuBLAS for
 * linear layers, own kernels for the rest, all on one stream. Built when CMake finds CUDA and cuDNN
 * (DDP_HAVE_CUDA_BACKEND); held op by op against the CPU reference by tests/unit/test_backend_cuda.c
 * (skipped without a GPU). fp32 for now; fp16/bf16 come with the precision work. */
#ifndef DDP_WORKER_BACKEND_CUDA_H
#define DDP_WORKER_BACKEND_CUDA_H

#include <stddef.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The number of GPUs this process can use (0 when there is no driver or device). */
int backend_cuda_device_count(void);
/* A backend on GPU `device`. Returns NULL with the CUDA/cuDNN/cuBLAS error, file:line, in err. */
backend_t *backend_cuda_create(int device, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
