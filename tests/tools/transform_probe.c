/* transform_probe: one torchvision-style transform on raw RGB pixels, for the comparison with
 * torchvision (tests/interop/test_transforms.py):
 *   transform_probe IN.rgb W H OUT.rgb resize S
 *   transform_probe IN.rgb W H OUT.rgb center S          (Resize(int(S/0.875)) + CenterCrop(S))
 *   transform_probe IN.rgb W H OUT.rgb crop X Y BW BH S FLIP   (resized_crop, then a flip if 1)
 *   transform_probe IN.rgb W H OUT.txt plan SEED EPOCH INDEX S  (the random-resized-crop plan)
 * IN.rgb: H x W x 3 uint8; OUT.rgb: S x S x 3 uint8 (the resampled, rounded pixels). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_transform.h"

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: see the comment in transform_probe.c\n");
        return 2;
    }
    int w = atoi(argv[2]), h = atoi(argv[3]);
    size_t n = (size_t)w * h * 3;
    uint8_t *rgb = malloc(n);
    FILE *f = fopen(argv[1], "rb");
    if (!rgb || !f || fread(rgb, 1, n, f) != n) {
        fprintf(stderr, "transform_probe: cannot read %s\n", argv[1]);
        return 1;
    }
    fclose(f);
    const char *kind = argv[5];
    image_plan_t p;
    int size;
    if (strcmp(kind, "plan") == 0) {
        size = atoi(argv[9]);
        p = image_plan(IMAGE_RANDOM_RESIZED_CROP, w, h, size, strtoull(argv[6], NULL, 10),
                       atoll(argv[7]), atoll(argv[8]));
        FILE *o = fopen(argv[4], "w");
        fprintf(o, "%g %g %g %g %d\n", p.x, p.y, p.w, p.h, p.is_flipped);
        fclose(o);
        free(rgb);
        return 0;
    } else if (strcmp(kind, "resize") == 0 || strcmp(kind, "center") == 0) {
        size = atoi(argv[6]);
        p = image_plan(kind[0] == 'r' ? IMAGE_RESIZE : IMAGE_RESIZE_CENTER_CROP, w, h, size, 0, 0,
                       0);
    } else {
        size = atoi(argv[10]);
        p = (image_plan_t){.x = atof(argv[6]),
                           .y = atof(argv[7]),
                           .w = atof(argv[8]),
                           .h = atof(argv[9]),
                           .out_w = size,
                           .out_h = size,
                           .is_flipped = atoi(argv[11]) != 0};
    }
    uint8_t *out = malloc((size_t)size * size * 3);
    image_scratch_t s = {0};
    if (!out || image_apply_u8(&p, rgb, w, h, size, &s, out) < 0) {
        fprintf(stderr, "transform_probe: out of memory\n");
        return 1;
    }
    f = fopen(argv[4], "wb");
    fwrite(out, 1, (size_t)size * size * 3, f);
    fclose(f);
    image_scratch_free(&s);
    free(out);
    free(rgb);
    return 0;
}
