/* store_conn: internals shared by store_server.c (sockets, limits, lifecycle) and store_ops.c
 * (what each request does). Not part of the public API. Loop thread only. */
#ifndef DDP_LAUNCHER_STORE_CONN_H
#define DDP_LAUNCHER_STORE_CONN_H

#include <stdbool.h>
#include <stdint.h>
#include <netinet/in.h>
#include <uv.h>

#include "kv_table.h"
#include "store_auth.h"
#include "store_proto.h"
#include "store_server.h"

typedef struct store_peer {
    struct store_peer *next;
    uint8_t addr[16]; /* IPv4 mapped into IPv6 form */
    unsigned n_conns;
} store_peer_t;

#define STORE_PEER_BUCKETS 1024u

typedef struct store_conn {
    uv_tcp_t tcp;
    store_server_t *srv;
    struct store_conn *prev, *next;
    store_peer_t *peer;
    char peer_name[64]; /* "addr:port" for log lines */
    store_dialect_t dialect;
    bool is_validated; /* current dialect: VALIDATE seen; legacy: from the first byte */
    bool is_authed;    /* passed the challenge, or the server has no secret */
    bool is_challenged;
    bool is_closing;
    uint8_t server_nonce[STORE_AUTH_NONCE_BYTES];
    uint8_t *in;
    size_t in_len, in_cap, in_need;
    uint64_t accepted_ms;
    uint64_t first_byte_ms; /* 0 until the peer sends something */
    uint64_t frame_started_ms; /* 0 when no partial frame is buffered */
    size_t out_queued;  /* reply bytes handed to libuv, not yet written */
    kv_waiter_t *waiter;
} store_conn_t;

struct store_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_timer_t sweep_timer;
    store_limits_t limits;
    store_secret_t secret;
    kv_table_t *table;
    store_conn_t *conns;
    store_peer_t *peers[STORE_PEER_BUCKETS];
    unsigned n_conns;
    unsigned fd_budget;      /* connections that fit in RLIMIT_NOFILE, leaving a reserve */
    unsigned n_open_handles;
    uint16_t port;
    size_t buffered_bytes;
    uint64_t n_requests, n_dropped;
    uint64_t drop_log_window_ms;
    unsigned drop_log_count, drop_log_suppressed;
    void (*done_cb)(void *);
    void *done_arg;
    bool is_stopping;
};

/* Log why and close: the only way a peer's misbehaviour ends. Rate-limited log lines. */
void store_conn_drop(store_conn_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Queue reply bytes (head then body, either may be empty). Drops c past max_output_bytes. */
void store_conn_send(store_conn_t *c, const void *head, size_t head_len, const void *body,
                     size_t body_len);
/* Carry out one decoded request. */
void store_ops_handle(store_conn_t *c, const store_request_t *req);
/* Release c's pending WAIT, if any. */
void store_ops_forget_waiter(store_conn_t *c);

#endif
