/* cuda_api: what libddpworker_cuda.so offers ddpworker, as one versioned table. ddpworker dlopens
 * the library, looks up one symbol (DDPWORKER_CUDA_API_SYMBOL) and refuses a table whose version
 * or size is not the one it was built with (a library from another build), instead of looking up
 * each function by name and casting it to a signature the compiler cannot check. Plain C: the
 * loader side needs no CUDA headers. */
#ifndef DDP_WORKER_CUDA_API_H
#define DDP_WORKER_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "backend_cuda.h"
#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bump on any change of the table below. */
#define DDPWORKER_CUDA_API_VERSION 3u /* 3: backend_create's two algorithm cache files */
#define DDPWORKER_CUDA_API_SYMBOL  "ddpworker_cuda_api"

typedef struct {
    uint32_t version; /* DDPWORKER_CUDA_API_VERSION */
    uint32_t size;    /* sizeof(ddpworker_cuda_api_t) */
    /* backend_cuda.h */
    int (*device_count)(void);
    backend_t *(*backend_create)(int device, unsigned flags,
                                 const backend_cuda_algo_cache_t *algo_cache, char *err,
                                 size_t err_len);
    /* comm_nccl.h; NULL when the library was built without NCCL */
    size_t (*nccl_id_bytes)(void);
    int (*nccl_unique_id)(void *out, char *err, size_t err_len);
    int (*nccl_create)(backend_t *backend, const void *id, int rank, int world, int64_t timeout_ms,
                       comm_t **out, char *err, size_t err_len);
} ddpworker_cuda_api_t;

/* The table, defined once in the library (cuda/cuda_api.cu). */
extern const ddpworker_cuda_api_t ddpworker_cuda_api;

#ifdef __cplusplus
}
#endif

#endif
