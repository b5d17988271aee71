/* libFuzzer harness over proto/spare_handoff: the handoff message a warm spare reads from its
 * socket (header, then the environment block). Checks that decoding never crashes or reads past
 * the input, that a decoded header encodes back to the same bytes, and that a block the checker
 * accepts really is the NUL-ended KEY=VALUE entries it counted. */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "spare_handoff.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    if (size >= DDP_SPARE_HEADER_BYTES) {
        uint32_t bytes;
        if (spare_handoff_header_decode(data, &bytes, err, sizeof err) == 0) {
            uint8_t again[DDP_SPARE_HEADER_BYTES];
            spare_handoff_header_encode(again, bytes);
            assert(memcmp(again, data, DDP_SPARE_HEADER_BYTES) == 0);
            assert(bytes <= DDP_SPARE_ENV_MAX_BYTES);
        }
    }
    /* a copy of exactly the input's length: ASan sees any read past it */
    char *block = malloc(size ? size : 1);
    memcpy(block, data, size);
    int n = spare_handoff_env_check(block, size, err, sizeof err);
    if (n >= 0) {
        int counted = 0;
        for (size_t at = 0; at < size; at += strlen(block + at) + 1) {
            assert(block[at] != '=' && strchr(block + at, '='));
            counted++;
        }
        assert(counted == n && (size == 0 || block[size - 1] == '\0'));
    }
    free(block);
    return 0;
}
