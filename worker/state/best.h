/* best: train.best_by, the best weights by validation: which result is better, the weights kept
 * in train.best_file (safetensors, written atomically, tagged with what they are the best of), what
 * that file says of itself at a resume, and loading them back for the final test. The value and its
 * step live in train_state_t (and so in snapshots). The trainer's thread. */
#ifndef DDP_WORKER_BEST_H
#define DDP_WORKER_BEST_H

#include <stdbool.h>
#include <stdint.h>

#include "train_conf.h"
#include "train_state.h"

/* "val_loss", "val_top1", "none". */
const char *best_by_name(best_by_t by);
/* Whether r beats the best so far (s->best_value; NaN: none yet) by train.best_by; a NaN or
 * infinite result never does. */
bool best_is_better(const train_conf_t *c, const train_state_t *s, const eval_result_t *r);
/* Rank 0: the model's weights into train.best_file, tagged as the best of s (value, step) for this
 * run (measure, seed). Exits (DDP_EXIT_IO) if they cannot be written. */
void best_write(const train_conf_t *c, model_t *m, const train_state_t *s);
/* Rank 0 at a resume: the best validation the snapshot recorded (*value NaN and *step -1: none),
 * replaced by what train.best_file says of itself when that is a later best of this run (a crash
 * came between writing it and the next snapshot), so the best is never forgotten nor replaced by a
 * worse one; reset, with a warning, when the file is gone. */
void best_recall(const train_conf_t *c, const char *model_name, double *value, int64_t *step);
/* The best weights (of best_step) into the model on every rank, from train.best_file (where they
 * went when they were best, possibly before a restart). Collective; exits (DDP_EXIT_DATA) when
 * rank 0 cannot read them. */
void best_load(const train_parts_t *p, int64_t best_step);

#endif
