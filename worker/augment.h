/* augment: one training sample from uint8 to normalized fp32, with torchvision's RandomCrop
 * (zero padding) and RandomHorizontalFlip, each choice a pure function of (seed, epoch, sample
 * index) so restarts replay identical batches. The CUDA backend implements the same function. */
#ifndef DDP_WORKER_AUGMENT_H
#define DDP_WORKER_AUGMENT_H

#include <stdbool.h>
#include <stdint.h>

#define AUGMENT_MAX_CHANNELS 4

typedef struct {
    bool is_random;  /* crop + flip; false: normalization only (evaluation) */
    int padding;     /* of the random crop */
    float mean[AUGMENT_MAX_CHANNELS], std[AUGMENT_MAX_CHANNELS]; /* on the 0..1 scale */
    uint64_t seed;
} augment_t;

typedef struct {
    int dx, dy;      /* crop offset in [-padding, padding] */
    bool is_flipped;
} augment_choice_t;

/* The random choices for one sample (dx = dy = 0 and no flip when !is_random). */
augment_choice_t augment_choose(const augment_t *a, int64_t epoch, int64_t index);
/* src: (h, w, c) uint8 NHWC; dst: (h, w, c) fp32 NHWC, (x/255 - mean) / std; c <= 4. */
void augment_sample(const augment_t *a, int64_t epoch, int64_t index, const uint8_t *src, int h,
                    int w, int c, float *dst);

#endif
