/* optimizer: the trainer's optimizer step (optim.name: sgd, adam, adamw, as torch.optim's SGD,
 * Adam and AdamW), one fused backend op over the flat arenas, and the state it owns beyond the
 * model's momentum arena: Adam's second moment (an arena allocated only for adam/adamw) and its
 * step count, both in backend memory. The model's momentum arena is SGD's momentum buffer or
 * Adam's first moment. Everything is allocated by optimizer_init; a step allocates nothing and
 * reads nothing back. Runs on the trainer's thread. */
#ifndef DDP_WORKER_OPTIMIZER_H
#define DDP_WORKER_OPTIMIZER_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "train_conf.h"

typedef struct {
    optim_kind_t kind;
    backend_t *backend;
    size_t n_params;
    double momentum, weight_decay, beta1, beta2, eps;
    bool is_nesterov;
    float *exp_avg_sq;   /* (n_params) backend memory: Adam's second moment; NULL for sgd */
    adam_count_t *count; /* backend memory: Adam's step count; NULL for sgd */
} optimizer_t;

/* The optimizer train.conf names, for n_params parameters on b. Returns 0, or -1 when the backend
 * is out of memory for the state (o is then empty). */
int optimizer_init(optimizer_t *o, const train_conf_t *c, backend_t *b, size_t n_params);
void optimizer_free(optimizer_t *o);
/* One step at learning rate lr: params (n_params) from grads (summed over ranks: grad_scale is
 * 1 / world), momentum = the model's momentum arena. ls: the backend's loss scaler or NULL; a
 * step with ls->found_inf set changes nothing. Queued on the backend's stream; returns at once. */
void optimizer_step(optimizer_t *o, float *params, const float *grads, float *momentum, double lr,
                    float grad_scale, const loss_scale_t *ls);
/* Whether the optimizer keeps a second moment and a step count (adam, adamw). */
bool optimizer_has_second_moment(const optimizer_t *o);
/* Adam's steps taken (skipped ones not counted), read back from the backend (a synchronization:
 * snapshots only); 0 for sgd. */
uint64_t optimizer_steps(optimizer_t *o);
/* Resume: set the step count (adam, adamw; ignored for sgd). */
void optimizer_set_steps(optimizer_t *o, uint64_t steps);
/* "sgd", "adam" or "adamw"; "unknown" for anything else (a damaged snapshot's number). */
const char *optimizer_name(uint32_t kind);

#endif
