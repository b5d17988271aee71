/* build_info: what this build of ddprun/ddpworker is: its version, the git commit it was
 * configured from, and the backends and collectives compiled in with the library versions CMake
 * found (CUDA, cuDNN, NCCL, OpenBLAS). The values are fixed when CMake configures the tree
 * (common/build_info.c.in); nothing here touches a GPU or loads a library. */
#ifndef DDP_COMMON_BUILD_INFO_H
#define DDP_COMMON_BUILD_INFO_H

#include <stdbool.h>
#include <stdio.h>

typedef struct {
    const char *version;          /* the CMake project version, "0.1.0" */
    const char *git_commit;       /* 12 hex digits, or "unknown" outside a git checkout */
    const char *build_type;       /* CMAKE_BUILD_TYPE */
    bool has_cuda_backend;        /* libddpworker_cuda.so is built (CUDA and cuDNN found) */
    bool has_nccl;                /* ... with the nccl collective */
    const char *cuda_version;     /* "13.0.88"; "" without CUDA */
    const char *cudnn_version;    /* "9.19.0"; "" without cuDNN */
    const char *nccl_version;     /* "2.28.9"; "" without NCCL */
    const char *openblas_version; /* "0.3.21"; "" when pkg-config did not say */
} build_info_t;

extern const build_info_t build_info;

/* `PROGRAM --version`: "PROGRAM VERSION", then "commit: ...", "backends: ..." (cpu only, or
 * cpu and cuda with the CUDA and cuDNN versions), "collectives: ..." (null, ring[, nccl with its
 * version]) and "build: ...", one a line. */
void build_info_print(const char *program, FILE *f);

#endif
