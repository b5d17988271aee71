/* comm_nccl: comm_i over NCCL for the cuda backend, one GPU per rank (comm_nccl.cu). Built into
 * libddpworker_cuda.so when CMake finds NCCL; ddpworker reaches it through cuda_api.h's table. */
#ifndef DDP_WORKER_COMM_NCCL_H
#define DDP_WORKER_COMM_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The size of an ncclUniqueId: what rank 0 publishes through the store for the others. */
size_t comm_nccl_id_bytes(void);
/* A fresh id into out (comm_nccl_id_bytes() bytes). Returns 0 or a negative code with err. */
int comm_nccl_unique_id(void *out, char *err, size_t err_len);
/* Join the communicator of `world` ranks named by id, on the backend's GPU; collectives wait for
 * what the backend has queued. Joining and every collective are bounded by timeout_ms. */
int comm_nccl_create(backend_t *backend, const void *id, int rank, int world, int64_t timeout_ms,
                     comm_t **out, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
