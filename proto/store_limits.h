/* store_limits: every bound the store enforces on a peer, with its default.
 *
 * The codec checks the per-frame limits before a caller buffers a claimed length; the server
 * checks the per-connection and global ones. Defaults follow PyTorch where PyTorch has one
 * (8 KiB keys, 8 MiB values) and are configurable on `ddprun store`.
 */
#ifndef DDP_PROTO_STORE_LIMITS_H
#define DDP_PROTO_STORE_LIMITS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    size_t max_key_bytes;              /* one key */
    size_t max_value_bytes;            /* one value (SET, APPEND, COMPARE_SET, QUEUE_PUSH) */
    uint64_t max_keys_per_op;          /* CHECK, WAIT, MULTI_GET, MULTI_SET */
    size_t max_frame_bytes;            /* one request; also the input buffer of a connection */
    size_t max_output_bytes;           /* replies queued for a client that does not read them */
    size_t max_total_buffer_bytes;     /* input + output buffers of all connections together */
    size_t max_store_bytes;            /* keys + values + queue items held by the table */
    unsigned max_connections;          /* in total */
    unsigned max_connections_per_peer; /* from one IP address */
    uint32_t frame_timeout_ms;    /* a partial frame may wait this long for its remaining bytes */
    uint32_t validate_timeout_ms; /* a connection that spoke must be validated (and, with a
                                     secret, authenticated) within this; with a secret even a
                                     silent connection must */
} store_limits_t;

#define STORE_DEFAULT_MAX_KEY_BYTES       (8u * 1024u)
#define STORE_DEFAULT_MAX_VALUE_BYTES     (8u * 1024u * 1024u)
#define STORE_DEFAULT_MAX_KEYS_PER_OP     16384u
#define STORE_DEFAULT_MAX_FRAME_BYTES     (64u * 1024u * 1024u)
#define STORE_DEFAULT_MAX_OUTPUT_BYTES    (64u * 1024u * 1024u)
#define STORE_DEFAULT_MAX_TOTAL_BUFFER    ((size_t)1024u * 1024u * 1024u)
#define STORE_DEFAULT_MAX_STORE_BYTES     ((size_t)2048u * 1024u * 1024u)
#define STORE_DEFAULT_MAX_CONNECTIONS     16384u
#define STORE_DEFAULT_MAX_CONNS_PER_PEER  4096u
#define STORE_DEFAULT_FRAME_TIMEOUT_MS    30000u
#define STORE_DEFAULT_VALIDATE_TIMEOUT_MS 10000u

/* Fill *lim with the defaults above. */
void store_limits_default(store_limits_t *lim);

#endif
