/* image_transform: see image_transform.h. The resampling follows PyTorch's antialiased bilinear
 * interpolation (aten's _compute_indices_weights_aa, itself PIL's ImagingResample): for output i,
 * center = x0 + (i + 0.5) * scale, the triangle filter widened by max(scale, 1), taps clamped to
 * the box, weights normalized; horizontal pass first, in fp32, then vertical. */
#include "image_transform.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

#define RRC_ATTEMPTS         10
#define RRC_SCALE_MIN        0.08
#define RRC_SCALE_MAX        1.0
#define CENTER_CROP_FRACTION 0.875

/* A uniform double in [lo, hi). */
static double uniform(uint64_t *state, double lo, double hi) {
    return lo + (hi - lo) * ((double)(rng_next(state) >> 11) / 9007199254740992.0);
}

/* Python's round(): halves to even. */
static int round_even(double x) {
    return (int)nearbyint(x);
}

static image_plan_t random_resized_crop(int width, int height, int size, uint64_t *state) {
    image_plan_t p = {.out_w = size, .out_h = size};
    double area = (double)width * height;
    double log_lo = log(3.0 / 4.0), log_hi = log(4.0 / 3.0);
    for (int attempt = 0; attempt < RRC_ATTEMPTS; attempt++) {
        double target = area * uniform(state, RRC_SCALE_MIN, RRC_SCALE_MAX);
        double aspect = exp(uniform(state, log_lo, log_hi));
        int w = round_even(sqrt(target * aspect)), h = round_even(sqrt(target / aspect));
        if (w > 0 && w <= width && h > 0 && h <= height) {
            p.y = (double)(rng_next(state) % (uint64_t)(height - h + 1));
            p.x = (double)(rng_next(state) % (uint64_t)(width - w + 1));
            p.w = w;
            p.h = h;
            p.is_flipped = rng_next(state) & 1;
            return p;
        }
    }
    /* torchvision's fallback: the central crop of the nearest allowed aspect */
    double in_ratio = (double)width / height;
    int w = width, h = height;
    if (in_ratio < 3.0 / 4.0)
        h = round_even(w / (3.0 / 4.0));
    else if (in_ratio > 4.0 / 3.0)
        w = round_even(h * (4.0 / 3.0));
    p.y = (height - h) / 2;
    p.x = (width - w) / 2;
    p.w = w;
    p.h = h;
    p.is_flipped = rng_next(state) & 1;
    return p;
}

/* Resize's sides for an image of width x height at size: the shorter to int(size / 0.875), the
 * longer scaled with it and truncated as torchvision's (in int64: it may not fit an int). */
static void center_crop_sides(int width, int height, int size, int64_t *new_short,
                              int64_t *new_long) {
    int short_side = width < height ? width : height, long_side = width < height ? height : width;
    *new_short = (int64_t)(size / CENTER_CROP_FRACTION);
    *new_long = (int64_t)((double)*new_short * long_side / short_side);
}

int image_plan_check(image_transform_kind_t kind, int width, int height, int size, char *err,
                     size_t err_len) {
    if (kind != IMAGE_RESIZE_CENTER_CROP) return 0; /* the others resample to size x size */
    int64_t new_short, new_long;
    center_crop_sides(width, height, size, &new_short, &new_long);
    if (new_long <= IMAGE_PLAN_MAX_SIDE) return 0;
    snprintf(err, err_len,
             "resizing %dx%d to a shorter side of %lld makes the longer one %lld pixels, more than "
             "%d (an extreme aspect ratio)",
             width, height, (long long)new_short, (long long)new_long, IMAGE_PLAN_MAX_SIDE);
    return -1;
}

image_plan_t image_plan(image_transform_kind_t kind, int width, int height, int size, uint64_t seed,
                        int64_t epoch, int64_t index) {
    if (kind == IMAGE_RANDOM_RESIZED_CROP) {
        uint64_t state =
            rng_key(seed ^ 0x7272632dull /* "rrc-" */, (uint64_t)epoch, (uint64_t)index);
        return random_resized_crop(width, height, size, &state);
    }
    image_plan_t p = {.w = width, .h = height, .out_w = size, .out_h = size};
    if (kind == IMAGE_RESIZE_CENTER_CROP) {
        int64_t new_short, new_long;
        center_crop_sides(width, height, size, &new_short, &new_long);
        if (new_long > IMAGE_PLAN_MAX_SIDE)
            new_long = IMAGE_PLAN_MAX_SIDE; /* refused by the check */
        p.out_w = (int)(width <= height ? new_short : new_long);
        p.out_h = (int)(width <= height ? new_long : new_short);
        p.wx = round_even((p.out_w - size) / 2.0);
        p.wy = round_even((p.out_h - size) / 2.0);
    }
    return p;
}

image_plan_t image_plan_scaled(const image_plan_t *p, int width, int height, int decoded_width,
                               int decoded_height) {
    image_plan_t q = *p;
    double fx = (double)decoded_width / width, fy = (double)decoded_height / height;
    q.x *= fx;
    q.w *= fx;
    q.y *= fy;
    q.h *= fy;
    return q;
}

void image_plan_min_decode(const image_plan_t *p, int width, int height, int *min_width,
                           int *min_height) {
    /* the box must keep at least as many pixels as it is resampled to: never upsample more */
    double f = fmax((double)p->out_w / p->w, (double)p->out_h / p->h);
    if (f > 1) f = 1;
    *min_width = (int)ceil(width * f);
    *min_height = (int)ceil(height * f);
}

static void *grow(void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    void *q = realloc(p, need);
    if (q) *cap = need;
    return q;
}

/* Weights of outputs [first, first + n) of out_size resampled from the box [x0, x0 + len) of the
 * input, taps clamped to [lo, hi): bounds[2i] the first tap, bounds[2i+1] their count; the taps'
 * weights at coeffs[i * ksize]. Returns ksize, or -1 when out of memory. */
static int make_coeffs(double x0, double len, int out_size, int first, int n, int lo, int hi,
                       float **coeffs, size_t *coeffs_cap, int **bounds, size_t *bounds_cap) {
    double scale = len / out_size, filterscale = scale > 1 ? scale : 1;
    double support = filterscale; /* the triangle's support, 1, widened when downscaling */
    int ksize = (int)ceil(support) * 2 + 1;
    float *c = grow(*coeffs, coeffs_cap, sizeof *c * (size_t)n * ksize);
    if (!c) return -1;
    *coeffs = c;
    int *b = grow(*bounds, bounds_cap, sizeof *b * 2 * (size_t)n);
    if (!b) return -1;
    *bounds = b;
    double inv = 1.0 / filterscale;
    for (int i = 0; i < n; i++) {
        double center = x0 + (first + i + 0.5) * scale;
        int xmin = (int)floor(center - support + 0.5), xmax = (int)floor(center + support + 0.5);
        if (xmin < lo) xmin = lo;
        if (xmax > hi) xmax = hi;
        if (xmax - xmin > ksize) xmax = xmin + ksize;
        double total = 0;
        int taps = xmax - xmin;
        float *k = c + (size_t)i * ksize;
        for (int t = 0; t < ksize; t++) {
            double d = fabs((xmin + t - center + 0.5) * inv);
            k[t] = t < taps && d < 1 ? (float)(1 - d) : 0.0f;
            total += k[t];
        }
        for (int t = 0; t < ksize; t++)
            k[t] = total > 0 ? (float)(k[t] / total) : 0.0f;
        b[2 * i] = xmin;
        b[2 * i + 1] = taps;
    }
    return ksize;
}

/* Python's round() in fp32 for |v| < 2^22: adding 1.5 * 2^23 leaves no fraction bits, so the
 * FPU's round-to-nearest-even does the rounding (no libm call; exact, as -ffast-math is not on). */
static inline float round_half_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* The resampled, rounded window: a uint8 tensor's values after torchvision's resize (as floats),
 * mirrored if the plan flips; then, with norm_scale, each value v becomes v * norm_scale[i] +
 * norm_shift[i] for its position i in the row. */
static int resample(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                    const float *norm_scale, const float *norm_shift /* (size * 3), or NULL */,
                    image_scratch_t *s, float *out /* (size, size, 3) */) {
    /* taps are clamped to the box's pixels: torchvision crops before it resizes */
    int bx0 = (int)floor(p->x), bx1 = (int)ceil(p->x + p->w), by0 = (int)floor(p->y),
        by1 = (int)ceil(p->y + p->h);
    if (bx1 > width) bx1 = width;
    if (by1 > height) by1 = height;
    /* rows first: the vertical taps tell which input rows the horizontal pass must produce */
    int vk = make_coeffs(p->y, p->h, p->out_h, p->wy, size, by0, by1, &s->vcoeffs, &s->vcoeffs_cap,
                         &s->vbounds, &s->vbounds_cap);
    if (vk < 0) return -1;
    const float *vc = s->vcoeffs;
    const int *vb = s->vbounds;
    int row0 = vb[0], row1 = vb[2 * (size - 1)] + vb[2 * (size - 1) + 1];
    int hk = make_coeffs(p->x, p->w, p->out_w, p->wx, size, bx0, bx1, &s->coeffs, &s->coeffs_cap,
                         &s->bounds, &s->bounds_cap);
    float *rows = grow(s->rows, &s->rows_cap, sizeof *rows * (size_t)(row1 - row0 + 1) * size * 3);
    if (hk < 0 || !rows) return -1;
    s->rows = rows;
    size_t row_len = (size_t)size * 3;
    for (int y = row0; y < row1; y++) {
        const uint8_t *src = rgb + (size_t)y * width * 3;
        float *dst = rows + (size_t)(y - row0) * row_len;
        for (int i = 0; i < size; i++) {
            const float *k = s->coeffs + (size_t)i * hk;
            const uint8_t *in = src + (size_t)s->bounds[2 * i] * 3;
            int taps = s->bounds[2 * i + 1];
            float r = 0, g = 0, b = 0;
            for (int t = 0; t < taps; t++, in += 3) {
                r += k[t] * (float)in[0];
                g += k[t] * (float)in[1];
                b += k[t] * (float)in[2];
            }
            /* a flip mirrors the columns: done here, where each output column is written once */
            float *o = dst + (size_t)(p->is_flipped ? size - 1 - i : i) * 3;
            o[0] = r;
            o[1] = g;
            o[2] = b;
        }
    }
    /* vertical: whole rows at a time (tap outer, column inner), so the loop vectorizes; the
     * same sums in the same order as tap inner */
    for (int j = 0; j < size; j++) {
        const float *k = vc + (size_t)j * vk;
        int y0 = vb[2 * j], taps = vb[2 * j + 1];
        float *restrict o = out + (size_t)j * row_len;
        const float *restrict first = rows + (size_t)(y0 - row0) * row_len;
        for (size_t i = 0; i < row_len; i++)
            o[i] = k[0] * first[i];
        for (int t = 1; t < taps; t++) {
            const float *restrict in = rows + (size_t)(y0 - row0 + t) * row_len;
            float kt = k[t];
            for (size_t i = 0; i < row_len; i++)
                o[i] += kt * in[i];
        }
        /* a uint8 tensor's resize ends rounded and clamped */
        for (size_t i = 0; i < row_len; i++) {
            float v = round_half_even(o[i]);
            o[i] = v < 0 ? 0 : v > 255 ? 255 : v;
        }
        if (norm_scale)
            for (size_t i = 0; i < row_len; i++)
                o[i] = o[i] * norm_scale[i] + norm_shift[i];
    }
    return 0;
}

int image_apply(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                const float mean[3], const float std[3], image_scratch_t *s, float *dst) {
    /* ToTensor then Normalize, (v / 255 - mean) / std, as one multiply and one add, laid out
     * along a row (r g b r g b ...) so that the loop applying it vectorizes */
    size_t row_len = (size_t)size * 3;
    float *norm = grow(s->norm, &s->norm_cap, sizeof *norm * 2 * row_len);
    if (!norm) return -1;
    s->norm = norm;
    for (size_t i = 0; i < row_len; i++) {
        norm[i] = 1.0f / (255.0f * std[i % 3]);
        norm[row_len + i] = -mean[i % 3] / std[i % 3];
    }
    return resample(p, rgb, width, height, size, norm, norm + row_len, s, dst);
}

int image_apply_u8(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                   image_scratch_t *s, uint8_t *dst) {
    float *tmp = malloc(sizeof *tmp * (size_t)size * size * 3);
    if (!tmp) return -1;
    int rc = resample(p, rgb, width, height, size, NULL, NULL, s, tmp);
    for (size_t i = 0; rc == 0 && i < (size_t)size * size * 3; i++)
        dst[i] = (uint8_t)tmp[i];
    free(tmp);
    return rc;
}

void image_scratch_free(image_scratch_t *s) {
    free(s->rows);
    free(s->coeffs);
    free(s->bounds);
    free(s->vcoeffs);
    free(s->vbounds);
    free(s->norm);
    memset(s, 0, sizeof *s);
}
