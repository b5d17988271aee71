/* libFuzzer harness over worker/decode/image_decode: the bytes of an image file from disk (JPEG
 * through libjpeg-turbo, PNG through libpng). Checks that header parsing and decoding never crash
 * or read out of bounds, that a decoded image is within the promised bounds and fills its pixels,
 * and that the transform of what decoded works too. The first byte picks the requested minimum
 * size (DCT scaling). */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "image_decode.h"
#include "image_transform.h"

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
