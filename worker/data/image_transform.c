/* image_transform: see image_transform.h. The resampling follows PyTorch's antialiased bilinear
 * interpolation (aten's _compute_indices_weights_aa, itself PIL's ImagingResample): for output i,
 * center = x0 + (i + 0.5) * scale, the triangle filter widened by max(scale, 1), taps clamped to
 * the box, weights normalized; horizontal pass first, in fp32, then vertical. */
#include "image_transform.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

#define RRC_ATTEMPTS 10
#define RRC_SCALE_MIN 0.08
#define RRC_SCALE_MAX 1.0
#define CENTER_CROP_FRACTION 0.875

/* A uniform double in [lo, hi). */
static double uniform(uint64_t *state, double lo, double hi) {
    return lo + (hi - lo) * ((double)(rng_next(state) >> 11) / 9007199254740992.0);
}

/* Python's round(): halves to even. */
static int round_even(double x) { return (int)nearbyint(x); }

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
    if (in_ratio < 3.0 / 4.0) h = round_even(w / (3.0 / 4.0));
    else if (in_ratio > 4.0 / 3.0) w = round_even(h * (4.0 / 3.0));
    p.y = (height - h) / 2;
    p.x = (width - w) / 2;
    p.w = w;
    p.h = h;
    p.is_flipped = rng_next(state) & 1;
    return p;
}

image_plan_t image_plan(image_transform_kind_t kind, int width, int height, int size,
                        uint64_t seed, int64_t epoch, int64_t index) {
    if (kind == IMAGE_RANDOM_RESIZED_CROP) {
        uint64_t state = rng_key(seed ^ 0x7272632dull /* "rrc-" */, (uint64_t)epoch, (uint64_t)index);
        return random_resized_crop(width, height, size, &state);
    }
    image_plan_t p = {.w = width, .h = height, .out_w = size, .out_h = size};
    if (kind == IMAGE_RESIZE_CENTER_CROP) {
        /* Resize(int(size / 0.875)) on the shorter side, the longer one truncated as torchvision's */
        int short_side = width < height ? width : height, long_side = width < height ? height : width;
        int new_short = (int)(size / CENTER_CROP_FRACTION);
        int new_long = (int)((double)new_short * long_side / short_side);
        p.out_w = width <= height ? new_short : new_long;
        p.out_h = width <= height ? new_long : new_short;
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
        for (int t = 0; t < ksize; t++) k[t] = total > 0 ? (float)(k[t] / total) : 0.0f;
        b[2 * i] = xmin;
        b[2 * i + 1] = taps;
    }
    return ksize;
}

/* The resampled, rounded window: a uint8 tensor's values after torchvision's resize (as floats). */
static int resample(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
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
    for (int y = row0; y < row1; y++) {
        const uint8_t *src = rgb + (size_t)y * width * 3;
        float *dst = rows + (size_t)(y - row0) * size * 3;
        for (int i = 0; i < size; i++) {
            const float *k = s->coeffs + (size_t)i * hk;
            int x0 = s->bounds[2 * i], taps = s->bounds[2 * i + 1];
            float acc[3] = {0, 0, 0};
            for (int t = 0; t < taps; t++)
                for (int c = 0; c < 3; c++) acc[c] += k[t] * src[(size_t)(x0 + t) * 3 + c];
            for (int c = 0; c < 3; c++) dst[i * 3 + c] = acc[c];
        }
    }
    for (int j = 0; j < size; j++) {
        const float *k = vc + (size_t)j * vk;
        int y0 = vb[2 * j], taps = vb[2 * j + 1];
        for (int i = 0; i < size * 3; i++) {
            float acc = 0;
            for (int t = 0; t < taps; t++) acc += k[t] * rows[(size_t)(y0 - row0 + t) * size * 3 + i];
            /* a uint8 tensor's resize ends rounded and clamped */
            float v = nearbyintf(acc);
            out[(size_t)j * size * 3 + i] = v < 0 ? 0 : v > 255 ? 255 : v;
        }
    }
    return 0;
}

int image_apply(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                const float mean[3], const float std[3], image_scratch_t *s, float *dst) {
    if (resample(p, rgb, width, height, size, s, dst) < 0) return -1;
    for (int y = 0; y < size; y++) {
        float *row = dst + (size_t)y * size * 3;
        if (p->is_flipped)
            for (int a = 0, b = size - 1; a < b; a++, b--)
                for (int c = 0; c < 3; c++) {
                    float t = row[a * 3 + c];
                    row[a * 3 + c] = row[b * 3 + c];
                    row[b * 3 + c] = t;
                }
        for (int x = 0; x < size; x++)
            for (int c = 0; c < 3; c++) row[x * 3 + c] = (row[x * 3 + c] / 255.0f - mean[c]) / std[c];
    }
    return 0;
}

int image_apply_u8(const image_plan_t *p, const uint8_t *rgb, int width, int height, int size,
                   image_scratch_t *s, uint8_t *dst) {
    static const float zero[3] = {0, 0, 0}, one[3] = {1, 1, 1};
    float *tmp = malloc(sizeof *tmp * (size_t)size * size * 3);
    if (!tmp) return -1;
    int rc = image_apply(p, rgb, width, height, size, zero, one, s, tmp);
    for (size_t i = 0; rc == 0 && i < (size_t)size * size * 3; i++) dst[i] = (uint8_t)nearbyintf(tmp[i] * 255.0f);
    free(tmp);
    return rc;
}

void image_scratch_free(image_scratch_t *s) {
    free(s->rows);
    free(s->coeffs);
    free(s->bounds);
    free(s->vcoeffs);
    free(s->vbounds);
    memset(s, 0, sizeof *s);
}
