/* Unit tests of worker/loader/image_transform: the geometry of each transform (torchvision's
 * numbers for Resize + CenterCrop, RandomResizedCrop's constraints and its central fallback),
 * plans as pure functions of (seed, epoch, index), DCT-scaled plans, and the resampling on
 * images whose result is known (identity, flat colours, a flip, a 2:1 reduction); a Resize +
 * CenterCrop whose longer side would exceed IMAGE_PLAN_MAX_SIDE is refused. The pixels
 * against torchvision itself: tests/interop/test_transforms.py. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "image_transform.h"

Test(image_transform, resize_center_crop_has_torchvisions_numbers) {
    /* 500x375 at 224: Resize(256) gives 341x256 (int(256 * 500 / 375)); the crop's left edge is
     * round((341 - 224) / 2) = round(58.5) = 58 (Python rounds halves to even) */
    image_plan_t p = image_plan(IMAGE_RESIZE_CENTER_CROP, 500, 375, 224, 1, 2, 3);
    cr_assert(p.x == 0 && p.y == 0 && p.w == 500 && p.h == 375, "the whole image is resampled");
    cr_assert(p.out_w == 341 && p.out_h == 256, "%dx%d", p.out_w, p.out_h);
    cr_assert(p.wx == 58 && p.wy == 16, "%d,%d", p.wx, p.wy);
    cr_assert(!p.is_flipped);
    p = image_plan(IMAGE_RESIZE_CENTER_CROP, 375, 500, 224, 1, 2, 3);
    cr_assert(p.out_w == 256 && p.out_h == 341 && p.wx == 16 && p.wy == 58);
    p = image_plan(IMAGE_RESIZE_CENTER_CROP, 64, 64, 32, 0, 0, 0); /* int(32 / 0.875) = 36 */
    cr_assert(p.out_w == 36 && p.out_h == 36 && p.wx == 2 && p.wy == 2);
    p = image_plan(IMAGE_RESIZE, 500, 375, 224, 0, 0, 0);
    cr_assert(p.w == 500 && p.h == 375 && p.out_w == 224 && p.out_h == 224 && p.wx == 0 &&
              p.wy == 0);
}

/* int(256 * 9000000 / 1) does not fit an int: the plan was undefined (a black sample, or a bogus
 * out of memory). */
Test(image_transform, an_extreme_aspect_ratio_is_refused_before_it_is_planned) {
    char err[256] = "";
    cr_assert_eq(image_plan_check(IMAGE_RESIZE_CENTER_CROP, 1, 9000000, 224, err, sizeof err), -1);
    cr_assert_str_eq(err, "resizing 1x9000000 to a shorter side of 256 makes the longer one "
                          "2304000000 pixels, more than 1048576 (an extreme aspect ratio)");
    cr_assert_eq(image_plan_check(IMAGE_RESIZE_CENTER_CROP, 9000000, 1, 224, err, sizeof err), -1);
    cr_assert(strstr(err, "resizing 9000000x1"), "%s", err);
    /* the other kinds resample to size x size; ordinary photographs pass */
    cr_assert_eq(image_plan_check(IMAGE_RESIZE, 1, 9000000, 224, err, sizeof err), 0);
    cr_assert_eq(image_plan_check(IMAGE_RANDOM_RESIZED_CROP, 1, 9000000, 224, err, sizeof err), 0);
    cr_assert_eq(image_plan_check(IMAGE_RESIZE_CENTER_CROP, 500, 375, 224, err, sizeof err), 0);
    cr_assert_eq(image_plan_check(IMAGE_RESIZE_CENTER_CROP, 1, 4096, 224, err, sizeof err), 0);
    /* planned anyway, the sides stay in range (no int overflow) */
    image_plan_t p = image_plan(IMAGE_RESIZE_CENTER_CROP, 1, 9000000, 224, 0, 0, 0);
    cr_assert(p.out_w == 256 && p.out_h == IMAGE_PLAN_MAX_SIDE, "%dx%d", p.out_w, p.out_h);
    cr_assert(p.wy >= 0 && p.wy + 224 <= p.out_h);
}

Test(image_transform, random_resized_crop_keeps_torchvisions_constraints) {
    int width = 200, height = 100, flips = 0, n = 2000;
    double min_scale = 1, max_scale = 0;
    for (int i = 0; i < n; i++) {
        image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, width, height, 32, 7, 0, i);
        cr_assert(p.w == floor(p.w) && p.h == floor(p.h) && p.x == floor(p.x) && p.y == floor(p.y),
                  "whole pixels");
        cr_assert(p.x >= 0 && p.y >= 0 && p.x + p.w <= width && p.y + p.h <= height && p.w > 0 &&
                  p.h > 0);
        cr_assert(p.out_w == 32 && p.out_h == 32 && p.wx == 0 && p.wy == 0);
        double scale = p.w * p.h / (width * height), ratio = p.w / p.h;
        /* rounding w and h to pixels moves both a little past the sampled ranges */
        cr_assert(scale > 0.06 && scale <= 1, "scale %g", scale);
        cr_assert(ratio > 0.70 && ratio < 1.43, "ratio %g", ratio);
        min_scale = fmin(min_scale, scale);
        max_scale = fmax(max_scale, scale);
        flips += p.is_flipped;
    }
    cr_assert(min_scale < 0.1 && max_scale > 0.45, "scales %g..%g: the range is used", min_scale,
              max_scale);
    cr_assert(flips > 0.45 * n && flips < 0.55 * n, "%d flips of %d", flips, n);
}

Test(image_transform, random_resized_crop_falls_back_to_the_central_crop) {
    /* no 3/4..4/3 box of >= 8% of the area fits a 1000x10 strip: torchvision's fallback keeps the
     * full height and the widest allowed ratio, w = round(10 * 4/3) = 13, centred */
    for (int i = 0; i < 20; i++) {
        image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, 1000, 10, 16, 3, 1, i);
        cr_assert(p.x == 493 && p.y == 0 && p.w == 13 && p.h == 10, "%g %g %g %g", p.x, p.y, p.w,
                  p.h);
        p = image_plan(IMAGE_RANDOM_RESIZED_CROP, 10, 1000, 16, 3, 1, i);
        cr_assert(p.x == 0 && p.y == 493 && p.w == 10 && p.h == 13, "%g %g %g %g", p.x, p.y, p.w,
                  p.h);
    }
}

static bool same_plan(image_plan_t a, image_plan_t b) {
    return a.x == b.x && a.y == b.y && a.w == b.w && a.h == b.h && a.is_flipped == b.is_flipped;
}

Test(image_transform, crops_are_a_function_of_seed_epoch_and_index) {
    int differ_seed = 0, differ_epoch = 0, differ_index = 0;
    for (int i = 0; i < 100; i++) {
        image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, 320, 240, 64, 5, 2, i);
        /* the same key gives the same crop, whoever asks (no rank or world size in the key) */
        cr_assert(same_plan(p, image_plan(IMAGE_RANDOM_RESIZED_CROP, 320, 240, 64, 5, 2, i)));
        differ_seed += !same_plan(p, image_plan(IMAGE_RANDOM_RESIZED_CROP, 320, 240, 64, 6, 2, i));
        differ_epoch += !same_plan(p, image_plan(IMAGE_RANDOM_RESIZED_CROP, 320, 240, 64, 5, 3, i));
        differ_index +=
            !same_plan(p, image_plan(IMAGE_RANDOM_RESIZED_CROP, 320, 240, 64, 5, 2, i + 1));
    }
    cr_assert(differ_seed > 95 && differ_epoch > 95 && differ_index > 95, "%d %d %d", differ_seed,
              differ_epoch, differ_index);
}

Test(image_transform, a_dct_scaled_decode_gets_the_same_box_scaled) {
    image_plan_t p = {.x = 40, .y = 20, .w = 100, .h = 50, .out_w = 32, .out_h = 32};
    int min_w, min_h;
    image_plan_min_decode(&p, 400, 200, &min_w, &min_h);
    /* the box must keep >= 32 pixels each way: factor 32/50 = 0.64 */
    cr_assert(min_w == 256 && min_h == 128, "%dx%d", min_w, min_h);
    image_plan_t q = image_plan_scaled(&p, 400, 200, 300, 150);
    cr_assert(q.x == 30 && q.y == 15 && q.w == 75 && q.h == 37.5 && q.out_w == 32);
    image_plan_t up = {.x = 0, .y = 0, .w = 10, .h = 10, .out_w = 32, .out_h = 32};
    image_plan_min_decode(&up, 10, 10, &min_w, &min_h);
    cr_assert(min_w == 10 && min_h == 10, "an upscale needs the full image, no more");
}

static uint8_t *image_of(int w, int h, uint8_t (*f)(int x, int y, int c)) {
    uint8_t *p = malloc((size_t)w * h * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++)
                p[((size_t)y * w + x) * 3 + c] = f(x, y, c);
    return p;
}

static uint8_t ramp(int x, int y, int c) {
    return (uint8_t)(x * 7 + y * 3 + c * 50);
}
static uint8_t stripes(int x, int y, int c) {
    return (uint8_t)((x % 2) * 255 + 0 * y * c);
}
static uint8_t flat(int x, int y, int c) {
    return (uint8_t)(c == 0 ? 10 : c == 1 ? 128 : 250) + 0 * x * y;
}

Test(image_transform, resampling_identity_flat_flip_and_a_two_to_one_reduction) {
    image_scratch_t s = {0};
    uint8_t *img = image_of(24, 24, ramp), out[24 * 24 * 3], flipped[24 * 24 * 3];
    image_plan_t same = image_plan(IMAGE_RESIZE, 24, 24, 24, 0, 0, 0);
    cr_assert_eq(image_apply_u8(&same, img, 24, 24, 24, &s, out), 0);
    cr_assert(memcmp(out, img, sizeof out) == 0, "resizing to the same size changes nothing");
    same.is_flipped = true;
    cr_assert_eq(image_apply_u8(&same, img, 24, 24, 24, &s, flipped), 0);
    for (int y = 0; y < 24; y++)
        for (int x = 0; x < 24; x++)
            for (int c = 0; c < 3; c++)
                cr_assert_eq(flipped[(y * 24 + x) * 3 + c], img[(y * 24 + 23 - x) * 3 + c]);
    free(img);

    /* a flat colour stays that colour at any scale and crop, and normalizes per channel */
    img = image_of(77, 41, flat);
    static const float mean[3] = {0.1f, 0.5f, 0.9f}, std[3] = {0.2f, 0.25f, 0.5f};
    float norm[16 * 16 * 3];
    for (int i = 0; i < 20; i++) {
        image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, 77, 41, 16, 1, 0, i);
        cr_assert_eq(image_apply(&p, img, 77, 41, 16, mean, std, &s, norm), 0);
        for (int k = 0; k < 16 * 16 * 3; k++) {
            int c = k % 3;
            float want = ((float)flat(0, 0, c) / 255.0f - mean[c]) / std[c];
            cr_assert(fabsf(norm[k] - want) < 1e-5f, "%g vs %g", (double)norm[k], (double)want);
        }
    }
    free(img);

    /* 1-pixel stripes 0/255 halved: inside, the antialiasing filter (4 taps 1:3:3:1) averages
     * them (127.5 -> 128), where sampling without it would alias to all 0 or all 255 */
    img = image_of(32, 8, stripes);
    image_plan_t half = {.w = 32, .h = 8, .out_w = 16, .out_h = 16};
    uint8_t small[16 * 16 * 3];
    cr_assert_eq(image_apply_u8(&half, img, 32, 8, 16, &s, small), 0);
    for (int i = 3; i < 15 * 3; i++)
        cr_assert(abs(small[i] - 128) <= 1, "%d: %d", i, small[i]);
    /* at the edge the filter's taps are clamped to the image: 3 taps weighted 3:3:1 -> 109 */
    cr_assert(abs(small[0] - 109) <= 1, "%d", small[0]);
    free(img);
    image_scratch_free(&s);
}

Test(image_transform, scratch_grows_to_the_largest_request_only) {
    image_scratch_t s = {0};
    uint8_t *img = image_of(200, 150, ramp);
    float out[64 * 64 * 3];
    static const float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
    image_plan_t big = image_plan(IMAGE_RESIZE_CENTER_CROP, 200, 150, 64, 0, 0, 0);
    cr_assert_eq(image_apply(&big, img, 200, 150, 64, mean, std, &s, out), 0);
    image_scratch_t after = s;
    for (int i = 0; i < 50; i++) {
        image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, 200, 150, 64, 0, 0, i);
        if (p.w * p.h > 200 * 150 * 0.5) continue; /* smaller boxes than the first */
        cr_assert_eq(image_apply(&p, img, 200, 150, 64, mean, std, &s, out), 0);
        cr_assert(s.rows == after.rows && s.coeffs == after.coeffs && s.vcoeffs == after.vcoeffs,
                  "reallocated for a smaller request");
    }
    free(img);
    image_scratch_free(&s);
}
