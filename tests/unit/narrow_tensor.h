/* narrow_tensor: the tensor descriptors the CUDA op tests hand to a backend, shared by
 * tests/unit/test_cuda_fused.c and tests/gpu/test_backend_cuda.c. One test program's state (static:
 * each test file is its own program). */
#ifndef DDP_TEST_NARROW_TENSOR_H
#define DDP_TEST_NARROW_TENSOR_H

#include <stddef.h>

#include "backend.h"

/* A tensor as the ops take it (backend.h): narrow where the backend under test keeps narrow
 * activations (the arenas given to mark_arenas, registered by narrow_arenas), else fp32, as the
 * model describes its own tensors; the ops take sizes from their own arguments. */
static backend_t *narrow_b;
static const float *narrow_arena[2];
static size_t narrow_n;

static inline void narrow_arenas(backend_t *b, const float *acts, const float *dacts, size_t n) {
    narrow_b = b;
    narrow_arena[0] = acts;
    narrow_arena[1] = dacts;
    narrow_n = n;
}

static inline tensor_desc_t TD(backend_t *b, const void *p) {
    dtype_t t = DTYPE_F32;
    for (int i = 0; i < 2 && p && b == narrow_b && b->mem->activation_dtype; i++)
        if ((const float *)p >= narrow_arena[i] && (const float *)p < narrow_arena[i] + narrow_n)
            t = b->mem->activation_dtype(b);
    return tensor_desc(p, t, 0, 0, 0, 0);
}

#endif
