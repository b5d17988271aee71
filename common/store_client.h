/* store_client: a blocking TCPStore client with deadlines, for workers, tools and tests.
 *
 * Speaks the current numbering to ddprun's store (with the auth extension) and to torch >= 2.2
 * servers, or the legacy numbering to torch <= 2.1 servers. Connecting retries with exponential
 * backoff until connect_timeout_ms; every operation is bounded by op_timeout_ms (or its own
 * timeout). One client per thread; the calling thread blocks at most for those bounds.
 *
 * Errors: 0 or a negative code (ddp_error.h); store_client_error() then says what happened and
 * where (host:port, key). Values returned through uint8_t ** are malloc'd; the caller frees.
 */
#ifndef DDP_COMMON_STORE_CLIENT_H
#define DDP_COMMON_STORE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store_auth.h"
#include "store_proto.h"

typedef struct {
    const char *host;
    uint16_t port;
    store_dialect_t dialect;      /* STORE_DIALECT_CURRENT (default if UNKNOWN) or LEGACY */
    const store_secret_t *secret; /* NULL or !is_set: no secret */
    int64_t connect_timeout_ms;   /* retry connecting until this passes; default 30000 */
    int64_t op_timeout_ms;        /* bound of every op and of WAIT; default 300000 */
    const char *source_addr;      /* optional local address to bind (tests) */
    size_t max_value_bytes;       /* the store's value limit; 0: STORE_DEFAULT_MAX_VALUE_BYTES.
                                     A longer value fails with -EMSGSIZE before it is sent */
} store_client_opts_t;

typedef struct store_client store_client_t;

/* Create and connect (with retry). On failure *out still holds a client whose
 * store_client_error() explains; destroy it. Returns 0 or a negative code. */
int store_client_connect(const store_client_opts_t *opts, store_client_t **out);
/* The same in two steps, so that another thread can interrupt the connect: store_client_new
 * only allocates (no I/O; on failure as above); store_client_open connects with retry, and an
 * interrupt ends its retries at once (DDP_ECLOSED). */
int store_client_new(const store_client_opts_t *opts, store_client_t **out);
int store_client_open(store_client_t *c);
void store_client_destroy(store_client_t *c);
/* From any thread: make the operation in progress on c fail at once (DDP_ECLOSED), e.g. a WAIT
 * another thread is blocked in. The client reconnects on its next operation. */
void store_client_interrupt(store_client_t *c);
const char *store_client_error(const store_client_t *c);

int store_client_set(store_client_t *c, const char *key, const void *val, size_t val_len);
/* Blocks until key exists (WAIT, as PyTorch's client does), bounded by op_timeout_ms. */
int store_client_get(store_client_t *c, const char *key, uint8_t **val, size_t *val_len);
int store_client_compare_set(store_client_t *c, const char *key, const void *expected,
                             size_t expected_len, const void *desired, size_t desired_len,
                             uint8_t **current, size_t *current_len);
int store_client_add(store_client_t *c, const char *key, int64_t delta, int64_t *result);
int store_client_check(store_client_t *c, const char *const *keys, size_t n_keys, bool *is_ready);
/* Wait for every key; timeout_ms < 0 uses op_timeout_ms. On timeout the wait is cancelled on the
 * server (CANCEL_WAIT; legacy servers lack it, so the connection is re-opened) and DDP_ETIMEOUT
 * returned. */
int store_client_wait(store_client_t *c, const char *const *keys, size_t n_keys,
                      int64_t timeout_ms);
int store_client_num_keys(store_client_t *c, int64_t *n);
/* BARRIER (torch >= 2.10 servers and ddprun's): count this arrival at key and block until
 * world_size arrivals; timeout as store_client_wait. */
int store_client_barrier(store_client_t *c, const char *key, int64_t world_size,
                         int64_t timeout_ms);
/* LIST_KEYS: every key holding a value, as a malloc'd array of malloc'd NUL-terminated strings
 * (keys containing NUL bytes are cut there); the caller frees each and the array. */
int store_client_list_keys(store_client_t *c, char ***keys, size_t *n_keys);
int store_client_delete_key(store_client_t *c, const char *key, bool *was_deleted);
int store_client_append(store_client_t *c, const char *key, const void *val, size_t val_len);
/* vals[i]/val_lens[i] for each key (empty when missing); free each vals[i]. No waiting. On failure
 * nothing is left to free (the values got are freed and set NULL). */
int store_client_multi_get(store_client_t *c, const char *const *keys, size_t n_keys,
                           uint8_t **vals, size_t *val_lens);
int store_client_multi_set(store_client_t *c, const char *const *keys, const void *const *vals,
                           const size_t *val_lens, size_t n_keys);
/* Round trip; *rtt_us (optional) gets the time it took. */
int store_client_ping(store_client_t *c, uint64_t *rtt_us);
int store_client_queue_push(store_client_t *c, const char *key, const void *val, size_t val_len);
/* Waits (bounded by timeout_ms, < 0: op_timeout_ms) for an item, then pops it. */
int store_client_queue_pop(store_client_t *c, const char *key, int64_t timeout_ms, uint8_t **val,
                           size_t *val_len);
int store_client_queue_len(store_client_t *c, const char *key, int64_t *n);

#endif
