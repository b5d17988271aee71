/* data_cifar: see data_cifar.h. Files are read whole (they are 30-150 MB) after a size check. */
#include "data_cifar.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CIFAR_SIDE   32
#define CIFAR_PIXELS (CIFAR_SIDE * CIFAR_SIDE)
#define CIFAR_IMAGE  (3 * CIFAR_PIXELS)

/* Append one file's records to out (already sized for them). */
static int read_file(const char *path, int label_bytes, int classes, dataset_t *out, int64_t first,
                     int64_t count, char *err, size_t el) {
    FILE *f = fopen(path, "rb");
    if (!f) return dataset_fail(err, el, "%s: cannot open: %s", path, strerror(errno));
    uint8_t record[2 + CIFAR_IMAGE];
    size_t size = (size_t)label_bytes + CIFAR_IMAGE;
    int rc = 0;
    for (int64_t i = 0; i < count; i++) {
        if (fread(record, 1, size, f) != size) {
            rc = dataset_fail(err, el, "%s: truncated in record %lld", path, (long long)i);
            break;
        }
        uint8_t label = record[label_bytes - 1]; /* CIFAR-100: the fine label, after the coarse */
        if (label >= classes) {
            rc = dataset_fail(err, el, "%s: record %lld has label %u, not below %d classes", path,
                              (long long)i, label, classes);
            break;
        }
        int64_t n = first + i;
        out->labels[n] = label;
        uint8_t *dst = out->images + n * CIFAR_IMAGE;
        const uint8_t *planes = record + label_bytes;
        for (int p = 0; p < CIFAR_PIXELS; p++)
            for (int ch = 0; ch < 3; ch++)
                dst[p * 3 + ch] = planes[ch * CIFAR_PIXELS + p];
    }
    fclose(f);
    return rc;
}

int cifar_load_dir(const char *dir, bool is_cifar100, bool is_train, int64_t limit, dataset_t *out,
                   char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    const char *names10_train[] = {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                                   "data_batch_4.bin", "data_batch_5.bin"};
    const char *names10_test[] = {"test_batch.bin"};
    const char *names100_train[] = {"train.bin"}, *names100_test[] = {"test.bin"};
    const char **names = is_cifar100 ? (is_train ? names100_train : names100_test)
                                     : (is_train ? names10_train : names10_test);
    int n_files = !is_cifar100 && is_train ? 5 : 1;
    int label_bytes = is_cifar100 ? 2 : 1, classes = is_cifar100 ? 100 : 10;
    size_t record = (size_t)label_bytes + CIFAR_IMAGE;
    char paths[5][2048];
    int64_t counts[5], total = 0;
    for (int i = 0; i < n_files; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/%s", dir, names[i]);
        struct stat st;
        if (stat(paths[i], &st) != 0)
            return dataset_fail(err, err_len, "%s: cannot open: %s", paths[i], strerror(errno));
        if (st.st_size == 0 || (size_t)st.st_size % record != 0)
            return dataset_fail(err, err_len,
                                "%s: %lld bytes is not a whole number of %zu-byte records",
                                paths[i], (long long)st.st_size, record);
        counts[i] = (int64_t)((size_t)st.st_size / record);
        total += counts[i];
    }
    out->images = malloc((size_t)total * CIFAR_IMAGE);
    out->labels = malloc((size_t)total * sizeof *out->labels);
    if (!out->images || !out->labels) {
        dataset_free(out);
        return dataset_fail(err, err_len, "%s: out of memory for %lld images", dir,
                            (long long)total);
    }
    for (int64_t i = 0, first = 0; i < n_files; first += counts[i], i++) {
        if (read_file(paths[i], label_bytes, classes, out, first, counts[i], err, err_len) < 0) {
            dataset_free(out);
            return -1;
        }
    }
    out->n = limit > 0 && limit < total ? limit : total;
    out->h = out->w = CIFAR_SIDE;
    out->c = 3;
    out->classes = classes;
    return 0;
}
