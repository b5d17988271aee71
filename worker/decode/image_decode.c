/* image_decode: see image_decode.h. libpng reports errors by longjmp: decode_png keeps everything
 * that must survive one (the decoder, the row pointers) outside its locals. */
#include "image_decode.h"
#include "ddp_error.h"

#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <png.h>
#include <turbojpeg.h>

static bool is_jpeg(const uint8_t *b, size_t n) {
    return n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF;
}

static bool is_png(const uint8_t *b, size_t n) {
    return n >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0;
}

void image_decoder_init(image_decoder_t *d) {
    memset(d, 0, sizeof *d);
}

void image_decoder_free(image_decoder_t *d) {
    if (d->tj) tjDestroy(d->tj);
    free(d->pixels);
    free(d->rows);
    memset(d, 0, sizeof *d);
}

/* Room for width x height pixels of `channels` bytes. */
static int reserve(image_decoder_t *d, int width, int height, int channels, char *err,
                   size_t err_len) {
    if (width <= 0 || height <= 0 || (int64_t)width * height > IMAGE_DECODE_MAX_PIXELS)
        return ddp_errf(err, err_len, "a %dx%d image is out of bounds (at most %lld pixels)", width,
                        height, (long long)IMAGE_DECODE_MAX_PIXELS);
    size_t need = (size_t)width * (size_t)height * (size_t)channels;
    if (need <= d->capacity) return 0;
    uint8_t *p = realloc(d->pixels, need);
    if (!p) return ddp_errf(err, err_len, "out of memory for a %dx%d image", width, height);
    d->pixels = p;
    d->capacity = need;
    return 0;
}

static int jpeg_header(image_decoder_t *d, const uint8_t *bytes, size_t n, int *w, int *h,
                       int *colorspace, char *err, size_t err_len) {
    if (!d->tj && !(d->tj = tjInitDecompress()))
        return ddp_errf(err, err_len, "cannot start libjpeg-turbo: %s", tjGetErrorStr2(NULL));
    int subsamp;
    *w = *h = 0; /* a stream of tables alone "succeeds" without setting them */
    if (n > (size_t)ULONG_MAX ||
        tjDecompressHeader3(d->tj, bytes, (unsigned long)n, w, h, &subsamp, colorspace) != 0)
        return ddp_errf(err, err_len, "not a readable JPEG: %s", tjGetErrorStr2(d->tj));
    if (*w == 0 && *h == 0)
        return ddp_errf(err, err_len, "not a readable JPEG: no image in it (%zu bytes)", n);
    if (*w <= 0 || *h <= 0 || (int64_t)*w * *h > IMAGE_DECODE_MAX_PIXELS)
        return ddp_errf(err, err_len, "a %dx%d JPEG is out of bounds", *w, *h);
    return 0;
}

/* The big-endian width and height of a PNG's IHDR, which must come first. */
static int png_header(const uint8_t *b, size_t n, int *w, int *h, char *err, size_t err_len) {
    if (n < 24 || memcmp(b + 12, "IHDR", 4) != 0)
        return ddp_errf(err, err_len, "not a readable PNG: no IHDR chunk (%zu bytes)", n);
    uint32_t pw = (uint32_t)b[16] << 24 | (uint32_t)b[17] << 16 | (uint32_t)b[18] << 8 | b[19];
    uint32_t ph = (uint32_t)b[20] << 24 | (uint32_t)b[21] << 16 | (uint32_t)b[22] << 8 | b[23];
    if (pw == 0 || ph == 0 || (uint64_t)pw * ph > (uint64_t)IMAGE_DECODE_MAX_PIXELS)
        return ddp_errf(err, err_len, "a %ux%u PNG is out of bounds", pw, ph);
    *w = (int)pw;
    *h = (int)ph;
    return 0;
}

int image_decode_info(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, image_info_t *out,
                      char *err, size_t err_len) {
    int colorspace;
    if (is_jpeg(bytes, n_bytes))
        return jpeg_header(d, bytes, n_bytes, &out->width, &out->height, &colorspace, err, err_len);
    if (is_png(bytes, n_bytes))
        return png_header(bytes, n_bytes, &out->width, &out->height, err, err_len);
    return ddp_errf(err, err_len, "not a JPEG or PNG file (%zu bytes)", n_bytes);
}

/* PIL's CMYK -> RGB (Pillow 9's cmyk2rgb: c' = 255 - k - c (255 - k) / 255, rounded its way), of
 * the inverted values a CMYK JPEG holds (PIL reads them as "CMYK;I": Adobe's convention). In
 * place: pixel i's 3 bytes land at or before its 4. */
static void cmyk_to_rgb(uint8_t *p, size_t n_pixels) {
    for (size_t i = 0; i < n_pixels; i++) {
        const uint8_t *in = p + 4 * i;
        int nk = in[3]; /* 255 - K, with K = 255 - stored */
        int rgb[3];
        for (int c = 0; c < 3; c++) {
            int t = (255 - in[c]) * nk + 128;
            rgb[c] = nk - (((t >> 8) + t) >> 8);
        }
        for (int c = 0; c < 3; c++)
            p[3 * i + c] = (uint8_t)(rgb[c] < 0 ? 0 : rgb[c]);
    }
}

/* After a decode that reported trouble: whether the image is whole anyway. libjpeg's warnings
 * mean a truncated file ("Premature end of JPEG file"; PIL refuses it too) or entropy data that
 * is damaged (grey or garbled blocks, which PIL would pass on silently): errors. Bytes between
 * the image data and a marker ("Corrupt JPEG data: N extraneous bytes before marker"), which a
 * few ImageNet files have, leave every pixel intact: as PIL, decode them. TurboJPEG keeps the
 * first warning's text. */
static bool is_benign_warning(void *tj) {
    return tjGetErrorCode(tj) == TJERR_WARNING &&
           strstr(tjGetErrorStr2(tj), "extraneous bytes before marker") != NULL;
}

static int decode_jpeg(image_decoder_t *d, const uint8_t *bytes, size_t n, int min_w, int min_h,
                       int *width, int *height, char *err, size_t err_len) {
    int w, h, colorspace;
    if (jpeg_header(d, bytes, n, &w, &h, &colorspace, err, err_len) < 0) return -1;
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
    /* libjpeg converts no CMYK to RGB: those come out as CMYK and are converted here */
    bool is_cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
    if (reserve(d, best_w, best_h, is_cmyk ? 4 : 3, err, err_len) < 0) return -1;
    if (tjDecompress2(d->tj, bytes, (unsigned long)n, d->pixels, best_w, 0, best_h,
                      is_cmyk ? TJPF_CMYK : TJPF_RGB, TJFLAG_LIMITSCANS) != 0 &&
        !is_benign_warning(d->tj))
        return ddp_errf(err, err_len, "a damaged JPEG: %s", tjGetErrorStr2(d->tj));
    if (is_cmyk) cmyk_to_rgb(d->pixels, (size_t)best_w * best_h);
    *width = best_w;
    *height = best_h;
    return 0;
}

/* libpng's error and input callbacks: the message is kept, the rest unwinds by longjmp. */
typedef struct {
    const uint8_t *bytes;
    size_t n, at;
    char message[200];
} png_source_t;

static void png_on_error(png_structp png, png_const_charp msg) {
    png_source_t *src = png_get_error_ptr(png);
    snprintf(src->message, sizeof src->message, "%s", msg);
    png_longjmp(png, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg) {
    (void)png; /* benign (an unknown ancillary chunk, a bad sRGB profile): PIL decodes on too */
    (void)msg;
}

static void png_on_read(png_structp png, png_bytep out, size_t len) {
    png_source_t *src = png_get_io_ptr(png);
    if (len > src->n - src->at) png_error(png, "the file ends early");
    memcpy(out, src->bytes + src->at, len);
    src->at += len;
}

/* The pixels as PIL's convert("RGB") gives them, without its colour management: gamma chunks
 * and ICC profiles are ignored as PIL ignores them. */
static void png_rgb_transforms(png_structp png, png_infop info) {
    int color = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
    if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png); /* tRNS ignored, as PIL */
    if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
    if (depth == 16) png_set_strip_16(png); /* PIL keeps the high byte */
    png_set_strip_alpha(png); /* dropped, not composited; also what palette_to_rgb makes of tRNS */
    if (!(color & PNG_COLOR_MASK_COLOR)) png_set_gray_to_rgb(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
}

static int decode_png(image_decoder_t *d, const uint8_t *bytes, size_t n, int *width, int *height,
                      char *err, size_t err_len) {
    int w, h;
    if (png_header(bytes, n, &w, &h, err, err_len) < 0) return -1;
    png_source_t src = {.bytes = bytes, .n = n};
    png_structp png =
        png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_read_struct(&png, NULL, NULL);
        return ddp_errf(err, err_len, "out of memory starting libpng");
    }
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, NULL);
        return ddp_errf(err, err_len, "a damaged PNG: %s", src.message);
    }
    png_set_read_fn(png, &src, png_on_read);
    png_set_user_limits(png, (png_uint_32)w, (png_uint_32)h); /* IHDR as checked above */
    png_read_info(png, info);
    png_rgb_transforms(png, info);
    if (png_get_rowbytes(png, info) != (size_t)w * 3)
        png_error(png, "unexpected row size after conversion to RGB");
    char why[256];
    if (reserve(d, w, h, 3, why, sizeof why) < 0) png_error(png, why);
    if ((size_t)h > d->rows_capacity) {
        uint8_t **rows = realloc(d->rows, sizeof *rows * (size_t)h);
        if (!rows) png_error(png, "out of memory for the row pointers");
        d->rows = rows;
        d->rows_capacity = (size_t)h;
    }
    for (int y = 0; y < h; y++)
        d->rows[y] = d->pixels + (size_t)y * w * 3;
    /* the chunks after the image data are not read: PIL decodes a file cut after them too */
    png_read_image(png, d->rows);
    png_destroy_read_struct(&png, &info, NULL);
    *width = w;
    *height = h;
    return 0;
}

int image_decode(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, int min_width,
                 int min_height, int *width, int *height, char *err, size_t err_len) {
    err[0] = '\0';
    if (is_jpeg(bytes, n_bytes))
        return decode_jpeg(d, bytes, n_bytes, min_width, min_height, width, height, err, err_len);
    if (is_png(bytes, n_bytes)) return decode_png(d, bytes, n_bytes, width, height, err, err_len);
    return ddp_errf(err, err_len, "not a JPEG or PNG file (%zu bytes)", n_bytes);
}
