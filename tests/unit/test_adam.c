/* adam (worker/nn/adam.h) through the cpu backend's adam_step, against a textbook Adam/AdamW
 * written out in double (m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), p -= lr m_hat /
 * (sqrt(v_hat) + eps)) over several steps with weight decay both ways, plus what the reference
 * cannot show: the first step is lr * sign(g), a power-of-two loss scale and grad_scale unscale
 * exactly, a skipped step (found_inf) changes nothing, the count included, and the OpenMP pass
 * gives the element-wise function's bits. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "rng.h"

#define N 1000

static uint64_t seed = 7;

static float uniform(float scale) {
    return scale * ((float)(rng_next(&seed) >> 40) / (float)(1 << 24) * 2.0f - 1.0f);
}

typedef struct {
    double p[N], m[N], v[N];
} reference_t;

static void reference_step(reference_t *r, const float *grads, double grad_scale,
                           const adam_hparams_t *h, int t) {
    for (int i = 0; i < N; i++) {
        double g = grads[i] * grad_scale;
        if (h->is_decoupled)
            r->p[i] *= 1 - h->lr * h->weight_decay;
        else
            g += h->weight_decay * r->p[i];
        r->m[i] = h->beta1 * r->m[i] + (1 - h->beta1) * g;
        r->v[i] = h->beta2 * r->v[i] + (1 - h->beta2) * g * g;
        double m_hat = r->m[i] / (1 - pow(h->beta1, t)), v_hat = r->v[i] / (1 - pow(h->beta2, t));
        r->p[i] -= h->lr * m_hat / (sqrt(v_hat) + h->eps);
    }
}

/* Five steps of fresh gradients on the cpu backend and in the reference, the lr changing as a
 * schedule would change it; every state and the count compared. */
static void against_reference(bool is_decoupled, double weight_decay) {
    backend_t *b = backend_cpu_create(1);
    static float p[N], m[N], v[N], g[N];
    static reference_t r;
    for (int i = 0; i < N; i++) {
        p[i] = uniform(1.0f);
        r.p[i] = p[i];
        r.m[i] = r.v[i] = m[i] = v[i] = 0;
    }
    adam_count_t count = {0};
    adam_hparams_t h = {.beta1 = 0.8,
                        .beta2 = 0.99,
                        .eps = 1e-6,
                        .weight_decay = weight_decay,
                        .is_decoupled = is_decoupled};
    for (int t = 1; t <= 5; t++) {
        h.lr = 0.01 / t;
        for (int i = 0; i < N; i++)
            g[i] = uniform(2.0f) * (i % 7 == 0 ? 1e-3f : 1.0f);
        b->ops->adam_step(b, p, g, m, v, N, &h, 0.5f, NULL, &count);
        reference_step(&r, g, 0.5, &h, t);
        cr_assert_eq(count.step, (uint64_t)t);
    }
    for (int i = 0; i < N; i++) {
        cr_assert(fabs(p[i] - r.p[i]) <= 2e-6 * fmax(1, fabs(r.p[i])), "param %d: %.9g, want %.9g",
                  i, p[i], r.p[i]);
        cr_assert(fabs(m[i] - r.m[i]) <= 1e-6, "m %d: %.9g, want %.9g", i, m[i], r.m[i]);
        cr_assert(fabs(v[i] - r.v[i]) <= 1e-6 * fmax(1e-6, fabs(r.v[i])), "v %d: %.9g, want %.9g",
                  i, v[i], r.v[i]);
    }
    b->mem->destroy(b);
}

Test(adam, adam_with_l2_weight_decay_matches_the_reference) {
    against_reference(false, 0.05);
}
Test(adam, adamw_with_decoupled_weight_decay_matches_the_reference) {
    against_reference(true, 0.05);
}
Test(adam, adam_without_weight_decay_matches_the_reference) {
    against_reference(false, 0.0);
}

/* The two weight decays are different things: same gradients, different parameters. */
Test(adam, l2_and_decoupled_weight_decay_differ) {
    backend_t *b = backend_cpu_create(1);
    float p[2][2] = {{1.0f, -2.0f}, {1.0f, -2.0f}}, m[2][2] = {{0}}, v[2][2] = {{0}};
    float g[2] = {0.5f, 0.25f};
    for (int k = 0; k < 2; k++) {
        adam_count_t c = {0};
        adam_hparams_t h = {.lr = 0.1,
                            .beta1 = 0.9,
                            .beta2 = 0.999,
                            .eps = 1e-8,
                            .weight_decay = 0.5,
                            .is_decoupled = k == 1};
        for (int t = 0; t < 3; t++)
            b->ops->adam_step(b, p[k], g, m[k], v[k], 2, &h, 1.0f, NULL, &c);
    }
    cr_assert(p[0][1] != p[1][1] && p[0][0] != p[1][0], "adam %g %g, adamw %g %g", p[0][0], p[0][1],
              p[1][0], p[1][1]);
    b->mem->destroy(b);
}

/* m_hat = g and v_hat = g^2 at step 1: the update is lr * g / (|g| + eps). */
Test(adam, the_first_step_moves_each_parameter_by_lr) {
    backend_t *b = backend_cpu_create(1);
    float p[3] = {0.5f, 0.5f, 0.5f}, m[3] = {0}, v[3] = {0}, g[3] = {3.0f, -0.002f, 0.0f};
    adam_count_t c = {0};
    adam_hparams_t h = {.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    b->ops->adam_step(b, p, g, m, v, 3, &h, 1.0f, NULL, &c);
    cr_assert_float_eq(p[0], 0.49f, 1e-7);
    cr_assert_float_eq(p[1], 0.51f, 1e-6);
    cr_assert_eq(p[2], 0.5f, "no gradient, no move (0 / eps)");
    cr_assert_float_eq(c.step_size, 0.1f, 1e-7); /* lr / (1 - 0.9) */
    b->mem->destroy(b);
}

Test(adam, a_power_of_two_loss_scale_unscales_exactly_and_a_skipped_step_changes_nothing) {
    backend_t *b = backend_cpu_create(1);
    float p[N], m[N], v[N], g[N], scaled[N], rp[N], rm[N], rv[N];
    for (int i = 0; i < N; i++) {
        rp[i] = p[i] = uniform(1.0f);
        rm[i] = m[i] = uniform(0.1f);
        rv[i] = v[i] = fabsf(uniform(0.01f));
        g[i] = uniform(1.0f);
        scaled[i] = g[i] * 4096.0f;
    }
    adam_hparams_t h = {.lr = 0.003,
                        .beta1 = 0.9,
                        .beta2 = 0.999,
                        .eps = 1e-8,
                        .weight_decay = 0.01,
                        .is_decoupled = true};
    adam_count_t c = {.step = 9}, rc = {.step = 9};
    loss_scale_t ls = {.scale = 4096.0f};
    /* DDP over 4 ranks: the summed gradient of 4 * g, averaged by grad_scale 1/4 */
    for (int i = 0; i < N; i++)
        scaled[i] *= 4.0f;
    b->ops->adam_step(b, rp, g, rm, rv, N, &h, 1.0f, NULL, &rc);
    b->ops->adam_step(b, p, scaled, m, v, N, &h, 0.25f, &ls, &c);
    cr_assert(!memcmp(p, rp, sizeof p) && !memcmp(m, rm, sizeof m) && !memcmp(v, rv, sizeof v),
              "unscaling by 4096 and averaging over 4 are exact");
    cr_assert_eq(c.step, 10);
    ls.found_inf = 1;
    scaled[3] = INFINITY;
    adam_count_t before = c;
    b->ops->adam_step(b, p, scaled, m, v, N, &h, 0.25f, &ls, &c);
    cr_assert(!memcmp(p, rp, sizeof p) && !memcmp(m, rm, sizeof m) && !memcmp(v, rv, sizeof v),
              "a skipped step changes no parameter and neither moment");
    cr_assert(!memcmp(&c, &before, sizeof c), "nor the step count");
    b->mem->destroy(b);
}

/* The parallel pass is the element-wise function, whatever the thread count. */
Test(adam, the_parallel_pass_gives_the_element_wise_bits) {
    backend_t *b = backend_cpu_create(4);
    size_t n = 100003;
    float *p = malloc(n * sizeof *p), *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
    float *g = malloc(n * sizeof *g), *q = malloc(n * sizeof *q), *qm = calloc(n, sizeof *qm);
    float *qv = calloc(n, sizeof *qv);
    for (size_t i = 0; i < n; i++) {
        q[i] = p[i] = uniform(1.0f);
        g[i] = uniform(1.0f);
    }
    adam_hparams_t h = {
        .lr = 0.001, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-4};
    adam_count_t c = {0}, rc = {0};
    for (int t = 0; t < 2; t++) {
        b->ops->adam_step(b, p, g, m, v, n, &h, 1.0f, NULL, &c);
        adam_count_next(&rc, &h, NULL);
        adam_scalars_t s = adam_scalars(&h);
        for (size_t i = 0; i < n; i++)
            adam_update(&q[i], &qm[i], &qv[i], g[i], &rc, &s);
    }
    cr_assert(!memcmp(p, q, n * sizeof *p) && !memcmp(m, qm, n * sizeof *m) &&
              !memcmp(v, qv, n * sizeof *v));
    free(p), free(m), free(v), free(g), free(q), free(qm), free(qv);
    b->mem->destroy(b);
}
