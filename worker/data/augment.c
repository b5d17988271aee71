/* augment: see augment.h. Output pixel (y, x) reads source (y + dy, x + dx) of the padded image,
 * mirrored in x first when flipped; pixels from the padding are 0 before normalization. */
#include "augment.h"

#include <stddef.h>

#include "rng.h"

augment_choice_t augment_choose(const augment_t *a, int64_t epoch, int64_t index) {
    augment_choice_t ch = {0, 0, false};
    if (!a->is_random) return ch;
    uint64_t state = rng_key(a->seed, (uint64_t)epoch, (uint64_t)index);
    uint64_t span = (uint64_t)(2 * a->padding + 1);
    ch.dx = (int)(rng_next(&state) % span) - a->padding;
    ch.dy = (int)(rng_next(&state) % span) - a->padding;
    ch.is_flipped = rng_next(&state) >> 63;
    return ch;
}

augment_norm_t augment_norm(const augment_t *a, int c) {
    augment_norm_t n = {{0}, {0}};
    for (int k = 0; k < c && k < AUGMENT_MAX_CHANNELS; k++) {
        n.scale[k] = 1.0f / (255.0f * a->std[k]);
        n.shift[k] = -a->mean[k] / a->std[k];
    }
    return n;
}

void augment_apply(const augment_choice_t *ch, const augment_norm_t *norm, const uint8_t *src,
                   int h, int w, int c, float *dst) {
    for (int y = 0; y < h; y++) {
        int sy = y + ch->dy;
        for (int x = 0; x < w; x++) {
            int sx = (ch->is_flipped ? w - 1 - x : x) + ch->dx;
            float *out = dst + ((int64_t)y * w + x) * c;
            bool is_inside = sy >= 0 && sy < h && sx >= 0 && sx < w;
            const uint8_t *in = is_inside ? src + ((int64_t)sy * w + sx) * c : NULL;
            /* never an FMA: this file is built with -ffp-contract=off (worker/CMakeLists.txt) */
            for (int k = 0; k < c; k++)
                out[k] = (float)(is_inside ? in[k] : 0) * norm->scale[k] + norm->shift[k];
        }
    }
}

void augment_sample(const augment_t *a, int64_t epoch, int64_t index, const uint8_t *src, int h,
                    int w, int c, float *dst) {
    augment_choice_t ch = augment_choose(a, epoch, index);
    augment_norm_t norm = augment_norm(a, c);
    augment_apply(&ch, &norm, src, h, w, c, dst);
}
