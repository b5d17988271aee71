/* dataset: the train and test splits train.conf asks for (Fashion-MNIST, MNIST, CIFAR-10/100 or
 * synthetic) and their normalization constants. Allocates at load; the main thread only. */
#ifndef DDP_WORKER_DATASET_H
#define DDP_WORKER_DATASET_H

#include <stddef.h>

#include "augment.h"
#include "data_idx.h"
#include "train_conf.h"

typedef struct {
    dataset_t train, test;
    float mean[AUGMENT_MAX_CHANNELS], std[AUGMENT_MAX_CHANNELS]; /* per channel, 0..1 scale */
} data_splits_t;

/* Returns 0, or -1 with "what and where" in err (the worker then exits with DDP_EXIT_DATA). */
int data_splits_load(const train_conf_t *c, data_splits_t *d, char *err, size_t err_len);
void data_splits_free(data_splits_t *d);

#endif
