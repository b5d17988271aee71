/* optimizer: see optimizer.h. */
#include "optimizer.h"

#include <string.h>

int optimizer_init(optimizer_t *o, const train_conf_t *c, backend_t *b, size_t n_params) {
    memset(o, 0, sizeof *o);
    o->kind = c->optimizer;
    o->backend = b;
    o->n_params = n_params;
    o->momentum = c->momentum;
    o->is_nesterov = c->is_nesterov;
    o->weight_decay = c->weight_decay;
    o->beta1 = c->betas[0];
    o->beta2 = c->betas[1];
    o->eps = c->eps;
    if (!optimizer_has_second_moment(o)) return 0;
    o->exp_avg_sq = b->mem->alloc(b, (n_params ? n_params : 1) * sizeof(float));
    o->count = b->mem->alloc(b, sizeof *o->count);
    if (!o->exp_avg_sq || !o->count) {
        optimizer_free(o);
        return -1;
    }
    return 0; /* alloc zeroes: no step taken, both moments 0, as torch's first step finds them */
}

void optimizer_free(optimizer_t *o) {
    if (o->exp_avg_sq) o->backend->mem->release(o->backend, o->exp_avg_sq);
    if (o->count) o->backend->mem->release(o->backend, o->count);
    memset(o, 0, sizeof *o);
}

bool optimizer_has_second_moment(const optimizer_t *o) {
    return o->kind == OPTIM_ADAM || o->kind == OPTIM_ADAMW;
}

void optimizer_step(optimizer_t *o, float *params, const float *grads, float *momentum, double lr,
                    float grad_scale, const loss_scale_t *ls) {
    backend_t *b = o->backend;
    if (o->kind == OPTIM_SGD) {
        b->ops->sgd_step(b, params, grads, momentum, o->n_params, (float)lr, (float)o->momentum,
                         (float)o->weight_decay, o->is_nesterov, grad_scale, ls);
        return;
    }
    adam_hparams_t h = {.lr = lr,
                        .beta1 = o->beta1,
                        .beta2 = o->beta2,
                        .eps = o->eps,
                        .weight_decay = o->weight_decay,
                        .is_decoupled = o->kind == OPTIM_ADAMW};
    b->ops->adam_step(b, params, grads, momentum, o->exp_avg_sq, o->n_params, &h, grad_scale, ls,
                      o->count);
}

uint64_t optimizer_steps(optimizer_t *o) {
    if (!o->count) return 0;
    adam_count_t c;
    o->backend->mem->to_host(o->backend, &c, o->count, sizeof c);
    return c.step;
}

void optimizer_set_steps(optimizer_t *o, uint64_t steps) {
    if (!o->count) return;
    adam_count_t c = {.step = steps}; /* the bias corrections are derived afresh every step */
    o->backend->mem->to_device(o->backend, o->count, &c, sizeof c);
}

const char *optimizer_name(uint32_t kind) {
    switch (kind) {
    case OPTIM_SGD:
        return "sgd";
    case OPTIM_ADAM:
        return "adam";
    case OPTIM_ADAMW:
        return "adamw";
    }
    return "unknown";
}
