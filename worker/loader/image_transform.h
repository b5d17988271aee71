/* image_transform: torchvision's transforms on decoded RGB pixels, into a normalized fp32 sample:
 * RandomResizedCrop + RandomHorizontalFlip, Resize to a square, and Resize (shorter side) +
 * CenterCrop. Resampling is antialiased bilinear as torchvision's resize of a tensor (PyTorch's
 * separable triangle filter whose support grows with the downscale factor, PIL's algorithm), with
 * the crop taken before the resize as torchvision's resized_crop does. Random choices come from a
 * counter-based generator keyed by (seed, epoch, sample index), so a sample is transformed alike
 * for any world size and after a restart. Buffers belong to one thread and grow to the largest
 * request, then are reused. */
#ifndef DDP_WORKER_IMAGE_TRANSFORM_H
#define DDP_WORKER_IMAGE_TRANSFORM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    IMAGE_RANDOM_RESIZED_CROP, /* train: scale 0.08-1, ratio 3/4-4/3, then a flip (p = 0.5) */
    IMAGE_RESIZE,              /* to size x size, aspect not kept */
    IMAGE_RESIZE_CENTER_CROP,  /* shorter side to int(size / 0.875), then the centre size x size */
} image_transform_kind_t;

/* Which part of the image becomes the sample: the box (x, y, w, h) of the image is resampled to
 * out_w x out_h, of which the window (wx, wy, size, size) is kept; then mirrored if flipped. */
typedef struct {
    double x, y, w, h;
    int out_w, out_h;
    int wx, wy;
    bool is_flipped;
} image_plan_t;

typedef struct {
    float *rows;             /* the horizontal pass */
    float *coeffs, *vcoeffs; /* horizontal and vertical weights */
    int *bounds, *vbounds;
    float *norm; /* the normalization's scale and shift along a row */
    size_t rows_cap, coeffs_cap, bounds_cap, vcoeffs_cap, vbounds_cap, norm_cap;
} image_scratch_t;

/* The longest side an image may be resampled to before the crop: Resize + CenterCrop scales the
 * longer side with the shorter (a 1 x 9000000 image at size 224 would become 256 x 2304000000).
 * No photograph comes near it, and int's range is far above it. */
#define IMAGE_PLAN_MAX_SIDE (1 << 20)

/* Whether an image of width x height (each >= 1) can be planned for kind at size: 0, or -1 with
 * why in err ("resizing 1x9000000 to a shorter side of 256 makes the longer one 2304000000
 * pixels, more than 1048576"). image_plan's results are only meaningful after a 0. */
int image_plan_check(image_transform_kind_t kind, int width, int height, int size, char *err,
                     size_t err_len);
/* The plan for an image of width x height: a pure function of (seed, epoch, index) for the random
 * kinds. */
image_plan_t image_plan(image_transform_kind_t kind, int width, int height, int size, uint64_t seed,
                        int64_t epoch, int64_t index);
/* The same plan for the image decoded at another size (DCT scaling): the box scaled with it. */
image_plan_t image_plan_scaled(const image_plan_t *p, int width, int height, int decoded_width,
                               int decoded_height);
/* The decoded size the plan needs at least, for image_decode's DCT scaling choice. */
void image_plan_min_decode(const image_plan_t *p, int width, int height, int *min_width,
                           int *min_height);
/* Carry out p on rgb (height, width, 3) into dst (size, size, 3): resampled values rounded as a
 * uint8 tensor's, then (v / 255 - mean[c]) / std[c]. Returns 0, or -1 when out of memory. */
int image_apply(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                const float mean[3], const float std[3], image_scratch_t *s, float *dst);
/* The same into uint8 (the resampled, rounded, flipped pixels: what torchvision's uint8 pipeline
 * holds before ToTensor), for tests. */
int image_apply_u8(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                   image_scratch_t *s, uint8_t *dst);
void image_scratch_free(image_scratch_t *s);

#endif
