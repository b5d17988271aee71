/* rng: counter-based randomness for the worker. Every random choice is a pure function of
 * (seed, stream, counters), so a restarted run replays the same choices without saved state. */
#ifndef DDP_WORKER_RNG_H
#define DDP_WORKER_RNG_H

#include <stdint.h>

/* SplitMix64: advances *state and returns 64 well-mixed bits. */
static inline uint64_t rng_next(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The state n draws after `state`: SplitMix64's state only counts, so draw j of a stream can be
 * made without the j before it (work split across threads gives the sequential values). */
static inline uint64_t rng_skip(uint64_t state, uint64_t n) {
    return state + n * 0x9E3779B97F4A7C15ull;
}

/* A generator state for (seed, a, b): e.g. (seed, epoch) or (seed ^ stream, epoch, index). */
static inline uint64_t rng_key(uint64_t seed, uint64_t a, uint64_t b) {
    uint64_t s = seed;
    uint64_t h = rng_next(&s) ^ a;
    h = rng_next(&h) ^ b;
    return rng_next(&h);
}

#endif
