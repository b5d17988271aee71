/* model: see model.h. The arenas, the initial values and running the layers forward and backward;
 * the architectures are model_build.c's. Building happens on the host (layer list, shapes, init
 * values); the arenas then go to the backend once. */
#include "model.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

#define BN_EPS      1e-5f
#define BN_MOMENTUM 0.1f

/* A standard normal sample from two uniform ones (Box-Muller). */
static double normal(uint64_t *state) {
    double u1 = ((double)(rng_next(state) >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(rng_next(state) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static double uniform(uint64_t *state, double bound) {
    return ((double)(rng_next(state) >> 11) / 9007199254740992.0 * 2.0 - 1.0) * bound;
}

/* The threads that draw initial values: every CPU this process may run on, whatever
 * OMP_NUM_THREADS says (a launcher sets 1 per worker for its steps; a GPU worker's host cores are
 * idle while it starts, and ResNet-18's 11M values on one thread take 0.28 s on the 2-core VM, most
 * of the 0.70 s the H100's startup trace put in the trainer's start). The values do not depend on
 * it. */
static int draw_threads(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    int n = CPU_COUNT(&set);
    return n < 1 ? 1 : n;
}

/* p[0..n_w) = std * a normal sample each, the rest of p[0..n) 0: value j takes draws 2j and 2j+1
 * of the stream at `state`, so threads fill slices of a big layer with the sequential values. */
static void fill_normal(float *p, size_t n_w, size_t n, double std, uint64_t state) {
#pragma omp parallel for schedule(static) if (n_w > ((size_t)1 << 16)) num_threads(draw_threads())
    for (size_t j = 0; j < n_w; j++) {
        uint64_t s = rng_skip(state, 2 * (uint64_t)j);
        p[j] = (float)(std * normal(&s));
    }
    for (size_t j = n_w; j < n; j++)
        p[j] = 0.0f;
}

/* Each layer draws from its own stream (and each value from its place in it), so the values do
 * not depend on how the work is split across threads. */
static void init_params(const model_t *m, uint64_t seed, float *params, float *buffers) {
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = &m->layers[i];
        float *p = params + l->param_offset;
        uint64_t state = rng_key(seed, 0x6d6f64656cull /* "model" */, (uint64_t)i);
        if (l->kind ==
            LAYER_CONV) { /* kaiming_normal_(mode="fan_out", nonlinearity="relu"), bias 0 */
            const conv_shape_t *s = &l->conv;
            fill_normal(p, (size_t)s->k * s->r * s->s * s->c, l->n_params,
                        sqrt(2.0 / ((double)s->k * s->r * s->s)), state);
        } else if (l->kind == LAYER_LINEAR && l->linear_init == LINEAR_INIT_NORMAL_001) {
            /* VGG: normal(0, 0.01), bias 0 */
            fill_normal(p, l->n_params - (size_t)m->tensors[l->out].c, l->n_params, 0.01, state);
        } else if (l->kind == LAYER_LINEAR) { /* nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in)) */
            const tensor_t *x = &m->tensors[l->in];
            double bound = 1.0 / sqrt((double)x->h * x->w * x->c);
#pragma omp parallel for schedule(static) if (l->n_params > ((size_t)1 << 16))                     \
    num_threads(draw_threads())
            for (size_t j = 0; j < l->n_params; j++) {
                uint64_t s = rng_skip(state, j);
                p[j] = (float)uniform(&s, bound);
            }
        } else if (l->kind == LAYER_BATCHNORM) {
            size_t c = l->n_params / 2;
            for (size_t j = 0; j < c; j++) {
                p[j] = l->is_zero_init ? 0.0f : 1.0f;
                p[c + j] = 0.0f;
                buffers[l->buffer_offset + j] = 0.0f;
                buffers[l->buffer_offset + c + j] = 1.0f;
            }
        }
    }
}

/* Im2col columns for as many images as fit in CONV_WORKSPACE_BYTES (at least one), or batch norm's
 * per-channel sums, whichever is larger. */
#define CONV_WORKSPACE_BYTES ((size_t)32 << 20)
static size_t workspace_bytes(const model_t *m) {
    size_t bytes = 0;
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = &m->layers[i];
        size_t need = 0;
        if (l->kind == LAYER_CONV) {
            size_t per_image =
                sizeof(float) * (size_t)l->conv.oh * l->conv.ow * l->conv.r * l->conv.s * l->conv.c;
            size_t images = per_image ? CONV_WORKSPACE_BYTES / per_image : 1;
            if (images < 1) images = 1;
            if (images > (size_t)m->batch_max) images = (size_t)m->batch_max;
            need = per_image * images;
        } else if (l->kind == LAYER_BATCHNORM) {
            need = 4 * sizeof(double) * l->n_params; /* 2 double and 3 float per channel */
        }
        if (need > bytes) bytes = need;
    }
    return bytes;
}

model_opts_t model_opts_default(const char *name, int width) {
    return (model_opts_t){
        .name = name, .width = width, .stem = MODEL_STEM_AUTO, .fc_width = 4096, .dropout = 0.5f};
}

int model_init(model_t *m, backend_t *bk, const char *name, int width, int h, int w, int c,
               int classes, int batch_max, char *err, size_t err_len) {
    model_opts_t o = model_opts_default(name, width);
    return model_init_opts(m, bk, &o, h, w, c, classes, batch_max, err, err_len);
}

int model_init_opts(model_t *m, backend_t *bk, const model_opts_t *opts, int h, int w, int c,
                    int classes, int batch_max, char *err, size_t err_len) {
    memset(m, 0, sizeof *m);
    m->backend = bk;
    snprintf(m->name, sizeof m->name, "%s", opts->name);
    m->opts = *opts;
    m->opts.name = m->name;
    m->batch_max = batch_max;
    m->h = h;
    m->w = w;
    m->c = c;
    m->classes = classes;
    const char *name = m->name;
    if (model__build(m, err, err_len) < 0) {
        model_free(m);
        return -1;
    }
    for (int i = 0; i < m->n_layers; i++)
        m->has_dropout |= m->layers[i].kind == LAYER_DROPOUT && m->layers[i].dropout_p > 0.0f;
    m->params = bk->mem->alloc(bk, m->n_params * sizeof(float));
    m->grads = bk->mem->alloc(bk, m->n_params * sizeof(float));
    m->momentum = bk->mem->alloc(bk, m->n_params * sizeof(float));
    m->buffers = bk->mem->alloc(bk, m->n_buffers * sizeof(float));
    m->acts = bk->mem->alloc(bk, m->n_acts * sizeof(float));
    m->dacts = bk->mem->alloc(bk, m->n_acts * sizeof(float));
    m->scratch = bk->mem->alloc(bk, m->n_scratch * sizeof(float));
    m->labels = bk->mem->alloc(bk, (size_t)batch_max * sizeof(int32_t));
    m->loss_sum = bk->mem->alloc(bk, sizeof(float));
    if (!m->params || !m->grads || !m->momentum || !m->buffers || !m->acts || !m->dacts ||
        !m->scratch || !m->labels || !m->loss_sum ||
        bk->mem->reserve_workspace(bk, workspace_bytes(m)) < 0) {
        snprintf(err, err_len,
                 "model %s: out of memory for %zu parameters and %zu activations "
                 "(batch %d); try a smaller train.batch_size",
                 name, m->n_params, m->n_acts, batch_max);
        model_free(m);
        return -1;
    }
    m->act_dtype = bk->mem->activation_dtype ? bk->mem->activation_dtype(bk) : DTYPE_F32;
    for (int i = 0; i < m->n_layers;
         i++) { /* a convolution's batch norm, whose statistics it may give */
        layer_t *l = &m->layers[i];
        l->stats_bn = -1;
        for (int j = i + 1;
             l->kind == LAYER_CONV && !l->has_bias && j < m->n_layers && l->stats_bn < 0; j++)
            if (m->layers[j].kind == LAYER_BATCHNORM && m->layers[j].in == l->out) l->stats_bn = j;
    }
    if (bk->mem->mark_arenas &&
        bk->mem->mark_arenas(bk, m->params, m->n_params, m->acts, m->dacts, m->n_acts) < 0) {
        snprintf(err, err_len, "model %s: out of memory for the backend's copies of %zu parameters",
                 name, m->n_params);
        model_free(m);
        return -1;
    }
    return 0;
}

int model_init_params(model_t *m, uint64_t seed) {
    float *host_params = calloc(m->n_params + 1, sizeof(float));
    float *host_buffers = calloc(m->n_buffers + 1, sizeof(float));
    if (!host_params || !host_buffers) {
        free(host_params);
        free(host_buffers);
        return -1;
    }
    init_params(m, seed, host_params, host_buffers);
    backend_t *bk = m->backend;
    bk->mem->to_device(bk, m->params, host_params, m->n_params * sizeof(float));
    bk->mem->to_device(bk, m->buffers, host_buffers, m->n_buffers * sizeof(float));
    free(host_params);
    free(host_buffers);
    return 0;
}

void model_free(model_t *m) {
    if (m->backend) {
        backend_t *bk = m->backend;
        for (int i = 0; i < m->n_graphs; i++)
            if (m->graphs[i].graph) bk->mem->graph_free(bk, m->graphs[i].graph);
        void *mem[] = {m->params, m->grads,   m->momentum, m->buffers, m->acts,
                       m->dacts,  m->scratch, m->labels,   m->loss_sum};
        for (size_t i = 0; i < sizeof mem / sizeof mem[0]; i++)
            if (mem[i]) bk->mem->release(bk, mem[i]);
    }
    free(m->layers);
    free(m->tensors);
    memset(m, 0, sizeof *m);
}

float *model_input(model_t *m) {
    return m->acts + m->tensors[0].offset;
}

const float *model_logits(const model_t *m) {
    return m->acts + m->tensors[m->n_tensors - 1].offset;
}

static size_t tensor_elems(const model_t *m, int t, int n) {
    const tensor_t *x = &m->tensors[t];
    return (size_t)n * x->h * x->w * x->c;
}

/* Tensor t (-1: none, data NULL) of n samples in the activations (is_grad false) or their
 * gradients, as the backend's ops take it. */
static tensor_desc_t desc(const model_t *m, int t, int n, bool is_grad) {
    if (t < 0) return tensor_desc(NULL, m->act_dtype, 0, 0, 0, 0);
    const tensor_t *x = &m->tensors[t];
    return tensor_desc((is_grad ? m->dacts : m->acts) + x->offset, m->act_dtype, n, x->h, x->w,
                       x->c);
}
static tensor_desc_t act(const model_t *m, int t, int n) {
    return desc(m, t, n, false);
}
static tensor_desc_t grad(const model_t *m, int t, int n) {
    return desc(m, t, n, true);
}

void model_set_step(model_t *m, uint64_t seed, int64_t step, int rank) {
    m->dropout_seed = seed;
    m->dropout_step = step;
    m->dropout_rank = rank;
}

uint64_t model_dropout_key(const model_t *m, int layer) {
    uint64_t step_key =
        rng_key(m->dropout_seed, 0x64726f706f7574ull /* "dropout" */, (uint64_t)m->dropout_step);
    return rng_key(step_key, (uint64_t)m->dropout_rank, (uint64_t)layer);
}

/* Batch norm layer bn over tensor x_t, with residual res_t (-1: none) and flags (BN_ACT_*), into
 * y_t: a lone batch norm or a fused chain (model.h). */
static void bn_act_forward(model_t *m, layer_t *bn, int x_t, int res_t, unsigned flags, int y_t,
                           int n, bool is_training) {
    backend_t *bk = m->backend;
    const tensor_t *tx = &m->tensors[x_t];
    int c = tx->c;
    size_t rows = (size_t)n * tx->h * tx->w;
    const float *p = m->params + bn->param_offset;
    tensor_desc_t x = act(m, x_t, n), res = act(m, res_t, n), y = act(m, y_t, n);
    float *run = m->buffers + bn->buffer_offset, *save = m->scratch + bn->scratch_offset;
    if (is_training && bn->has_sums) { /* its convolution left the sums in the saved slots */
        bn->has_sums = false;
        bk->ops->bn_act_forward_train_sums(bk, rows, c, x, save, save + c, p, p + c, res, flags, y,
                                           save, save + c, run, run + c, BN_MOMENTUM, BN_EPS);
    } else if (is_training)
        bk->ops->bn_act_forward_train(bk, rows, c, x, p, p + c, res, flags, y, save, save + c, run,
                                      run + c, BN_MOMENTUM, BN_EPS);
    else
        bk->ops->bn_act_forward_eval(bk, rows, c, x, p, p + c, res, flags, y, run, run + c, BN_EPS);
}

/* Its backward; flags add BN_ACT_WRITE_* as the layer's plan says. */
static void bn_act_backward(model_t *m, const layer_t *bn, int x_t, int res_t, unsigned flags,
                            int y_t, int n) {
    backend_t *bk = m->backend;
    const tensor_t *tx = &m->tensors[x_t];
    int c = tx->c;
    size_t rows = (size_t)n * tx->h * tx->w;
    const float *p = m->params + bn->param_offset;
    const float *save = m->scratch + bn->scratch_offset;
    float *dp = m->grads + bn->param_offset;
    bk->ops->bn_act_backward(bk, rows, c, act(m, x_t, n), p, save, save + c, act(m, y_t, n),
                             grad(m, y_t, n), flags, grad(m, x_t, n), grad(m, res_t, n), dp,
                             dp + c);
}

/* ---- recordings: see model.h ---- */

enum { MODEL_GRAPH_FORWARD, MODEL_GRAPH_LOSS, MODEL_GRAPH_BACKWARD };

/* The arguments of one forward, loss or backward (those a recording holds). */
typedef struct {
    int n;
    bool is_training;
    float smoothing, grad_scale;
    const loss_scale_t *ls;
} step_args_t;

/* Runs eager(m, a) as the backend's recording of it when the backend records: the first call with
 * these arguments runs the ops (the backend searches algorithms and grows its buffers then), the
 * second records them and runs the recording, the later ones run it. Eager when the backend does
 * not record, the model has dropout, or every slot is taken. */
static void run_recorded(model_t *m, int kind, const step_args_t *a,
                         void (*eager)(model_t *m, const step_args_t *a)) {
    backend_t *bk = m->backend;
    if (!bk->mem->graph_begin || m->has_dropout) {
        eager(m, a);
        return;
    }
    model_graph_t *g = NULL;
    for (int i = 0; i < m->n_graphs && !g; i++) {
        model_graph_t *k = &m->graphs[i];
        if (k->kind == kind && k->n == a->n && k->is_training == a->is_training &&
            k->smoothing == a->smoothing && k->grad_scale == a->grad_scale && k->ls == a->ls)
            g = k;
    }
    if (!g && m->n_graphs < MODEL_GRAPHS) {
        g = &m->graphs[m->n_graphs++];
        *g = (model_graph_t){.kind = kind,
                             .n = a->n,
                             .is_training = a->is_training,
                             .smoothing = a->smoothing,
                             .grad_scale = a->grad_scale,
                             .ls = a->ls};
    }
    if (g && g->graph) {
        if (bk->mem->graph_run(bk, g->graph) == 0) return;
        bk->mem->graph_free(bk, g->graph); /* stale: run the ops now, record them next time */
        g->graph = NULL;
        g->calls = 0;
    }
    if (!g || g->calls++ == 0 || bk->mem->graph_begin(bk) < 0) {
        eager(m, a);
        return;
    }
    eager(m, a); /* recorded, not run */
    g->graph = bk->mem->graph_end(bk);
    if (!g->graph || bk->mem->graph_run(bk, g->graph) < 0) eager(m, a);
}

static void forward_eager(model_t *m, const step_args_t *a);
static void loss_eager(model_t *m, const step_args_t *a);
static void backward_eager(model_t *m, const step_args_t *a, model_grads_ready_cb cb, void *arg);
static void backward_recordable(model_t *m, const step_args_t *a) {
    backward_eager(m, a, NULL, NULL);
}

void model_forward(model_t *m, int n, bool is_training) {
    step_args_t a = {.n = n, .is_training = is_training};
    run_recorded(m, MODEL_GRAPH_FORWARD, &a, forward_eager);
}

void model_loss(model_t *m, int n, float label_smoothing, float grad_scale,
                const loss_scale_t *ls) {
    step_args_t a = {.n = n, .smoothing = label_smoothing, .grad_scale = grad_scale, .ls = ls};
    run_recorded(m, MODEL_GRAPH_LOSS, &a, loss_eager);
}

void model_backward(model_t *m, int n, model_grads_ready_cb cb, void *arg) {
    step_args_t a = {.n = n};
    if (!m->backend->mem->graph_begin || m->has_dropout) {
        backward_eager(m, &a, cb, arg); /* buckets leave as backward completes them */
        return;
    }
    run_recorded(m, MODEL_GRAPH_BACKWARD, &a, backward_recordable);
    /* recorded or not, every gradient is final (in queue order) once it has run: the buckets in
     * the order backward completes them */
    for (int i = m->n_layers - 1; cb && i >= 0; i--)
        if (m->layers[i].n_params) cb(arg, m->layers[i].param_offset);
}

/* A training forward's convolution l that also gives its batch norm the statistics of its output
 * (conv2d_bn_forward with no scale and bias); false when the backend does not (the caller runs
 * the plain convolution). */
static bool conv_with_stats(model_t *m, layer_t *l, tensor_desc_t x, const float *w,
                            tensor_desc_t y) {
    backend_t *bk = m->backend;
    if (l->stats_bn < 0 || !bk->ops->conv2d_bn_forward || !bk->ops->bn_act_forward_train_sums)
        return false;
    layer_t *bn = &m->layers[l->stats_bn];
    float *save = m->scratch + bn->scratch_offset;
    if (bk->ops->conv2d_bn_forward(bk, &l->conv, x, NULL, NULL, w, y, save, save + l->conv.k) < 0)
        return false;
    bn->has_sums = true;
    m->conv_stats_runs++;
    return true;
}

static void forward_eager(model_t *m, const step_args_t *a) {
    int n = a->n;
    bool is_training = a->is_training;
    backend_t *bk = m->backend;
    const backend_i *o = bk->ops;
    if (bk->mem->prepare_forward) bk->mem->prepare_forward(bk);
    for (int i = 0; i < m->n_layers; i++) {
        layer_t *l = &m->layers[i];
        const tensor_t *tx = &m->tensors[l->in];
        tensor_desc_t x = act(m, l->in, n), y = act(m, l->out, n);
        float *p = m->params + l->param_offset;
        switch (l->kind) {
        case LAYER_CONV:
            l->conv.n = n;
            if (!is_training || !conv_with_stats(m, l, x, p, y))
                o->conv2d_forward(bk, &l->conv, x, p, y);
            if (l->has_bias)
                o->bias_add(bk, (size_t)n * l->conv.oh * l->conv.ow, l->conv.k,
                            p + (size_t)l->conv.k * l->conv.r * l->conv.s * l->conv.c, y);
            break;
        case LAYER_BATCHNORM: /* fused: its ReLU runs it */
            if (!l->is_fused) bn_act_forward(m, l, l->in, -1, 0, l->out, n, is_training);
            break;
        case LAYER_RELU:
            if (l->bn_layer >= 0)
                bn_act_forward(m, &m->layers[l->bn_layer], l->in, l->in2, BN_ACT_RELU, l->out, n,
                               is_training);
            else
                o->relu_forward(bk, x, y, tensor_elems(m, l->in, n));
            break;
        case LAYER_ADD:
            if (!l->is_fused)
                o->add_forward(bk, x, act(m, l->in2, n), y, tensor_elems(m, l->in, n));
            break;
        case LAYER_MAXPOOL:
            l->pool.n = n;
            o->maxpool_forward(bk, &l->pool, x, y, (int32_t *)(m->scratch + l->scratch_offset));
            break;
        case LAYER_AVGPOOL_GLOBAL:
            o->avgpool_global_forward(bk, n, tx->h * tx->w, tx->c, x, y);
            break;
        case LAYER_AVGPOOL_ADAPTIVE:
            l->pool.n = n;
            o->avgpool_adaptive_forward(bk, &l->pool, x, y);
            break;
        case LAYER_DROPOUT: /* evaluation: p = 0, a copy */
            o->dropout_forward(bk, x, y, tensor_elems(m, l->in, n),
                               is_training ? l->dropout_p : 0.0f, model_dropout_key(m, i));
            break;
        case LAYER_LINEAR: {
            int in = tx->h * tx->w * tx->c, out = m->tensors[l->out].c;
            o->linear_forward(bk, n, in, out, x, p, p + (size_t)out * in, y);
            break;
        }
        }
    }
}

static void loss_eager(model_t *m, const step_args_t *a) {
    int last = m->n_tensors - 1;
    m->backend->ops->softmax_xent(m->backend, a->n, m->classes, act(m, last, a->n), m->labels,
                                  a->smoothing, a->grad_scale, a->ls, grad(m, last, a->n),
                                  m->loss_sum);
}

static void backward_eager(model_t *m, const step_args_t *a, model_grads_ready_cb cb, void *arg) {
    int n = a->n;
    backend_t *bk = m->backend;
    const backend_i *o = bk->ops;
    o->fill(bk, m->grads, 0.0f, m->n_params);
    /* the activation gradients whose first producer adds to them (the others are written) */
    for (int t = 0; t < m->n_tensors - 1; t++)
        if (m->tensors[t].is_grad_zeroed)
            o->fill(bk, m->dacts + m->tensors[t].offset, 0.0f, tensor_elems(m, t, n));
    for (int i = m->n_layers - 1; i >= 0; i--) {
        layer_t *l = &m->layers[i];
        const tensor_t *tx = &m->tensors[l->in];
        tensor_desc_t x = act(m, l->in, n), y = act(m, l->out, n), dy = grad(m, l->out, n);
        tensor_desc_t dx = grad(m, l->in == 0 ? -1 : l->in, n); /* nothing needs the input's */
        const float *p = m->params + l->param_offset;
        float *dp = m->grads + l->param_offset;
        switch (l->kind) {
        case LAYER_CONV:
            if (l->has_bias)
                o->bias_backward(bk, (size_t)n * l->conv.oh * l->conv.ow, l->conv.k, dy,
                                 dp + (size_t)l->conv.k * l->conv.r * l->conv.s * l->conv.c);
            o->conv2d_backward(bk, &l->conv, x, p, dy, dx, dp);
            break;
        case LAYER_BATCHNORM: /* fused: its ReLU ran it (its gradients are final here) */
            if (!l->is_fused)
                bn_act_backward(m, l, l->in, -1, l->is_dx_written ? BN_ACT_WRITE_DX : 0, l->out, n);
            break;
        case LAYER_RELU:
            if (l->bn_layer >= 0)
                bn_act_backward(m, &m->layers[l->bn_layer], l->in, l->in2,
                                BN_ACT_RELU | (l->is_dx_written ? BN_ACT_WRITE_DX : 0) |
                                    (l->is_dx2_written ? BN_ACT_WRITE_DRESIDUAL : 0),
                                l->out, n);
            else
                o->relu_backward(bk, y, dy, dx, tensor_elems(m, l->in, n));
            break;
        case LAYER_ADD:
            if (l->is_fused) break;
            o->accumulate(bk, dy, dx, tensor_elems(m, l->in, n));
            o->accumulate(bk, dy, grad(m, l->in2, n), tensor_elems(m, l->in, n));
            break;
        case LAYER_MAXPOOL:
            o->maxpool_backward(bk, &l->pool, (const int32_t *)(m->scratch + l->scratch_offset), dy,
                                dx);
            break;
        case LAYER_AVGPOOL_GLOBAL:
            o->avgpool_global_backward(bk, n, tx->h * tx->w, tx->c, dy, dx);
            break;
        case LAYER_AVGPOOL_ADAPTIVE:
            o->avgpool_adaptive_backward(bk, &l->pool, dy, dx);
            break;
        case LAYER_DROPOUT:
            o->dropout_backward(bk, dy, dx, tensor_elems(m, l->in, n), l->dropout_p,
                                model_dropout_key(m, i));
            break;
        case LAYER_LINEAR: {
            int in = tx->h * tx->w * tx->c, out = m->tensors[l->out].c;
            o->linear_backward(bk, n, in, out, x, p, dy, dx, dp, dp + (size_t)out * in);
            break;
        }
        }
        if (cb && l->n_params) cb(arg, l->param_offset);
    }
}

double model_take_loss(model_t *m) {
    float loss = 0.0f;
    m->backend->mem->to_host(m->backend, &loss, m->loss_sum, sizeof loss);
    m->backend->ops->fill(m->backend, m->loss_sum, 0.0f, 1);
    return loss;
}
