/* eval_score: one sample's evaluation as torchvision counts it. The losses are torch 1.13's
 * cross_entropy on the same logits (printed by /usr/bin/python3); the tie rule is argmax's. */
#include <criterion/criterion.h>
#include <math.h>

#include "eval_score.h"

Test(eval_score, the_loss_is_torchs_cross_entropy_with_label_smoothing) {
    const float z[3] = {1, 2, 3};
    cr_assert_float_eq(eval_score_loss(z, 3, 2, 0.0), 0.40760594606399536, 1e-6);
    /* the training criterion's smoothing: the evaluation used plain cross-entropy */
    cr_assert_float_eq(eval_score_loss(z, 3, 2, 0.1), 0.5076059103012085, 1e-6);
    cr_assert_float_eq(eval_score_loss(z, 3, 0, 0.1), 2.3076059818267822, 1e-6);
}

Test(eval_score, equal_logits_rank_by_index_as_argmax) {
    const float same[4] = {0, 0, 0, 0};
    cr_assert_eq(eval_score_rank(same, 4, 0), 0, "the first of equal maxima is argmax's");
    cr_assert_eq(eval_score_rank(same, 4, 2), 2, "a later one is not a top-1 hit");
    const float z[4] = {0.5f, 2, 1, 2};
    cr_assert_eq(eval_score_rank(z, 4, 1), 0);
    cr_assert_eq(eval_score_rank(z, 4, 3), 1);
    cr_assert_eq(eval_score_rank(z, 4, 0), 3);
}

Test(eval_score, a_nan_logit_is_never_a_hit) {
    const float z[3] = {0, NAN, 1};
    cr_assert_eq(eval_score_rank(z, 3, 2), 3);
}
