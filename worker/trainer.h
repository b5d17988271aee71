/* trainer: ddpworker's training loop on one rank: batches from the sampler through augmentation
 * into the model, DDP gradient averaging (grad_sync), the optimizer, the learning-rate schedule, sharded
 * evaluation, the progress line and the metrics file. Runs on the worker's main thread; a failure
 * ends the process with the exit code that tells the agent what happened (proto/exit_codes.h). */
#ifndef DDP_WORKER_TRAINER_H
#define DDP_WORKER_TRAINER_H

#include <stdint.h>
#include <stdio.h>

#include "augment.h"
#include "backend.h"
#include "comm.h"
#include "dataset.h"
#include "grad_sync.h"
#include "lr_schedule.h"
#include "model.h"
#include "optimizer.h"
#include "sampler.h"
#include "snapshot.h"
#include "train_conf.h"

typedef struct {
    double loss, top1, top5;
    int64_t n;
} eval_result_t;

typedef struct {
    const train_conf_t *conf;
    int rank, world;
    comm_t *comm;
    backend_t *backend;
    model_t model;
    optimizer_t optim;       /* its state beyond the model's momentum arena */
    const data_splits_t *data;
    sampler_t sampler;
    augment_t augment_train, augment_eval;
    lr_schedule_t lr;
    grad_sync_t sync;
    bool has_sync;
    loss_scale_t *loss_scale; /* the backend's copy of the dynamic loss scale; NULL: no scaling */
    /* the train [0] and test [1] images and labels where the backend reads them: uploaded once to
     * a GPU (is_uploaded), the host's own on the cpu backend */
    uint8_t *images[2], *labels[2];
    bool is_uploaded;
    int64_t *indices;        /* (batch) dataset indices of the batch being assembled */
    augment_job_t *host_jobs, *jobs; /* (batch) that batch's samples and choices; jobs: backend's */
    float *host_logits;      /* (batch, classes), evaluation */
    FILE *metrics;           /* rank 0, or NULL */
    int64_t steps_per_epoch, total_steps;
    int64_t step, epoch;     /* the next step to run, the epoch it belongs to */
    int64_t cursor;          /* global sample positions of this epoch already trained on */
    snapshot_writer_t *snapshots; /* rank 0 with snapshot.dir set, else NULL */
    int64_t last_snapshot_step;
    bool has_written_params; /* train.params_file holds the final weights */
} trainer_t;

/* Everything a run needs, allocated here. Exits the process on failure (config, data, memory). */
void trainer_init(trainer_t *t, const train_conf_t *conf, const data_splits_t *data,
                  backend_t *backend, comm_t *comm);
/* Train until epochs, max_steps or hours run out, evaluate, report. Returns the final
 * evaluation; exits the process with DDP_EXIT_PEER_FAILURE if a collective fails. */
eval_result_t trainer_run(trainer_t *t);
/* Evaluate on this rank's shard of the test set, reduced over all ranks. */
eval_result_t trainer_evaluate(trainer_t *t);
/* One training step on the next batch of this epoch (from the cursor), which it advances.
 * Returns the batch's sample count on this rank. */
int trainer_step(trainer_t *t);
void trainer_free(trainer_t *t);

/* trainer_snapshot.c, internal to the trainer: */
/* Rank 0: the snapshot writer; every rank: SIGTERM/SIGUSR1 handlers. No-op without snapshot.dir. */
void trainer__snapshot_init(trainer_t *t);
/* Load the newest good snapshot (rank 0) and broadcast it; returns whether one was loaded. */
bool trainer__resume(trainer_t *t);
/* Take a snapshot of the state after the last step (rank 0 writes; asynchronously unless
 * is_blocking). Returns the stall in seconds. */
double trainer__snapshot(trainer_t *t, bool is_blocking);
/* Whether any rank got SIGTERM/SIGUSR1 (a collective; every rank calls it at the same step).
 * *signum: SIGTERM if any rank received it, else SIGUSR1. */
bool trainer__stop_requested(trainer_t *t, int *signum);
void trainer__snapshot_free(trainer_t *t);
/* The loss scaler's state, read from the backend (a synchronization); zeros without scaling. */
loss_scale_t trainer__loss_scale(trainer_t *t);

/* One unit of progress for ddprun --hang-timeout; any thread (the snapshot writer beats too). */
void trainer__progress_beat(void);

/* Print "ddpworker: rank R: <message>" to stderr and exit with code. */
_Noreturn void trainer_die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
