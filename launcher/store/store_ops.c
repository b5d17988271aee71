/* store_ops: what each TCPStore request does to the table and what goes back (store_ops.h).
 * Never touches a socket: every outcome is written into the result, which store_server.c sends.
 * Framing, limits on frames and sockets are store_server.c's. Loop thread only. */
#include "store/store_ops.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- building the result ------------------------------------------------------------------ */

__attribute__((format(printf, 2, 3))) static void drop(store_ops_result_t *r, const char *fmt,
                                                       ...) {
    if (r->drop[0]) return; /* the first reason is the one logged */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->drop, sizeof r->drop, fmt, ap);
    va_end(ap);
}

static void reply_u8(store_ops_result_t *r, uint8_t v) {
    r->head[0] = v;
    r->head_len = 1;
}

static void reply_i64(store_ops_result_t *r, int64_t v) {
    store_writer_t w;
    store_writer_init(&w, r->head, sizeof r->head);
    store_put_i64(&w, v);
    r->head_len = w.len;
}

/* u64 length + bytes; p is borrowed from the table. */
static void reply_bytes(store_ops_result_t *r, const uint8_t *p, size_t n) {
    store_writer_t w;
    store_writer_init(&w, r->head, sizeof r->head);
    store_put_u64(&w, n);
    r->head_len = w.len;
    r->body = p;
    r->body_len = n;
}

static void print_key(const store_bytes_t *key, char *out, size_t out_len) {
    size_t n = key->len < out_len - 1 ? key->len : out_len - 1;
    for (size_t i = 0; i < n; i++) {
        uint8_t ch = key->ptr[i];
        out[i] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    out[n] = '\0';
}

/* A table write failed: the store is full (or out of memory). The request has no error reply in
 * PyTorch's protocol, so the writer is disconnected; nothing already stored changes. */
static void drop_on_write_error(store_ops_t *ops, const store_request_t *req, int rc,
                                store_ops_result_t *r) {
    char key[64];
    print_key(&req->key, key, sizeof key);
    if (rc == -ENOSPC)
        drop(r, "%s '%s' refused: the store holds %zu bytes, limit %zu", store_op_name(req->op),
             key, kv_table_bytes(ops->table), ops->limits->max_store_bytes);
    else
        drop(r, "%s '%s' failed: %s", store_op_name(req->op), key, strerror(-rc));
}

/* ---- waiting ------------------------------------------------------------------------------ */

/* The table completed s's WAIT inside the request being handled: s joins that request's result. */
static void on_wait_done(void *owner) {
    store_session_t *s = owner;
    store_ops_t *ops = s->ops;
    s->waiter = NULL;
    s->next_woken = NULL;
    if (ops->woken_tail)
        ops->woken_tail->next_woken = s;
    else
        ops->woken_head = s;
    ops->woken_tail = s;
}

void store_ops_forget_waiter(store_session_t *s) {
    if (!s->waiter) return;
    kv_table_wait_cancel(s->ops->table, s->waiter);
    s->waiter = NULL;
}

static void op_wait(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                    store_ops_result_t *r) {
    kv_table_t *t = ops->table;
    if (s->waiter) {
        if (s->dialect != STORE_DIALECT_LEGACY) {
            drop(r, "WAIT sent while its previous WAIT is still pending");
            return;
        }
        /* torch <= 2.1 abandons a timed-out WAIT without cancelling it and keeps using the
         * connection (its next get() starts with a WAIT), as torch's own server allows: the new
         * WAIT replaces the abandoned one. */
        store_ops_forget_waiter(s);
    }
    /* links for the keys missing now only: the waiter is charged to the table's budget */
    uint64_t n_missing = 0;
    size_t cursor = 0;
    store_bytes_t key;
    while (store_proto_next_item(req, &cursor, &key, NULL))
        n_missing += !kv_table_check(t, key.ptr, key.len);
    kv_waiter_t *w = NULL;
    int rc = kv_table_wait_begin(t, n_missing, on_wait_done, s, &w);
    cursor = 0;
    while (rc == 0 && store_proto_next_item(req, &cursor, &key, NULL))
        rc = kv_table_wait_add_key(t, w, key.ptr, key.len);
    if (rc < 0) {
        if (w) kv_table_wait_cancel(t, w);
        drop(r, "WAIT on %llu keys failed: %s", (unsigned long long)req->n_items,
             rc == -ENOSPC ? "the store is full" : strerror(-rc));
        return;
    }
    if (kv_table_wait_commit(t, w) == 1)
        reply_u8(r, STORE_WAIT_STOP_WAITING);
    else
        s->waiter = w;
}

static void op_barrier(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                       store_ops_result_t *r) {
    if (s->waiter) {
        drop(r, "BARRIER sent while a WAIT is still pending");
        return;
    }
    kv_waiter_t *w = NULL;
    int rc = kv_table_barrier(ops->table, req->key.ptr, req->key.len, req->add_delta, on_wait_done,
                              s, &w);
    if (rc == 1)
        reply_u8(r, STORE_WAIT_STOP_WAITING);
    else if (rc == 0)
        s->waiter = w;
    else if (rc == -EINVAL || rc == -ERANGE)
        drop(r, "BARRIER on a key whose value is not a 64-bit integer");
    else
        drop_on_write_error(ops, req, rc, r);
}

/* ---- replies built from many keys --------------------------------------------------------- */

static void op_multi_get(store_ops_t *ops, const store_request_t *req, store_ops_result_t *r) {
    kv_table_t *t = ops->table;
    size_t cursor = 0, total = 0, n;
    store_bytes_t key;
    while (store_proto_next_item(req, &cursor, &key, NULL)) {
        kv_table_get(t, key.ptr, key.len, &n);
        total += 8 + n;
        if (total > ops->limits->max_output_bytes) {
            /* Many keys naming one big value would multiply it: bound the reply, not the claim. */
            drop(r, "MULTI_GET reply above the output limit of %zu bytes",
                 ops->limits->max_output_bytes);
            return;
        }
    }
    uint8_t *buf = malloc(total ? total : 1);
    if (!buf) {
        drop(r, "out of memory building a %zu-byte MULTI_GET reply", total);
        return;
    }
    store_writer_t w;
    store_writer_init(&w, buf, total);
    for (cursor = 0; store_proto_next_item(req, &cursor, &key, NULL);) {
        const uint8_t *v = kv_table_get(t, key.ptr, key.len, &n);
        store_put_bytes(&w, v, n);
    }
    r->owned = buf;
    r->body = buf;
    r->body_len = w.len;
}

static void op_list_keys(store_ops_t *ops, store_ops_result_t *r) {
    kv_table_t *t = ops->table;
    size_t cursor = 0, total = 8, n;
    const uint8_t *key;
    int64_t count = 0;
    while (kv_table_next_key(t, &cursor, &key, &n)) {
        total += 8 + n;
        count++;
    }
    if (total > ops->limits->max_output_bytes) {
        drop(r, "LIST_KEYS reply of %zu bytes above the output limit of %zu bytes", total,
             ops->limits->max_output_bytes);
        return;
    }
    uint8_t *buf = malloc(total);
    if (!buf) {
        drop(r, "out of memory building a %zu-byte LIST_KEYS reply", total);
        return;
    }
    store_writer_t w;
    store_writer_init(&w, buf, total);
    store_put_i64(&w, count);
    for (cursor = 0; kv_table_next_key(t, &cursor, &key, &n);)
        store_put_bytes(&w, key, n);
    r->owned = buf;
    r->body = buf;
    r->body_len = w.len;
}

static void op_queue_pop(store_ops_t *ops, const store_request_t *req, store_ops_result_t *r) {
    int64_t len_before;
    uint8_t *item;
    size_t n;
    int rc = kv_table_queue_pop(ops->table, req->key.ptr, req->key.len, &len_before, &item, &n);
    if (rc < 0) {
        drop_on_write_error(ops, req, rc, r);
        return;
    }
    store_writer_t w;
    store_writer_init(&w, r->head, sizeof r->head);
    store_put_i64(&w, len_before);
    if (len_before > 0) store_put_u64(&w, n);
    r->head_len = w.len;
    r->owned = item;
    r->body = item;
    r->body_len = n;
}

/* ---- authentication ----------------------------------------------------------------------- */

static void op_auth_hello(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                          store_ops_result_t *r) {
    if (req->u32 != STORE_AUTH_VERSION) {
        drop(r, "auth hello of unsupported version %u", req->u32);
        return;
    }
    if (!ops->secret->is_set) {
        reply_u8(r, STORE_AUTH_OPEN);
        return;
    }
    store_auth_random_nonce(s->server_nonce);
    s->is_challenged = true;
    r->head[0] = STORE_AUTH_CHALLENGE;
    memcpy(r->head + 1, s->server_nonce, STORE_AUTH_NONCE_BYTES);
    r->head_len = 1 + STORE_AUTH_NONCE_BYTES;
}

static void op_auth_proof(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                          store_ops_result_t *r) {
    if (!s->is_challenged || s->is_authed) {
        drop(r, "auth proof without a pending challenge");
        return;
    }
    const uint8_t *client_nonce = req->auth, *proof = req->auth + STORE_AUTH_NONCE_BYTES;
    uint8_t expect[STORE_AUTH_MAC_BYTES];
    store_auth_client_mac(ops->secret, s->server_nonce, client_nonce, expect);
    s->is_challenged = false;
    if (!store_auth_mac_equal(expect, proof)) {
        reply_u8(r, STORE_AUTH_DENIED);
        drop(r, "authentication failed: the client holds a different shared secret");
        return;
    }
    r->head[0] = STORE_AUTH_OK;
    store_auth_server_mac(ops->secret, s->server_nonce, client_nonce, r->head + 1);
    r->head_len = 1 + STORE_AUTH_MAC_BYTES;
    s->is_authed = true;
}

/* ---- one request -------------------------------------------------------------------------- */

static void handle(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                   store_ops_result_t *r) {
    kv_table_t *t = ops->table;
    const store_bytes_t *k = &req->key;
    int rc = 0;
    size_t n;
    const uint8_t *v;

    if (!s->is_authed && req->op != STORE_OP_VALIDATE && req->op != STORE_OP_AUTH_HELLO &&
        req->op != STORE_OP_AUTH_PROOF) {
        drop(r,
             "%s before authentication refused: this store requires the shared secret "
             "(ddprun's --secret-file / DDPRUN_STORE_SECRET)",
             store_op_name(req->op));
        return;
    }
    switch (req->op) {
    case STORE_OP_VALIDATE:
        if (s->is_validated) drop(r, "VALIDATE sent twice");
        s->is_validated = true;
        return;
    case STORE_OP_AUTH_HELLO:
        op_auth_hello(ops, s, req, r);
        return;
    case STORE_OP_AUTH_PROOF:
        op_auth_proof(ops, s, req, r);
        return;
    case STORE_OP_PING: {
        store_writer_t w;
        store_writer_init(&w, r->head, sizeof r->head);
        store_put_u32(&w, req->u32);
        r->head_len = w.len;
        return;
    }
    case STORE_OP_SET:
        rc = kv_table_set(t, k->ptr, k->len, req->value.ptr, req->value.len);
        break;
    case STORE_OP_COMPARE_SET:
        rc = kv_table_compare_set(t, k->ptr, k->len, req->value.ptr, req->value.len,
                                  req->value2.ptr, req->value2.len, &v, &n);
        if (rc == 0) reply_bytes(r, v, n);
        break;
    case STORE_OP_GET:
        v = kv_table_get(t, k->ptr, k->len, &n);
        reply_bytes(r, v, n);
        return;
    case STORE_OP_ADD: {
        int64_t result;
        rc = kv_table_add(t, k->ptr, k->len, req->add_delta, &result);
        if (rc == 0) reply_i64(r, result);
        if (rc == -EINVAL || rc == -ERANGE) {
            char key[64];
            print_key(k, key, sizeof key);
            drop(r, "ADD on key '%s' whose value is not a 64-bit integer", key);
            return;
        }
        break;
    }
    case STORE_OP_CHECK: {
        size_t cursor = 0;
        store_bytes_t key;
        bool is_ready = true;
        while (is_ready && store_proto_next_item(req, &cursor, &key, NULL))
            is_ready = kv_table_check(t, key.ptr, key.len);
        reply_u8(r, is_ready ? STORE_CHECK_READY : STORE_CHECK_NOT_READY);
        return;
    }
    case STORE_OP_WAIT:
        op_wait(ops, s, req, r);
        return;
    case STORE_OP_GETNUMKEYS:
        reply_i64(r, kv_table_num_keys(t));
        return;
    case STORE_OP_DELETE_KEY:
        reply_i64(r, kv_table_delete(t, k->ptr, k->len));
        return;
    case STORE_OP_APPEND:
        kv_table_get(t, k->ptr, k->len, &n);
        if (n + req->value.len > ops->limits->max_value_bytes) {
            drop(r, "APPEND would make a value longer than the value-size limit (%zu bytes)",
                 ops->limits->max_value_bytes);
            return;
        }
        rc = kv_table_append(t, k->ptr, k->len, req->value.ptr, req->value.len);
        break;
    case STORE_OP_MULTI_GET:
        op_multi_get(ops, req, r);
        return;
    case STORE_OP_MULTI_SET: {
        size_t cursor = 0;
        store_bytes_t key, val;
        while (rc == 0 && store_proto_next_item(req, &cursor, &key, &val))
            rc = kv_table_set(t, key.ptr, key.len, val.ptr, val.len);
        break;
    }
    case STORE_OP_CANCEL_WAIT:
        store_ops_forget_waiter(s);
        reply_u8(r, STORE_WAIT_CANCELED);
        return;
    case STORE_OP_QUEUE_PUSH:
        rc = kv_table_queue_push(t, k->ptr, k->len, req->value.ptr, req->value.len);
        break;
    case STORE_OP_QUEUE_POP:
        op_queue_pop(ops, req, r);
        return;
    case STORE_OP_QUEUE_LEN:
        reply_i64(r, kv_table_queue_len(t, k->ptr, k->len));
        return;
    case STORE_OP_LIST_KEYS:
        op_list_keys(ops, r);
        return;
    case STORE_OP_BARRIER:
        op_barrier(ops, s, req, r);
        return;
    case STORE_OP_WATCH_KEY:
        drop(r, "WATCH_KEY (torch's legacy watch_key callback API) is not supported");
        return;
    default:
        drop(r, "unhandled operation %d", (int)req->op);
        return;
    }
    if (rc < 0) drop_on_write_error(ops, req, rc, r);
}

void store_ops_handle(store_ops_t *ops, store_session_t *s, const store_request_t *req,
                      store_ops_result_t *res) {
    res->woken = NULL;
    res->head_len = 0;
    res->body = NULL;
    res->body_len = 0;
    res->owned = NULL;
    res->drop[0] = '\0';
    ops->woken_head = ops->woken_tail = NULL;
    handle(ops, s, req, res);
    res->woken = ops->woken_head;
    ops->woken_head = ops->woken_tail = NULL;
}

void store_ops_result_free(store_ops_result_t *res) {
    free(res->owned);
    res->owned = NULL;
}

void store_ops_init(store_ops_t *ops, kv_table_t *table, const store_limits_t *limits,
                    const store_secret_t *secret) {
    *ops = (store_ops_t){.table = table, .limits = limits, .secret = secret};
}

void store_ops_session_init(store_ops_t *ops, store_session_t *s) {
    *s = (store_session_t){.ops = ops, .is_authed = !ops->secret->is_set};
}
