/* data_idx: MNIST-style IDX files (Fashion-MNIST, MNIST), gzipped or not, into memory as uint8
 * NHWC images and labels. Headers, dimensions, sizes and labels are validated; a truncated or
 * wrong file is an error naming the file and what is wrong. Allocates once per load. */
#ifndef DDP_WORKER_DATA_IDX_H
#define DDP_WORKER_DATA_IDX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp_error.h"

typedef struct {
    uint8_t *images; /* (n, h, w, c) uint8 NHWC */
    int32_t *labels; /* (n), in [0, classes) */
    char **paths;    /* an image folder's files, (n); images is then NULL and the loader decodes
                        them to h x w x c */
    int64_t n;
    int h, w, c;
    int classes;
} dataset_t;

/* Load an images file (idx3: n x h x w) and its labels file (idx1: n), keeping the first `limit`
 * samples (0: all). Labels must be below `classes`. Returns 0, or -1 with a message in err. */
int idx_load(const char *images_path, const char *labels_path, int64_t limit, int classes,
             dataset_t *out, char *err, size_t err_len);
/* The train or test split of an MNIST-layout directory (train-images-idx3-ubyte[.gz] ...). */
int idx_load_dir(const char *dir, bool is_train, int64_t limit, dataset_t *out, char *err,
                 size_t err_len);
/* The images file idx_load_dir reads for that split: dir/NAME, else dir/NAME.gz (when dir/NAME is
 * missing), into out. */
void idx_images_path(const char *dir, bool is_train, char *out, size_t out_len);
void dataset_free(dataset_t *d);
/* Format a loader error into err; returns -1 (the loaders' error return). */
#define dataset_fail ddp_errf

#endif
