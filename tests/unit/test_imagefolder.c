/* Unit tests of worker/data/imagefolder, image_decode and loader on a folder written here. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "image_decode.h"
#include "imagefolder.h"
#include "loader.h"

static char root[64];

static void setup(void) {
    strcpy(root, "/tmp/imagefolder_test_XXXXXX");
    cr_assert_not_null(mkdtemp(root));
}

static void cleanup(void) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(imagefolder, .init = setup, .fini = cleanup);

/* A w x h JPEG of one colour at root/rel. */
static void write_jpeg(const char *rel, int w, int h, unsigned char value) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0755);
            *p = '/';
        }
    unsigned char *rgb = malloc((size_t)w * h * 3);
    memset(rgb, value, (size_t)w * h * 3);
    tjhandle tj = tjInitCompress();
    unsigned char *jpeg = NULL;
    unsigned long size = 0;
    cr_assert_eq(tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &jpeg, &size, TJSAMP_444, 95, 0), 0);
    FILE *f = fopen(path, "wb");
    fwrite(jpeg, 1, size, f);
    fclose(f);
    tjFree(jpeg);
    tjDestroy(tj);
    free(rgb);
}

Test(imagefolder, classes_and_files_in_torchvisions_order) {
    write_jpeg("train/b/2.jpg", 8, 8, 10);
    write_jpeg("train/b/1.JPG", 8, 8, 10);
    write_jpeg("train/a/z/3.jpeg", 8, 8, 10);
    write_jpeg("train/a/0.png.txt", 8, 8, 10); /* not an image name: ignored */
    write_jpeg("train/a/1.jpg", 8, 8, 10);
    write_jpeg("val/b/x.jpg", 8, 8, 10);
    imagefolder_t f;
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), 0, "%s", err);
    cr_assert_eq(f.n_classes, 2);
    cr_assert_str_eq(f.classes[0], "a");
    cr_assert_eq(f.train.n, 4);
    /* class a: its own files, then its subfolder's; class b: by name */
    const char *want[] = {"train/a/1.jpg", "train/a/z/3.jpeg", "train/b/1.JPG", "train/b/2.jpg"};
    int labels[] = {0, 0, 1, 1};
    for (int i = 0; i < 4; i++) {
        cr_assert(strstr(f.train.paths[i], want[i]), "%s", f.train.paths[i]);
        cr_assert_eq(f.train.labels[i], labels[i]);
    }
    cr_assert(f.val.n == 1 && f.val.labels[0] == 1, "val/b is train's class 1 by name");
    cr_assert_eq(f.test.n, 0);
    imagefolder_free(&f);
}

Test(imagefolder, errors_name_the_folder) {
    imagefolder_t f;
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "no train/ folder"), "%s", err);
    write_jpeg("train/a/1.jpg", 8, 8, 1);
    mkdir(strcat(strcpy(err, root), "/train/empty"), 0755);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "class 'empty' has no image files"), "%s", err);
}

Test(imagefolder, dct_scaling_decodes_near_the_size_asked) {
    write_jpeg("big.jpg", 400, 240, 200);
    char path[256], err[256];
    snprintf(path, sizeof path, "%s/big.jpg", root);
    FILE *f = fopen(path, "rb");
    static uint8_t bytes[1 << 20];
    size_t n = fread(bytes, 1, sizeof bytes, f);
    fclose(f);
    image_decoder_t d;
    image_decoder_init(&d);
    int w, h;
    cr_assert_eq(image_decode(&d, bytes, n, 0, 0, &w, &h, err, sizeof err), 0, "%s", err);
    cr_assert(w == 400 && h == 240);
    cr_assert_eq(image_decode(&d, bytes, n, 60, 60, &w, &h, err, sizeof err), 0, "%s", err);
    cr_assert(w >= 60 && h >= 60 && w < 200, "%dx%d: scaled down, still covering 60x60", w, h);
    cr_assert(abs(d.pixels[0] - 200) <= 2);
    cr_assert_eq(image_decode(&d, bytes, n / 2, 0, 0, &w, &h, err, sizeof err), -1, "truncated");
    cr_assert_eq(image_decode(&d, (const uint8_t *)"GIF89a", 6, 0, 0, &w, &h, err, sizeof err), -1);
    cr_assert(strstr(err, "not a JPEG or PNG"), "%s", err);
    image_decoder_free(&d);
}

Test(imagefolder, the_loader_gives_batches_in_order_and_handles_bad_files) {
    for (int i = 0; i < 6; i++) {
        char rel[64];
        snprintf(rel, sizeof rel, "train/c%d/%d.jpg", i % 2, i);
        write_jpeg(rel, 20 + i, 30, (unsigned char)(40 * i));
    }
    imagefolder_t f;
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), 0, "%s", err);
    dataset_t d = {.n = f.train.n, .h = 8, .w = 8, .c = 3, .classes = 2, .labels = f.train.labels,
                   .paths = f.train.paths};
    loader_opts_t o = {.workers = 3, .slots = 2, .batch_max = 4, .size = 8,
                       .mean = {0, 0, 0}, .std = {1, 1, 1}, .seed = 1};
    loader_t *l;
    cr_assert_eq(loader_create(&o, &l, err, sizeof err), 0, "%s", err);
    int64_t first[] = {5, 0, 3}, second[] = {1, 2};
    loader_submit(l, 7, &d, IMAGE_RESIZE, 0, first, 3);
    loader_submit(l, 8, &d, IMAGE_RESIZE, 0, second, 2);
    loader_batch_t b;
    cr_assert_eq(loader_take(l, 7, &b, err, sizeof err), 0, "%s", err);
    cr_assert_eq(b.n, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(b.labels[i], d.labels[first[i]]);
        /* a one-colour image resizes to that colour: the pixel says which file it was */
        int file = atoi(strrchr(d.paths[first[i]], '/') + 1);
        float want = (float)(40 * file) / 255.0f;
        cr_assert(fabsf(b.pixels[(size_t)i * 8 * 8 * 3] - want) < 3.0f / 255, "%g vs %g",
                  (double)b.pixels[(size_t)i * 8 * 8 * 3], (double)want);
    }
    loader_release(l, 7);
    cr_assert_eq(loader_take(l, 8, &b, err, sizeof err), 0, "%s", err);
    loader_release(l, 8);
    /* a damaged file: an error naming it, or, with skip, the next sample that decodes */
    FILE *bad = fopen(d.paths[2], "wb");
    fputs("damaged", bad);
    fclose(bad);
    int64_t with_bad[] = {2};
    loader_submit(l, 9, &d, IMAGE_RESIZE, 0, with_bad, 1);
    cr_assert_eq(loader_take(l, 9, &b, err, sizeof err), -1);
    cr_assert(strstr(err, d.paths[2]) && strstr(err, "not a JPEG or PNG"), "%s", err);
    loader_release(l, 9);
    loader_destroy(l);
    o.is_skip_bad = true;
    cr_assert_eq(loader_create(&o, &l, err, sizeof err), 0, "%s", err);
    loader_submit(l, 1, &d, IMAGE_RESIZE, 0, with_bad, 1);
    cr_assert_eq(loader_take(l, 1, &b, err, sizeof err), 0, "%s", err);
    cr_assert_eq(b.labels[0], d.labels[3], "replaced by sample 3");
    cr_assert_eq(loader_skipped(l), 1);
    loader_release(l, 1);
    /* a batch submitted and never taken is abandoned cleanly */
    loader_submit(l, 2, &d, IMAGE_RANDOM_RESIZED_CROP, 1, first, 3);
    loader_destroy(l);
    imagefolder_free(&f);
}
