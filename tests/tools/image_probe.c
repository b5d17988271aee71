/* image_probe: ddpworker's image decoding and folder scan, for the comparisons with PIL and
 * torchvision's ImageFolder (tests/interop/test_image_decode.py):
 *   image_probe decode FILE OUT.rgb [MIN_W MIN_H]   prints "W H", writes H x W x 3 uint8 RGB
 *   image_probe scan ROOT      prints "class NAME" per class, then "SPLIT LABEL PATH" per file
 * Exit 0, or 1 with ddpworker's message on stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_decode.h"
#include "imagefolder.h"

static int decode(int argc, char **argv) {
    FILE *f = fopen(argv[2], "rb");
    if (!f) return fprintf(stderr, "image_probe: cannot open %s\n", argv[2]), 1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *bytes = malloc(n > 0 ? (size_t)n : 1);
    if (!bytes || fread(bytes, 1, (size_t)n, f) != (size_t)n)
        return fprintf(stderr, "image_probe: cannot read %s\n", argv[2]), 1;
    fclose(f);
    image_decoder_t d;
    image_decoder_init(&d);
    char err[512];
    int w, h, min_w = argc > 5 ? atoi(argv[4]) : 0, min_h = argc > 5 ? atoi(argv[5]) : 0;
    int rc = image_decode(&d, bytes, (size_t)n, min_w, min_h, &w, &h, err, sizeof err);
    if (rc == 0) {
        FILE *o = fopen(argv[3], "wb");
        if (!o || fwrite(d.pixels, 1, (size_t)w * h * 3, o) != (size_t)w * h * 3)
            return fprintf(stderr, "image_probe: cannot write %s\n", argv[3]), 1;
        fclose(o);
        printf("%d %d\n", w, h);
    } else {
        fprintf(stderr, "%s\n", err);
    }
    image_decoder_free(&d);
    free(bytes);
    return rc == 0 ? 0 : 1;
}

static int scan(const char *root) {
    imagefolder_t f;
    char err[1024];
    if (imagefolder_scan(root, &f, err, sizeof err) < 0) return fprintf(stderr, "%s\n", err), 1;
    for (int i = 0; i < f.n_classes; i++)
        printf("class %s\n", f.classes[i]);
    const imagefolder_split_t *splits[] = {&f.train, &f.val, &f.test};
    const char *names[] = {"train", "val", "test"};
    for (int s = 0; s < 3; s++)
        for (int64_t i = 0; i < splits[s]->n; i++)
            printf("%s %d %s\n", names[s], splits[s]->labels[i], splits[s]->paths[i]);
    imagefolder_free(&f);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "decode") == 0) return decode(argc, argv);
    if (argc == 3 && strcmp(argv[1], "scan") == 0) return scan(argv[2]);
    fprintf(stderr, "usage: image_probe decode FILE OUT.rgb [MIN_W MIN_H] | scan ROOT\n");
    return 2;
}
