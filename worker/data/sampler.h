/* sampler: which samples each rank trains on, with torch's DistributedSampler contract: a
 * per-epoch shuffle seeded by (seed, epoch), padded by wrapping so every rank gets the same count,
 * rank r taking global positions r, r + world, r + 2 world, ... Plus a global cursor: positions
 * already consumed this epoch, so a resume, even with another world size, continues where the
 * job stopped. Allocates at init only. */
#ifndef DDP_WORKER_SAMPLER_H
#define DDP_WORKER_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    int64_t n; /* dataset size */
    int world, rank;
    uint64_t seed;
    bool is_shuffled;
    int64_t epoch;
    int64_t *perm; /* (n) this epoch's order */
} sampler_t;

/* Returns 0 or -ENOMEM / -EINVAL (n < 1, rank outside [0, world)). Epoch 0 is set. */
int sampler_init(sampler_t *s, int64_t n, int world, int rank, uint64_t seed, bool is_shuffled);
void sampler_free(sampler_t *s);
/* Reorder for an epoch: the same (seed, epoch) gives the same order on every rank and run. */
void sampler_set_epoch(sampler_t *s, int64_t epoch);
/* Global positions per epoch: n rounded up to a multiple of world. */
int64_t sampler_total(const sampler_t *s);
/* Samples this rank sees in an epoch that starts at global position `cursor`: the same on every
 * rank (positions past the end wrap around), so all ranks run the same number of steps. */
int64_t sampler_rank_count(const sampler_t *s, int64_t cursor);
/* The dataset index of this rank's i-th sample of an epoch resumed at `cursor`. */
int64_t sampler_index(const sampler_t *s, int64_t cursor, int64_t i);

#endif
