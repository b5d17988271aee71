/* model: the networks ddpworker trains, as a flat list of layers over tensors, built by name for
 * any input shape and class count, run on any backend_i. Parameters, their gradients and the
 * optimizer's momentum each live in one arena (params are laid out in forward order, so backward
 * finishes them from the end of the arena towards the start: a gradient bucket is a slice, and
 * it is complete once backward has passed its first layer). Batch-norm running statistics live in
 * a fourth arena ("buffers"). Everything is allocated by model_init; nothing in a step.
 *
 * Models (model_build.c), as torchvision defines them, with torchvision's parameter names on every
 * layer (layer_t.name: weights.h reads and writes torchvision's state_dict with them):
 * - mlp (two hidden layers of `width`), cnn (two conv-bn-relu-maxpool stages, width and 2 width
 *   channels, then linear): small networks for tests and quick runs;
 * - resnet18/34 (basic blocks) and resnet50/101/152 (bottleneck blocks, expansion 4, the stride in
 *   the 3x3 convolution: torchvision's v1.5), base channels `width` (64 is torchvision's), stem
 *   imagenet (7x7/2 conv, bn, relu, 3x3/2 max-pool pad 1) or cifar (3x3/1 conv, bn, relu);
 * - vgg11/13/16/19 and their _bn variants (torchvision's cfgs A/B/D/E): 3x3 convolutions with bias
 *   (+ bn) + relu, 2x2/2 max-pools, an adaptive average pool to 7x7, then the classifier
 *   Linear(8 width * 49, fc_width)-ReLU-Dropout-Linear(fc_width, fc_width)-ReLU-Dropout-Linear.
 * Init (model_init_params) is torchvision's, a pure function of the seed: Kaiming normal (fan_out,
 * relu) convolutions with zero bias, BN gamma 1 beta 0 (gamma 0 for each residual block's last BN
 * with zero_init_residual), linear layers PyTorch's uniform default, VGG's normal(0, 0.01) with
 * zero bias.
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
    LAYER_AVGPOOL_ADAPTIVE,
    LAYER_DROPOUT,
} layer_kind_t;

/* How a linear layer's parameters are drawn. */
typedef enum { LINEAR_INIT_UNIFORM, LINEAR_INIT_NORMAL_001 } linear_init_t;

#define MODEL_LAYER_NAME_MAX 48

typedef struct {
    int h, w, c;     /* per sample; (N, H, W, C) in the arenas */
    size_t offset;   /* into acts and dacts, sized for batch_max */
    bool is_virtual; /* inside a fused chain (model__fuse): never stored, no room in the arenas */
    bool is_grad_zeroed; /* backward zeroes its gradient first: its first producer adds to it */
} tensor_t;

typedef struct {
    layer_kind_t kind;
    int in, in2, out; /* tensor indices (in2: LAYER_ADD, or a fused chain's residual) */
    /* Fusion (model__fuse): a batch norm whose output only a ReLU reads, or only an add whose
     * output only a ReLU reads, runs as one bn_act op at that ReLU: the ReLU's layer names the
     * batch norm (bn_layer, else -1), reads its input (in) and the add's other input (in2, else
     * -1); the batch norm and the add are skipped (is_fused) but keep their place, parameters and
     * index (init streams, dropout keys and bucket callbacks are as without fusion). A batch norm
     * left alone runs as bn_act without residual or ReLU. */
    int bn_layer;
    bool is_fused;
    /* Statistics from a convolution's epilogue (backend conv2d_bn_forward, where offered and
     * accepted): a convolution's stats_bn is the batch norm that reads its output (-1: none); a
     * batch norm's has_sums says that, in this training forward, its saved mean and invstd slots
     * hold its input's sums instead (bn_act_forward_train_sums finishes them). */
    int stats_bn;
    bool has_sums;
    /* backward writes the gradient of in (in2) instead of adding to it: no one produced it yet */
    bool is_dx_written, is_dx2_written;
    conv_shape_t conv;             /* n is set per call */
    pool_shape_t pool;             /* max pool, adaptive average pool */
    size_t param_offset, n_params; /* conv: (K,R,S,C) filters then K biases; batch norm: gamma then
                                    * beta; linear: (out, in) weights then out biases */
    size_t buffer_offset;          /* batch norm: running mean then running var */
    size_t scratch_offset;         /* batch norm: saved mean, invstd; max pool: argmax (int32) */
    bool has_bias;                 /* conv */
    bool is_zero_init;             /* batch norm: gamma starts at 0 (zero_init_residual) */
    linear_init_t linear_init;
    float dropout_p;
    /* torchvision's module path ("layer1.0.conv1", "features.3", "fc"); empty without parameters */
    char name[MODEL_LAYER_NAME_MAX];
} layer_t;

typedef enum { MODEL_STEM_AUTO, MODEL_STEM_IMAGENET, MODEL_STEM_CIFAR } model_stem_t;

/* Images with both sides at least this big get the ImageNet stem under MODEL_STEM_AUTO. */
#define MODEL_STEM_AUTO_MIN_SIDE 64

typedef struct {
    const char *name;  /* mlp, cnn, resnet18 ... resnet152, vgg11 ... vgg19_bn */
    int width;         /* base channels (64: torchvision's) / hidden units */
    model_stem_t stem; /* resnets; auto: imagenet for inputs >= 64 px on both sides */
    int fc_width;      /* vgg: the classifier's hidden width (4096: torchvision's) */
    float dropout;     /* vgg: the classifier's dropout probability, [0, 1) */
    bool is_zero_init_residual;
} model_opts_t;

/* A recorded forward, loss or backward (backend graph_*), for one set of arguments. */
typedef struct {
    int kind; /* MODEL_GRAPH_* (model.c) */
    int n;
    bool is_training;
    float smoothing, grad_scale;
    const loss_scale_t *ls;
    int calls;   /* the first call runs the ops, the second records them */
    void *graph; /* NULL until recorded */
} model_graph_t;

#define MODEL_GRAPHS 8

typedef struct {
    backend_t *backend;
    char name[32];
    int batch_max, h, w, c, classes;
    layer_t *layers;
    int n_layers;
    tensor_t *tensors; /* [0] is the input, [n_tensors - 1] the logits */
    int n_tensors;
    size_t n_params, n_buffers, n_acts, n_scratch;
    /* backend memory */
    float *params, *grads, *momentum, *buffers;
    float *acts, *dacts, *scratch;
    dtype_t act_dtype; /* how the backend stores acts and dacts (backend_memory_i) */
    int32_t *labels;   /* (batch_max) */
    float *loss_sum;   /* one float: summed training loss since model_take_loss */
    model_opts_t opts; /* opts.name points at name */
    /* dropout's mask key: (seed, step, rank), set by model_set_step before each training forward */
    uint64_t dropout_seed;
    int64_t dropout_step;
    int dropout_rank;
    /* Recordings (backends with graph_*: cuda unless DDP_CUDA_GRAPHS=0): forward, loss and backward
     * each run as one recording per set of arguments from their second call on; not for models
     * with dropout (its masks change every step). */
    model_graph_t graphs[MODEL_GRAPHS];
    int n_graphs;
    bool has_dropout;
    long conv_stats_runs; /* convolutions that gave their batch norm its statistics (tests) */
} model_t;

/* Called during backward each time the gradients of params[ready_from, n_params) are final. */
typedef void (*model_grads_ready_cb)(void *arg, size_t ready_from);

/* torchvision's defaults for the rest: stem auto, fc_width 4096, dropout 0.5, no zero init. */
model_opts_t model_opts_default(const char *name, int width);
/* Build o->name for inputs of h x w x c and `classes` classes, batches up to batch_max; every
 * arena zero (model_init_params draws the parameters). Returns 0, or -1 with the reason in err
 * (unknown name, input too small for the network, out of memory). */
int model_init_opts(model_t *m, backend_t *b, const model_opts_t *o, int h, int w, int c,
                    int classes, int batch_max, char *err, size_t err_len);
/* model_init_opts with model_opts_default(name, width). */
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
/* Dropout's masks for the next training forward are a function of (seed, step, rank, layer):
 * a restarted run replays them, and DDP's ranks drop differently, as torch's per-rank generators.
 */
void model_set_step(model_t *m, uint64_t seed, int64_t step, int rank);
/* The mask key of layer `layer` (a LAYER_DROPOUT) under the current model_set_step. */
uint64_t model_dropout_key(const model_t *m, int layer);
/* Forward n samples of model_input. Training mode uses batch statistics and updates the running
 * ones, and drops out; evaluation mode uses the running ones and drops nothing. */
void model_forward(model_t *m, int n, bool is_training);
/* Softmax cross-entropy of the logits against m->labels: adds the summed loss to *m->loss_sum and
 * sets the logits' gradient (of the batch mean, times grad_scale and, with ls, the loss scale). */
void model_loss(model_t *m, int n, float label_smoothing, float grad_scale, const loss_scale_t *ls);
/* Zero every gradient, then backward through all layers; cb (may be NULL) as buckets complete. */
void model_backward(model_t *m, int n, model_grads_ready_cb cb, void *arg);
/* The summed loss since the last call (reads one float back from the backend), then resets it. */
double model_take_loss(model_t *m);

/* model.c only (model_build.c): the layer list, tensors and arena sizes of m->opts for m's input
 * shape, classes and batch_max, fused (layer_t.bn_layer) and with each backward's write-or-add
 * decided (layer_t.is_dx_written, tensor_t.is_grad_zeroed). Returns 0, or -1 with the reason in
 * err. */
int model__build(model_t *m, char *err, size_t err_len);

#endif
