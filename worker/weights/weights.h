/* weights: a model's parameters and batch-norm statistics as torchvision's state_dict, in a
 * safetensors file (safetensors.h): the names of layer_t.name plus ".weight", ".bias",
 * ".running_mean", ".running_var", ".num_batches_tracked"; torchvision's shapes and layouts: conv
 * filters (K, C, R, S) (ours are (K, R, S, C)), linear weights (out, in) with the input flattened
 * in PyTorch's (C, H, W) order (ours is NHWC's (H, W, C): the columns of a linear layer after a
 * conv or pool are permuted both ways), num_batches_tracked int64. A file written here loads into
 * torchvision with load_state_dict(strict=True), and torchvision's files load here.
 * Host-side, at start-up or the end of a run; blocking file I/O. */
#ifndef DDP_WORKER_WEIGHTS_H
#define DDP_WORKER_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "model.h"

/* Write m's parameters and running statistics to path (atomically: a temporary file, fsync,
 * rename), F32, every num_batches_tracked = steps (the training steps taken). Reads the arenas back
 * from the backend (synchronizes). Returns 0, or -1 with "PATH: why" in err. */
int weights_save(model_t *m, const char *path, int64_t steps, char *err, size_t err_len);
/* weights_save with tags: a NULL-terminated key, value, key, value, ... list (NULL: none; at most
 * WEIGHTS_MAX_TAGS pairs) added to the file's __metadata__, where PyTorch ignores it: what the
 * file says about itself (the trainer tags its best weights with their validation). */
#define WEIGHTS_MAX_TAGS 8
int weights_save_tagged(model_t *m, const char *path, int64_t steps, const char *const *tags,
                        char *err, size_t err_len);
/* The __metadata__ value of key in the safetensors file at path, into out (cut to out_len - 1).
 * Returns 1 when the file has it, 0 when not, -1 with "PATH: why" in err when path is not a
 * readable safetensors file. Reads the header only. */
int weights_read_tag(const char *path, const char *key, char *out, size_t out_len, char *err,
                     size_t err_len);

/* How a load treats tensors that do not fit (train.conf's model.init_skip_mismatched and
 * model.init_skip). */
typedef struct {
    /* the final layer's tensors (the last layer with parameters: torchvision's fc, classifier.6),
     * when the file lacks them or has them in another shape, keep m's values: a new classifier head
     */
    bool is_skip_head;
    /* NULL, or comma-separated state_dict names, "prefix*" for all that begin so: those of m are
     * not loaded (they keep m's values) whether they fit or not; those of the file only are
     * ignored. Every entry must name a tensor of m or of the file. */
    const char *skip;
} weights_skip_t;

/* Load path into m's parameters and running statistics (uploaded to the backend), converting F16,
 * BF16 and F64 to fp32. Every tensor of m must be in the file with m's shape, and every tensor of
 * the file must be m's (a missing num_batches_tracked is fine: m keeps no such count, and PyTorch
 * accepts its absence too), apart from what skip (NULL: nothing) allows; else -1 with "PATH:
 * tensor 'NAME': why; tensor ...; and N more (counts): what to do" in err, and m unchanged. A file
 * of which no tensor fits is an error too, and so is a value that is NaN, infinite or beyond
 * float's range ("PATH: tensor 'NAME': N of its M values are ..."). With log, one line says how
 * many tensors loaded and which were skipped (names, the first few), then a line per skipped head
 * tensor saying why. Returns 0 or -1. */
int weights_load_init(model_t *m, const char *path, const weights_skip_t *skip, FILE *log,
                      char *err, size_t err_len);
/* weights_load_init with skip = {.is_skip_head = is_skip_mismatched}. */
int weights_load(model_t *m, const char *path, bool is_skip_mismatched, FILE *log, char *err,
                 size_t err_len);

#endif
