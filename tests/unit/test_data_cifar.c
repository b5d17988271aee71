/* Unit tests of worker/decode/data_cifar on hand-made files in the CIFAR binary layout. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "temp_dir.h"
#include "data_cifar.h"

static char dir[64];

static void make_dir(void) {
    temp_dir_make(dir, sizeof dir, "cifar_test");
}

static void remove_dir(void) {
    temp_dir_remove(dir);
}

TestSuite(data_cifar, .init = make_dir, .fini = remove_dir);

/* `records` records: label bytes (coarse 7, then label i % 10 or i % 100), then planes where
 * pixel p of channel ch holds (p + 50 * ch) & 255. `cut` bytes are dropped from the end. */
static void write_file(const char *name, int label_bytes, int records, int label_mod, int cut) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    for (int r = 0; r < records; r++) {
        if (label_bytes == 2) fputc(7, f);
        fputc(r % label_mod, f);
        for (int ch = 0; ch < 3; ch++)
            for (int p = 0; p < 1024; p++)
                fputc((p + 50 * ch) & 255, f);
    }
    fclose(f);
    if (cut) cr_assert_eq(truncate(path, (off_t)records * (label_bytes + 3072) - cut), 0);
}

Test(data_cifar, cifar10_train_batches_to_nhwc) {
    const char *names[] = {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                           "data_batch_4.bin", "data_batch_5.bin"};
    for (int i = 0; i < 5; i++)
        write_file(names[i], 1, 3, 10, 0);
    dataset_t d;
    char err[512];
    cr_assert_eq(cifar_load_dir(dir, false, true, 0, &d, err, sizeof err), 0, "%s", err);
    cr_assert(d.n == 15 && d.h == 32 && d.w == 32 && d.c == 3 && d.classes == 10);
    cr_assert_eq(d.labels[4], 1, "second file, second record");
    /* pixel 5 of image 0, NHWC: R, G, B = 5, 55, 105 */
    cr_assert(d.images[15] == 5 && d.images[16] == 55 && d.images[17] == 105);
    dataset_free(&d);
    cr_assert_eq(cifar_load_dir(dir, false, true, 4, &d, err, sizeof err), 0);
    cr_assert_eq(d.n, 4);
    dataset_free(&d);
}

Test(data_cifar, cifar100_uses_the_fine_label) {
    write_file("test.bin", 2, 120, 100, 0);
    dataset_t d;
    char err[512];
    cr_assert_eq(cifar_load_dir(dir, true, false, 0, &d, err, sizeof err), 0, "%s", err);
    cr_assert(d.n == 120 && d.classes == 100 && d.labels[99] == 99 && d.labels[100] == 0);
    dataset_free(&d);
}

Test(data_cifar, wrong_files_say_what_and_where) {
    dataset_t d;
    char err[512];
    cr_assert_eq(cifar_load_dir(dir, false, false, 0, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "test_batch.bin: cannot open"), "%s", err);
    write_file("test_batch.bin", 1, 4, 10, 100);
    cr_assert_eq(cifar_load_dir(dir, false, false, 0, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "is not a whole number of 3073-byte records"), "%s", err);
    write_file("test_batch.bin", 1, 12, 12, 0); /* labels 10 and 11 are out of range */
    cr_assert_eq(cifar_load_dir(dir, false, false, 0, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "record 10 has label 10, not below 10 classes"), "%s", err);
}
