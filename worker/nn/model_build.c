/* model_build: the architectures of model.h as layer lists: shapes, arena offsets, torchvision's
 * module names, how each layer's parameters are drawn. Host only, at start-up; model.c owns the
 * arenas and runs the layers. */
#include "model.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    model_t *m;
    int cap_layers, cap_tensors;
    bool has_failed;
    char *err;
    size_t err_len;
} builder_t;

static int fail(builder_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(builder_t *b, const char *fmt, ...) {
    if (!b->has_failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err, b->err_len, fmt, ap);
        va_end(ap);
    }
    b->has_failed = true;
    return 0;
}

static int add_tensor(builder_t *b, int h, int w, int c) {
    model_t *m = b->m;
    if (b->has_failed) return 0;
    if (h < 1 || w < 1)
        return fail(b, "model %s: the input (%dx%d) is too small (a layer's output would be %dx%d)",
                    m->name, m->h, m->w, h, w);
    if (m->n_tensors == b->cap_tensors) {
        b->cap_tensors = b->cap_tensors ? 2 * b->cap_tensors : 16;
        tensor_t *t = realloc(m->tensors, sizeof *t * (size_t)b->cap_tensors);
        if (!t) return fail(b, "out of memory building model %s", m->name);
        m->tensors = t;
    }
    tensor_t *t = &m->tensors[m->n_tensors];
    *t = (tensor_t){.h = h, .w = w, .c = c, .offset = m->n_acts};
    m->n_acts += (size_t)m->batch_max * h * w * c;
    return m->n_tensors++;
}

/* A new layer reading tensor `in`, named (printf-style; NULL: no parameters, no name). */
static layer_t *add_layer(builder_t *b, layer_kind_t kind, int in, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static layer_t *add_layer(builder_t *b, layer_kind_t kind, int in, const char *fmt, ...) {
    model_t *m = b->m;
    if (b->has_failed) return NULL;
    if (m->n_layers == b->cap_layers) {
        b->cap_layers = b->cap_layers ? 2 * b->cap_layers : 16;
        layer_t *l = realloc(m->layers, sizeof *l * (size_t)b->cap_layers);
        if (!l) {
            fail(b, "out of memory building model %s", m->name);
            return NULL;
        }
        m->layers = l;
    }
    layer_t *l = &m->layers[m->n_layers++];
    *l = (layer_t){
        .kind = kind, .in = in, .in2 = -1, .out = -1, .param_offset = m->n_params, .bn_layer = -1};
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(l->name, sizeof l->name, fmt, ap);
        va_end(ap);
    }
    return l;
}

/* Layers with parameters are named prefix.suffix (just suffix with an empty prefix). */
#define NAMED(prefix, suffix) "%s%s%s", prefix, *(prefix) ? "." : "", suffix

static int conv(builder_t *b, int in, int k, int size, int stride, int pad, bool has_bias,
                const char *prefix, const char *suffix) {
    layer_t *l = add_layer(b, LAYER_CONV, in, NAMED(prefix, suffix));
    if (!l) return 0;
    const tensor_t *x = &b->m->tensors[in];
    conv_shape_t *s = &l->conv;
    *s = (conv_shape_t){.h = x->h,
                        .w = x->w,
                        .c = x->c,
                        .k = k,
                        .r = size,
                        .s = size,
                        .stride = stride,
                        .pad = pad};
    s->oh = (x->h + 2 * pad - size) / stride + 1;
    s->ow = (x->w + 2 * pad - size) / stride + 1;
    l->has_bias = has_bias;
    l->n_params = (size_t)k * size * size * x->c + (has_bias ? (size_t)k : 0);
    b->m->n_params += l->n_params;
    l->out = add_tensor(b, s->oh, s->ow, k);
    return l->out;
}

static int batchnorm(builder_t *b, int in, const char *prefix, const char *suffix) {
    layer_t *l = add_layer(b, LAYER_BATCHNORM, in, NAMED(prefix, suffix));
    if (!l) return 0;
    model_t *m = b->m;
    const tensor_t x = m->tensors[in];
    l->n_params = 2 * (size_t)x.c;
    m->n_params += l->n_params;
    l->buffer_offset = m->n_buffers;
    m->n_buffers += 2 * (size_t)x.c;
    l->scratch_offset = m->n_scratch;
    m->n_scratch += 2 * (size_t)x.c;
    l->out = add_tensor(b, x.h, x.w, x.c);
    return l->out;
}

/* A layer without parameters whose output has the input's shape. */
static int same_shape(builder_t *b, layer_kind_t kind, int in) {
    layer_t *l = add_layer(b, kind, in, NULL);
    if (!l) return 0;
    const tensor_t x = b->m->tensors[in];
    l->out = add_tensor(b, x.h, x.w, x.c);
    return l->out;
}

static int relu(builder_t *b, int in) {
    return same_shape(b, LAYER_RELU, in);
}

static int add(builder_t *b, int in, int in2) {
    int out = same_shape(b, LAYER_ADD, in);
    if (!b->has_failed) b->m->layers[b->m->n_layers - 1].in2 = in2;
    return out;
}

static int dropout(builder_t *b, int in, float p) {
    int out = same_shape(b, LAYER_DROPOUT, in);
    if (!b->has_failed) b->m->layers[b->m->n_layers - 1].dropout_p = p;
    return out;
}

/* nn.MaxPool2d(size, stride, pad): PyTorch's output size (floor mode). */
static int maxpool(builder_t *b, int in, int size, int stride, int pad) {
    layer_t *l = add_layer(b, LAYER_MAXPOOL, in, NULL);
    if (!l) return 0;
    model_t *m = b->m;
    const tensor_t x = m->tensors[in];
    pool_shape_t *s = &l->pool;
    *s = (pool_shape_t){.h = x.h, .w = x.w, .c = x.c, .size = size, .stride = stride, .pad = pad};
    s->oh = x.h + 2 * pad < size ? 0 : (x.h + 2 * pad - size) / stride + 1;
    s->ow = x.w + 2 * pad < size ? 0 : (x.w + 2 * pad - size) / stride + 1;
    l->scratch_offset = m->n_scratch; /* argmax: int32, one per output, stored in float slots */
    m->n_scratch += (size_t)m->batch_max * s->oh * s->ow * x.c;
    l->out = add_tensor(b, s->oh, s->ow, x.c);
    return l->out;
}

static int avgpool_global(builder_t *b, int in) {
    layer_t *l = add_layer(b, LAYER_AVGPOOL_GLOBAL, in, NULL);
    if (!l) return 0;
    l->out = add_tensor(b, 1, 1, b->m->tensors[in].c);
    return l->out;
}

static int avgpool_adaptive(builder_t *b, int in, int oh, int ow) {
    layer_t *l = add_layer(b, LAYER_AVGPOOL_ADAPTIVE, in, NULL);
    if (!l) return 0;
    const tensor_t x = b->m->tensors[in];
    l->pool = (pool_shape_t){.h = x.h, .w = x.w, .c = x.c, .oh = oh, .ow = ow};
    l->out = add_tensor(b, oh, ow, x.c);
    return l->out;
}

/* Linear over the whole input tensor, flattened in its (H, W, C) order. */
static int linear(builder_t *b, int in, int out, linear_init_t init, const char *name) {
    layer_t *l = add_layer(b, LAYER_LINEAR, in, NAMED("", name));
    if (!l) return 0;
    const tensor_t x = b->m->tensors[in];
    l->n_params = (size_t)out * x.h * x.w * x.c + (size_t)out;
    l->linear_init = init;
    b->m->n_params += l->n_params;
    l->out = add_tensor(b, 1, 1, out);
    return l->out;
}

/* torchvision's BasicBlock: conv3x3(stride)-bn-relu-conv3x3-bn, plus the input (downsampled by a
 * 1x1 conv + bn when the shape changes), then relu. */
/* The block's last batch norm: gamma starts at 0 with zero_init_residual, as torchvision's. */
static void mark_zero_init(builder_t *b) {
    if (!b->has_failed)
        b->m->layers[b->m->n_layers - 1].is_zero_init = b->m->opts.is_zero_init_residual;
}

/* The input, or its 1x1 conv + bn projection when the block changes the shape. */
static int shortcut(builder_t *b, int in, int planes, int stride, const char *p) {
    if (stride == 1 && b->m->tensors[in].c == planes) return in;
    return batchnorm(b, conv(b, in, planes, 1, stride, 0, false, p, "downsample.0"), p,
                     "downsample.1");
}

/* torchvision's BasicBlock: conv3x3(stride)-bn-relu-conv3x3-bn, plus the shortcut, then relu. */
static int basic_block(builder_t *b, int in, int planes, int stride, const char *p) {
    int y = relu(b, batchnorm(b, conv(b, in, planes, 3, stride, 1, false, p, "conv1"), p, "bn1"));
    y = batchnorm(b, conv(b, y, planes, 3, 1, 1, false, p, "conv2"), p, "bn2");
    mark_zero_init(b);
    return relu(b, add(b, y, shortcut(b, in, planes, stride, p)));
}

/* torchvision's Bottleneck (v1.5): conv1x1-bn-relu-conv3x3(stride)-bn-relu-conv1x1(4 planes)-bn,
 * plus the shortcut, then relu. */
static int bottleneck(builder_t *b, int in, int planes, int stride, const char *p) {
    int y = relu(b, batchnorm(b, conv(b, in, planes, 1, 1, 0, false, p, "conv1"), p, "bn1"));
    y = relu(b, batchnorm(b, conv(b, y, planes, 3, stride, 1, false, p, "conv2"), p, "bn2"));
    y = batchnorm(b, conv(b, y, 4 * planes, 1, 1, 0, false, p, "conv3"), p, "bn3");
    mark_zero_init(b);
    return relu(b, add(b, y, shortcut(b, in, 4 * planes, stride, p)));
}

static void resnet(builder_t *b, int x, const int blocks[4], bool is_bottleneck) {
    model_t *m = b->m;
    int width = m->opts.width;
    bool is_imagenet = m->opts.stem == MODEL_STEM_IMAGENET ||
                       (m->opts.stem == MODEL_STEM_AUTO && m->h >= MODEL_STEM_AUTO_MIN_SIDE &&
                        m->w >= MODEL_STEM_AUTO_MIN_SIDE);
    if (is_imagenet) {
        x = relu(b, batchnorm(b, conv(b, x, width, 7, 2, 3, false, "", "conv1"), "", "bn1"));
        x = maxpool(b, x, 3, 2, 1);
    } else {
        x = relu(b, batchnorm(b, conv(b, x, width, 3, 1, 1, false, "", "conv1"), "", "bn1"));
    }
    for (int stage = 0; stage < 4; stage++)
        for (int i = 0; i < blocks[stage]; i++) {
            char prefix[MODEL_LAYER_NAME_MAX];
            snprintf(prefix, sizeof prefix, "layer%d.%d", stage + 1, i);
            int stride = stage > 0 && i == 0 ? 2 : 1;
            x = is_bottleneck ? bottleneck(b, x, width << stage, stride, prefix)
                              : basic_block(b, x, width << stage, stride, prefix);
        }
    linear(b, avgpool_global(b, x), m->classes, LINEAR_INIT_UNIFORM, "fc");
}

/* torchvision's VGG cfgs: channels (in units of width / 64), 0 for a max-pool. */
static const int vgg_a[] = {64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0, -1};
static const int vgg_b[] = {64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0, -1};
static const int vgg_d[] = {64,  64,  0,   128, 128, 0,   256, 256, 256, 0,
                            512, 512, 512, 0,   512, 512, 512, 0,   -1};
static const int vgg_e[] = {64,  64,  0,   128, 128, 0,   256, 256, 256, 256, 0,
                            512, 512, 512, 512, 0,   512, 512, 512, 512, 0,   -1};

static void vgg(builder_t *b, int x, const int *cfg, bool has_bn) {
    model_t *m = b->m;
    int index = 0; /* features.N: torchvision counts every module, relus and pools included */
    char n[MODEL_LAYER_NAME_MAX];
    for (const int *v = cfg; *v >= 0; v++) {
        if (*v == 0) {
            x = maxpool(b, x, 2, 2, 0);
            index++;
            continue;
        }
        int k = *v * m->opts.width / 64;
        snprintf(n, sizeof n, "features.%d", index++);
        x = conv(b, x, k < 1 ? 1 : k, 3, 1, 1, true, "", n);
        if (has_bn) {
            snprintf(n, sizeof n, "features.%d", index++);
            x = batchnorm(b, x, "", n);
        }
        x = relu(b, x);
        index++;
    }
    x = avgpool_adaptive(b, x, 7, 7);
    int fc = m->opts.fc_width;
    x = dropout(b, relu(b, linear(b, x, fc, LINEAR_INIT_NORMAL_001, "classifier.0")),
                m->opts.dropout);
    x = dropout(b, relu(b, linear(b, x, fc, LINEAR_INIT_NORMAL_001, "classifier.3")),
                m->opts.dropout);
    linear(b, x, m->classes, LINEAR_INIT_NORMAL_001, "classifier.6");
}

/* ---- after building: fusion, the backward's write-or-add plan, the arena offsets ---- */

/* The layer reading tensor t, when exactly one does (else -1). */
static int only_reader(const model_t *m, int t) {
    int reader = -1;
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = &m->layers[i];
        int reads = (l->in == t) + (l->in2 == t);
        if (!reads) continue;
        if (reads > 1 || reader >= 0) return -1;
        reader = i;
    }
    return reader;
}

/* batch norm -> ReLU and batch norm -> add -> ReLU chains into one bn_act at the ReLU (model.h). */
static void fuse(model_t *m) {
    for (int i = 0; i < m->n_layers; i++) {
        layer_t *bn = &m->layers[i];
        if (bn->kind != LAYER_BATCHNORM) continue;
        int r = only_reader(m, bn->out), residual = -1;
        if (r < 0) continue;
        layer_t *add = NULL;
        if (m->layers[r].kind == LAYER_ADD) {
            add = &m->layers[r];
            residual = add->in == bn->out ? add->in2 : add->in;
            r = only_reader(m, add->out);
            if (r < 0) continue;
        }
        layer_t *relu = &m->layers[r];
        if (relu->kind != LAYER_RELU) continue;
        bn->is_fused = true;
        m->tensors[bn->out].is_virtual = true;
        if (add) {
            add->is_fused = true;
            m->tensors[add->out].is_virtual = true;
        }
        relu->bn_layer = i;
        relu->in = bn->in;
        relu->in2 = residual;
    }
}

/* Whether a layer's backward can write (rather than add to) the gradient of its input(s): the
 * convolutions (cuDNN's and the GEMM's beta 0) and batch norm with or without its chain. */
static bool writes_dx(const layer_t *l) {
    return (l->kind == LAYER_CONV || (l->kind == LAYER_BATCHNORM && !l->is_fused) ||
            (l->kind == LAYER_RELU && l->bn_layer >= 0));
}

/* In backward order, the first producer of each gradient writes it when it can; a gradient whose
 * first producer adds is zeroed before backward. Every other producer adds. */
static void plan_gradients(model_t *m) {
    bool *seen = calloc((size_t)m->n_tensors, sizeof *seen);
    if (!seen) abort(); /* a few bytes at start-up */
    for (int i = m->n_layers - 1; i >= 0; i--) {
        layer_t *l = &m->layers[i];
        if (l->is_fused) continue;
        int inputs[2] = {l->in, l->kind == LAYER_ADD || l->bn_layer >= 0 ? l->in2 : -1};
        for (int k = 0; k < 2; k++) {
            int t = inputs[k];
            if (t <= 0 || seen[t]) continue; /* the model input's gradient is never computed */
            seen[t] = true;
            bool is_written = writes_dx(l);
            if (k == 0)
                l->is_dx_written = is_written;
            else
                l->is_dx2_written = is_written;
            m->tensors[t].is_grad_zeroed = !is_written;
        }
        if (l->kind == LAYER_CONV) l->conv.is_dx_written = l->is_dx_written;
    }
    free(seen);
}

/* Arena offsets for the tensors that are stored, in order. */
static void place_tensors(model_t *m) {
    m->n_acts = 0;
    for (int t = 0; t < m->n_tensors; t++) {
        tensor_t *x = &m->tensors[t];
        x->offset = x->is_virtual ? 0 : m->n_acts;
        if (!x->is_virtual) m->n_acts += (size_t)m->batch_max * x->h * x->w * x->c;
    }
}

#define RESNETS "resnet18, resnet34, resnet50, resnet101, resnet152"
#define VGGS    "vgg11, vgg13, vgg16, vgg19 (and _bn)"

int model__build(model_t *m, char *err, size_t err_len) {
    builder_t b = {.m = m, .err = err, .err_len = err_len};
    const char *name = m->name;
    int width = m->opts.width;
    int x = add_tensor(&b, m->h, m->w, m->c);
    static const struct {
        const char *name;
        int blocks[4];
        bool is_bottleneck;
    } resnets[] = {{"resnet18", {2, 2, 2, 2}, false},
                   {"resnet34", {3, 4, 6, 3}, false},
                   {"resnet50", {3, 4, 6, 3}, true},
                   {"resnet101", {3, 4, 23, 3}, true},
                   {"resnet152", {3, 8, 36, 3}, true}};
    static const struct {
        const char *name;
        const int *cfg;
    } vggs[] = {{"vgg11", vgg_a}, {"vgg13", vgg_b}, {"vgg16", vgg_d}, {"vgg19", vgg_e}};
    bool is_known = false;
    if (width < 1) return fail(&b, "model %s: width %d is not positive", name, width), -1;
    if (strcmp(name, "mlp") == 0) {
        x = relu(&b, linear(&b, x, width, LINEAR_INIT_UNIFORM, "1"));
        x = relu(&b, linear(&b, x, width, LINEAR_INIT_UNIFORM, "3"));
        linear(&b, x, m->classes, LINEAR_INIT_UNIFORM, "5");
        is_known = true;
    } else if (strcmp(name, "cnn") ==
               0) { /* nn.Sequential indices of tests/interop/torch_models.py */
        x = maxpool(&b,
                    relu(&b, batchnorm(&b, conv(&b, x, width, 3, 1, 1, false, "", "0"), "", "1")),
                    2, 2, 0);
        x = maxpool(
            &b, relu(&b, batchnorm(&b, conv(&b, x, 2 * width, 3, 1, 1, false, "", "4"), "", "5")),
            2, 2, 0);
        linear(&b, x, m->classes, LINEAR_INIT_UNIFORM, "9");
        is_known = true;
    }
    for (size_t i = 0; !is_known && i < sizeof resnets / sizeof resnets[0]; i++)
        if (strcmp(name, resnets[i].name) == 0) {
            resnet(&b, x, resnets[i].blocks, resnets[i].is_bottleneck);
            is_known = true;
        }
    for (size_t i = 0; !is_known && i < sizeof vggs / sizeof vggs[0]; i++) {
        size_t len = strlen(vggs[i].name);
        if (strncmp(name, vggs[i].name, len) == 0 &&
            (!name[len] || strcmp(name + len, "_bn") == 0)) {
            if (m->opts.fc_width < 1)
                return fail(&b, "model %s: fc_width must be positive", name), -1;
            if (!(m->opts.dropout >= 0.0f && m->opts.dropout < 1.0f))
                return fail(&b, "model %s: dropout %g is not in [0, 1)", name,
                            (double)m->opts.dropout),
                       -1;
            vgg(&b, x, vggs[i].cfg, name[len] != '\0');
            is_known = true;
        }
    }
    if (!is_known) fail(&b, "unknown model '%s' (mlp, cnn, " RESNETS ", " VGGS ")", name);
    if (b.has_failed) return -1;
    fuse(m);
    plan_gradients(m);
    place_tensors(m);
    return 0;
}
