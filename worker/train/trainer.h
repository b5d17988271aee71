/* trainer: ddpworker's training loop on one rank. It owns the run's state (train_state_t) and the
 * loop; its parts take what they need as arguments and never call back: the batches (feed.h), the
 * evaluations and the best weights (eval.h, best.h), snapshots on disk and in memory
 * (checkpoint.h, checkpoint_memory.h), what the run tells (run_log.h). A step is batch -> forward
 * -> loss -> backward (DDP gradient averaging in buckets, grad_sync) -> the optimizer and the
 * learning-rate schedule. Runs on the worker's main thread; a failure ends the process with the
 * exit code that tells the agent what happened (die.h, proto/exit_codes.h). */
#ifndef DDP_WORKER_TRAINER_H
#define DDP_WORKER_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "checkpoint.h"
#include "checkpoint_memory.h"
#include "comm.h"
#include "dataset.h"
#include "eval.h"
#include "feed.h"
#include "grad_sync.h"
#include "lr_schedule.h"
#include "model.h"
#include "optimizer.h"
#include "run_log.h"
#include "sampler.h"
#include "status_report.h"
#include "train_conf.h"
#include "train_state.h"

typedef struct {
    model_t model;
    optimizer_t optim;   /* its state beyond the model's momentum arena */
    train_parts_t p;     /* conf, data, comm, backend, rank and world; lent to the parts */
    train_state_t state; /* where the run is */
    sampler_t sampler;
    lr_schedule_t lr;
    grad_sync_t sync;
    bool has_sync;
    feed_t feed;           /* the batches, from either kind of dataset */
    int64_t *indices;      /* (batch) dataset indices of the batch being assembled */
    int64_t *next_indices; /* (batch) the batch after it, decoded ahead (image folders) */
    eval_t eval;
    checkpoint_t ckpt;
    checkpoint_memory_t memory;
    run_log_t log;           /* rank 0's metrics */
    status_report_t *status; /* progress for `ddprun status`, or NULL */
    int64_t steps_per_epoch, total_steps;
    int64_t lr_step_offset;  /* the schedule's step (of this world) minus state.step: not 0 once
                                a run resumed at another world size (align_schedule) */
    int64_t samples_trained; /* by this rank in this process, for the summary */
    bool has_written_params; /* train.params_file holds the final weights */
    bool was_spare;          /* this process waited as ddprun's warm spare before its round */
} trainer_t;

/* Everything a run needs that does not depend on the round (model, optimizer state, the data
 * where the backend reads it, the decode threads), allocated here: a warm spare does this before
 * it knows its rank. Exits the process on failure (config, data, memory). */
void trainer_prepare(trainer_t *t, const train_conf_t *conf, const data_splits_t *data,
                     backend_t *backend);
/* One forward and backward of a whole batch of whatever the input holds, before trainer_start: on
 * a GPU the first step's one-time costs (kernels loaded, library workspaces, the convolution
 * algorithms looked up) are then paid before a round needs the process (a warm spare does this).
 * Leaves nothing trainer_start keeps: the parameters, running statistics and gradients it touches
 * are all drawn, broadcast or loaded from a snapshot, or zeroed, there or by the next step. */
void trainer_warm_up(trainer_t *t);
/* The round's part, after trainer_prepare: rank and world from comm, the sampler and schedule,
 * the gradient thread, snapshots (resuming from the newest good one) or the initial parameters
 * broadcast from rank 0. Collective: every rank calls it. Exits the process on failure. */
void trainer_start(trainer_t *t, comm_t *comm);
/* Train until epochs, max_steps or hours run out, evaluate, report. Returns the final
 * evaluation; exits the process with DDP_EXIT_PEER_FAILURE if a collective fails. */
eval_result_t trainer_run(trainer_t *t);
/* One training step on the next batch of this epoch (from the cursor), which it advances.
 * Returns the batch's sample count on this rank. */
int trainer_step(trainer_t *t);
void trainer_free(trainer_t *t);

#endif
