/* Unit tests of worker/optim/lr_schedule: scaling, warm-up and every schedule's shape. */
#include <criterion/criterion.h>
#include <math.h>

#include "lr_schedule.h"

static lr_schedule_t make(schedule_t kind, lr_scaling_t scaling, double warmup_epochs, int world) {
    train_conf_t c;
    train_conf_default(&c);
    c.lr = 0.1;
    c.schedule = kind;
    c.lr_scaling = scaling;
    c.warmup_epochs = warmup_epochs;
    c.step_every_epochs = 2;
    c.step_gamma = 0.5;
    lr_schedule_t s;
    lr_schedule_init(&s, &c, world, 100, 1000); /* 100 steps per epoch, 10 epochs */
    return s;
}

Test(lr_schedule, scaling_with_world_size) {
    cr_assert_float_eq(make(SCHEDULE_CONSTANT, LR_SCALING_NONE, 0, 8).base_lr, 0.1, 1e-12);
    cr_assert_float_eq(make(SCHEDULE_CONSTANT, LR_SCALING_LINEAR, 0, 8).base_lr, 0.8, 1e-12);
    cr_assert_float_eq(make(SCHEDULE_CONSTANT, LR_SCALING_SQRT, 0, 4).base_lr, 0.2, 1e-12);
}

Test(lr_schedule, warmup_is_linear_up_to_the_base) {
    lr_schedule_t s = make(SCHEDULE_CONSTANT, LR_SCALING_NONE, 1, 1); /* 100 warm-up steps */
    cr_assert_float_eq(lr_at(&s, 0), 0.001, 1e-12);
    cr_assert_float_eq(lr_at(&s, 49), 0.05, 1e-12);
    cr_assert_float_eq(lr_at(&s, 99), 0.1, 1e-12);
    cr_assert_float_eq(lr_at(&s, 500), 0.1, 1e-12);
}

Test(lr_schedule, step_cosine_and_one_cycle_shapes) {
    lr_schedule_t st = make(SCHEDULE_STEP, LR_SCALING_NONE, 0, 1);
    cr_assert_float_eq(lr_at(&st, 199), 0.1, 1e-12);
    cr_assert_float_eq(lr_at(&st, 200), 0.05, 1e-12);
    cr_assert_float_eq(lr_at(&st, 999), 0.1 * pow(0.5, 4), 1e-12);
    lr_schedule_t co = make(SCHEDULE_COSINE, LR_SCALING_NONE, 0, 1);
    cr_assert_float_eq(lr_at(&co, 0), 0.1, 1e-12);
    cr_assert_float_eq(lr_at(&co, 500), 0.05, 1e-12);
    cr_assert_lt(lr_at(&co, 999), 1e-6);
    for (int64_t i = 1; i < 1000; i++)
        cr_assert_leq(lr_at(&co, i), lr_at(&co, i - 1));
    lr_schedule_t oc = make(SCHEDULE_ONE_CYCLE, LR_SCALING_NONE, 0, 1);
    cr_assert_eq(oc.warmup_steps, 300);
    cr_assert_lt(lr_at(&oc, 0), 0.001);
    cr_assert_float_eq(lr_at(&oc, 299), 0.1, 1e-12);
    cr_assert_lt(lr_at(&oc, 999), 1e-4);
    cr_assert_geq(lr_at(&oc, 999), 0.1 / 1e4);
}

/* A run bounded by train.hours alone has no known length (0 steps): its warm-up is kept whole
 * (it was clamped to the "length" of 1 step, so the first step ran at the full lr). */
Test(lr_schedule, a_run_of_unknown_length_keeps_its_warmup) {
    train_conf_t c;
    train_conf_default(&c);
    c.lr = 0.1;
    c.schedule = SCHEDULE_STEP;
    c.warmup_epochs = 5;
    lr_schedule_t s;
    lr_schedule_init(&s, &c, 1, 100, 0);
    cr_assert_eq(s.warmup_steps, 500);
    cr_assert_float_eq(lr_at(&s, 0), 0.1 / 500, 1e-15);
    cr_assert_float_eq(lr_at(&s, 499), 0.1, 1e-15);
}
