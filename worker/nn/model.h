/* model: the networks ddpworker trains, as a flat list of layers over tensors, built by name for
 * any input shape and class count, run on any backend_i. Parameters, their gradients and the
 * optimizer's momentum each live in one arena (params are laid out in forward order, so backward
 * finishes them from the end of the arena towards the start: a gradient bucket is a slice, and
 * it is complete once backward has passed its first layer). Batch-norm running statistics live in
 * a fourth arena ("buffers"). Everything is allocated by model_init; nothing in a step.
 *
 * Models: mlp (two hidden layers of `width`), cnn (two conv-bn-relu-maxpool stages, width and
 * 2 width channels, then linear), resnet18/resnet34 (CIFAR-style: 3x3 stem without max-pool,
 * basic blocks of width .. 8 width channels, global average pool, linear). Init is Kaiming normal
 * (fan_out, relu) for convolutions, PyTorch's uniform default for linear layers, BN gamma 1 beta 0,
 * a pure function of the seed.
 */
#ifndef DDP_WORKER_MODEL_H
#define DDP_WORKER_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

typedef enum {
    LAYER_CONV,
    LAYER_BATCHNORM,
    LAYER_RELU,
    LAYER_ADD,
    LAYER_MAXPOOL,
    LAYER_AVGPOOL_GLOBAL,
    LAYER_LINEAR,
} layer_kind_t;

typedef struct {
    int h, w, c;   /* per sample; (N, H, W, C) in the arenas */
    size_t offset; /* into acts and dacts, sized for batch_max */
} tensor_t;

typedef struct {
    layer_kind_t kind;
    int in, in2, out;        /* tensor indices (in2: LAYER_ADD only) */
    conv_shape_t conv;       /* n is set per call */
    pool_shape_t pool;
    size_t param_offset, n_params;
    size_t buffer_offset;    /* batch norm: running mean then running var */
    size_t scratch_offset;   /* batch norm: saved mean, invstd; max pool: argmax (int32) */
} layer_t;

typedef struct {
    backend_t *backend;
    char name[32];
    int batch_max, h, w, c, classes;
    layer_t *layers;
    int n_layers;
    tensor_t *tensors;       /* [0] is the input, [n_tensors - 1] the logits */
    int n_tensors;
    size_t n_params, n_buffers, n_acts, n_scratch;
    /* backend memory */
    float *params, *grads, *momentum, *buffers;
    float *acts, *dacts, *scratch;
    int32_t *labels;         /* (batch_max) */
    float *loss_sum;         /* one float: summed training loss since model_take_loss */
} model_t;

/* Called during backward each time the gradients of params[ready_from, n_params) are final. */
typedef void (*model_grads_ready_cb)(void *arg, size_t ready_from);

/* Build `name` for inputs of h x w x c and `classes` classes, batches up to batch_max; every arena
 * zero (model_init_params draws the parameters). Returns 0, or -1 with the reason in err (unknown
 * name, input too small for the network, out of memory). */
int model_init(model_t *m, backend_t *b, const char *name, int width, int h, int w, int c,
               int classes, int batch_max, char *err, size_t err_len);
/* The initial parameters and batch-norm buffers, a function of seed (PyTorch's schemes: Kaiming
 * normal convolutions, uniform linear layers, BN 1/0). Only the rank that DDP broadcasts from
 * needs them, and no rank that resumes from a snapshot: drawing ResNet-18's 11M takes ~0.3 s.
 * Returns 0, or -1 when out of host memory. */
int model_init_params(model_t *m, uint64_t seed);
void model_free(model_t *m);
/* The input batch: (batch_max, H, W, C), backend memory. */
float *model_input(model_t *m);
const float *model_logits(const model_t *m);
/* Forward n samples of model_input. Training mode uses batch statistics and updates the running
 * ones; evaluation mode uses the running ones. */
void model_forward(model_t *m, int n, bool is_training);
/* Softmax cross-entropy of the logits against m->labels: adds the summed loss to *m->loss_sum and
 * sets the logits' gradient (of the batch mean, times grad_scale and, with ls, the loss scale). */
void model_loss(model_t *m, int n, float label_smoothing, float grad_scale, const loss_scale_t *ls);
/* Zero every gradient, then backward through all layers; cb (may be NULL) as buckets complete. */
void model_backward(model_t *m, int n, model_grads_ready_cb cb, void *arg);
/* The summed loss since the last call (reads one float back from the backend), then resets it. */
double model_take_loss(model_t *m);

#endif
