/* Unit tests of worker/decode/data_idx: real Fashion-MNIST when installed, and hand-made IDX files
 * (plain and gzipped) for every way a file can be wrong: a gzip CRC or data error is said as such
 * (not as a truncation), a side beyond IDX_MAX_SIDE and a FIFO are refused. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <zlib.h>

#include "temp_dir.h"
#include "data_idx.h"

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

static char dir[64];

static void make_dir(void) {
    temp_dir_make(dir, sizeof dir, "idx_test");
}

static void remove_dir(void) {
    temp_dir_remove(dir);
}

TestSuite(data_idx, .init = make_dir, .fini = remove_dir);

/* An IDX file: header (0 0 8 ndims, big-endian dims), then `payload` bytes base + i % mod. */
static void write_idx(const char *name, bool is_gz, int ndims, const uint32_t *dims, size_t payload,
                      int mod, int base) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    gzFile f = gzopen(path, is_gz ? "wb" : "wbT");
    cr_assert_not_null(f);
    uint8_t head[4] = {0, 0, 8, (uint8_t)ndims};
    gzwrite(f, head, 4);
    for (int i = 0; i < ndims; i++) {
        uint8_t b[4] = {(uint8_t)(dims[i] >> 24), (uint8_t)(dims[i] >> 16), (uint8_t)(dims[i] >> 8),
                        (uint8_t)dims[i]};
        gzwrite(f, b, 4);
    }
    for (size_t i = 0; i < payload; i++) {
        uint8_t v = (uint8_t)((size_t)base + i % (size_t)mod);
        gzwrite(f, &v, 1);
    }
    gzclose(f);
}

static int load(const char *images, const char *labels, dataset_t *d, char *err) {
    char ip[256], lp[256];
    snprintf(ip, sizeof ip, "%s/%s", dir, images);
    snprintf(lp, sizeof lp, "%s/%s", dir, labels);
    return idx_load(ip, lp, 0, 10, d, err, 512);
}

Test(data_idx, fashion_mnist_as_installed) {
    struct stat st;
    if (stat(FASHION_DIR, &st) != 0) cr_skip_test("dataset-fashion-mnist is not installed");
    dataset_t train, test;
    char err[512];
    cr_assert_eq(idx_load_dir(FASHION_DIR, true, 0, &train, err, sizeof err), 0, "%s", err);
    cr_assert(train.n == 60000 && train.h == 28 && train.w == 28 && train.c == 1);
    int counts[10] = {0};
    for (int64_t i = 0; i < train.n; i++)
        counts[train.labels[i]]++;
    for (int k = 0; k < 10; k++)
        cr_assert_eq(counts[k], 6000, "class %d", k);
    dataset_free(&train);
    cr_assert_eq(idx_load_dir(FASHION_DIR, false, 1000, &test, err, sizeof err), 0, "%s", err);
    cr_assert_eq(test.n, 1000, "train_limit keeps the first N");
    dataset_free(&test);
}

Test(data_idx, plain_and_gzipped_files) {
    uint32_t idims[3] = {5, 2, 3}, ldims[1] = {5};
    for (int gz = 0; gz < 2; gz++) {
        write_idx("train-images-idx3-ubyte", gz, 3, idims, 30, 251, 0);
        write_idx("train-labels-idx1-ubyte", gz, 1, ldims, 5, 10, 0);
        dataset_t d;
        char err[512];
        cr_assert_eq(idx_load_dir(dir, true, 0, &d, err, sizeof err), 0, "%s", err);
        cr_assert(d.n == 5 && d.h == 2 && d.w == 3 && d.images[7] == 7 && d.labels[4] == 4);
        dataset_free(&d);
    }
}

static void expect_error(const char *needle, char *err) {
    cr_assert(strstr(err, needle), "'%s' lacks '%s'", err, needle);
}

Test(data_idx, wrong_files_say_what_and_where) {
    uint32_t idims[3] = {4, 2, 2}, ldims[1] = {4}, ldims5[1] = {5};
    dataset_t d;
    char err[512];
    write_idx("img", true, 3, idims, 16, 256, 0);
    write_idx("lab", true, 1, ldims, 4, 10, 0);
    cr_assert_eq(load("img", "lab", &d, err), 0, "%s", err);
    dataset_free(&d);

    write_idx("short", true, 3, idims, 15, 256, 0);
    cr_assert_eq(load("short", "lab", &d, err), -1);
    expect_error("short: truncated: fewer than the 4 images", err);
    write_idx("long", false, 3, idims, 17, 256, 0);
    cr_assert_eq(load("long", "lab", &d, err), -1);
    expect_error("long: longer than its header says", err);
    write_idx("lab5", true, 1, ldims5, 5, 10, 0);
    cr_assert_eq(load("img", "lab5", &d, err), -1);
    expect_error("has 4 images but", err);
    write_idx("badlab", true, 1, ldims, 4, 10, 9);
    cr_assert_eq(load("img", "badlab", &d, err), -1);
    expect_error("is not below 10 classes", err);
    cr_assert_eq(load("lab", "lab", &d, err), -1);
    expect_error("not an IDX file of unsigned bytes with 3 dimensions", err);
    uint32_t zero[3] = {4, 0, 2};
    write_idx("zero", true, 3, zero, 0, 1, 0);
    cr_assert_eq(load("zero", "lab", &d, err), -1);
    expect_error("dimension 1 is 0", err);
    uint32_t absurd[3] = {60000000, 28, 28}; /* 47 GB: beyond any dataset */
    write_idx("absurd", true, 3, absurd, 100, 256, 0);
    cr_assert_eq(load("absurd", "lab", &d, err), -1);
    expect_error("absurd: its dimensions claim more than", err);
    uint32_t huge[3] = {6000000, 28, 28}; /* claims 4.7 GB, holds 100 bytes */
    uint32_t huge_labels[1] = {6000000};
    write_idx("liarlab", true, 1, huge_labels, 10, 10, 0);
    write_idx("liarimg", true, 3, huge, 100, 256, 0);
    cr_assert_eq(load("liarimg", "liarlab", &d, err), -1);
    expect_error("liarimg: truncated", err);
    char empty[256];
    snprintf(empty, sizeof empty, "%s/empty", dir);
    fclose(fopen(empty, "w"));
    cr_assert_eq(load("empty", "lab", &d, err), -1);
    expect_error("empty: truncated: no IDX header", err);
    cr_assert_eq(load("missing", "lab", &d, err), -1);
    expect_error("missing: cannot open", err);
}

/* Flip the bits of byte `at` of dir/name (at < 0: from the end). */
static void corrupt(const char *name, long at) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, at, at < 0 ? SEEK_END : SEEK_SET), 0);
    int c = fgetc(f);
    cr_assert_neq(c, EOF);
    cr_assert_eq(fseek(f, at, at < 0 ? SEEK_END : SEEK_SET), 0);
    fputc(c ^ 0xff, f);
    cr_assert_eq(fclose(f), 0);
}

/* zlib checks a gzip file's CRC after its last byte, when expect_end reads on: a mismatch was
 * reported as trailing bytes, and a data error within as a truncation. */
Test(data_idx, a_gzip_crc_or_data_error_is_said_as_such) {
    uint32_t idims[3] = {50, 10, 10}, ldims[1] = {50};
    write_idx("lab.gz", true, 1, ldims, 50, 10, 0);
    write_idx("crc.gz", true, 3, idims, 5000, 251, 0);
    corrupt("crc.gz", -8); /* the trailer: CRC-32, then the length */
    dataset_t d;
    char err[512];
    cr_assert_eq(load("crc.gz", "lab.gz", &d, err), -1);
    expect_error("crc.gz: corrupt gzip data: incorrect data check", err);
    cr_assert_not(strstr(err, "trailing"), "%s", err);
    /* bytes that do not compress: the trailer is read by expect_end, after the payload */
    uint32_t big[3] = {50, 32, 32};
    char path[256];
    snprintf(path, sizeof path, "%s/noise.gz", dir);
    gzFile f = gzopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t head[16] = {0, 0, 8, 3, 0, 0, 0, 50, 0, 0, 0, 32, 0, 0, 0, 32};
    gzwrite(f, head, sizeof head);
    uint64_t x = 88172645463325252ull;
    for (uint32_t i = 0; i < big[0] * big[1] * big[2]; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint8_t v = (uint8_t)x;
        gzwrite(f, &v, 1);
    }
    gzclose(f);
    corrupt("noise.gz", -8);
    cr_assert_eq(load("noise.gz", "lab.gz", &d, err), -1);
    expect_error("noise.gz: corrupt gzip data: incorrect data check", err);
    cr_assert_not(strstr(err, "trailing"), "%s", err);
    write_idx("data.gz", true, 3, idims, 5000, 251, 0);
    corrupt("data.gz", 12); /* the deflate stream's first block header */
    cr_assert_eq(load("data.gz", "lab.gz", &d, err), -1);
    expect_error("data.gz: corrupt gzip data: ", err);
    cr_assert_not(strstr(err, "truncated"), "%s", err);
    /* a gzip file cut short is still a truncation */
    write_idx("cut.gz", true, 3, idims, 5000, 251, 0);
    snprintf(path, sizeof path, "%s/cut.gz", dir);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(truncate(path, st.st_size / 2), 0);
    cr_assert_eq(load("cut.gz", "lab.gz", &d, err), -1);
    expect_error("cut.gz: truncated: fewer than the 50 images", err);
}

/* Sides become ints (and a model's input shape): one beyond 65535 is refused, naming the file, and
 * one beyond INT_MAX is refused so before its bytes are looked for. */
Test(data_idx, an_image_side_beyond_the_limit_is_refused) {
    uint32_t high[3] = {1, 70000, 2}, wide[3] = {1, 1, 3000000000u}, ldims[1] = {1};
    write_idx("lab", false, 1, ldims, 1, 10, 0);
    write_idx("high", false, 3, high, 140000, 256, 0);
    dataset_t d;
    char err[512];
    cr_assert_eq(load("high", "lab", &d, err), -1, "a 70000-pixel-high image was accepted");
    expect_error("high: images 70000 pixels high (at most 65535)", err);
    write_idx("wide", false, 3, wide, 16, 256, 0);
    cr_assert_eq(load("wide", "lab", &d, err), -1);
    expect_error("wide: images 3000000000 pixels wide (at most 65535)", err);
    uint32_t ok[3] = {1, 65535, 1};
    write_idx("ok", false, 3, ok, 65535, 256, 0);
    cr_assert_eq(load("ok", "lab", &d, err), 0, "%s", err);
    cr_assert_eq(d.h, 65535);
    dataset_free(&d);
}

/* gzopen() of a FIFO waits for a writer forever. */
Test(data_idx, a_fifo_is_refused_not_waited_on, .timeout = 10) {
    uint32_t ldims[1] = {4};
    write_idx("lab", false, 1, ldims, 4, 10, 0);
    char path[256];
    snprintf(path, sizeof path, "%s/fifo", dir);
    cr_assert_eq(mkfifo(path, 0600), 0);
    dataset_t d;
    char err[512];
    cr_assert_eq(load("fifo", "lab", &d, err), -1);
    expect_error("fifo: not a regular file (a FIFO)", err);
}
