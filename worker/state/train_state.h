/* train_state: what a run has reached, as plain values the trainer owns and passes to its parts
 * (checkpoint, evaluation, reporting), and the broadcast that makes every rank's arenas (the
 * model's parameters, buffers, momentum, the optimizer's second moment) one rank's. The trainer's
 * thread. */
#ifndef DDP_WORKER_TRAIN_STATE_H
#define DDP_WORKER_TRAIN_STATE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "comm.h"
#include "dataset.h"
#include "loss_scale.h"
#include "model.h"
#include "optimizer.h"
#include "train_conf.h"

/* Where the run is: the step loop's position, the best validation so far, the time spent, the
 * loss scaler. Owned by the trainer; checkpoints save and restore it, evaluation updates the best,
 * reporting reads it. */
typedef struct {
    int64_t step, epoch; /* the next step to run, the epoch it belongs to */
    int64_t cursor;      /* global sample positions of this epoch already trained on */
    /* train.best_by: the best validation value so far (NaN: none yet) and its step (-1); the
     * weights are in train.best_file */
    double best_value;
    int64_t best_step;
    /* train.hours: wall time of this run before this process (from its snapshot), and when this
     * process began training (CLOCK_MONOTONIC; 0: not yet) */
    double elapsed_before_s, start_s;
    loss_scale_t *loss_scale; /* the backend's copy of the dynamic loss scale; NULL: no scaling */
    bool is_finished;         /* the run has ended (its last snapshot says so) */
} train_state_t;

/* An evaluation of a split, reduced over all ranks: mean loss, top-1 and top-5 accuracy, samples.
 */
typedef struct {
    double loss, top1, top5;
    int64_t n;
    data_split_t split;
} eval_result_t;

/* What a run trains with, borrowed from the trainer by its parts (checkpoint, evaluation): the
 * configuration, the data, this rank in the world and the arenas. */
typedef struct {
    const train_conf_t *conf;
    const data_splits_t *data;
    comm_t *comm;
    backend_t *backend;
    model_t *model;
    optimizer_t *optim;
    int rank, world;
} train_parts_t;

/* The arenas train_state_bcast carries. */
enum {
    TRAIN_STATE_PARAMS = 1 << 0,
    TRAIN_STATE_MOMENTUM = 1 << 1,
    TRAIN_STATE_BUFFERS = 1 << 2,       /* batch-norm running statistics */
    TRAIN_STATE_SECOND_MOMENT = 1 << 3, /* only where optim has one (Adam, AdamW) */
};

/* Training wall time of the whole run so far, restarts included (train.hours). */
double train_state_elapsed_s(const train_state_t *s);
/* The loss scaler's state, read from the backend (a synchronization); zeros without scaling. */
loss_scale_t train_state_loss_scale(const train_state_t *s, backend_t *b);
/* The model's weights as a safetensors file (nn/weights, atomic) of step, with tags
 * (weights_save_tagged: key/value pairs, NULL-terminated, or NULL) in its metadata; exits
 * (DDP_EXIT_IO) naming key if not. Every weights file the trainer writes goes through here. */
void train_state_save_weights(model_t *m, int64_t step, const char *path, const char *key,
                              const char *const *tags);
/* root's arenas named by parts into every rank's, in the order params, momentum, buffers, second
 * moment. Collective: every rank calls it with the same parts. A failure exits
 * (DDP_EXIT_PEER_FAILURE) naming "broadcasting <whose> <part>". */
void train_state_bcast(comm_t *comm, model_t *m, const optimizer_t *optim, unsigned parts, int root,
                       const char *whose);

#endif
