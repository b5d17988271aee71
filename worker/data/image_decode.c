/* image_decode: see image_decode.h. */
#include "image_decode.h"

#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <png.h>
#include <turbojpeg.h>

static int fail(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
    return -1;
}

static bool is_jpeg(const uint8_t *b, size_t n) { return n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF; }

static bool is_png(const uint8_t *b, size_t n) {
    return n >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0;
}

void image_decoder_init(image_decoder_t *d) { memset(d, 0, sizeof *d); }

void image_decoder_free(image_decoder_t *d) {
    if (d->tj) tjDestroy(d->tj);
    free(d->pixels);
    memset(d, 0, sizeof *d);
}

static int reserve(image_decoder_t *d, int width, int height, char *err, size_t err_len) {
    if (width <= 0 || height <= 0 || (int64_t)width * height > IMAGE_DECODE_MAX_PIXELS)
        return fail(err, err_len, "a %dx%d image is out of bounds", width, height);
    size_t need = (size_t)width * (size_t)height * 3;
    if (need <= d->capacity) return 0;
    uint8_t *p = realloc(d->pixels, need);
    if (!p) return fail(err, err_len, "out of memory for a %dx%d image", width, height);
    d->pixels = p;
    d->capacity = need;
    return 0;
}

static int jpeg_header(image_decoder_t *d, const uint8_t *bytes, size_t n, int *w, int *h,
                       char *err, size_t err_len) {
    if (!d->tj && !(d->tj = tjInitDecompress()))
        return fail(err, err_len, "cannot start libjpeg-turbo: %s", tjGetErrorStr2(NULL));
    int subsamp, colorspace;
    if (n > (size_t)ULONG_MAX ||
        tjDecompressHeader3(d->tj, bytes, (unsigned long)n, w, h, &subsamp, &colorspace) != 0)
        return fail(err, err_len, "not a readable JPEG: %s", tjGetErrorStr2(d->tj));
    if (*w <= 0 || *h <= 0 || (int64_t)*w * *h > IMAGE_DECODE_MAX_PIXELS)
        return fail(err, err_len, "a %dx%d JPEG is out of bounds", *w, *h);
    return 0;
}

int image_decode_info(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, image_info_t *out,
                      char *err, size_t err_len) {
    if (is_jpeg(bytes, n_bytes))
        return jpeg_header(d, bytes, n_bytes, &out->width, &out->height, err, err_len);
    if (is_png(bytes, n_bytes)) {
        png_image img = {.version = PNG_IMAGE_VERSION};
        if (!png_image_begin_read_from_memory(&img, bytes, n_bytes))
            return fail(err, err_len, "not a readable PNG: %s", img.message);
        out->width = (int)img.width;
        out->height = (int)img.height;
        png_image_free(&img);
        return 0;
    }
    return fail(err, err_len, "not a JPEG or PNG file (%zu bytes)", n_bytes);
}

static int decode_jpeg(image_decoder_t *d, const uint8_t *bytes, size_t n, int min_w, int min_h,
                       int *width, int *height, char *err, size_t err_len) {
    int w, h;
    if (jpeg_header(d, bytes, n, &w, &h, err, err_len) < 0) return -1;
    /* the smallest scaling factor that still covers what the transform needs */
    int n_factors = 0;
    tjscalingfactor *factors = tjGetScalingFactors(&n_factors);
    int best_w = w, best_h = h;
    for (int i = 0; factors && (min_w > 0 || min_h > 0) && i < n_factors; i++) {
        if (factors[i].num > factors[i].denom) continue; /* upscaling is the resize's work */
        int sw = TJSCALED(w, factors[i]), sh = TJSCALED(h, factors[i]);
        if (sw >= min_w && sh >= min_h && (int64_t)sw * sh < (int64_t)best_w * best_h) {
            best_w = sw;
            best_h = sh;
        }
    }
    if (reserve(d, best_w, best_h, err, err_len) < 0) return -1;
    /* TJFLAG_STOPONWARNING: a truncated or damaged file is an error, not a grey half image */
    if (tjDecompress2(d->tj, bytes, (unsigned long)n, d->pixels, best_w, 0, best_h, TJPF_RGB,
                      TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS) != 0)
        return fail(err, err_len, "a damaged JPEG: %s", tjGetErrorStr2(d->tj));
    *width = best_w;
    *height = best_h;
    return 0;
}

static int decode_png(image_decoder_t *d, const uint8_t *bytes, size_t n, int *width, int *height,
                      char *err, size_t err_len) {
    png_image img = {.version = PNG_IMAGE_VERSION};
    if (!png_image_begin_read_from_memory(&img, bytes, n))
        return fail(err, err_len, "not a readable PNG: %s", img.message);
    img.format = PNG_FORMAT_RGB; /* grey expanded, alpha composited over black, 16 bit reduced */
    if (reserve(d, (int)img.width, (int)img.height, err, err_len) < 0) {
        png_image_free(&img);
        return -1;
    }
    if (!png_image_finish_read(&img, NULL, d->pixels, 0, NULL)) {
        fail(err, err_len, "a damaged PNG: %s", img.message);
        png_image_free(&img);
        return -1;
    }
    *width = (int)img.width;
    *height = (int)img.height;
    return 0;
}

int image_decode(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, int min_width,
                 int min_height, int *width, int *height, char *err, size_t err_len) {
    err[0] = '\0';
    if (is_jpeg(bytes, n_bytes))
        return decode_jpeg(d, bytes, n_bytes, min_width, min_height, width, height, err, err_len);
    if (is_png(bytes, n_bytes)) return decode_png(d, bytes, n_bytes, width, height, err, err_len);
    return fail(err, err_len, "not a JPEG or PNG file (%zu bytes)", n_bytes);
}
