/* libFuzzer harness over the safetensors reader (worker/weights/safetensors.c), the parser of the
 * weight files model.init takes from outside: the input is a whole file, read through the real
 * path (a memfd: length prefix, header, then every tensor the header lists) and parsed again from
 * memory. Any crash, leak, sanitizer report or tensor read outside the file is a bug. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[1024], path[64];
    safetensors_index_t ix;
    if (safetensors_parse_buffer(data, size, &ix, err, sizeof err) == 0) {
        for (int i = 0; i < ix.n; i++) /* every tensor lies inside the buffer */
            if (ix.data_offset + ix.entries[i].end > size) abort();
        safetensors_index_free(&ix);
    }
    int mfd = memfd_create("fuzz", MFD_CLOEXEC);
    if (mfd < 0) return 0;
    if (write(mfd, data, size) == (ssize_t)size) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", mfd);
        int fd = safetensors_open(path, &ix, err, sizeof err);
        if (fd >= 0) {
            for (int i = 0; i < ix.n; i++) {
                const safetensors_entry_t *e = &ix.entries[i];
                void *buf = malloc((size_t)(e->end - e->begin) + 1);
                if (buf && safetensors_read(fd, &ix, e, buf, err, sizeof err) < 0)
                    abort(); /* validated */
                free(buf);
            }
            close(fd);
            safetensors_index_free(&ix);
        }
    }
    close(mfd);
    return 0;
}
