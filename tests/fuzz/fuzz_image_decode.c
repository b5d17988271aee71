/* libFuzzer harness over worker/decode/image_decode: the bytes of an image file from disk (JPEG
 * through libjpeg-turbo, PNG through libpng). Checks that header parsing and decoding never crash
 * or read out of bounds, that a decoded image is within the promised bounds and fills its pixels,
 * and that the transform of what decoded works too. The first byte picks the requested minimum
 * size (DCT scaling). The header's dimensions also go through every transform's planning, as the
 * loader plans before it decodes: a plan that image_plan_check passes has sides in range, a window
 * inside them and a decode size within the image. */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "image_decode.h"
#include "image_transform.h"

/* The loader's planning for an image of the header's width x height, at a size from the input. */
static void plan_header(const image_info_t *info, int size, uint64_t index) {
    static const image_transform_kind_t kinds[] = {IMAGE_RANDOM_RESIZED_CROP, IMAGE_RESIZE,
                                                   IMAGE_RESIZE_CENTER_CROP};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        char err[256];
        if (image_plan_check(kinds[k], info->width, info->height, size, err, sizeof err) < 0) {
            assert(kinds[k] == IMAGE_RESIZE_CENTER_CROP && err[0]);
            continue;
        }
        image_plan_t p = image_plan(kinds[k], info->width, info->height, size, 1, 0, index);
        assert(p.out_w >= size && p.out_h >= size);
        assert(p.out_w <= IMAGE_PLAN_MAX_SIDE && p.out_h <= IMAGE_PLAN_MAX_SIDE);
        assert(p.wx >= 0 && p.wy >= 0 && p.wx + size <= p.out_w && p.wy + size <= p.out_h);
        assert(p.x >= 0 && p.y >= 0 && p.w > 0 && p.h > 0);
        assert(p.x + p.w <= info->width && p.y + p.h <= info->height);
        int min_w, min_h;
        image_plan_min_decode(&p, info->width, info->height, &min_w, &min_h);
        assert(min_w >= 1 && min_h >= 1 && min_w <= info->width && min_h <= info->height);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int min_side = data[0] % 64;
    uint8_t *bytes = malloc(size - 1 ? size - 1 : 1); /* exactly the input: ASan sees overreads */
    memcpy(bytes, data + 1, size - 1);
    static image_decoder_t d;
    static image_scratch_t s;
    char err[512];
    image_info_t info;
    if (image_decode_info(&d, bytes, size - 1, &info, err, sizeof err) == 0) {
        plan_header(&info, 8 + data[0] * 16, size); /* train.conf's image_size: 8 to 4096 */
        int w, h;
        if (image_decode(&d, bytes, size - 1, min_side, min_side, &w, &h, err, sizeof err) == 0) {
            assert(w > 0 && h > 0 && (int64_t)w * h <= IMAGE_DECODE_MAX_PIXELS);
            assert(w <= info.width && h <= info.height);
            if ((int64_t)w * h <= 1 << 20) {
                static const float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.25f, 0.25f, 0.25f};
                float out[16 * 16 * 3];
                image_plan_t p = image_plan(IMAGE_RANDOM_RESIZED_CROP, w, h, 16, 1, 0, size);
                assert(image_apply(&p, d.pixels, w, h, 16, mean, std, &s, out) == 0);
            }
        }
    }
    free(bytes);
    return 0;
}
