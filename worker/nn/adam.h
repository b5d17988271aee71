/* adam: the arithmetic of torch.optim.Adam and AdamW (amsgrad and maximize off) as one source the
 * cpu backend calls and the cuda kernels compile (like loss_scale.h), and the step count that
 * lives in backend memory next to the moments, so that a step needs no host read-back.
 *
 * Numerics are torch 1.13's _single_tensor_adam(w): the hyper-parameters are Python floats
 * (double), rounded to fp32 where torch's kernels take them as scalars; the bias corrections come
 * from the step count in double; every tensor operation is one fp32 rounding, in torch's order.
 * Pure functions, no allocation; any thread. */
#ifndef DDP_WORKER_ADAM_H
#define DDP_WORKER_ADAM_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "loss_scale.h"

#ifdef __CUDACC__
#define ADAM_FN __host__ __device__ static inline
#else
#define ADAM_FN static inline
#endif

/* What the user chose (train.conf's optim.*), as torch's param_group holds it. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    bool is_decoupled; /* AdamW: p *= 1 - lr * wd first; Adam: g += wd * p (L2) */
} adam_hparams_t;

/* Adam's state besides its two moment arenas: backend memory, zeroed before the first step.
 * adam_count_next advances it on the backend (the cuda kernel reads it there); the host reads it
 * only for snapshots and writes it only on resume. */
typedef struct {
    uint64_t step;   /* steps taken (torch's state['step']); skipped steps do not count */
    float step_size; /* of the step in progress: lr / (1 - beta1^step) */
    float bias_correction2_sqrt; /* of the step in progress: sqrt(1 - beta2^step) */
} adam_count_t;

/* The hyper-parameters as the fp32 scalars torch's kernels see. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay;
    bool is_decoupled;
} adam_scalars_t;

ADAM_FN adam_scalars_t adam_scalars(const adam_hparams_t *h) {
    adam_scalars_t s;
    s.beta1 = (float)h->beta1;
    s.one_minus_beta1 = (float)(1.0 - h->beta1); /* torch: alpha=1 - beta1, a double */
    s.beta2 = (float)h->beta2;
    s.one_minus_beta2 = (float)(1.0 - h->beta2);
    s.eps = (float)h->eps;
    s.weight_decay = (float)h->weight_decay;
    s.decay = (float)(1.0 - h->lr * h->weight_decay);
    s.is_decoupled = h->is_decoupled;
    return s;
}

/* Start a step: unless GradScaler skips it (ls->found_inf), count it and derive its bias
 * corrections. Returns whether the step runs. ls may be NULL (no loss scaling). */
ADAM_FN bool adam_count_next(adam_count_t *c, const adam_hparams_t *h, const loss_scale_t *ls) {
    if (ls && ls->found_inf) return false;
    c->step++;
    double t = (double)c->step;
    c->step_size = (float)(h->lr / (1.0 - pow(h->beta1, t)));
    c->bias_correction2_sqrt = (float)sqrt(1.0 - pow(h->beta2, t));
    return true;
}

/* One element: parameter p, first moment m, second moment v, from its gradient g (already
 * averaged over ranks and unscaled), for the step c describes. */
ADAM_FN void adam_update(float *p, float *m, float *v, float g, const adam_count_t *c,
                         const adam_scalars_t *s) {
    float x = *p;
    if (s->is_decoupled)
        x *= s->decay; /* param.mul_(1 - lr * wd) */
    else if (s->weight_decay != 0.0f)
        g = g + s->weight_decay * x;                             /* grad.add(param, alpha=wd) */
    float mt = *m * s->beta1;                                    /* exp_avg.mul_(beta1) */
    mt = mt + s->one_minus_beta1 * g;                            /* .add_(grad, alpha=1 - beta1) */
    float vt = *v * s->beta2;                                    /* exp_avg_sq.mul_(beta2) */
    vt = vt + s->one_minus_beta2 * g * g;                        /* .addcmul_(g, g, 1 - beta2) */
    float denom = sqrtf(vt) / c->bias_correction2_sqrt + s->eps; /* (sqrt / bc2_sqrt).add_(eps) */
    *p = x - c->step_size * mt / denom; /* addcdiv_(m, denom, -step_size) */
    *m = mt;
    *v = vt;
}

#endif
