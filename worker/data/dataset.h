/* dataset: the train, validation and test splits train.conf asks for (Fashion-MNIST, MNIST,
 * CIFAR-10/100 or synthetic) and their normalization constants. A validation split is held out of
 * train (data.val_split) when the dataset has none. Allocates at load; the main thread only. */
#ifndef DDP_WORKER_DATASET_H
#define DDP_WORKER_DATASET_H

#include <stddef.h>

#include "augment.h"
#include "data_idx.h"
#include "train_conf.h"

typedef enum { SPLIT_TRAIN, SPLIT_VAL, SPLIT_TEST, SPLIT_COUNT } data_split_t;

typedef struct {
    dataset_t train, val, test; /* a split with n == 0 is absent (val without data.val_split) */
    float mean[AUGMENT_MAX_CHANNELS], std[AUGMENT_MAX_CHANNELS]; /* per channel, 0..1 scale */
} data_splits_t;

/* The split s of d, and its name ("train", "val", "test"). */
const dataset_t *data_split(const data_splits_t *d, data_split_t s);
const char *data_split_name(data_split_t s);
/* Move a deterministic fraction of train (a function of the sample count alone, so the same for
 * every seed, world size and restart) into val, keeping both in their original order. Returns 0,
 * or -1 with err (out of memory, a fraction that leaves either side empty). */
int data_hold_out(dataset_t *train, double fraction, dataset_t *val, char *err, size_t err_len);

/* Returns 0, or -1 with "what and where" in err (the worker then exits with DDP_EXIT_DATA). */
int data_splits_load(const train_conf_t *c, data_splits_t *d, char *err, size_t err_len);
void data_splits_free(data_splits_t *d);

#endif
