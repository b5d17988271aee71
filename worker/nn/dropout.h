/* dropout: which elements inverted dropout keeps, as a pure function of (key, element index), so
 * that the cpu loop and the cuda kernel draw the same mask, the backward draws it again instead of
 * storing it, and a restarted run replays it. The key is the model's: (seed, step, rank, layer)
 * (model.h). Integer arithmetic only: no rounding differs between host and device. */
#ifndef DDP_WORKER_DROPOUT_H
#define DDP_WORKER_DROPOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define DROPOUT_FN __host__ __device__ static inline
#else
#define DROPOUT_FN static inline
#endif

/* 24 bits of uniform randomness per element: p is honoured to 2^-24. */
#define DROPOUT_BITS 24

/* The drop threshold for probability p in [0, 1): an element drops when its 24 bits are below. */
DROPOUT_FN uint32_t dropout_threshold(float p) {
    double t = (double)p * (double)(1u << DROPOUT_BITS);
    return p <= 0.0f ? 0u : t >= (double)(1u << DROPOUT_BITS) ? (1u << DROPOUT_BITS) : (uint32_t)t;
}

/* Whether element i survives: SplitMix64's finalizer over the key and the index. */
DROPOUT_FN int dropout_keeps(uint64_t key, uint64_t i, uint32_t threshold) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> (64 - DROPOUT_BITS)) >= threshold;
}

/* The survivors' factor, as nn.Dropout's 1 / (1 - p) in fp32. */
DROPOUT_FN float dropout_scale(float p) {
    return 1.0f / (1.0f - p);
}

#endif
