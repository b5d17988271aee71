/* lr_schedule: the learning rate at each step from train.conf's [optim] keys: base lr scaled with
 * the world size (none, linear, sqrt), linear warm-up, then constant, step, cosine or one-cycle.
 * Pure; a function of the step (of the world it was made for: the trainer maps a run resumed at
 * another world size onto it), so a resumed run recomputes it without saved state. */
#ifndef DDP_WORKER_LR_SCHEDULE_H
#define DDP_WORKER_LR_SCHEDULE_H

#include <stdint.h>

#include "train_conf.h"

typedef struct {
    double base_lr; /* after world-size scaling */
    schedule_t schedule;
    int64_t warmup_steps;
    int64_t total_steps; /* of the whole run (cosine and one-cycle need it) */
    int64_t step_every;  /* step schedule: steps between decays */
    double step_gamma;
} lr_schedule_t;

/* From the configuration, the world size and the run's length in steps (0: not known, a run of
 * train.hours alone, which constant and step schedules allow). */
void lr_schedule_init(lr_schedule_t *s, const train_conf_t *c, int world_size,
                      int64_t steps_per_epoch, int64_t total_steps);
/* The learning rate for step (0-based). */
double lr_at(const lr_schedule_t *s, int64_t step);

#endif
