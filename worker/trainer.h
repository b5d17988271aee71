/* trainer: ddpworker's training loop on one rank: batches from the sampler through augmentation
 * into the model, DDP gradient averaging (grad_sync), SGD, the learning-rate schedule, sharded
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
#include "sampler.h"
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
    const data_splits_t *data;
    sampler_t sampler;
    augment_t augment_train, augment_eval;
    lr_schedule_t lr;
    grad_sync_t sync;
    bool has_sync;
    float *host_batch;       /* (batch, H, W, C) fp32, assembled here then copied to the backend */
    int32_t *host_labels;
    int64_t *indices;        /* (batch) dataset indices of the batch being assembled */
    float *host_logits;      /* (batch, classes), evaluation */
    FILE *metrics;           /* rank 0, or NULL */
    int64_t steps_per_epoch, total_steps;
    int64_t step, epoch;
} trainer_t;

/* Everything a run needs, allocated here. Exits the process on failure (config, data, memory). */
void trainer_init(trainer_t *t, const train_conf_t *conf, const data_splits_t *data,
                  backend_t *backend, comm_t *comm);
/* Train until epochs, max_steps or hours run out, evaluate, report. Returns the final
 * evaluation; exits the process with DDP_EXIT_PEER_FAILURE if a collective fails. */
eval_result_t trainer_run(trainer_t *t);
/* Evaluate on this rank's shard of the test set, reduced over all ranks. */
eval_result_t trainer_evaluate(trainer_t *t);
/* One training step on the batch at this epoch's batch index. Returns the batch's sample count. */
int trainer_step(trainer_t *t, int64_t batch_index);
void trainer_free(trainer_t *t);

/* Print "ddpworker: rank R: <message>" to stderr and exit with code. */
_Noreturn void trainer_die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
