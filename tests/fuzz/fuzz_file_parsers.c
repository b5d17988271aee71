/* libFuzzer harness over the worker's parsers of files that come from outside: train.conf
 * (with overrides), IDX datasets, CIFAR binary batches and snapshots. The input goes to a memfd
 * (CIFAR: a file in a scratch directory, the loader takes a directory) so the parsers' real file
 * paths are exercised. The first byte picks the parser: odd train.conf, 2 CIFAR-10, 4 a snapshot,
 * other even IDX. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data_cifar.h"
#include "data_idx.h"
#include "snapshot.h"
#include "train_conf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int to_memfd(const uint8_t *p, size_t n, char *path, size_t len) {
    int fd = memfd_create("fuzz", MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (write(fd, p, n) != (ssize_t)n) {
        close(fd);
        return -1;
    }
    snprintf(path, len, "/proc/self/fd/%d", fd);
    return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    char err[1024];
    if (data[0] & 1) {
        char path[64];
        int fd = to_memfd(data + 1, size - 1, path, sizeof path);
        if (fd < 0) return 0;
        train_conf_t c;
        char *overrides[] = {"optim.lr=0.5", "train.epochs=2"};
        train_conf_load(path, overrides, 2, &c, err, sizeof err);
        close(fd);
        return 0;
    }
    if (data[0] == 4) {
        char path[64];
        int fd = to_memfd(data + 1, size - 1, path, sizeof path);
        if (fd < 0) return 0;
        snapshot_data_t d;
        if (snapshot_read(path, &d, err, sizeof err) == 0) {
            if (!d.params || !d.momentum || !d.buffers) __builtin_trap();
            if ((d.header.optimizer != SNAPSHOT_OPTIM_SGD) != (d.second_moment != NULL))
                __builtin_trap();
            (void)snapshot_state_hash(&d);
            snapshot_data_free(&d);
        }
        close(fd);
        return 0;
    }
    if (data[0] == 2) {
        static char dir[64];
        if (!dir[0]) {
            snprintf(dir, sizeof dir, "/tmp/fuzz-cifar-%d", (int)getpid());
            mkdir(dir, 0700);
        }
        char path[128];
        snprintf(path, sizeof path, "%s/test_batch.bin", dir);
        FILE *f = fopen(path, "wb");
        if (!f) return 0;
        fwrite(data + 1, 1, size - 1, f);
        fclose(f);
        dataset_t d;
        if (cifar_load_dir(dir, false, false, 0, &d, err, sizeof err) == 0) {
            for (int64_t i = 0; i < d.n; i++)
                if (d.labels[i] >= 10) __builtin_trap();
            dataset_free(&d);
        }
        return 0;
    }
    /* IDX: split the rest into an images file and a labels file at a position from byte 1. */
    if (size < 2) return 0;
    size_t cut = 2 + (size_t)data[1] * (size - 2) / 255;
    char ipath[64], lpath[64];
    int fi = to_memfd(data + 2, cut - 2, ipath, sizeof ipath);
    int fl = to_memfd(data + cut, size - cut, lpath, sizeof lpath);
    if (fi >= 0 && fl >= 0) {
        dataset_t d;
        if (idx_load(ipath, lpath, 0, 10, &d, err, sizeof err) == 0) {
            for (int64_t i = 0; i < d.n; i++)
                if (d.labels[i] >= 10) __builtin_trap();
            dataset_free(&d);
        }
    }
    if (fi >= 0) close(fi);
    if (fl >= 0) close(fl);
    return 0;
}
