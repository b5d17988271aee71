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

static void teardown(void) { backend->ops->destroy(backend); }

TestSuite(model, .init = setup, .fini = teardown);

static void fill_batch(model_t *m, int n, uint64_t seed) {
    float *x = model_input(m);
    size_t per = (size_t)m->h * m->w * m->c;
    for (size_t i = 0; i < per * (size_t)n; i++)
        x[i] = (float)((double)(rng_next(&seed) >> 11) / 9007199254740992.0 * 2 - 1);
    for (int i = 0; i < n; i++) m->labels[i] = (int32_t)(rng_next(&seed) % (uint64_t)m->classes);
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
    cr_assert_eq(model_init(&m, backend, name, width, h, w, c, 4, n, err, sizeof err), 0, "%s", err);
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

Test(model, mlp_gradients) { check_model_gradients("mlp", 6, 4, 4, 1, 3, 1e-3); }
Test(model, cnn_gradients) { check_model_gradients("cnn", 3, 8, 8, 1, 4, 2e-3); }
Test(model, resnet18_gradients_through_residuals) {
    check_model_gradients("resnet18", 2, 8, 8, 3, 4, 3e-3);
}

Test(model, parameter_counts_match_the_pytorch_definitions) {
    /* torch: sum(p.numel() for p in model.parameters()) of the same definitions */
    struct { const char *name; int width, h, w, c, classes; size_t expected; } cases[] = {
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
    for (int i = 1; i < n_ready; i++) cr_assert_lt(ready[i], ready[i - 1], "report %d", i);
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
}
