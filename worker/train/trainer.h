/* trainer: ddpworker's training loop on one rank: batches from the sampler through augmentation
 * into the model, DDP gradient averaging (grad_sync), the optimizer, the learning-rate schedule,
 * sharded evaluation, the progress line and the metrics file. Runs on the worker's main thread; a
 * failure ends the process with the exit code that tells the agent what happened
 * (proto/exit_codes.h). */
#ifndef DDP_WORKER_TRAINER_H
#define DDP_WORKER_TRAINER_H

#include <stdint.h>
#include <stdio.h>

#include "augment.h"
#include "backend.h"
#include "comm.h"
#include "dataset.h"
#include "feed.h"
#include "grad_sync.h"
#include "json_lines.h"
#include "loader.h"
#include "lr_schedule.h"
#include "memory_snapshot.h"
#include "model.h"
#include "optimizer.h"
#include "sampler.h"
#include "snapshot.h"
#include "status_report.h"
#include "tb_events.h"
#include "train_conf.h"

typedef struct {
    double loss, top1, top5;
    int64_t n;
    data_split_t split;
} eval_result_t;

typedef struct {
    const train_conf_t *conf;
    int rank, world;
    comm_t *comm;
    backend_t *backend;
    model_t model;
    optimizer_t optim; /* its state beyond the model's momentum arena */
    const data_splits_t *data;
    sampler_t sampler;
    lr_schedule_t lr;
    grad_sync_t sync;
    bool has_sync;
    loss_scale_t *loss_scale; /* the backend's copy of the dynamic loss scale; NULL: no scaling */
    feed_t feed;              /* the batches, from either kind of dataset */
    int64_t *indices;         /* (batch) dataset indices of the batch being assembled */
    int64_t *next_indices;    /* (batch) the batch after it, decoded ahead (image folders) */
    uint64_t eval_batches;    /* batch numbers used by evaluations so far (the loader's ids) */
    int64_t skipped_images;   /* data.on_bad_image = skip: files replaced, all ranks (at the end) */
    float *host_logits;       /* (batch, classes), evaluation */
    FILE *metrics;            /* rank 0, or NULL */
    tb_events_t *tb;          /* rank 0 with train.tensorboard_dir: its event file, or NULL */
    int64_t steps_per_epoch, total_steps;
    int64_t step, epoch;          /* the next step to run, the epoch it belongs to */
    int64_t cursor;               /* global sample positions of this epoch already trained on */
    snapshot_writer_t *snapshots; /* rank 0 with snapshot.dir set, else NULL */
    memory_snapshot_t *memory; /* rank 0 under ddprun (snapshot.every_memory 0: progress alone) */
    bool is_memory_copying;    /* copies out to memory are in flight: fence before the optimizer */
    double memory_stall_s, memory_stall_max_s; /* the trainer's time in memory snapshots */
    int64_t n_memory;                          /* memory snapshots taken by this process */
    const char *resume_source; /* "memory", "peer", "disk", "none" (lost all); NULL: first start */
    int64_t steps_lost;        /* steps trained before the restart and lost (-1: unknown) */
    int resume_rank;           /* the rank that sent the state resumed from */
    int64_t last_snapshot_step;
    bool has_written_params;              /* train.params_file holds the final weights */
    status_report_t *status;              /* progress for `ddprun status`, or NULL */
    int64_t samples_trained, n_snapshots; /* by this rank in this process, for the summary */
    /* train.best_by: the best validation value so far (NaN: none yet) and its step (-1); the
     * weights are in train.best_file */
    double best_value;
    int64_t best_step;
    /* train.hours: wall time of this run before this process (from its snapshot), and when this
     * process began training (CLOCK_MONOTONIC) */
    double elapsed_before_s, start_s;
    data_split_t eval_split;
    bool was_spare; /* this process waited as ddprun's warm spare before its round */
    /* the snapshot resumed from was a finished run's; the run has ended (snapshots say so) */
    bool was_finished, is_finished;
    bool is_already_finished; /* resumed a finished run that train.conf asks nothing more of */
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
/* Evaluate on this rank's shard of split, reduced over all ranks. */
eval_result_t trainer_evaluate(trainer_t *t, data_split_t split);
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
/* trainer__snapshot in two halves, so the model may change between them (the final evaluation
 * loads the best weights) and the write land later: take copies the state into the writer's
 * buffers (rank 0; returns the stall), commit hands them to the writer thread (waits for the
 * write if is_blocking) and reports the "snapshot" event. */
double trainer__snapshot_take(trainer_t *t);
void trainer__snapshot_commit(trainer_t *t, bool is_blocking, double stall);
/* After every step, one collective (every rank calls it at the same step; none without
 * snapshot.dir and train.hours): the stop signal any rank received, SIGTERM over SIGUSR1 (0: none,
 * and always 0 without snapshot.dir), and in *is_out_of_time whether train.hours is spent by rank
 * 0's clock. */
int trainer__agree_step(trainer_t *t, bool *is_out_of_time);
void trainer__snapshot_free(trainer_t *t);

/* checkpoint_memory.c, internal to the trainer: memory snapshots (memory_snapshot.h). */
/* Rank 0 under ddprun (DDPRUN_MEMORY_SNAPSHOT_DIR) with snapshot.every_memory: open the slots.
 * A failure is a warning: training goes on without them. */
void trainer__memory_init(trainer_t *t);
/* After every step: record the step reached; every snapshot.every_memory steps copy the state
 * into the next slot (a GPU: on a side stream, while the next step runs) to be sealed by the
 * writer's thread. */
void trainer__memory_snapshot(trainer_t *t);
/* Before anything overwrites the state (the optimizer, the loss scaler): wait for the copies. */
void trainer__memory_fence(trainer_t *t);
/* The "memory_snapshots" metrics event (count, the training thread's stall: tests/bench), written
 * before the "final" event, which stays the last line of a finished run. */
void trainer__report_memory(trainer_t *t);
void trainer__memory_free(trainer_t *t);
/* Rank 0 after a resume: its source and steps lost as a "resume" metrics event and for
 * `ddprun status`. */
void trainer__report_resume(trainer_t *t);
/* The header of the state after the last step (trainer_snapshot.c): everything but checksums. */
void trainer__describe(const trainer_t *t, snapshot_header_t *h);
/* Training wall time of the whole run so far, restarts included (train.hours). */
double trainer__elapsed_s(const trainer_t *t);

/* trainer_eval.c, internal to the trainer: */
/* Validate (on val, else test), report an "eval" event, and keep the weights when train.best_by
 * says they are the best so far (rank 0 writes train.best_file). Every rank, the same step. */
eval_result_t trainer__validate(trainer_t *t);
/* The run's end: the test split (else the validation split) with the best weights when
 * train.best_by kept any (loaded into the model on every rank), else the last; reported by
 * trainer__report_final. */
eval_result_t trainer__final(trainer_t *t, const eval_result_t *last_validation);
/* The "final" event (rank 0: metrics and stdout) of trainer__final's result. */
void trainer__report_final(trainer_t *t, const eval_result_t *r);
/* One "epoch" event: wall time and images/s of the epoch, and its validation when one ran. */
void trainer__report_epoch(trainer_t *t, double wall_s, int64_t samples, const eval_result_t *val);
/* The model's weights as a safetensors file (nn/weights, atomic), with tags (weights_save_tagged:
 * key/value pairs, NULL-terminated, or NULL) in its metadata; exit "io" naming key if not. Every
 * weights file the trainer writes goes through here. */
void trainer__write_weights(trainer_t *t, const char *path, const char *key,
                            const char *const *tags);
/* Rank 0 at a resume: the best validation the snapshot recorded (*value NaN and *step -1: none),
 * replaced by what train.best_file says of itself when that is a later best of this run (a crash
 * came between writing it and the next snapshot), so the best is never forgotten nor replaced by a
 * worse one; reset, with a warning, when the file is gone. */
void trainer__recall_best(const trainer_t *t, double *value, int64_t *step);
/* A metrics line (rank 0 with train.metrics_file); frees o. */
void trainer__write_metrics(trainer_t *t, cJSON *o);

/* The loss scaler's state, read from the backend (a synchronization); zeros without scaling. */
loss_scale_t trainer__loss_scale(trainer_t *t);

/* Before anything else goes to stdout: end the updating progress line a terminal shows. */
void trainer__end_progress_line(void);
/* One unit of progress for ddprun --hang-timeout; any thread (the snapshot writer beats too). */
void trainer__progress_beat(void);

#endif
