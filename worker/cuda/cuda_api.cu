/* cuda_api: the table ddpworker loads (cuda_api.h). */
#include "cuda_api.h"

#include "backend_cuda.h"
#ifdef DDP_HAVE_NCCL
#include "comm_nccl.h"
#endif

extern "C" __attribute__((visibility("default"))) const ddpworker_cuda_api_t ddpworker_cuda_api = {
    DDPWORKER_CUDA_API_VERSION, sizeof(ddpworker_cuda_api_t), backend_cuda_device_count,
    backend_cuda_create,
#ifdef DDP_HAVE_NCCL
    comm_nccl_id_bytes,         comm_nccl_unique_id,          comm_nccl_create,
#else
    NULL,
    NULL,
    NULL,
#endif
};
