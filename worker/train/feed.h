/* feed: the trainer's batches, from either kind of dataset, into the model's input and labels.
 * In-memory datasets (CIFAR, MNIST, ...) stay uint8 where the backend reads them (uploaded once to
 * a GPU) and the backend augments each batch from the host's choices; image folders are decoded
 * by the loader's threads (data/loader.h), one batch ahead of the step that uses it, and the fp32
 * batch goes to the model with to_device. Knows nothing of the trainer; its thread. */
#ifndef DDP_WORKER_FEED_H
#define DDP_WORKER_FEED_H

#include <stdbool.h>
#include <stdint.h>

#include "augment.h"
#include "backend.h"
#include "dataset.h"
#include "loader.h"
#include "model.h"
#include "train_conf.h"

typedef struct {
    const train_conf_t *conf;
    const data_splits_t *data;
    backend_t *backend;
    augment_t augment_train, augment_eval;
    /* each split's images and labels (data_split_t) where the backend reads them: uploaded once
     * to a GPU (is_uploaded), the host's own on the cpu backend; NULL for an absent split or an
     * image folder */
    uint8_t *images[SPLIT_COUNT];
    int32_t *labels[SPLIT_COUNT];
    bool is_uploaded;
    augment_job_t *host_jobs, *jobs; /* (batch) that batch's samples and choices; jobs: backend's */
    int32_t *host_labels;            /* (batch) the labels of the batch in the model, on the host */
    loader_t *loader;                /* image folders: the decode threads; NULL otherwise */
} feed_t;

/* Everything the batches need, allocated now: the datasets placed where m's backend reads them,
 * the decode threads of an image folder. Exits the process on failure (memory, the loader). */
void feed_init(feed_t *f, const train_conf_t *conf, const data_splits_t *data, const model_t *m,
               backend_t *backend);
/* The samples at indices[0..n) of split into m's input and labels (labels also in
 * f->host_labels): augmented by train.conf's choices for (epoch, index) in training, plainly in
 * evaluation. id numbers the batch (the step, or the batch's number in an evaluation: an image
 * folder's decode ids); next_indices[0..next_n) is the batch after it, which an image folder
 * decodes meanwhile (in-memory datasets need no head start). Exits (DDP_EXIT_DATA) on an image
 * that does not decode without data.on_bad_image = skip. */
void feed_batch(feed_t *f, model_t *m, data_split_t split, int64_t epoch, uint64_t id,
                const int64_t *indices, int n, const int64_t *next_indices, int next_n);
/* Whether the batches are decoded from files (an image folder), which may skip bad ones. */
bool feed_is_files(const feed_t *f);
/* Image files replaced by the next one that decodes (data.on_bad_image = skip), on this rank. */
int64_t feed_skipped(const feed_t *f);
void feed_free(feed_t *f);

#endif
