/* eval: evaluation of the model on a split, sharded over the ranks and reduced; the validations
 * during training ("eval" events, and the best weights by train.best_by through best.h) and the
 * final test ("final" event) with the best weights or the last. Every rank calls it at the same
 * step; the trainer's thread. */
#ifndef DDP_WORKER_EVAL_H
#define DDP_WORKER_EVAL_H

#include <stdint.h>

#include "feed.h"
#include "run_log.h"
#include "train_state.h"

typedef struct {
    const train_parts_t *p; /* borrowed */
    feed_t *feed;           /* borrowed */
    run_log_t *log;         /* borrowed: rank 0's metrics */
    int64_t *indices;       /* (batch) dataset indices of the batch being assembled */
    int64_t *next_indices;  /* (batch) the batch after it, decoded ahead (image folders) */
    float *host_logits;     /* (batch, classes) */
    uint64_t batches;       /* batch numbers used by evaluations so far (the loader's ids) */
    data_split_t split;     /* the validation split: val, else test */
} eval_t;

/* Buffers for batches of train.batch_size. Exits on out of memory. */
void eval_init(eval_t *e, const train_parts_t *p, feed_t *feed, run_log_t *log);
/* Evaluate on this rank's shard of split, reduced over all ranks (rank 0's batch-norm statistics,
 * as DDP's buffer broadcast makes them). */
eval_result_t eval_run(eval_t *e, data_split_t split);
/* Validate, report an "eval" event, and keep the weights when train.best_by says they are the best
 * so far (s->best_*; rank 0 writes train.best_file and a "best" event). */
eval_result_t eval_validate(eval_t *e, train_state_t *s);
/* The run's end: the test split (else the validation split) with the best weights when
 * train.best_by kept any (loaded into the model on every rank), else the last (last_validation,
 * when it was on that split). */
eval_result_t eval_final(eval_t *e, const train_state_t *s, const eval_result_t *last_validation);
/* Rank 0: the "final" event (metrics and stdout) of eval_final's result; skipped_images: the
 * image files data.on_bad_image = skip replaced, on all ranks. */
void eval_report_final(eval_t *e, const train_state_t *s, const eval_result_t *r,
                       int64_t skipped_images);
void eval_free(eval_t *e);

#endif
