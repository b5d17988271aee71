/* lr_schedule: see lr_schedule.h. One-cycle follows the common shape: warm up to base_lr over the
 * first 30% (or the configured warm-up), then cosine down to base_lr / 1e4. */
#include "lr_schedule.h"

#include <math.h>

void lr_schedule_init(lr_schedule_t *s, const train_conf_t *c, int world_size,
                      int64_t steps_per_epoch, int64_t total_steps) {
    double scale = c->lr_scaling == LR_SCALING_LINEAR ? (double)world_size
                   : c->lr_scaling == LR_SCALING_SQRT ? sqrt((double)world_size)
                                                      : 1.0;
    s->base_lr = c->lr * scale;
    s->schedule = c->schedule;
    s->total_steps = total_steps > 0 ? total_steps : 1;
    s->warmup_steps = (int64_t)llround(c->warmup_epochs * (double)steps_per_epoch);
    if (s->schedule == SCHEDULE_ONE_CYCLE && s->warmup_steps == 0)
        s->warmup_steps = (int64_t)(0.3 * (double)s->total_steps);
    /* a run of unknown length (train.hours alone) keeps its whole warm-up */
    if (total_steps > 0 && s->warmup_steps >= s->total_steps) s->warmup_steps = s->total_steps - 1;
    s->step_every = c->step_every_epochs * (steps_per_epoch > 0 ? steps_per_epoch : 1);
    s->step_gamma = c->step_gamma;
}

double lr_at(const lr_schedule_t *s, int64_t step) {
    if (step < s->warmup_steps) return s->base_lr * (double)(step + 1) / (double)s->warmup_steps;
    int64_t after = step - s->warmup_steps, span = s->total_steps - s->warmup_steps;
    double progress = span > 0 ? (double)after / (double)span : 1.0;
    if (progress > 1.0) progress = 1.0;
    switch (s->schedule) {
    case SCHEDULE_CONSTANT:
        return s->base_lr;
    case SCHEDULE_STEP:
        return s->base_lr * pow(s->step_gamma, (double)(step / s->step_every));
    case SCHEDULE_COSINE:
        return s->base_lr * 0.5 * (1.0 + cos(M_PI * progress));
    case SCHEDULE_ONE_CYCLE: {
        double floor_lr = s->base_lr / 1e4;
        return floor_lr + (s->base_lr - floor_lr) * 0.5 * (1.0 + cos(M_PI * progress));
    }
    }
    return s->base_lr;
}
