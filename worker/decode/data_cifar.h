/* data_cifar: the CIFAR-10 and CIFAR-100 "binary version" files into the same dataset_t as the
 * IDX loader (uint8 NHWC 32x32x3). Each record is the label byte(s) then 3072 bytes of red,
 * green and blue planes; sizes and labels are validated, errors name the file and the record. */
#ifndef DDP_WORKER_DATA_CIFAR_H
#define DDP_WORKER_DATA_CIFAR_H

#include <stdbool.h>
#include <stdint.h>

#include "data_idx.h"

/* CIFAR-10: data_batch_1..5.bin (train) or test_batch.bin in dir; CIFAR-100: train.bin or
 * test.bin, fine labels. Keeps the first `limit` samples (0: all). Returns 0 or -1 with err. */
int cifar_load_dir(const char *dir, bool is_cifar100, bool is_train, int64_t limit, dataset_t *out,
                   char *err, size_t err_len);

#endif
