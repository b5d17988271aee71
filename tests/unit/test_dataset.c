/* Unit tests of worker/data/dataset: the held-out validation split (data.val_split) is a pure
 * function of the sample count, disjoint from what is trained on and in the original order; int32
 * labels carry 1000 classes without wrapping; an IDX test split of another shape than train's is
 * refused naming both files; synthetic sizes are checked before anything is generated. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dataset.h"
#include "temp_dir.h"

/* n samples of 2x1x1 whose pixels and label both encode the index, so any mix-up shows. */
static dataset_t numbered(int64_t n) {
    dataset_t d = {.n = n, .h = 2, .w = 1, .c = 1, .classes = (int)n};
    d.images = malloc((size_t)n * 2);
    d.labels = malloc(sizeof *d.labels * (size_t)n);
    cr_assert(d.images && d.labels);
    for (int64_t i = 0; i < n; i++) {
        d.images[2 * i] = (uint8_t)(i & 0xff);
        d.images[2 * i + 1] = (uint8_t)(i >> 8);
        d.labels[i] = (int32_t)i;
    }
    return d;
}

static void hold_out(int64_t n, double fraction, dataset_t *train, dataset_t *val) {
    *train = numbered(n);
    char err[256];
    cr_assert_eq(data_hold_out(train, fraction, val, err, sizeof err), 0, "%s", err);
}

Test(dataset, hold_out_splits_train_into_two_disjoint_ordered_parts) {
    dataset_t train, val;
    hold_out(1000, 0.1, &train, &val);
    cr_assert_eq(val.n, 100);
    cr_assert_eq(train.n, 900);
    cr_assert(val.h == 2 && val.w == 1 && val.c == 1 && val.classes == 1000);
    char *seen = calloc(1000, 1);
    const dataset_t *parts[2] = {&train, &val};
    for (int p = 0; p < 2; p++) {
        for (int64_t i = 0; i < parts[p]->n; i++) {
            int32_t label = parts[p]->labels[i];
            cr_assert(label >= 0 && label < 1000);
            cr_assert_eq(parts[p]->images[2 * i] | parts[p]->images[2 * i + 1] << 8, label,
                         "sample %lld's pixels are not its label's sample", (long long)i);
            cr_assert_not(seen[label], "sample %d is in both parts", label);
            seen[label] = 1;
            if (i > 0) cr_assert_gt(label, parts[p]->labels[i - 1], "the original order is kept");
        }
    }
    for (int i = 0; i < 1000; i++)
        cr_assert(seen[i], "sample %d is lost", i);
    /* not simply the head or the tail: a shuffled choice spread over the whole set */
    cr_assert(val.labels[0] < 500 && val.labels[val.n - 1] >= 500);
    cr_assert_neq(val.labels[val.n - 1] - val.labels[0], 99);
    free(seen);
    dataset_free(&train);
    dataset_free(&val);
}

Test(dataset, hold_out_is_the_same_every_time_for_the_same_count) {
    /* every rank, every restart and every seed holds out the same samples */
    dataset_t t1, v1, t2, v2;
    hold_out(777, 0.25, &t1, &v1);
    hold_out(777, 0.25, &t2, &v2);
    cr_assert_eq(v1.n, v2.n);
    cr_assert_eq(memcmp(v1.labels, v2.labels, sizeof *v1.labels * (size_t)v1.n), 0);
    cr_assert_eq(memcmp(t1.labels, t2.labels, sizeof *t1.labels * (size_t)t1.n), 0);
    /* another count is another permutation, not a prefix of this one */
    dataset_t t3, v3;
    hold_out(776, 0.25, &t3, &v3);
    cr_assert_neq(memcmp(v1.labels, v3.labels, sizeof *v3.labels * 16), 0);
    dataset_t *all[6] = {&t1, &v1, &t2, &v2, &t3, &v3};
    for (int i = 0; i < 6; i++)
        dataset_free(all[i]);
}

Test(dataset, hold_out_refuses_a_fraction_that_empties_a_side) {
    dataset_t train = numbered(10), val;
    char err[256] = "";
    cr_assert_eq(data_hold_out(&train, 0.01, &val, err, sizeof err), -1);
    cr_assert(strstr(err, "leaves the validation split empty"), "%s", err);
    cr_assert_eq(data_hold_out(&train, 0.99, &val, err, sizeof err), -1);
    cr_assert(strstr(err, "leaves training empty"), "%s", err);
    cr_assert_eq(train.n, 10, "train is untouched on failure");
    dataset_free(&train);
}

static train_conf_t synthetic_conf(int classes, int64_t train_limit, double val_split) {
    train_conf_t c;
    train_conf_default(&c);
    c.data_kind = DATA_SYNTHETIC;
    c.height = c.width_px = 4;
    c.channels = 1;
    c.classes = classes;
    c.train_limit = train_limit;
    c.test_limit = 64;
    c.val_split = val_split;
    return c;
}

Test(dataset, a_thousand_classes_do_not_wrap) {
    train_conf_t c = synthetic_conf(1000, 4000, 0);
    data_splits_t d;
    char err[256];
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), 0, "%s", err);
    cr_assert_eq(d.train.classes, 1000);
    int32_t top = 0;
    for (int64_t i = 0; i < d.train.n; i++) {
        cr_assert(d.train.labels[i] >= 0 && d.train.labels[i] < 1000);
        if (d.train.labels[i] > top) top = d.train.labels[i];
    }
    cr_assert_gt(top, 900, "labels above 255 exist (uint8 labels wrapped at 256)");
    cr_assert_eq(d.val.n, 0, "no val_split: no validation split");
    data_splits_free(&d);
}

/* Synthetic images are learnable: the rows of the label's band are bright (127-254), the others
 * dark (0-127), noisy in both; rows of a width in bytes that is not a multiple of 8 (5 x 3) are
 * filled to their end and no further (ASan: the buffer's end). */
Test(dataset, synthetic_images_brighten_their_labels_band) {
    train_conf_t c = synthetic_conf(5, 200, 0);
    c.height = 10;
    c.width_px = 5;
    c.channels = 3;
    data_splits_t d;
    char err[256];
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), 0, "%s", err);
    int distinct[256] = {0}, n_distinct = 0;
    for (int64_t i = 0; i < d.train.n; i++) {
        const uint8_t *img = d.train.images + (size_t)i * 10 * 15;
        for (int y = 0; y < 10; y++) {
            bool is_band = y * 5 / 10 == d.train.labels[i];
            for (int j = 0; j < 15; j++) {
                uint8_t v = img[y * 15 + j];
                cr_assert(is_band ? v >= 127 && v <= 254 : v <= 127,
                          "image %lld row %d byte %d: %d (label %d)", (long long)i, y, j, v,
                          d.train.labels[i]);
                n_distinct += distinct[v]++ == 0;
            }
        }
    }
    cr_assert_gt(n_distinct, 200, "noise: only %d distinct values", n_distinct);
    data_splits_free(&d);
}

Test(dataset, val_split_holds_out_of_train_and_leaves_test_alone) {
    train_conf_t c = synthetic_conf(10, 400, 0.2);
    data_splits_t d;
    char err[256];
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), 0, "%s", err);
    cr_assert(d.val.n == 80 && d.train.n == 320 && d.test.n == 64, "%lld %lld %lld",
              (long long)d.val.n, (long long)d.train.n, (long long)d.test.n);
    cr_assert_str_eq(data_split_name(SPLIT_VAL), "val");
    cr_assert_eq(data_split(&d, SPLIT_VAL), &d.val);
    data_splits_free(&d);
    c.val_split = 0.001; /* 0.4 samples: none */
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "data.val_split"), "%s", err);
}

/* dir/name: an IDX file of unsigned bytes, big-endian dims, then `payload` bytes i % 10. */
static void write_idx(const char *dir, const char *name, int ndims, const uint32_t *dims,
                      size_t payload) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    uint8_t head[4] = {0, 0, 8, (uint8_t)ndims};
    fwrite(head, 1, 4, f);
    for (int i = 0; i < ndims; i++) {
        uint8_t b[4] = {(uint8_t)(dims[i] >> 24), (uint8_t)(dims[i] >> 16), (uint8_t)(dims[i] >> 8),
                        (uint8_t)dims[i]};
        fwrite(b, 1, 4, f);
    }
    for (size_t i = 0; i < payload; i++)
        fputc((int)(i % 10), f);
    cr_assert_eq(fclose(f), 0);
}

/* The model, its input buffer and the augmentation are sized by train's images: a 40x40 test split
 * beside 28x28 training images overflowed the input buffer at evaluation. */
Test(dataset, an_idx_test_split_of_another_shape_is_refused_naming_both_files) {
    char dir[64];
    temp_dir_make(dir, sizeof dir, "dataset_test");
    uint32_t train_dims[3] = {4, 28, 28}, test_dims[3] = {4, 40, 40}, labels[1] = {4};
    write_idx(dir, "train-images-idx3-ubyte", 3, train_dims, 4 * 28 * 28);
    write_idx(dir, "train-labels-idx1-ubyte", 1, labels, 4);
    write_idx(dir, "t10k-images-idx3-ubyte", 3, test_dims, 4 * 40 * 40);
    write_idx(dir, "t10k-labels-idx1-ubyte", 1, labels, 4);
    train_conf_t c;
    train_conf_default(&c);
    c.data_kind = DATA_MNIST;
    snprintf(c.data_dir, sizeof c.data_dir, "%s", dir);
    data_splits_t d;
    char err[1024] = "";
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), -1, "a 40x40 test split was accepted");
    cr_assert(strstr(err, "t10k-images-idx3-ubyte holds 40x40x1 images") &&
                  strstr(err, "train-images-idx3-ubyte holds 28x28x1") && strstr(err, dir),
              "%s", err);
    cr_assert(strstr(err, "the test split must have the training split's shape"), "%s", err);
    /* the same shape loads */
    write_idx(dir, "t10k-images-idx3-ubyte", 3, train_dims, 4 * 28 * 28);
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), 0, "%s", err);
    cr_assert(d.test.h == 28 && d.test.w == 28 && d.test.n == 4);
    data_splits_free(&d);
    temp_dir_remove(dir);
}

/* 4096 x 4096 x 64 bytes times 2^34 images is 2^64: malloc(0), then every image written past it.
 * The channel count (at most AUGMENT_MAX_CHANNELS) was checked only after all that. */
Test(dataset, synthetic_sizes_are_checked_before_anything_is_generated, .timeout = 20) {
    train_conf_t c = synthetic_conf(10, (int64_t)1 << 34, 0);
    c.height = c.width_px = 4096;
    c.channels = 64;
    data_splits_t d;
    char err[512] = "";
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "data.channels: 64; at most 4 are supported"), "%s", err);
    c.channels = 4; /* 2^26 bytes an image, 2^38 of them: 2^64 again */
    c.train_limit = (int64_t)1 << 38;
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "data.train_limit: 274877906944 synthetic images of 4096x4096x4 bytes") &&
                  strstr(err, "overflow"),
              "%s", err);
    c.train_limit = 64;
    c.test_limit = (int64_t)1 << 38;
    cr_assert_eq(data_splits_load(&c, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "data.test_limit: 274877906944 synthetic images"), "%s", err);
}
