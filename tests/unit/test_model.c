/* model: the layer graph wired correctly (whole-network gradients against finite differences,
 * residual fan-out included), parameter counts equal to the PyTorch definitions, bucket callbacks
 * in arena order, clear errors for unknown names and inputs too small for a network. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "rng.h"

static backend_t *backend;

static void setup(void) {
    backend = backend_cpu_create(1);
    cr_assert_not_null(backend);
}

static void teardown(void) {
    backend->mem->destroy(backend);
}

TestSuite(model, .init = setup, .fini = teardown);

static void fill_batch(model_t *m, int n, uint64_t seed) {
    float *x = model_input(m);
    size_t per = (size_t)m->h * m->w * m->c;
    for (size_t i = 0; i < per * (size_t)n; i++)
        x[i] = (float)((double)(rng_next(&seed) >> 11) / 9007199254740992.0 * 2 - 1);
    for (int i = 0; i < n; i++)
        m->labels[i] = (int32_t)(rng_next(&seed) % (uint64_t)m->classes);
}

static double loss_of(model_t *m, int n) {
    model_forward(m, n, true);
    model_loss(m, n, 0.1f, 1.0f, NULL);
    return model_take_loss(m) / n;
}

static void check_model_gradients(const char *name, int width, int h, int w, int c, int n,
                                  double tol) {
    model_t m;
    char err[256];
    cr_assert_eq(model_init(&m, backend, name, width, h, w, c, 4, n, err, sizeof err), 0, "%s",
                 err);
    cr_assert_eq(model_init_params(&m, 7), 0);
    fill_batch(&m, n, 99);
    loss_of(&m, n);
    model_backward(&m, n, NULL, NULL);
    float *analytic = malloc(m.n_params * sizeof(float));
    memcpy(analytic, m.grads, m.n_params * sizeof(float));
    /* a spread of parameters: every layer's first and some in between */
    uint64_t pick = 5;
    int checked = 0;
    for (int l = 0; l < m.n_layers; l++) {
        const layer_t *layer = &m.layers[l];
        for (int k = 0; k < 3 && layer->n_params; k++) {
            size_t i = layer->param_offset + (k == 0 ? 0 : rng_next(&pick) % layer->n_params);
            float v = m.params[i];
            double h_step = 3e-4; /* larger steps cross ReLU/max-pool kinks in deep nets */
            m.params[i] = (float)(v + h_step);
            double up = loss_of(&m, n);
            m.params[i] = (float)(v - h_step);
            double down = loss_of(&m, n);
            m.params[i] = v;
            double numeric = (up - down) / (2 * h_step);
            cr_assert(fabs(numeric - analytic[i]) <= tol + 0.05 * fabs(numeric),
                      "%s layer %d param %zu: analytic %.6f, finite differences %.6f", name, l, i,
                      analytic[i], numeric);
            checked++;
        }
    }
    cr_assert_gt(checked, 5);
    free(analytic);
    model_free(&m);
}

Test(model, mlp_gradients) {
    check_model_gradients("mlp", 6, 4, 4, 1, 3, 1e-3);
}
Test(model, cnn_gradients) {
    check_model_gradients("cnn", 3, 8, 8, 1, 4, 2e-3);
}
Test(model, resnet18_gradients_through_residuals) {
    check_model_gradients("resnet18", 2, 8, 8, 3, 4, 3e-3);
}

/* The opts variant of check_model_gradients, over the layers from `first_layer` on, within
 * tol + rtol * |finite differences|. */
static void check_opts_gradients(const model_opts_t *o, int h, int w, int n, int first_layer,
                                 double tol, double rtol) {
    model_t m;
    char err[256];
    cr_assert_eq(model_init_opts(&m, backend, o, h, w, 3, 4, n, err, sizeof err), 0, "%s", err);
    model_set_step(&m, 3, 1, 0);
    /* gradients of all the parameters: finite differences would cross ReLU and max-pool kinks in
     * a network this deep, so check a sample as check_model_gradients does */
    cr_assert_eq(model_init_params(&m, 7), 0);
    fill_batch(&m, n, 99);
    loss_of(&m, n);
    model_backward(&m, n, NULL, NULL);
    float *analytic = malloc(m.n_params * sizeof(float));
    memcpy(analytic, m.grads, m.n_params * sizeof(float));
    uint64_t pick = 5;
    int checked = 0;
    for (int l = first_layer; l < m.n_layers; l++) {
        const layer_t *layer = &m.layers[l];
        for (int k = 0; k < 2 && layer->n_params; k++) {
            /* the first weight, and for a conv with bias its first bias */
            size_t i =
                layer->param_offset + (k == 0            ? 0
                                       : layer->has_bias ? layer->n_params - 1
                                                         : rng_next(&pick) % layer->n_params);
            float v = m.params[i];
            double h_step = 3e-4;
            m.params[i] = (float)(v + h_step);
            double up = loss_of(&m, n);
            m.params[i] = (float)(v - h_step);
            double down = loss_of(&m, n);
            m.params[i] = v;
            double numeric = (up - down) / (2 * h_step);
            cr_assert(fabs(numeric - analytic[i]) <= tol + rtol * fabs(numeric),
                      "%s layer %d (%s) param %zu: analytic %.6f, finite differences %.6f", o->name,
                      l, layer->name, i, analytic[i], numeric);
            checked++;
        }
    }
    cr_assert_gt(checked, 10);
    free(analytic);
    model_free(&m);
}

/* Bottlenecks after the ImageNet stem, coarsely: fifty layers with batch norm over a few samples
 * at initialisation are so curved that central differences of fp32 losses stray by up to ~15%,
 * and a step in the first layers straddles some ReLU or max-pool kink downstream. A wiring error (a
 * missing shortcut, a wrong stride) is off by far more; tests/interop/test_torch_reference.py
 * holds every gradient against PyTorch to 2e-3. */
Test(model, resnet50_gradients_through_bottlenecks, .timeout = 60) {
    model_opts_t o = model_opts_default("resnet50", 2);
    o.stem = MODEL_STEM_IMAGENET;
    check_opts_gradients(&o, 64, 64, 8, 60, 1e-2, 0.15); /* from layer2.3 on */
}

/* bias, batch norm, max-pools, the adaptive pool repeating a 1x1 input 49 times, dropout (the
 * same mask for the same step: a fixed function for finite differences) */
Test(model, vgg11_bn_gradients_through_dropout_and_adaptive_pool, .timeout = 60) {
    model_opts_t o = model_opts_default("vgg11_bn", 4);
    o.fc_width = 16;
    check_opts_gradients(&o, 32, 32, 3, 0, 3e-3, 0.05);
}

/* torchvision 0.14: sum(p.numel() for p in torchvision.models.NAME(num_classes=1000).parameters())
 * and the running statistics of its state_dict. */
Test(model, torchvision_parameter_counts, .timeout = 60) {
    struct {
        const char *name;
        model_stem_t stem;
        size_t params, buffers;
    } cases[] = {
        {"resnet18", MODEL_STEM_IMAGENET, 11689512, 9600},
        {"resnet50", MODEL_STEM_IMAGENET, 25557032, 53120},
        {"resnet101", MODEL_STEM_AUTO, 44549160, 105344}, /* auto: 64x64 takes the imagenet stem */
        {"resnet152", MODEL_STEM_IMAGENET, 60192808, 151424},
        {"vgg11", MODEL_STEM_AUTO, 132863336, 0},
        {"vgg11_bn", MODEL_STEM_AUTO, 132868840, 5504},
        {"vgg16", MODEL_STEM_AUTO, 138357544, 0},
        {"vgg19_bn", MODEL_STEM_AUTO, 143678248, 11008},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        model_t m;
        char err[256];
        model_opts_t o = model_opts_default(cases[i].name, 64);
        o.stem = cases[i].stem;
        cr_assert_eq(model_init_opts(&m, backend, &o, 64, 64, 3, 1000, 1, err, sizeof err), 0, "%s",
                     err);
        cr_assert_eq(m.n_params, cases[i].params, "%s: %zu parameters, torchvision has %zu",
                     cases[i].name, m.n_params, cases[i].params);
        cr_assert_eq(m.n_buffers, cases[i].buffers, "%s: %zu running statistics", cases[i].name,
                     m.n_buffers);
        model_free(&m);
    }
}

/* A few of torchvision's state_dict names, and their layers' shapes. */
Test(model, layers_carry_torchvision_names) {
    struct {
        const char *model, *layer;
        layer_kind_t kind;
        int k;
    } cases[] = {
        {"resnet50", "conv1", LAYER_CONV, 8},
        {"resnet50", "layer1.0.downsample.0", LAYER_CONV, 32},
        {"resnet50", "layer1.0.downsample.1", LAYER_BATCHNORM, 32},
        {"resnet50", "layer3.5.conv3", LAYER_CONV, 128},
        {"resnet50", "layer4.2.bn2", LAYER_BATCHNORM, 64},
        {"resnet50", "fc", LAYER_LINEAR, 10},
        {"resnet18", "layer2.0.downsample.1", LAYER_BATCHNORM, 16},
        {"vgg16_bn", "features.0", LAYER_CONV, 8},
        {"vgg16_bn", "features.1", LAYER_BATCHNORM, 8},
        {"vgg16_bn", "features.41", LAYER_BATCHNORM, 64},
        {"vgg16", "features.28", LAYER_CONV, 64},
        {"vgg16", "classifier.3", LAYER_LINEAR, 4096},
        {"vgg16", "classifier.6", LAYER_LINEAR, 10},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        model_t m;
        char err[256];
        cr_assert_eq(model_init(&m, backend, cases[i].model, 8, 64, 64, 3, 10, 1, err, sizeof err),
                     0, "%s", err);
        const layer_t *found = NULL;
        for (int l = 0; l < m.n_layers; l++)
            if (strcmp(m.layers[l].name, cases[i].layer) == 0) found = &m.layers[l];
        cr_assert_not_null(found, "%s has no layer %s", cases[i].model, cases[i].layer);
        cr_assert_eq(found->kind, cases[i].kind, "%s %s", cases[i].model, cases[i].layer);
        cr_assert_eq(m.tensors[found->out].c, cases[i].k, "%s %s: %d channels", cases[i].model,
                     cases[i].layer, m.tensors[found->out].c);
        model_free(&m);
    }
}

static int count_kind(const model_t *m, layer_kind_t kind) {
    int n = 0;
    for (int l = 0; l < m->n_layers; l++)
        n += m->layers[l].kind == kind;
    return n;
}

Test(model, stem_auto_is_imagenet_from_64_pixels) {
    struct {
        int h, w;
        model_stem_t stem;
        int pools, first_size;
    } cases[] = {
        {32, 32, MODEL_STEM_AUTO, 0, 3},     {64, 63, MODEL_STEM_AUTO, 0, 3},
        {64, 64, MODEL_STEM_AUTO, 1, 7},     {224, 224, MODEL_STEM_AUTO, 1, 7},
        {32, 32, MODEL_STEM_IMAGENET, 1, 7}, {128, 128, MODEL_STEM_CIFAR, 0, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        model_t m;
        char err[256];
        model_opts_t o = model_opts_default("resnet18", 4);
        o.stem = cases[i].stem;
        cr_assert_eq(
            model_init_opts(&m, backend, &o, cases[i].h, cases[i].w, 3, 10, 1, err, sizeof err), 0);
        cr_assert_eq(count_kind(&m, LAYER_MAXPOOL), cases[i].pools, "case %zu", i);
        cr_assert_eq(m.layers[0].conv.r, cases[i].first_size, "case %zu", i);
        cr_assert_eq(m.layers[0].conv.stride, cases[i].first_size == 7 ? 2 : 1);
        model_free(&m);
    }
}

Test(model, zero_init_residual_zeroes_each_blocks_last_bn_gamma) {
    const char *names[2] = {"resnet18", "resnet50"};
    for (int k = 0; k < 2; k++) {
        for (int zero = 0; zero < 2; zero++) {
            model_t m;
            char err[256];
            model_opts_t o = model_opts_default(names[k], 4);
            o.is_zero_init_residual = zero;
            cr_assert_eq(model_init_opts(&m, backend, &o, 32, 32, 3, 10, 1, err, sizeof err), 0);
            cr_assert_eq(model_init_params(&m, 1), 0);
            int zeroed = 0;
            for (int l = 0; l < m.n_layers; l++) {
                const layer_t *ly = &m.layers[l];
                if (ly->kind != LAYER_BATCHNORM) continue;
                const char *dot = strrchr(ly->name, '.');
                bool is_last = dot && strcmp(dot + 1, k ? "bn3" : "bn2") == 0;
                float gamma = m.params[ly->param_offset];
                cr_assert_eq(gamma, zero && is_last ? 0.0f : 1.0f, "%s %s", names[k], ly->name);
                zeroed += gamma == 0.0f;
            }
            cr_assert_eq(zeroed, zero ? (k ? 16 : 8) : 0, "%s: %d blocks zeroed", names[k], zeroed);
            model_free(&m);
        }
    }
}

/* VGG's init: normal(0, 0.01) linear weights with zero biases, zero conv biases. */
Test(model, vgg_init_follows_torchvision) {
    model_t m;
    char err[256];
    cr_assert_eq(model_init(&m, backend, "vgg11", 8, 32, 32, 3, 10, 1, err, sizeof err), 0);
    cr_assert_eq(model_init_params(&m, 2), 0);
    for (int l = 0; l < m.n_layers; l++) {
        const layer_t *ly = &m.layers[l];
        const float *p = m.params + ly->param_offset;
        if (ly->kind == LAYER_CONV) {
            for (int j = 0; j < ly->conv.k; j++)
                cr_assert_eq(p[ly->n_params - 1 - j], 0.0f, "%s bias", ly->name);
        } else if (ly->kind == LAYER_LINEAR) {
            size_t out = (size_t)m.tensors[ly->out].c, n_w = ly->n_params - out;
            double sum2 = 0;
            for (size_t j = 0; j < n_w; j++)
                sum2 += (double)p[j] * p[j];
            cr_assert(fabs(sqrt(sum2 / n_w) - 0.01) < 0.002, "%s: std %g", ly->name,
                      sqrt(sum2 / n_w));
            for (size_t j = 0; j < out; j++)
                cr_assert_eq(p[n_w + j], 0.0f);
        }
    }
    model_free(&m);
}

/* The initial values are each layer's stream drawn in order (Box-Muller from two draws per conv
 * value, one uniform draw per linear value), however the draw is split across threads: ResNet-18's
 * layers against a sequential draw here, at the CPUs this process may use. */
Test(model, initial_values_are_each_layers_stream_in_order, .timeout = 60) {
    model_t m;
    char err[256];
    uint64_t seed = 7;
    cr_assert_eq(model_init(&m, backend, "resnet18", 16, 32, 32, 3, 10, 1, err, sizeof err), 0);
    cr_assert_eq(model_init_params(&m, seed), 0);
    int checked = 0;
    for (int l = 0; l < m.n_layers; l++) {
        const layer_t *ly = &m.layers[l];
        const float *p = m.params + ly->param_offset;
        uint64_t state = rng_key(seed, 0x6d6f64656cull /* "model" */, (uint64_t)l);
        if (ly->kind == LAYER_CONV) {
            const conv_shape_t *c = &ly->conv;
            size_t n_w = (size_t)c->k * c->r * c->s * c->c;
            double std = sqrt(2.0 / ((double)c->k * c->r * c->s));
            for (size_t j = 0; j < n_w; j++) {
                double u1 = ((double)(rng_next(&state) >> 11) + 1.0) / 9007199254740993.0;
                double u2 = (double)(rng_next(&state) >> 11) / 9007199254740992.0;
                float want = (float)(std * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
                cr_assert(memcmp(&want, &p[j], sizeof want) == 0, "%s value %zu: %.9g vs %.9g",
                          ly->name, j, want, p[j]);
            }
            checked++;
        } else if (ly->kind == LAYER_LINEAR) {
            const tensor_t *x = &m.tensors[ly->in];
            double bound = 1.0 / sqrt((double)x->h * x->w * x->c);
            for (size_t j = 0; j < ly->n_params; j++) {
                double u = (double)(rng_next(&state) >> 11) / 9007199254740992.0 * 2.0 - 1.0;
                float want = (float)(u * bound);
                cr_assert(memcmp(&want, &p[j], sizeof want) == 0, "%s value %zu", ly->name, j);
            }
            checked++;
        }
    }
    cr_assert_eq(checked, 21, "20 convolutions and the classifier");
    model_free(&m);
}

/* Dropout only in training, its masks a function of (seed, step, rank): the same step replays,
 * another step or rank draws another mask. */
Test(model, dropout_masks_follow_seed_step_and_rank) {
    model_t m;
    char err[256];
    model_opts_t o = model_opts_default("vgg11", 4);
    o.fc_width = 64;
    cr_assert_eq(model_init_opts(&m, backend, &o, 32, 32, 3, 10, 4, err, sizeof err), 0, "%s", err);
    cr_assert_eq(model_init_params(&m, 1), 0);
    fill_batch(&m, 4, 5);
    float a[40], b[40], e1[40], e2[40];
    model_set_step(&m, 9, 10, 0);
    model_forward(&m, 4, true);
    memcpy(a, model_logits(&m), sizeof a);
    model_forward(&m, 4, true);
    memcpy(b, model_logits(&m), sizeof b);
    cr_assert(memcmp(a, b, sizeof a) == 0, "the same (seed, step, rank): the same masks");
    model_set_step(&m, 9, 11, 0);
    model_forward(&m, 4, true);
    cr_assert(memcmp(a, model_logits(&m), sizeof a) != 0, "another step");
    model_set_step(&m, 9, 10, 1);
    model_forward(&m, 4, true);
    cr_assert(memcmp(a, model_logits(&m), sizeof a) != 0, "another rank");
    model_forward(&m, 4, false);
    memcpy(e1, model_logits(&m), sizeof e1);
    model_set_step(&m, 1, 2, 3);
    model_forward(&m, 4, false);
    memcpy(e2, model_logits(&m), sizeof e2);
    cr_assert(memcmp(e1, e2, sizeof e1) == 0, "evaluation drops nothing");
    model_free(&m);
}

Test(model, parameter_counts_match_the_pytorch_definitions) {
    /* torch: sum(p.numel() for p in model.parameters()) of the same definitions */
    struct {
        const char *name;
        int width, h, w, c, classes;
        size_t expected;
    } cases[] = {
        {"resnet18", 64, 32, 32, 3, 10, 11173962},
        {"resnet34", 64, 32, 32, 3, 10, 21282122},
        {"cnn", 32, 28, 28, 1, 10, 288 + 64 + 18432 + 128 + 64 * 49 * 10 + 10},
        {"mlp", 100, 28, 28, 1, 10, 784 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        model_t m;
        char err[256];
        cr_assert_eq(model_init(&m, backend, cases[i].name, cases[i].width, cases[i].h, cases[i].w,
                                cases[i].c, cases[i].classes, 2, err, sizeof err),
                     0, "%s", err);
        cr_assert_eq(m.n_params, cases[i].expected, "%s: %zu parameters, expected %zu",
                     cases[i].name, m.n_params, cases[i].expected);
        model_free(&m);
    }
}

static size_t ready[256];
static int n_ready;
static void on_ready(void *arg, size_t from) {
    (void)arg;
    ready[n_ready++] = from;
}

Test(model, backward_reports_gradients_final_from_the_end_of_the_arena) {
    model_t m;
    char err[256];
    cr_assert_eq(model_init(&m, backend, "resnet18", 2, 8, 8, 3, 4, 2, err, sizeof err), 0);
    cr_assert_eq(model_init_params(&m, 1), 0);
    fill_batch(&m, 2, 1);
    loss_of(&m, 2);
    n_ready = 0;
    model_backward(&m, 2, on_ready, NULL);
    cr_assert_gt(n_ready, 10);
    cr_assert_eq(ready[n_ready - 1], 0, "the last report covers the whole arena");
    for (int i = 1; i < n_ready; i++)
        cr_assert_lt(ready[i], ready[i - 1], "report %d", i);
    model_free(&m);
}

Test(model, same_seed_same_initial_parameters) {
    model_t a, b;
    char err[256];
    cr_assert_eq(model_init(&a, backend, "cnn", 4, 8, 8, 1, 3, 2, err, sizeof err), 0);
    cr_assert_eq(model_init(&b, backend, "cnn", 4, 8, 8, 1, 3, 2, err, sizeof err), 0);
    cr_assert_eq(model_init_params(&a, 42), 0);
    cr_assert_eq(model_init_params(&b, 42), 0);
    cr_assert_eq(memcmp(a.params, b.params, a.n_params * sizeof(float)), 0);
    cr_assert_eq(model_init_params(&b, 43), 0);
    cr_assert_neq(memcmp(a.params, b.params, a.n_params * sizeof(float)), 0);
    model_free(&a);
    model_free(&b);
}

Test(model, unknown_names_and_too_small_inputs_are_clear_errors) {
    model_t m;
    char err[256];
    cr_assert_eq(model_init(&m, backend, "vgg99", 4, 8, 8, 1, 3, 2, err, sizeof err), -1);
    cr_assert(strstr(err, "unknown model 'vgg99'"), "%s", err);
    cr_assert_eq(model_init(&m, backend, "cnn", 4, 3, 3, 1, 3, 2, err, sizeof err), -1);
    cr_assert(strstr(err, "too small"), "%s", err);
    /* five 2x2 max-pools need 32 pixels */
    cr_assert_eq(model_init(&m, backend, "vgg16", 4, 31, 40, 3, 3, 2, err, sizeof err), -1);
    cr_assert(strstr(err, "too small"), "%s", err);
    cr_assert_eq(model_init(&m, backend, "vgg16_gn", 4, 32, 32, 3, 3, 2, err, sizeof err), -1);
    cr_assert(strstr(err, "unknown model 'vgg16_gn'"), "%s", err);
}

/* Fusion and the backward's plan: every batch norm that a ReLU (directly or through the residual
 * add) reads runs as one bn_act at that ReLU, the chain's inner tensors take no room, and only the
 * gradients whose first producer adds (pooling, linear) are zeroed before backward. */
Test(model, resnet_chains_fuse_and_only_adding_producers_need_zeroed_gradients) {
    struct {
        const char *name;
        model_stem_t stem;
        int fused_bn, lone_bn, fused_add, zeroed;
    } cases[] = {
        {"resnet18", MODEL_STEM_CIFAR, 17, 3, 8, 2},    /* avgpool's and fc's inputs */
        {"resnet18", MODEL_STEM_IMAGENET, 17, 3, 8, 3}, /* and the max-pool's */
        {"resnet50", MODEL_STEM_IMAGENET, 49, 4, 16, 3},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        model_t m;
        char err[256];
        model_opts_t o = model_opts_default(cases[k].name, 4);
        o.stem = cases[k].stem;
        cr_assert_eq(model_init_opts(&m, backend, &o, 32, 32, 3, 10, 2, err, sizeof err), 0, "%s",
                     err);
        int fused_bn = 0, lone_bn = 0, fused_add = 0, executors = 0, zeroed = 0;
        size_t all = 0;
        for (int l = 0; l < m.n_layers; l++) {
            const layer_t *ly = &m.layers[l];
            fused_bn += ly->kind == LAYER_BATCHNORM && ly->is_fused;
            lone_bn += ly->kind == LAYER_BATCHNORM && !ly->is_fused;
            fused_add += ly->kind == LAYER_ADD && ly->is_fused;
            if (ly->kind == LAYER_RELU && ly->bn_layer >= 0) {
                executors++;
                const layer_t *bn = &m.layers[ly->bn_layer];
                cr_assert(bn->kind == LAYER_BATCHNORM && bn->is_fused && ly->in == bn->in);
                cr_assert(ly->is_dx_written, "%s: a chain writes its input's gradient", bn->name);
                if (ly->in2 >= 0) cr_assert(ly->is_dx2_written, "%s: and its residual's", bn->name);
            }
            if (ly->kind == LAYER_CONV && l > 0)
                cr_assert_eq(ly->conv.is_dx_written, ly->is_dx_written);
        }
        for (int t = 0; t < m.n_tensors; t++) {
            all += (size_t)2 * m.tensors[t].h * m.tensors[t].w * m.tensors[t].c;
            zeroed += m.tensors[t].is_grad_zeroed;
        }
        cr_assert_eq(fused_bn, cases[k].fused_bn, "case %zu: %d fused batch norms", k, fused_bn);
        cr_assert_eq(lone_bn, cases[k].lone_bn, "case %zu", k);
        cr_assert_eq(fused_add, cases[k].fused_add, "case %zu", k);
        cr_assert_eq(executors, fused_bn, "case %zu", k);
        cr_assert_eq(zeroed, cases[k].zeroed, "case %zu: %d gradients zeroed", k, zeroed);
        cr_assert_lt(m.n_acts, all, "case %zu: the chains' inner tensors take no room", k);
        model_free(&m);
    }
}
