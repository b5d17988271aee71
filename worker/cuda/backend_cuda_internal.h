/* What the other CUDA files of libddpworker_cuda.so need of the backend (not part of backend_i). */
#ifndef DDP_WORKER_BACKEND_CUDA_INTERNAL_H
#define DDP_WORKER_BACKEND_CUDA_INTERNAL_H

#include <cuda_runtime.h>

#include "backend.h"

/* The stream every op of b is queued on. */
cudaStream_t backend_cuda_stream(backend_t *b);

#endif
