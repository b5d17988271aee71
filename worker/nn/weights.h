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

/* Load path into m's parameters and running statistics (uploaded to the backend), converting F16,
 * BF16 and F64 to fp32. Every tensor of m must be in the file with m's shape, and every tensor of
 * the file must be m's (a missing num_batches_tracked is fine: m keeps no such count, and PyTorch
 * accepts its absence too); else -1 with "PATH: tensor 'NAME': why" in err. With
 * is_skip_mismatched, a tensor of another shape, a missing tensor and an unexpected one are named
 * on log instead (m keeps its current values for those), and only a file of which no tensor fits is
 * an error. Returns 0 or -1. */
int weights_load(model_t *m, const char *path, bool is_skip_mismatched, FILE *log, char *err,
                 size_t err_len);

#endif
