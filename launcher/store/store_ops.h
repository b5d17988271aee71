/* store_ops: what each TCPStore request does to the table and what goes back, with PyTorch's
 * semantics (TCPStoreLibUvBackend.cpp is the reference), plus ddprun's auth handshake. Knows no
 * sockets: given a decoded request and the connection's session it returns a result (the reply,
 * the sessions whose WAIT the request completed, or why the peer must go), which store_server.c
 * carries out. A request flows one way: server -> proto (decode) -> ops -> table -> result ->
 * server (send, wake, drop). Loop thread only. */
#ifndef DDP_LAUNCHER_STORE_OPS_H
#define DDP_LAUNCHER_STORE_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/kv_table.h"
#include "store_auth.h"
#include "store_limits.h"
#include "store_proto.h"

typedef struct store_session store_session_t;

/* The rules every session shares: the table and the limits and secret, borrowed from the
 * server for its lifetime. */
typedef struct {
    kv_table_t *table;
    const store_limits_t *limits;
    const store_secret_t *secret;
    store_session_t *woken_head, *woken_tail; /* while a request runs: whom it woke */
} store_ops_t;

/* Per connection: the protocol state of one peer. The server embeds it in its connection and
 * reads dialect / is_validated / is_authed for framing and its timers. */
struct store_session {
    store_ops_t *ops;
    store_dialect_t dialect;
    bool is_validated; /* current dialect: VALIDATE seen; legacy: from the first byte */
    bool is_authed;    /* passed the challenge, or the server has no secret */
    bool is_challenged;
    uint8_t server_nonce[STORE_AUTH_NONCE_BYTES];
    kv_waiter_t *waiter;         /* its pending WAIT or BARRIER, if any */
    store_session_t *next_woken; /* store_ops_result_t.woken's link */
};

#define STORE_OPS_HEAD_BYTES (1 + STORE_AUTH_MAC_BYTES) /* the longest fixed reply */
#define STORE_OPS_DROP_BYTES 256

/* What to do after a request, in this order: send STOP_WAITING to every woken session, send the
 * reply (head then body; nothing when both are empty), then drop the peer if drop is set. */
typedef struct {
    store_session_t *woken; /* linked by next_woken; may include the requester (legacy clients) */
    uint8_t head[STORE_OPS_HEAD_BYTES];
    size_t head_len;
    const uint8_t *body; /* borrowed from the table until its next call, or owned */
    size_t body_len;
    uint8_t *owned;                  /* malloc'd reply memory: store_ops_result_free */
    char drop[STORE_OPS_DROP_BYTES]; /* non-empty: why the peer is disconnected */
} store_ops_result_t;

/* ops borrows table, limits and secret; they must outlive it and every session. */
void store_ops_init(store_ops_t *ops, kv_table_t *table, const store_limits_t *limits,
                    const store_secret_t *secret);
/* A new connection's session: unvalidated, authenticated only when there is no secret. */
void store_ops_session_init(store_ops_t *ops, store_session_t *s);
/* Carry out one decoded request of session s; fills *res (always: call store_ops_result_free). */
void store_ops_handle(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                      store_ops_result_t *res);
void store_ops_result_free(store_ops_result_t *res);
/* Release s's pending WAIT, if any (the connection closes, or CANCEL_WAIT). */
void store_ops_forget_waiter(store_session_t *s);

#endif
