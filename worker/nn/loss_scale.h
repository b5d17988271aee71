/* loss_scale: dynamic loss scaling, as PyTorch's GradScaler does it, kept where the gradients are
 * (device memory on cuda) so that a step needs no host synchronization: the loss gradient is
 * multiplied by `scale` (softmax_xent), the summed gradients are checked for inf/NaN
 * (loss_scale_check), the optimizer divides by `scale` and skips the whole step if any was found
 * (sgd_step), and loss_scale_update then backs off or grows the scale. The host reads the state
 * only at log intervals and snapshots.
 *
 * Every rank decides alike without another collective: the check runs on the all-reduced sum, and
 * an inf or a NaN on any rank makes that sum non-finite everywhere.
 *
 * loss_scale_next is the one implementation of the update rule; the cpu backend calls it and the
 * cuda backend's one-thread kernel compiles the same function. */
#ifndef DDP_WORKER_LOSS_SCALE_H
#define DDP_WORKER_LOSS_SCALE_H

#include <stdint.h>

#ifdef __CUDACC__
#define LOSS_SCALE_FN __host__ __device__ static inline
#else
#define LOSS_SCALE_FN static inline
#endif

/* GradScaler's constants (growth_factor, backoff_factor). */
#define LOSS_SCALE_GROWTH  2.0f
#define LOSS_SCALE_BACKOFF 0.5f

typedef struct {
    float scale;            /* the loss (and so every gradient) is multiplied by this */
    uint32_t found_inf;     /* this step's summed gradients hold an inf or a NaN */
    uint32_t good_steps;    /* steps since the last overflow or growth (GradScaler's tracker) */
    uint32_t skipped_steps; /* steps skipped for an overflow since this process started */
} loss_scale_t;

/* After a step: an overflow halves the scale and restarts the count; growth_interval good steps
 * in a row double it (unless that overflows fp32). Clears found_inf for the next step. */
LOSS_SCALE_FN void loss_scale_next(loss_scale_t *s, uint32_t growth_interval) {
    if (s->found_inf) {
        s->scale *= LOSS_SCALE_BACKOFF;
        s->good_steps = 0;
        s->skipped_steps++;
    } else if (++s->good_steps >= growth_interval) {
        float grown = s->scale * LOSS_SCALE_GROWTH;
        if (grown - grown == 0.0f) s->scale = grown; /* finite: inf - inf is NaN */
        s->good_steps = 0;
    }
    s->found_inf = 0;
}

#endif
