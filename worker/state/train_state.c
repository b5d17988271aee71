/* train_state: see train_state.h. */
#include "train_state.h"

#include <stdio.h>

#include "clock.h"
#include "die.h"
#include "exit_codes.h"
#include "weights.h"

double train_state_elapsed_s(const train_state_t *s) {
    return s->elapsed_before_s + (s->start_s > 0 ? clock_now_s() - s->start_s : 0);
}

loss_scale_t train_state_loss_scale(const train_state_t *s, backend_t *b) {
    loss_scale_t ls = {0};
    if (s->loss_scale) b->mem->to_host(b, &ls, s->loss_scale, sizeof ls);
    return ls;
}

void train_state_save_weights(model_t *m, int64_t step, const char *path, const char *key,
                              const char *const *tags) {
    char err[2048];
    if (weights_save_tagged(m, path, step, tags, err, sizeof err) < 0)
        die(DDP_EXIT_IO, "%s: %s", key, err);
}

static void bcast(comm_t *comm, void *data, size_t n_elems, int root, const char *whose,
                  const char *part) {
    char what[160];
    snprintf(what, sizeof what, "broadcasting %s %s", whose, part);
    die_comm(comm, comm->ops->broadcast(comm, data, n_elems * sizeof(float), root), what);
}

void train_state_bcast(comm_t *comm, model_t *m, const optimizer_t *optim, unsigned parts, int root,
                       const char *whose) {
    if (parts & TRAIN_STATE_PARAMS) bcast(comm, m->params, m->n_params, root, whose, "parameters");
    if (parts & TRAIN_STATE_MOMENTUM)
        bcast(comm, m->momentum, m->n_params, root, whose, "momentum");
    if (parts & TRAIN_STATE_BUFFERS)
        bcast(comm, m->buffers, m->n_buffers, root, whose, "batch-norm statistics");
    if ((parts & TRAIN_STATE_SECOND_MOMENT) && optimizer_has_second_moment(optim))
        bcast(comm, optim->exp_avg_sq, m->n_params, root, whose, "second moment");
}
