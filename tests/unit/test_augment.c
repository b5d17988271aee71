/* Unit tests of worker/augment: normalization, crop with zero padding, flip, determinism. */
#include <criterion/criterion.h>
#include <string.h>

#include "augment.h"

#define H 4
#define W 5

static void image(uint8_t *img) {
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            img[y * W + x] = (uint8_t)(10 * y + x + 1);
}

static augment_t plain(void) {
    augment_t a = {.is_random = false, .padding = 0, .seed = 1};
    a.mean[0] = 0;
    a.std[0] = 1.0f / 255.0f; /* identity: out = pixel value */
    return a;
}

Test(augment, normalization_only_when_not_random) {
    uint8_t img[H * W];
    float out[H * W];
    image(img);
    augment_t a = plain();
    a.mean[0] = 0.5f;
    a.std[0] = 0.25f;
    augment_sample(&a, 0, 0, img, H, W, 1, out);
    for (int i = 0; i < H * W; i++)
        cr_assert_float_eq(out[i], (img[i] / 255.0f - 0.5f) / 0.25f, 1e-5);
}

Test(augment, crop_shift_flip_match_the_choice) {
    uint8_t img[H * W];
    float out[H * W];
    image(img);
    augment_t a = plain();
    a.is_random = true;
    a.padding = 2;
    int flips = 0, seen_dx[5] = {0};
    for (int64_t idx = 0; idx < 400; idx++) {
        augment_choice_t ch = augment_choose(&a, 3, idx);
        cr_assert(ch.dx >= -2 && ch.dx <= 2 && ch.dy >= -2 && ch.dy <= 2);
        seen_dx[ch.dx + 2]++;
        flips += ch.is_flipped;
        augment_sample(&a, 3, idx, img, H, W, 1, out);
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                int sy = y + ch.dy, sx = (ch.is_flipped ? W - 1 - x : x) + ch.dx;
                float want = sy >= 0 && sy < H && sx >= 0 && sx < W ? img[sy * W + sx] : 0;
                cr_assert_float_eq(out[y * W + x], want, 1e-3, "idx %lld y %d x %d", (long long)idx,
                                   y, x);
            }
    }
    for (int k = 0; k < 5; k++)
        cr_assert_gt(seen_dx[k], 40, "offset %d too rare", k - 2);
    cr_assert(flips > 150 && flips < 250, "flips %d of 400", flips);
}

Test(augment, same_seed_epoch_index_same_choice) {
    augment_t a = plain();
    a.is_random = true;
    a.padding = 4;
    augment_choice_t x = augment_choose(&a, 7, 123), y = augment_choose(&a, 7, 123);
    cr_assert(x.dx == y.dx && x.dy == y.dy && x.is_flipped == y.is_flipped);
    int differ = 0;
    for (int64_t i = 0; i < 50; i++) {
        augment_choice_t p = augment_choose(&a, 7, i), q = augment_choose(&a, 8, i);
        differ += p.dx != q.dx || p.dy != q.dy || p.is_flipped != q.is_flipped;
    }
    cr_assert_gt(differ, 30, "another epoch, other choices");
}
