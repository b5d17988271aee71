/* loss_scale_next against torch's _amp_update_scale_ rule (GradScaler defaults: growth 2, backoff
 * 0.5): an overflow halves and restarts the count, growth_interval clean steps double, a growth
 * that would overflow fp32 is not taken, found_inf is cleared for the next step. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>

#include "loss_scale.h"

Test(loss_scale, grows_after_growth_interval_clean_steps) {
    loss_scale_t s = {.scale = 1024.0f};
    for (int i = 0; i < 2; i++)
        loss_scale_next(&s, 3);
    cr_assert_eq(s.scale, 1024.0f);
    cr_assert_eq(s.good_steps, 2);
    loss_scale_next(&s, 3);
    cr_assert_eq(s.scale, 2048.0f);
    cr_assert_eq(s.good_steps, 0, "the count restarts after a growth");
    cr_assert_eq(s.skipped_steps, 0);
}

Test(loss_scale, an_overflow_backs_off_restarts_the_count_and_clears_the_flag) {
    loss_scale_t s = {.scale = 65536.0f};
    loss_scale_next(&s, 3);
    loss_scale_next(&s, 3);
    s.found_inf = 1;
    loss_scale_next(&s, 3);
    cr_assert_eq(s.scale, 32768.0f);
    cr_assert_eq(s.good_steps, 0);
    cr_assert_eq(s.found_inf, 0);
    cr_assert_eq(s.skipped_steps, 1);
    /* two clean steps after the overflow are not enough: the count started again */
    loss_scale_next(&s, 3);
    loss_scale_next(&s, 3);
    cr_assert_eq(s.scale, 32768.0f);
    loss_scale_next(&s, 3);
    cr_assert_eq(s.scale, 65536.0f);
}

Test(loss_scale, never_grows_to_infinity) {
    loss_scale_t s = {.scale = FLT_MAX};
    loss_scale_next(&s, 1);
    cr_assert_eq(s.scale, FLT_MAX);
    cr_assert_eq(s.good_steps, 0, "torch resets the tracker even when the growth is not taken");
    cr_assert(isfinite(s.scale));
}

Test(loss_scale, interval_one_grows_every_clean_step) {
    loss_scale_t s = {.scale = 1.0f};
    for (int i = 0; i < 10; i++)
        loss_scale_next(&s, 1);
    cr_assert_eq(s.scale, 1024.0f);
    for (int i = 0; i < 4; i++) {
        s.found_inf = 1;
        loss_scale_next(&s, 1);
    }
    cr_assert_eq(s.scale, 64.0f);
    cr_assert_eq(s.skipped_steps, 4);
}
