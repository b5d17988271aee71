/* sampler: see sampler.h. The shuffle is Fisher-Yates driven by rng.h's counter-based generator
 * keyed by (seed, epoch), so no state has to be saved or replayed. */
#include "sampler.h"

#include <errno.h>
#include <stdlib.h>

#include "rng.h"

/* Uniform in [0, bound) without modulo bias (Lemire's method). */
static uint64_t below(uint64_t *state, uint64_t bound) {
    unsigned __int128 m = (unsigned __int128)rng_next(state) * bound;
    uint64_t low = (uint64_t)m;
    if (low < bound) {
        uint64_t threshold = -bound % bound;
        while (low < threshold) {
            m = (unsigned __int128)rng_next(state) * bound;
            low = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

int sampler_init(sampler_t *s, int64_t n, int world, int rank, uint64_t seed, bool is_shuffled) {
    if (n < 1 || world < 1 || rank < 0 || rank >= world) return -EINVAL;
    s->perm = malloc((size_t)n * sizeof *s->perm);
    if (!s->perm) return -ENOMEM;
    s->n = n;
    s->world = world;
    s->rank = rank;
    s->seed = seed;
    s->is_shuffled = is_shuffled;
    sampler_set_epoch(s, 0);
    return 0;
}

void sampler_free(sampler_t *s) {
    free(s->perm);
    s->perm = NULL;
}

void sampler_set_epoch(sampler_t *s, int64_t epoch) {
    s->epoch = epoch;
    for (int64_t i = 0; i < s->n; i++)
        s->perm[i] = i;
    if (!s->is_shuffled) return;
    uint64_t state = rng_key(s->seed, 0x53414D504C4552ull /* "SAMPLER" */, (uint64_t)epoch);
    for (int64_t i = s->n - 1; i > 0; i--) {
        int64_t j = (int64_t)below(&state, (uint64_t)i + 1);
        int64_t t = s->perm[i];
        s->perm[i] = s->perm[j];
        s->perm[j] = t;
    }
}

int64_t sampler_total(const sampler_t *s) {
    return (s->n + s->world - 1) / s->world * s->world;
}

/* The same count on every rank, also when a resume with another world size left the cursor
 * unaligned: ranks that step past the end take wrapped (padding) samples, so no rank runs a step
 * the others do not. */
int64_t sampler_rank_count(const sampler_t *s, int64_t cursor) {
    int64_t left = sampler_total(s) - cursor;
    return left <= 0 ? 0 : (left + s->world - 1) / s->world;
}

int64_t sampler_index(const sampler_t *s, int64_t cursor, int64_t i) {
    int64_t position = cursor + s->rank + i * s->world;
    return s->perm[position % s->n]; /* positions past n wrap: DistributedSampler's padding */
}
