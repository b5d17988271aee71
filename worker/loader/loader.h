/* loader: batches of an image folder decoded and transformed by a pool of threads, ahead of the
 * trainer. The trainer submits a batch (its samples' files, labels and plans' keys) and later
 * takes it, finished, from a fixed ring of preallocated slots: fp32 NHWC (n, size, size, 3)
 * normalized, and int32 labels. Workers pull samples one at a time from the oldest submitted batch,
 * so every core helps with the batch the trainer waits for first. Each worker thread owns its read
 * buffer, decoder and resampling scratch; after the first few images nothing is allocated.
 * A file that cannot be read or decoded is an error naming it (data.on_bad_image = error), or is
 * replaced by the next sample of the split that decodes, counted (skip). Threads: the trainer's
 * thread submits and takes; the pool's threads decode. */
#ifndef DDP_WORKER_LOADER_H
#define DDP_WORKER_LOADER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "data_idx.h"
#include "image_transform.h"

typedef struct loader loader_t;

typedef struct {
    int workers;   /* decode threads, >= 1 */
    int slots;     /* batches in flight, >= 1 */
    int batch_max; /* samples per batch */
    int size;      /* output side */
    float mean[3], std[3];
    bool is_skip_bad; /* data.on_bad_image = skip */
    uint64_t seed;
} loader_opts_t;

/* A finished batch: pixels (n, size, size, 3) fp32, labels (n). */
typedef struct {
    const float *pixels;
    const int32_t *labels;
    int n;
} loader_batch_t;

/* Returns 0, or -1 with err (out of memory, threads). */
int loader_create(const loader_opts_t *o, loader_t **out, char *err, size_t err_len);
/* Queue batch `id` (any number the caller chooses, unique among those in flight): samples
 * indices[0..n) of split d (n <= batch_max; more are cut), transformed by kind, random plans keyed
 * by (seed, epoch, index): a sample comes out the same whatever batch, rank or thread it is in.
 * d must outlive the batch. Blocks while every slot is in use (until a loader_release). */
void loader_submit(loader_t *l, uint64_t id, const dataset_t *d, image_transform_kind_t kind,
                   int64_t epoch, const int64_t *indices, int n);
/* Whether batch id is queued or ready (not yet released). */
bool loader_has(loader_t *l, uint64_t id);
/* Wait for batch id and return it; valid until loader_release. Returns 0, or -1 with "PATH: why"
 * in err when a file could not be used (and data.on_bad_image is error). */
int loader_take(loader_t *l, uint64_t id, loader_batch_t *out, char *err, size_t err_len);
/* Hand batch id's slot back. */
void loader_release(loader_t *l, uint64_t id);
/* Samples replaced so far (data.on_bad_image = skip). */
int64_t loader_skipped(loader_t *l);
/* Stop the threads (a batch being decoded is abandoned) and free everything. */
void loader_destroy(loader_t *l);

#endif
