/* augment: one training sample from uint8 to normalized fp32, with torchvision's RandomCrop
 * (zero padding) and RandomHorizontalFlip, each choice a pure function of (seed, epoch, sample
 * index) so restarts replay identical batches. The choices are made here, on the host; applying
 * them is backend_i.augment_batch's work (the cpu backend calls augment_apply, the cuda backend's
 * kernel computes the same bits where the dataset lives). */
#ifndef DDP_WORKER_AUGMENT_H
#define DDP_WORKER_AUGMENT_H

#include <stdbool.h>
#include <stdint.h>

#define AUGMENT_MAX_CHANNELS 4

typedef struct {
    bool is_random; /* crop + flip; false: normalization only (evaluation) */
    int padding;    /* of the random crop */
    float mean[AUGMENT_MAX_CHANNELS], std[AUGMENT_MAX_CHANNELS]; /* on the 0..1 scale */
    uint64_t seed;
} augment_t;

typedef struct {
    int dx, dy; /* crop offset in [-padding, padding] */
    bool is_flipped;
} augment_choice_t;

/* One sample of a batch: which dataset sample, augmented how. */
typedef struct {
    int64_t index;
    augment_choice_t choice;
} augment_job_t;

/* Normalization as one multiply and one add per value: x * scale[k] + shift[k] for a uint8 x. */
typedef struct {
    float scale[AUGMENT_MAX_CHANNELS], shift[AUGMENT_MAX_CHANNELS];
} augment_norm_t;

/* The random choices for one sample (dx = dy = 0 and no flip when !is_random). */
augment_choice_t augment_choose(const augment_t *a, int64_t epoch, int64_t index);
/* scale = 1 / (255 std), shift = -mean / std, per channel (c <= 4). */
augment_norm_t augment_norm(const augment_t *a, int c);
/* src: (h, w, c) uint8 NHWC; dst: (h, w, c) fp32 NHWC, src shifted and mirrored by ch, normalized.
 * Each value is one rounded multiply then one rounded add (never fused), which a GPU reproduces. */
void augment_apply(const augment_choice_t *ch, const augment_norm_t *norm, const uint8_t *src,
                   int h, int w, int c, float *dst);
/* augment_choose then augment_apply: (x/255 - mean) / std of the shifted, mirrored sample. */
void augment_sample(const augment_t *a, int64_t epoch, int64_t index, const uint8_t *src, int h,
                    int w, int c, float *dst);

#endif
