/* store_server: the TCPStore-protocol server on a libuv loop (standalone `ddprun store`, or
 * embedded in the agent's loop). Single-threaded: every callback runs on the given loop.
 *
 * Owns the listening socket, the connections and the kv_table. Enforces store_limits_t per peer;
 * a peer that breaks a limit or the protocol is logged (peer address + limit) and disconnected,
 * nobody else is affected. With a secret, every connection must pass ddprun's HMAC challenge.
 */
#ifndef DDP_LAUNCHER_STORE_SERVER_H
#define DDP_LAUNCHER_STORE_SERVER_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "store_auth.h"
#include "store_limits.h"

typedef struct store_server store_server_t;

typedef struct {
    const char *host;      /* address to bind: a literal or a name, IPv4 or IPv6 */
    uint16_t port;         /* 0 picks a free port (see store_server_port) */
    store_limits_t limits; /* start from store_limits_default() */
    store_secret_t secret; /* is_set = false: no authentication */
} store_server_opts_t;

typedef struct {
    unsigned n_connections;
    uint64_t n_requests;
    uint64_t n_dropped; /* connections closed for breaking a limit or the protocol */
    size_t buffered_bytes;
    size_t table_bytes;
} store_server_stats_t;

/* Bind, listen and start serving on loop. Returns 0, or a negative code with a message in err
 * (e.g. the port is in use); then the half-made server is freed by the loop, so run it (briefly)
 * before closing the loop. The caller runs the loop. */
int store_server_start(uv_loop_t *loop, const store_server_opts_t *opts, store_server_t **out,
                       char *err, size_t err_len);
uint16_t store_server_port(const store_server_t *s);
void store_server_stats(const store_server_t *s, store_server_stats_t *out);
/* Close every connection and the listener; frees s once all handles closed, then calls done_cb
 * (may be NULL). The loop must keep running until then. */
void store_server_stop(store_server_t *s, void (*done_cb)(void *arg), void *arg);

#endif
