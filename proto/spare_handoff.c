/* spare_handoff: the warm spare's handoff message (see spare_handoff.h). */
#include "spare_handoff.h"

#include <stdio.h>
#include <string.h>

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void spare_handoff_header_encode(uint8_t out[DDP_SPARE_HEADER_BYTES], uint32_t env_bytes) {
    put_u32(out, DDP_SPARE_MAGIC);
    put_u32(out + 4, DDP_SPARE_VERSION);
    put_u32(out + 8, env_bytes);
    put_u32(out + 12, DDP_SPARE_N_FDS);
}

int spare_handoff_header_decode(const uint8_t in[DDP_SPARE_HEADER_BYTES], uint32_t *env_bytes,
                                char *err, size_t err_len) {
    uint32_t magic = get_u32(in), version = get_u32(in + 4), bytes = get_u32(in + 8),
             n_fds = get_u32(in + 12);
    if (magic != DDP_SPARE_MAGIC || version != DDP_SPARE_VERSION) {
        snprintf(err, err_len,
                 "not a handoff of this ddprun (magic 0x%08x, version %u; expected "
                 "0x%08x, version %u)",
                 magic, version, DDP_SPARE_MAGIC, DDP_SPARE_VERSION);
        return -1;
    }
    if (n_fds != DDP_SPARE_N_FDS) {
        snprintf(err, err_len, "a handoff with %u descriptors, not %d", n_fds, DDP_SPARE_N_FDS);
        return -1;
    }
    if (bytes > DDP_SPARE_ENV_MAX_BYTES) {
        snprintf(err, err_len, "an environment of %u bytes, over the limit of %u", bytes,
                 DDP_SPARE_ENV_MAX_BYTES);
        return -1;
    }
    *env_bytes = bytes;
    return 0;
}

int spare_handoff_env_check(const char *block, size_t len, char *err, size_t err_len) {
    int n = 0;
    for (size_t at = 0; at < len;) {
        const char *end = memchr(block + at, '\0', len - at);
        if (!end) {
            snprintf(err, err_len, "environment entry at byte %zu is not ended by a NUL", at);
            return -1;
        }
        const char *eq = memchr(block + at, '=', (size_t)(end - (block + at)));
        if (!eq || eq == block + at) {
            snprintf(err, err_len, "environment entry at byte %zu is not KEY=VALUE", at);
            return -1;
        }
        if (++n > DDP_SPARE_ENV_MAX_VARS) {
            snprintf(err, err_len, "more than %d environment entries", DDP_SPARE_ENV_MAX_VARS);
            return -1;
        }
        at = (size_t)(end - block) + 1;
    }
    return n;
}
