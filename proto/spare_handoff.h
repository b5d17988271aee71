/* spare_handoff: what ddprun tells a warm spare when a round needs it. A spare is a ddpworker that
 * ddprun starts ahead of time with DDPRUN_SPARE_FD naming its end of a socketpair; it initializes
 * what does not depend on the round (CUDA context, cuDNN handles, the data, the model's arenas),
 * writes the byte DDP_SPARE_READY (the agent hands rounds only to spares that have), and then
 * reads one message: a header of DDP_SPARE_HEADER_BYTES (little-endian u32 magic,
 * version, env_bytes, n_fds) that carries n_fds = DDP_SPARE_N_FDS descriptors as SCM_RIGHTS (its
 * new stdout and stderr), then env_bytes of environment, "KEY=VALUE" entries each ended by a NUL,
 * which replaces the spare's whole environment (it is what a freshly started worker of the round
 * would have had). End of file before a header: the agent retired the spare. Pure: no I/O, no
 * allocation; both sides bound every length by the limits here. */
#ifndef DDP_PROTO_SPARE_HANDOFF_H
#define DDP_PROTO_SPARE_HANDOFF_H

#include <stddef.h>
#include <stdint.h>

#define DDP_SPARE_FD_ENV        "DDPRUN_SPARE_FD"
#define DDP_SPARE_MAGIC         0x52415053u /* "SPAR" */
#define DDP_SPARE_VERSION       1u
#define DDP_SPARE_READY         'R'
#define DDP_SPARE_HEADER_BYTES  16
#define DDP_SPARE_N_FDS         2 /* stdout, stderr */
#define DDP_SPARE_ENV_MAX_BYTES (1u << 20)
#define DDP_SPARE_ENV_MAX_VARS  16384

void spare_handoff_header_encode(uint8_t out[DDP_SPARE_HEADER_BYTES], uint32_t env_bytes);
/* 0 with *env_bytes set; -1 with a message in err when the header is not this version's (magic,
 * version, descriptor count) or claims more than DDP_SPARE_ENV_MAX_BYTES. */
int spare_handoff_header_decode(const uint8_t in[DDP_SPARE_HEADER_BYTES], uint32_t *env_bytes,
                                char *err, size_t err_len);
/* Checks an environment block of len bytes: a sequence of at most DDP_SPARE_ENV_MAX_VARS entries,
 * each "KEY=VALUE" with a non-empty KEY, ended by a NUL (so the block's last byte is a NUL, or the
 * block is empty). Returns the number of entries, or -1 with a message naming the offset. */
int spare_handoff_env_check(const char *block, size_t len, char *err, size_t err_len);

#endif
