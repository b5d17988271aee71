/* dataset: see dataset.h. Synthetic data is learnable on purpose (each class brightens its own
 * band of rows), so a synthetic run's accuracy still says whether training works. */
#include "dataset.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data_cifar.h"
#include "imagefolder.h"
#include "rng.h"

#define SYNTHETIC_TRAIN_DEFAULT 10000
#define SYNTHETIC_TEST_DEFAULT  2000

/* Whether the synthetic splits train.conf asks for can be made: checked before anything is
 * generated, so a shape the augmentation refuses or a size beyond size_t costs nothing first. */
static int synthetic_check(const train_conf_t *c, int64_t n_train, int64_t n_test, char *err,
                           size_t err_len) {
    if (c->channels > AUGMENT_MAX_CHANNELS)
        return dataset_fail(err, err_len, "data.channels: %lld; at most %d are supported",
                            (long long)c->channels, AUGMENT_MAX_CHANNELS);
    /* height, width and channels are bounded by train.conf (4096, 4096, 64): their product fits */
    uint64_t per = (uint64_t)c->height * (uint64_t)c->width_px * (uint64_t)c->channels;
    const int64_t counts[2] = {n_train, n_test};
    for (int i = 0; i < 2; i++) {
        uint64_t n = (uint64_t)counts[i];
        if (n > SIZE_MAX / per || n > SIZE_MAX / sizeof(int32_t))
            return dataset_fail(
                err, err_len,
                "data.%s: %lld synthetic images of %lldx%lldx%lld bytes (data.height x data.width "
                "x data.channels) overflow this machine's sizes; ask for fewer or smaller images",
                i == 0 ? "train_limit" : "test_limit", (long long)counts[i], (long long)c->height,
                (long long)c->width_px, (long long)c->channels);
    }
    return 0;
}

/* n synthetic images (synthetic_check passed). */
static int synthetic(const train_conf_t *c, int64_t n, uint64_t stream, dataset_t *d, char *err,
                     size_t err_len) {
    memset(d, 0, sizeof *d);
    d->n = n;
    d->h = (int)c->height;
    d->w = (int)c->width_px;
    d->c = (int)c->channels;
    d->classes = (int)c->classes;
    size_t per = (size_t)d->h * d->w * d->c;
    d->images = malloc(per * (size_t)n);
    d->labels = malloc((size_t)n * sizeof *d->labels);
    if (!d->images || !d->labels) {
        dataset_free(d);
        return dataset_fail(err, err_len, "synthetic data: out of memory for %lld images",
                            (long long)n);
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t state =
            rng_key((uint64_t)c->seed ^ stream, 0x73796e74ull /* "synt" */, (uint64_t)i);
        int label = (int)(rng_next(&state) % (uint64_t)d->classes);
        d->labels[i] = label;
        uint8_t *img = d->images + per * (size_t)i;
        size_t row = (size_t)d->w * d->c;
        for (int y = 0; y < d->h; y++) {
            uint64_t band = y * d->classes / d->h == label ? 127 : 0;
            /* 7 bits of noise per byte, eight bytes from each draw (byte k: its bits 8k..8k+6, on
             * any host): a draw per byte was most of a GPU worker's start (30 720 CIFAR-sized
             * images: 0.1-0.4 s on the H200's host) */
            uint8_t *out = img + (size_t)y * row;
            for (size_t j = 0; j < row; j += 8) {
                uint64_t bits = rng_next(&state);
                size_t count = row - j < 8 ? row - j : 8;
                for (size_t k = 0; k < count; k++)
                    out[j + k] = (uint8_t)(((bits >> (8 * k)) & 127) + band);
            }
        }
    }
    return 0;
}

static void set_stats(data_splits_t *d, const float *mean, const float *std, int channels) {
    for (int i = 0; i < AUGMENT_MAX_CHANNELS; i++) {
        d->mean[i] = mean[i < channels ? i : 0];
        d->std[i] = std[i < channels ? i : 0];
    }
}

/* A split of an image folder as a dataset of files (the loader decodes them). */
static void take_split(imagefolder_split_t *s, int size, int classes, int64_t limit,
                       dataset_t *out) {
    *out = (dataset_t){.n = s->n,
                       .h = size,
                       .w = size,
                       .c = 3,
                       .classes = classes,
                       .labels = s->labels,
                       .paths = s->paths};
    memset(s, 0, sizeof *s);
    for (int64_t i = limit; limit > 0 && i < out->n; i++)
        free(out->paths[i]); /* the first N */
    if (limit > 0 && limit < out->n) out->n = limit;
}

static int load_imagefolder(const train_conf_t *c, data_splits_t *d, char *err, size_t err_len) {
    imagefolder_t f;
    if (imagefolder_scan(c->data_dir, &f, err, err_len) < 0) return -1;
    int size = (int)c->image_size;
    take_split(&f.train, size, f.n_classes, c->train_limit, &d->train);
    take_split(&f.val, size, f.n_classes, c->test_limit, &d->val);
    take_split(&f.test, size, f.n_classes, c->test_limit, &d->test);
    imagefolder_free(&f);
    if (d->val.n && c->val_split > 0)
        return dataset_fail(err, err_len, "data.val_split: %s has a val/ folder already",
                            c->data_dir);
    return 0;
}

/* The test split of an IDX directory in the training split's image shape: the model, its input
 * buffer and the augmentation are sized by train's (CIFAR's and an image folder's splits have one
 * shape by construction). */
static int same_shape(const char *dir, const dataset_t *train, const dataset_t *test, char *err,
                      size_t err_len) {
    if (test->h == train->h && test->w == train->w && test->c == train->c) return 0;
    char train_path[2048], test_path[2048];
    idx_images_path(dir, true, train_path, sizeof train_path);
    idx_images_path(dir, false, test_path, sizeof test_path);
    return dataset_fail(err, err_len,
                        "%s holds %dx%dx%d images (height x width x channels) but %s holds "
                        "%dx%dx%d: the test split must have the training split's shape",
                        test_path, test->h, test->w, test->c, train_path, train->h, train->w,
                        train->c);
}

int data_splits_load(const train_conf_t *c, data_splits_t *d, char *err, size_t err_len) {
    memset(d, 0, sizeof *d);
    int rc = 0;
    switch (c->data_kind) {
    case DATA_FASHION_MNIST:
    case DATA_MNIST: {
        rc = idx_load_dir(c->data_dir, true, c->train_limit, &d->train, err, err_len);
        if (rc == 0) rc = idx_load_dir(c->data_dir, false, c->test_limit, &d->test, err, err_len);
        if (rc == 0) rc = same_shape(c->data_dir, &d->train, &d->test, err, err_len);
        static const float fm_mean[1] = {0.2860f}, fm_std[1] = {0.3530f};
        static const float m_mean[1] = {0.1307f}, m_std[1] = {0.3081f};
        bool is_fashion = c->data_kind == DATA_FASHION_MNIST;
        set_stats(d, is_fashion ? fm_mean : m_mean, is_fashion ? fm_std : m_std, 1);
        break;
    }
    case DATA_CIFAR10:
    case DATA_CIFAR100: {
        bool is_100 = c->data_kind == DATA_CIFAR100;
        rc = cifar_load_dir(c->data_dir, is_100, true, c->train_limit, &d->train, err, err_len);
        if (rc == 0)
            rc = cifar_load_dir(c->data_dir, is_100, false, c->test_limit, &d->test, err, err_len);
        static const float c10_mean[3] = {0.4914f, 0.4822f, 0.4465f};
        static const float c10_std[3] = {0.2470f, 0.2435f, 0.2616f};
        static const float c100_mean[3] = {0.5071f, 0.4865f, 0.4409f};
        static const float c100_std[3] = {0.2673f, 0.2564f, 0.2762f};
        set_stats(d, is_100 ? c100_mean : c10_mean, is_100 ? c100_std : c10_std, 3);
        break;
    }
    case DATA_SYNTHETIC: {
        int64_t n_train = c->train_limit ? c->train_limit : SYNTHETIC_TRAIN_DEFAULT;
        int64_t n_test = c->test_limit ? c->test_limit : SYNTHETIC_TEST_DEFAULT;
        rc = synthetic_check(c, n_train, n_test, err, err_len);
        if (rc == 0) rc = synthetic(c, n_train, 0, &d->train, err, err_len);
        if (rc == 0) rc = synthetic(c, n_test, 0x7e57ull, &d->test, err, err_len);
        static const float mean[1] = {0.37f}, std[1] = {0.2f};
        set_stats(d, mean, std, 1);
        break;
    }
    case DATA_IMAGEFOLDER: {
        rc = load_imagefolder(c, d, err, err_len);
        static const float imagenet_mean[3] = {0.485f, 0.456f, 0.406f};
        static const float imagenet_std[3] = {0.229f, 0.224f, 0.225f};
        set_stats(d, imagenet_mean, imagenet_std, 3);
        break;
    }
    }
    for (int i = 0; i < 3; i++) { /* data.mean / data.std, unless auto */
        if (!isnan(c->mean[i])) d->mean[i] = (float)c->mean[i];
        if (!isnan(c->std[i])) d->std[i] = (float)c->std[i];
    }
    if (rc == 0 && d->train.c > AUGMENT_MAX_CHANNELS)
        rc = dataset_fail(err, err_len, "data: %d channels; at most %d are supported", d->train.c,
                          AUGMENT_MAX_CHANNELS);
    if (rc == 0 && c->val_split > 0) {
        char msg[512];
        rc = data_hold_out(&d->train, c->val_split, &d->val, msg, sizeof msg);
        if (rc < 0) dataset_fail(err, err_len, "data.val_split: %s", msg);
    }
    if (rc < 0) data_splits_free(d);
    return rc;
}

void data_splits_free(data_splits_t *d) {
    dataset_free(&d->train);
    dataset_free(&d->val);
    dataset_free(&d->test);
}

const dataset_t *data_split(const data_splits_t *d, data_split_t s) {
    return s == SPLIT_TRAIN ? &d->train : s == SPLIT_VAL ? &d->val : &d->test;
}

const char *data_split_name(data_split_t s) {
    return s == SPLIT_TRAIN ? "train" : s == SPLIT_VAL ? "val" : "test";
}

/* A copy of the samples of src whose is_held[i] equals want, in order (pixels, or file paths). */
static int copy_where(const dataset_t *src, const bool *is_held, bool want, int64_t n_out,
                      dataset_t *out) {
    size_t per = src->paths ? 0 : (size_t)src->h * src->w * src->c;
    *out = (dataset_t){.n = n_out, .h = src->h, .w = src->w, .c = src->c, .classes = src->classes};
    out->labels = malloc(sizeof *out->labels * (size_t)n_out);
    if (src->paths)
        out->paths = calloc((size_t)n_out, sizeof *out->paths);
    else
        out->images = malloc(per * (size_t)n_out);
    bool is_ok = out->labels && (out->paths || out->images);
    for (int64_t i = 0, j = 0; is_ok && i < src->n; i++) {
        if (is_held[i] != want) continue;
        if (src->paths)
            is_ok = (out->paths[j] = strdup(src->paths[i])) != NULL;
        else
            memcpy(out->images + per * (size_t)j, src->images + per * (size_t)i, per);
        out->labels[j++] = src->labels[i];
    }
    if (!is_ok) {
        dataset_free(out);
        return -1;
    }
    return 0;
}

int data_hold_out(dataset_t *train, double fraction, dataset_t *val, char *err, size_t err_len) {
    int64_t n = train->n, n_val = (int64_t)(fraction * (double)n + 0.5);
    if (n_val < 1 || n_val >= n)
        return dataset_fail(err, err_len, "%g of %lld training samples leaves %s empty", fraction,
                            (long long)n, n_val < 1 ? "the validation split" : "training");
    /* the first n_val of a permutation keyed by n alone: a seed does not move samples between
     * train and val, so runs with different seeds validate on the same samples */
    int64_t *order = malloc(sizeof *order * (size_t)n);
    bool *is_held = calloc((size_t)n, sizeof *is_held);
    int rc = order && is_held ? 0 : -1;
    if (rc == 0) {
        uint64_t state = rng_key(0x76616c73706c6974ull /* "valsplit" */, (uint64_t)n, 0);
        for (int64_t i = 0; i < n; i++)
            order[i] = i;
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(rng_next(&state) % (uint64_t)(i + 1));
            int64_t tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
        for (int64_t i = 0; i < n_val; i++)
            is_held[order[i]] = true;
        dataset_t kept;
        rc = copy_where(train, is_held, true, n_val, val);
        if (rc == 0 && (rc = copy_where(train, is_held, false, n - n_val, &kept)) < 0)
            dataset_free(val);
        if (rc == 0) {
            dataset_free(train);
            *train = kept;
        }
    }
    free(order);
    free(is_held);
    if (rc < 0)
        return dataset_fail(err, err_len, "out of memory holding out %lld samples",
                            (long long)n_val);
    return 0;
}
