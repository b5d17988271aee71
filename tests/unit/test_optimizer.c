/* optimizer (worker/optim/optimizer.c): train.conf's optim.* reach the right backend op with
 * torch's meaning, the Adam state exists only for adam/adamw, and its step count counts taken steps
 * only and survives a set (what a resume does). */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "optimizer.h"

static backend_t *b;
static train_conf_t conf;

static void setup(void) {
    b = backend_cpu_create(1);
    train_conf_default(&conf);
}

static void teardown(void) {
    b->mem->destroy(b);
}

TestSuite(optimizer, .init = setup, .fini = teardown, .timeout = 30);

static void set(const char *key, const char *value) {
    char err[256];
    cr_assert_eq(train_conf_set(&conf, "optim", key, value, err, sizeof err), 0, "%s", err);
}

#define N 4
static const float grads[N] = {0.5f, -1.0f, 0.25f, 2.0f};

/* N parameters after `steps` steps of the configured optimizer at lr 0.1, grad_scale 0.5. */
static void run(float *params, int steps, uint64_t *taken) {
    optimizer_t o;
    cr_assert_eq(optimizer_init(&o, &conf, b, N), 0);
    float momentum[N] = {0};
    for (int i = 0; i < N; i++)
        params[i] = 1.0f - (float)i;
    for (int s = 0; s < steps; s++)
        optimizer_step(&o, params, grads, momentum, 0.1, 0.5f, NULL);
    *taken = optimizer_steps(&o);
    optimizer_free(&o);
}

Test(optimizer, sgd_is_the_backend_sgd_step_and_keeps_no_adam_state) {
    optimizer_t o;
    cr_assert_eq(optimizer_init(&o, &conf, b, N), 0);
    cr_assert(!optimizer_has_second_moment(&o) && !o.exp_avg_sq && !o.count);
    cr_assert_str_eq(optimizer_name(o.kind), "sgd");
    optimizer_free(&o);
    float got[N], want[N], m[N] = {0};
    uint64_t taken;
    run(got, 2, &taken);
    cr_assert_eq(taken, 0);
    for (int i = 0; i < N; i++)
        want[i] = 1.0f - (float)i;
    for (int s = 0; s < 2; s++)
        b->ops->sgd_step(b, want, grads, m, N, 0.1f, 0.9f, 5e-4f, false, 0.5f, NULL);
    cr_assert(!memcmp(got, want, sizeof got));
}

Test(optimizer, adam_and_adamw_read_betas_eps_and_weight_decay) {
    set("name", "adam");
    set("betas", "0.5, 0.75");
    set("eps", "0.125");
    set("weight_decay", "0.25");
    float adam[N], adamw[N];
    uint64_t taken;
    run(adam, 1, &taken);
    cr_assert_eq(taken, 1);
    /* step 1 by hand: g = 0.5 * grad + 0.25 * p; m_hat = g; v_hat = g^2; p -= 0.1 g / (|g| + eps)
     */
    for (int i = 0; i < N; i++) {
        double p = 1.0 - i, g = 0.5 * grads[i] + 0.25 * p;
        cr_assert_float_eq(adam[i], p - 0.1 * g / (fabs(g) + 0.125), 1e-6, "adam %d", i);
    }
    set("name", "adamw");
    run(adamw, 1, &taken);
    for (int i = 0; i < N; i++) {
        double p = (1.0 - i) * (1 - 0.1 * 0.25), g = 0.5 * grads[i];
        cr_assert_float_eq(adamw[i], p - 0.1 * g / (fabs(g) + 0.125), 1e-6, "adamw %d", i);
    }
}

Test(optimizer, the_step_count_counts_taken_steps_and_can_be_set) {
    set("name", "adamw");
    optimizer_t o;
    cr_assert_eq(optimizer_init(&o, &conf, b, N), 0);
    cr_assert(optimizer_has_second_moment(&o) && o.exp_avg_sq && o.count);
    for (int i = 0; i < N; i++)
        cr_assert_eq(o.exp_avg_sq[i], 0.0f, "the state starts at zero");
    float params[N] = {1, 2, 3, 4}, momentum[N] = {0};
    loss_scale_t ls = {.scale = 2.0f};
    optimizer_step(&o, params, grads, momentum, 0.1, 1.0f, &ls);
    ls.found_inf = 1;
    optimizer_step(&o, params, grads, momentum, 0.1, 1.0f, &ls);
    cr_assert_eq(optimizer_steps(&o), 1, "the skipped step is not counted");
    optimizer_set_steps(&o, 41);
    ls.found_inf = 0;
    optimizer_step(&o, params, grads, momentum, 0.1, 1.0f, &ls);
    cr_assert_eq(optimizer_steps(&o), 42);
    optimizer_free(&o);
}
