/* image_decode: one image file's bytes to RGB pixels as torchvision's ImageFolder gets them
 * (PIL's Image.open(...).convert("RGB")): JPEG through libjpeg-turbo's TurboJPEG API (v2 API, as
 * Debian 12's libjpeg-turbo 2.1 has; grayscale expanded, CMYK/YCCK converted with PIL's formula),
 * with DCT scaling so that a large JPEG is decoded near the size the transform needs; PNG through
 * libpng (palette and low bit depths expanded, alpha dropped as PIL drops it, 16-bit channels to
 * their high byte, no gamma applied; a 16-bit grayscale PNG, which PIL clips to 255, is scaled
 * instead). Bytes from disk are outside input: anything corrupt, truncated or unknown is an error
 * with a message, never a crash (fuzz_image_decode). A decoder belongs to one thread; its buffers
 * grow to the largest image and are then reused, so a steady stream of JPEGs allocates nothing
 * (libpng allocates its own state per PNG). */
#ifndef DDP_WORKER_IMAGE_DECODE_H
#define DDP_WORKER_IMAGE_DECODE_H

#include <stddef.h>
#include <stdint.h>

/* Refused beyond this many pixels (decompression bombs). */
#define IMAGE_DECODE_MAX_PIXELS ((int64_t)1 << 28)

typedef struct {
    void *tj;        /* tjhandle, created on first use */
    uint8_t *pixels; /* (height, width, 3) RGB of the last decode */
    size_t capacity; /* bytes at pixels (a CMYK JPEG needs 4 per pixel while it converts) */
    uint8_t **rows;  /* a PNG's row pointers into pixels */
    size_t rows_capacity;
} image_decoder_t;

typedef struct {
    int width, height; /* as stored in the file */
} image_info_t;

void image_decoder_init(image_decoder_t *d);
void image_decoder_free(image_decoder_t *d);
/* The stored size, from the header alone. Returns 0, or -1 with the reason in err. */
int image_decode_info(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, image_info_t *out,
                      char *err, size_t err_len);
/* Decode to RGB in d->pixels, *width x *height. A JPEG is decoded at the smallest of libjpeg's
 * scaling factors (1/8 .. 1) that keeps it at least min_width x min_height (0 x 0: full size);
 * other formats at full size. Returns 0, or -1 with the reason in err. */
int image_decode(image_decoder_t *d, const uint8_t *bytes, size_t n_bytes, int min_width,
                 int min_height, int *width, int *height, char *err, size_t err_len);

#endif
