/* Unit tests of worker/loader/loader on JPEG files written here: batches come back in submission
 * order with their labels, a sample's pixels depend only on (seed, epoch, index) (not on the
 * batch it is in, the rank, or the number of threads), bad files stop the batch naming the file
 * or are replaced deterministically and counted, a full ring makes submit wait for a release,
 * and destroying with batches queued neither hangs nor leaks; an image whose resize would exceed
 * IMAGE_PLAN_MAX_SIDE is an error naming it. */
#include <criterion/criterion.h>
#include <math.h>
#include <png.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "temp_dir.h"
#include "imagefolder.h"
#include "loader.h"

static char root[64];

static void setup(void) {
    temp_dir_make(root, sizeof root, "loader_test");
}

static void cleanup(void) {
    temp_dir_remove(root);
}

TestSuite(loader, .init = setup, .fini = cleanup, .timeout = 60);

/* root/train/c<label>/<i>.jpg: w x h, a ramp whose brightness says i. */
static void write_jpeg(int i, int label, int w, int h) {
    char path[512];
    snprintf(path, sizeof path, "%s/train", root);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/train/c%d", root, label);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/train/c%d/%02d.jpg", root, label, i);
    unsigned char *rgb = malloc((size_t)w * h * 3);
    for (int k = 0; k < w * h * 3; k++)
        rgb[k] = (unsigned char)(20 * i + (k / 3) % w);
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

typedef struct {
    imagefolder_t folder;
    dataset_t d;
} folder_t;

/* n files over two classes, of several sizes. */
static void make_folder(folder_t *f, int n, int size) {
    for (int i = 0; i < n; i++)
        write_jpeg(i, i % 2, 20 + 7 * i, 30 + 3 * (i % 4));
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f->folder, err, sizeof err), 0, "%s", err);
    f->d = (dataset_t){.n = f->folder.train.n,
                       .h = size,
                       .w = size,
                       .c = 3,
                       .classes = 2,
                       .labels = f->folder.train.labels,
                       .paths = f->folder.train.paths};
}

static loader_t *start(int workers, int slots, int batch, int size, bool is_skip) {
    loader_opts_t o = {.workers = workers,
                       .slots = slots,
                       .batch_max = batch,
                       .size = size,
                       .mean = {0.5f, 0.5f, 0.5f},
                       .std = {0.25f, 0.25f, 0.25f},
                       .is_skip_bad = is_skip,
                       .seed = 11};
    loader_t *l;
    char err[256];
    cr_assert_eq(loader_create(&o, &l, err, sizeof err), 0, "%s", err);
    return l;
}

#define SIZE 12
#define PER  (SIZE * SIZE * 3)

Test(loader, batches_come_back_with_their_samples_and_labels) {
    folder_t f;
    make_folder(&f, 6, SIZE);
    loader_t *l = start(3, 2, 4, SIZE, false);
    int64_t first[] = {5, 0, 3}, second[] = {1, 2};
    loader_submit(l, 7, &f.d, IMAGE_RESIZE, 0, first, 3);
    loader_submit(l, 8, &f.d, IMAGE_RESIZE, 0, second, 2);
    cr_assert(loader_has(l, 7) && loader_has(l, 8) && !loader_has(l, 9));
    loader_batch_t b;
    char err[1300];
    cr_assert_eq(loader_take(l, 8, &b, err, sizeof err), 0, "%s", err); /* any order */
    cr_assert_eq(b.n, 2);
    loader_release(l, 8);
    cr_assert_eq(loader_take(l, 7, &b, err, sizeof err), 0, "%s", err);
    cr_assert_eq(b.n, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(b.labels[i], f.d.labels[first[i]]);
        /* the top-left pixel, normalized back: file i's brightness 20 i (give or take the JPEG
         * and the resample's filter over the ramp) */
        int file = atoi(strrchr(f.d.paths[first[i]], '/') + 1);
        float v = (b.pixels[(size_t)i * PER] * 0.25f + 0.5f) * 255.0f;
        cr_assert(fabsf(v - 20.0f * file) < 12, "sample %d: %g, file %d", i, (double)v, file);
    }
    loader_release(l, 7);
    cr_assert(!loader_has(l, 7));
    cr_assert_eq(loader_take(l, 99, &b, err, sizeof err), -1);
    cr_assert(strstr(err, "never submitted"), "%s", err);
    loader_destroy(l);
    imagefolder_free(&f.folder);
}

/* Every sample of indices[0..n) in batches of `batch`, into out (n, PER). */
static void load_all(loader_t *l, const dataset_t *d, image_transform_kind_t kind, int64_t epoch,
                     const int64_t *indices, int n, int batch, float *out) {
    static uint64_t id = 1000;
    for (int at = 0; at < n; at += batch, id++) {
        int m = n - at < batch ? n - at : batch;
        loader_submit(l, id, d, kind, epoch, indices + at, m);
        loader_batch_t b;
        char err[1300];
        cr_assert_eq(loader_take(l, id, &b, err, sizeof err), 0, "%s", err);
        memcpy(out + (size_t)at * PER, b.pixels, sizeof(float) * PER * (size_t)m);
        loader_release(l, id);
    }
}

Test(loader, a_samples_crop_is_the_same_for_any_world_size_batch_and_thread_count) {
    enum { N = 8 };
    folder_t f;
    make_folder(&f, N, SIZE);
    int64_t all[N], rank0[N / 2], rank1[N / 2];
    for (int i = 0; i < N; i++)
        all[i] = i;
    for (int i = 0; i < N / 2; i++) { /* DistributedSampler's split of the same order, world 2 */
        rank0[i] = 2 * i;
        rank1[i] = 2 * i + 1;
    }
    static float one[N * PER], two[N * PER], again[N * PER], other_epoch[N * PER];
    loader_t *l = start(1, 2, N, SIZE, false);
    load_all(l, &f.d, IMAGE_RANDOM_RESIZED_CROP, 3, all, N, N, one);
    load_all(l, &f.d, IMAGE_RANDOM_RESIZED_CROP, 4, all, N, N, other_epoch);
    loader_destroy(l);
    l = start(3, 3, 3, SIZE, false);
    float half[N / 2 * PER];
    load_all(l, &f.d, IMAGE_RANDOM_RESIZED_CROP, 3, rank0, N / 2, 3, half);
    for (int i = 0; i < N / 2; i++)
        memcpy(two + (size_t)rank0[i] * PER, half + (size_t)i * PER, sizeof half / (N / 2));
    load_all(l, &f.d, IMAGE_RANDOM_RESIZED_CROP, 3, rank1, N / 2, 2, half);
    for (int i = 0; i < N / 2; i++)
        memcpy(two + (size_t)rank1[i] * PER, half + (size_t)i * PER, sizeof half / (N / 2));
    load_all(l, &f.d, IMAGE_RANDOM_RESIZED_CROP, 3, all, N, 3, again);
    loader_destroy(l);
    cr_assert(memcmp(one, two, sizeof one) == 0, "world 1 and world 2 see the same crops");
    cr_assert(memcmp(one, again, sizeof one) == 0, "and so do other batch sizes and thread counts");
    cr_assert(memcmp(one, other_epoch, sizeof one) != 0, "another epoch crops anew");
    imagefolder_free(&f.folder);
}

Test(loader, a_bad_file_stops_the_batch_naming_it_or_is_replaced_and_counted) {
    folder_t f;
    make_folder(&f, 6, SIZE);
    for (int bad = 2; bad <= 3; bad++) { /* two in a row: the replacement skips both */
        FILE *out = fopen(f.d.paths[bad], "wb");
        fputs(bad == 2 ? "damaged" : "\xff\xd8\xff\xe0 truncated", out);
        fclose(out);
    }
    loader_t *l = start(2, 2, 4, SIZE, false);
    int64_t with_bad[] = {0, 2, 4};
    loader_submit(l, 1, &f.d, IMAGE_RESIZE, 0, with_bad, 3);
    loader_batch_t b;
    char err[1300];
    cr_assert_eq(loader_take(l, 1, &b, err, sizeof err), -1);
    cr_assert(strstr(err, f.d.paths[2]) && strstr(err, "not a JPEG or PNG"), "%s", err);
    loader_release(l, 1);
    loader_destroy(l);

    l = start(2, 2, 4, SIZE, true);
    int64_t good[] = {4};
    static float want[PER];
    load_all(l, &f.d, IMAGE_RESIZE, 0, good, 1, 1, want);
    loader_submit(l, 2, &f.d, IMAGE_RESIZE, 0, with_bad, 3);
    cr_assert_eq(loader_take(l, 2, &b, err, sizeof err), 0, "%s", err);
    cr_assert_eq(b.labels[1], f.d.labels[4], "2 and 3 are bad: replaced by sample 4");
    cr_assert(memcmp(b.pixels + PER, want, sizeof want) == 0, "with sample 4's pixels");
    cr_assert_eq(loader_skipped(l), 1);
    loader_release(l, 2);
    int64_t bad_again[] = {3, 2};
    loader_submit(l, 3, &f.d, IMAGE_RESIZE, 0, bad_again, 2);
    cr_assert_eq(loader_take(l, 3, &b, err, sizeof err), 0, "%s", err);
    cr_assert(b.labels[0] == f.d.labels[4] && b.labels[1] == f.d.labels[4]);
    cr_assert_eq(loader_skipped(l), 3, "every replacement counts");
    loader_release(l, 3);
    loader_destroy(l);
    imagefolder_free(&f.folder);
}

Test(loader, a_fifo_named_like_an_image_is_an_error_not_a_hang) {
    folder_t f;
    make_folder(&f, 2, SIZE);
    char fifo[512];
    snprintf(fifo, sizeof fifo, "%s/train/c0/zz.jpg", root);
    cr_assert_eq(mkfifo(fifo, 0644), 0);
    imagefolder_free(&f.folder);
    char err[1300];
    cr_assert_eq(imagefolder_scan(root, &f.folder, err, sizeof err), 0, "%s", err);
    cr_assert_eq(f.folder.train.n, 3, "listed, as torchvision lists it");
    f.d.paths = f.folder.train.paths;
    f.d.labels = f.folder.train.labels;
    f.d.n = 3;
    loader_t *l = start(1, 1, 1, SIZE, false);
    int64_t idx[] = {1};
    cr_assert(strstr(f.d.paths[1], "zz.jpg"));
    loader_submit(l, 1, &f.d, IMAGE_RESIZE, 0, idx, 1);
    loader_batch_t b;
    cr_assert_eq(loader_take(l, 1, &b, err, sizeof err), -1);
    cr_assert(strstr(err, "zz.jpg: not a regular file"), "%s", err);
    loader_release(l, 1);
    loader_destroy(l);
    imagefolder_free(&f.folder);
}

/* A 1 x 2000000 strip at Resize(1170) + CenterCrop(1024): its longer side would become
 * 2340000000 pixels, beyond int (which the plan was cast to: a garbage sample, or a bogus out of
 * memory). */
Test(loader, an_extreme_aspect_ratio_is_an_error_naming_the_image) {
    char path[512];
    snprintf(path, sizeof path, "%s/strip.png", root);
    FILE *file = fopen(path, "wb");
    cr_assert_not_null(file);
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    cr_assert(png && info && !setjmp(png_jmpbuf(png)));
    png_init_io(png, file);
    png_set_user_limits(png, 1, 2000000); /* libpng's default stops at 1000000 */
    png_set_compression_level(png, 1);
    png_set_IHDR(png, info, 1, 2000000, 8, PNG_COLOR_TYPE_GRAY, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (int y = 0; y < 2000000; y++) {
        png_byte v = (png_byte)(y >> 13);
        png_write_row(png, &v);
    }
    png_write_end(png, info);
    png_destroy_write_struct(&png, &info);
    cr_assert_eq(fclose(file), 0);
    char *paths[1] = {path};
    int32_t labels[1] = {0};
    dataset_t d = {
        .n = 1, .h = 1024, .w = 1024, .c = 3, .classes = 2, .labels = labels, .paths = paths};
    loader_t *l = start(1, 1, 1, 1024, false);
    int64_t idx[] = {0};
    loader_submit(l, 1, &d, IMAGE_RESIZE_CENTER_CROP, 0, idx, 1);
    loader_batch_t b;
    char err[1300] = "";
    cr_assert_eq(loader_take(l, 1, &b, err, sizeof err), -1, "a 1x2000000 image was resampled");
    cr_assert(strstr(err, "strip.png: resizing 1x2000000 to a shorter side of 1170 makes the "
                          "longer one 2340000000 pixels, more than 1048576"),
              "%s", err);
    loader_release(l, 1);
    loader_destroy(l);
}

typedef struct {
    loader_t *l;
    const dataset_t *d;
    volatile int is_submitted;
} submitter_t;

static void *submit_third(void *arg) {
    submitter_t *s = arg;
    int64_t idx[] = {0};
    loader_submit(s->l, 3, s->d, IMAGE_RESIZE, 0, idx, 1);
    __atomic_store_n(&s->is_submitted, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

Test(loader, a_full_ring_makes_submit_wait_for_a_release) {
    folder_t f;
    make_folder(&f, 2, SIZE);
    loader_t *l = start(1, 2, 1, SIZE, false);
    int64_t idx[] = {1};
    loader_submit(l, 1, &f.d, IMAGE_RESIZE, 0, idx, 1);
    loader_submit(l, 2, &f.d, IMAGE_RESIZE, 0, idx, 1);
    submitter_t s = {.l = l, .d = &f.d};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, submit_third, &s), 0);
    loader_batch_t b;
    char err[1300];
    cr_assert_eq(loader_take(l, 1, &b, err, sizeof err), 0, "%s", err);
    usleep(100 * 1000);
    cr_assert_eq(__atomic_load_n(&s.is_submitted, __ATOMIC_SEQ_CST), 0, "both slots are in use");
    loader_release(l, 1);
    pthread_join(th, NULL);
    cr_assert(s.is_submitted && loader_has(l, 3));
    cr_assert_eq(loader_take(l, 3, &b, err, sizeof err), 0, "%s", err);
    cr_assert_eq(b.labels[0], f.d.labels[0]);
    loader_destroy(l); /* batch 2 done and never taken, 3 taken and not released */
    imagefolder_free(&f.folder);
}

Test(loader, destroying_with_batches_queued_neither_hangs_nor_leaks) {
    folder_t f;
    make_folder(&f, 8, 64);
    loader_t *l = start(2, 3, 8, 64, false);
    int64_t idx[] = {0, 1, 2, 3, 4, 5, 6, 7};
    for (uint64_t id = 0; id < 3; id++)
        loader_submit(l, id, &f.d, IMAGE_RANDOM_RESIZED_CROP, 0, idx, 8);
    loader_destroy(l); /* mid-epoch: the trainer leaves with decodes pending */
    imagefolder_free(&f.folder);
}
