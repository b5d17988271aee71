/* Unit tests of worker/decode/image_decode: JPEG and PNG bytes made here with libjpeg-turbo and
 * libpng decode to the pixels written (exactly for lossless cases), DCT scaling picks the
 * smallest factor that still covers the size asked, CMYK and interlaced files decode, damaged
 * or foreign bytes are errors with a message, and the buffers grow only to the largest image. */
#include <criterion/criterion.h>
#include <png.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

#include "image_decode.h"

/* A w x h JPEG of the given RGB pixels (or CMYK when pf is TJPF_CMYK); tjFree the result. */
static uint8_t *jpeg_of(const uint8_t *px, int w, int h, int pf, int subsamp, int quality,
                        size_t *n) {
    tjhandle tj = tjInitCompress();
    unsigned char *out = NULL;
    unsigned long size = 0;
    cr_assert_eq(tjCompress2(tj, px, w, 0, h, pf, &out, &size, subsamp, quality, 0), 0, "%s",
                 tjGetErrorStr2(tj));
    tjDestroy(tj);
    *n = size;
    return out;
}

/* One flat colour: JPEG keeps it within a step whatever the subsampling. */
static uint8_t *flat(int w, int h, int channels, const uint8_t *value) {
    uint8_t *p = malloc((size_t)w * h * channels);
    for (size_t i = 0; i < (size_t)w * h; i++)
        memcpy(p + i * channels, value, (size_t)channels);
    return p;
}

typedef struct {
    uint8_t *data;
    size_t n, cap;
} membuf_t;

static void on_write(png_structp png, png_bytep bytes, size_t len) {
    membuf_t *m = png_get_io_ptr(png);
    if (m->n + len > m->cap) {
        m->cap = 2 * (m->n + len);
        m->data = realloc(m->data, m->cap);
    }
    memcpy(m->data + m->n, bytes, len);
    m->n += len;
}

static void on_flush(png_structp png) {
    (void)png;
}

/* A PNG of `channels` 8-bit samples per pixel (1 grey, 2 grey+alpha, 3 RGB, 4 RGBA). */
static membuf_t png_of(uint8_t *px, int w, int h, int channels, bool is_interlaced) {
    static const int types[] = {0, PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA,
                                PNG_COLOR_TYPE_RGB, PNG_COLOR_TYPE_RGB_ALPHA};
    membuf_t m = {0};
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    cr_assert(png && info && !setjmp(png_jmpbuf(png)));
    png_set_write_fn(png, &m, on_write, on_flush);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 8, types[channels],
                 is_interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_bytep *rows = malloc(sizeof *rows * (size_t)h);
    for (int y = 0; y < h; y++)
        rows[y] = px + (size_t)y * w * channels;
    png_set_rows(png, info, rows);
    png_write_png(png, info, PNG_TRANSFORM_IDENTITY, NULL);
    png_destroy_write_struct(&png, &info);
    free(rows);
    return m;
}

static uint8_t *pattern(int w, int h, int channels) {
    uint8_t *p = malloc((size_t)w * h * channels);
    for (size_t i = 0; i < (size_t)w * h * channels; i++)
        p[i] = (uint8_t)(i * 37 + i / 7);
    return p;
}

Test(image_decode, a_jpeg_decodes_to_its_colour_at_full_size) {
    static const uint8_t rgb[3] = {200, 40, 90};
    uint8_t *px = flat(33, 17, 3, rgb);
    size_t n;
    uint8_t *jpeg = jpeg_of(px, 33, 17, TJPF_RGB, TJSAMP_420, 95, &n);
    image_decoder_t d;
    image_decoder_init(&d);
    image_info_t info;
    char err[256];
    cr_assert_eq(image_decode_info(&d, jpeg, n, &info, err, sizeof err), 0, "%s", err);
    cr_assert(info.width == 33 && info.height == 17);
    int w, h;
    cr_assert_eq(image_decode(&d, jpeg, n, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    cr_assert(w == 33 && h == 17);
    for (size_t i = 0; i < (size_t)w * h * 3; i++)
        cr_assert(abs(d.pixels[i] - rgb[i % 3]) <= 2, "pixel value %zu: %d vs %d", i, d.pixels[i],
                  rgb[i % 3]);
    image_decoder_free(&d);
    tjFree(jpeg);
    free(px);
}

Test(image_decode, a_grayscale_jpeg_comes_out_as_equal_rgb) {
    uint8_t *px = pattern(16, 16, 1);
    size_t n;
    uint8_t *jpeg = jpeg_of(px, 16, 16, TJPF_GRAY, TJSAMP_GRAY, 100, &n);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[256];
    int w, h;
    cr_assert_eq(image_decode(&d, jpeg, n, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    for (size_t i = 0; i < 16 * 16; i++) {
        cr_assert(d.pixels[3 * i] == d.pixels[3 * i + 1] && d.pixels[3 * i] == d.pixels[3 * i + 2]);
        cr_assert(abs(d.pixels[3 * i] - px[i]) <= 3, "%d vs %d", d.pixels[3 * i], px[i]);
    }
    image_decoder_free(&d);
    tjFree(jpeg);
    free(px);
}

Test(image_decode, a_cmyk_jpeg_is_converted_as_pil_does) {
    /* stored (inverted, Adobe) CMYK: PIL's C = 255 - stored; R = (255 - K)(1 - C / 255) */
    static const uint8_t stored[4] = {255 - 100, 255 - 50, 255 - 200, 255 - 30};
    uint8_t *px = flat(16, 16, 4, stored);
    size_t n;
    uint8_t *jpeg = jpeg_of(px, 16, 16, TJPF_CMYK, TJSAMP_444, 100, &n);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[256];
    int w, h;
    cr_assert_eq(image_decode(&d, jpeg, n, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    static const int want[3] = {137, 181, 49}; /* Pillow 9.4: CMYK(100, 50, 200, 30) -> RGB */
    for (int c = 0; c < 3; c++)
        cr_assert(abs(d.pixels[c] - want[c]) <= 2, "%d: %d", c, d.pixels[c]);
    image_decoder_free(&d);
    tjFree(jpeg);
    free(px);
}

Test(image_decode, dct_scaling_takes_the_smallest_factor_that_covers) {
    static const uint8_t grey[3] = {128, 128, 128};
    uint8_t *px = flat(400, 240, 3, grey);
    size_t n;
    uint8_t *jpeg = jpeg_of(px, 400, 240, TJPF_RGB, TJSAMP_420, 90, &n);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[256];
    /* asked (w, h) -> decoded: libjpeg-turbo's factors are k/8 (and larger, never used) */
    static const int cases[][4] = {
        {0, 0, 400, 240},     /* nothing asked: full size */
        {50, 30, 50, 30},     /* 1/8 exactly */
        {51, 30, 100, 60},    /* just over 1/8: 2/8 */
        {60, 100, 200, 120},  /* the height decides: 4/8 */
        {300, 1, 300, 180},   /* 6/8 */
        {399, 239, 400, 240}, /* only 8/8 covers */
        {800, 480, 400, 240}, /* more than the image: full size, never upscaled */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int w, h;
        cr_assert_eq(image_decode(&d, jpeg, n, cases[i][0], cases[i][1], &w, &h, err, sizeof err),
                     0, "%s", err);
        cr_assert(w == cases[i][2] && h == cases[i][3], "asked %dx%d, got %dx%d, want %dx%d",
                  cases[i][0], cases[i][1], w, h, cases[i][2], cases[i][3]);
        cr_assert(abs(d.pixels[(size_t)(h / 2 * w + w / 2) * 3] - 128) <= 2);
    }
    image_decoder_free(&d);
    tjFree(jpeg);
    free(px);
}

Test(image_decode, pngs_decode_exactly_alpha_dropped_grey_expanded_interlace_undone) {
    uint8_t *px = pattern(13, 9, 4);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[256];
    for (int channels = 1; channels <= 4; channels++) {
        for (int is_interlaced = 0; is_interlaced < 2; is_interlaced++) {
            membuf_t m = png_of(px, 13, 9, channels, is_interlaced);
            int w, h;
            cr_assert_eq(image_decode(&d, m.data, m.n, 5, 5, &w, &h, err, sizeof err), 0, "%s",
                         err);
            cr_assert(w == 13 && h == 9, "PNGs are decoded at full size");
            for (size_t i = 0; i < 13 * 9; i++)
                for (int c = 0; c < 3; c++) {
                    int want = px[i * channels + (channels >= 3 ? c : 0)];
                    cr_assert_eq(d.pixels[3 * i + c], want, "%d channels, interlaced %d, pixel %zu",
                                 channels, is_interlaced, i);
                }
            free(m.data);
        }
    }
    image_decoder_free(&d);
    free(px);
}

/* Decoding fails with a message containing want, and the decoder still works afterwards. */
static void refuses(image_decoder_t *d, const uint8_t *bytes, size_t n, const char *want) {
    char err[256] = "";
    int w = -1, h = -1;
    cr_assert_eq(image_decode(d, bytes, n, 0, 0, &w, &h, err, sizeof err), -1, "decoded %zu bytes",
                 n);
    cr_assert(strstr(err, want), "'%s' does not say '%s'", err, want);
}

Test(image_decode, damaged_truncated_and_foreign_bytes_are_errors) {
    uint8_t *px = pattern(64, 48, 4);
    size_t n;
    uint8_t *jpeg = jpeg_of(px, 64, 48, TJPF_RGB, TJSAMP_420, 90, &n);
    membuf_t png = png_of(px, 64, 48, 3, false);
    image_decoder_t d;
    image_decoder_init(&d);
    /* headers promising 2^16 x 2^16 pixels: refused before anything is allocated for them */
    uint8_t huge[64];
    memcpy(huge, png.data, sizeof huge);
    memcpy(huge + 16, "\x00\x01\x00\x00\x00\x01\x00\x00", 8);
    refuses(&d, huge, sizeof huge, "out of bounds");
    uint8_t *huge_jpeg = malloc(n);
    memcpy(huge_jpeg, jpeg, n);
    for (size_t i = 0; i + 8 < n; i++)
        if (huge_jpeg[i] == 0xFF && huge_jpeg[i + 1] == 0xC0) { /* SOF0: height, width at +5 */
            memcpy(huge_jpeg + i + 5, "\x50\x00\x50\x00", 4);   /* 20480^2 */
            break;
        }
    refuses(&d, huge_jpeg, n, "out of bounds");
    free(huge_jpeg);
    cr_assert_eq(d.capacity, 0, "nothing decoded yet, nothing allocated");
    refuses(&d, jpeg, n / 2, "damaged JPEG"); /* "Premature end of JPEG file" */
    refuses(&d, jpeg, 3, "not a readable JPEG");
    uint8_t *garbled = malloc(n);
    memcpy(garbled, jpeg, n);
    memset(garbled + 200, 0, 200); /* the tables: what make_jpeg_folder.py --broken does */
    refuses(&d, garbled, n, "JPEG");
    memcpy(garbled, jpeg, n);
    memcpy(garbled + n - 40, "\xff\xd0\xff\xd0\xff\xd0",
           6); /* restart markers that do not belong */
    refuses(&d, garbled, n, "damaged JPEG: Corrupt JPEG data");
    refuses(&d, png.data, png.n / 2, "damaged PNG");
    refuses(&d, png.data, 30, "damaged PNG");
    refuses(&d, png.data, 12, "not a readable PNG");
    refuses(&d, (const uint8_t *)"GIF89a....", 10, "not a JPEG or PNG file (10 bytes)");
    refuses(&d, (const uint8_t *)"", 0, "not a JPEG or PNG");
    /* still usable */
    int w, h;
    char err[256];
    cr_assert_eq(image_decode(&d, jpeg, n, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    image_decoder_free(&d);
    free(garbled);
    free(png.data);
    tjFree(jpeg);
    free(px);
}

Test(image_decode, buffers_grow_to_the_largest_image_only) {
    uint8_t *px = pattern(96, 64, 4);
    size_t n_big, n_small;
    uint8_t *big = jpeg_of(px, 96, 64, TJPF_RGB, TJSAMP_444, 90, &n_big);
    uint8_t *small = jpeg_of(px, 32, 16, TJPF_RGB, TJSAMP_444, 90, &n_small);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[256];
    int w, h;
    cr_assert_eq(image_decode(&d, big, n_big, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    uint8_t *pixels = d.pixels;
    size_t capacity = d.capacity;
    cr_assert_eq(capacity, (size_t)96 * 64 * 3);
    for (int i = 0; i < 20; i++) {
        const uint8_t *b = i % 2 ? big : small;
        cr_assert_eq(image_decode(&d, b, i % 2 ? n_big : n_small, 0, 0, &w, &h, err, sizeof err),
                     0);
        cr_assert(d.pixels == pixels && d.capacity == capacity, "reallocated at image %d", i);
    }
    image_decoder_free(&d);
    tjFree(big);
    tjFree(small);
    free(px);
}
