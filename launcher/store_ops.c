/* store_ops: what each TCPStore request does to the table and what goes back, with PyTorch's
 * semantics (TCPStoreLibUvBackend.cpp is the reference), plus ddprun's auth handshake.
 * Framing, limits and sockets are store_server.c's. Loop thread only. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "store_conn.h"

static void send_u8(store_conn_t *c, uint8_t v) {
    store_conn_send(c, &v, 1, NULL, 0);
}

static void send_i64(store_conn_t *c, int64_t v) {
    uint8_t b[8];
    store_writer_t w;
    store_writer_init(&w, b, sizeof b);
    store_put_i64(&w, v);
    store_conn_send(c, b, sizeof b, NULL, 0);
}

static void send_bytes(store_conn_t *c, const uint8_t *p, size_t n) {
    uint8_t head[8];
    store_writer_t w;
    store_writer_init(&w, head, sizeof head);
    store_put_u64(&w, n);
    store_conn_send(c, head, sizeof head, p, n);
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
static void drop_on_write_error(store_conn_t *c, const store_request_t *req, int rc) {
    char key[64];
    print_key(&req->key, key, sizeof key);
    if (rc == -ENOSPC)
        store_conn_drop(c, "%s '%s' refused: the store holds %zu bytes, limit %zu",
                        store_op_name(req->op), key, kv_table_bytes(c->srv->table),
                        c->srv->limits.max_store_bytes);
    else
        store_conn_drop(c, "%s '%s' failed: %s", store_op_name(req->op), key, strerror(-rc));
}

static void on_wait_done(void *owner) {
    store_conn_t *c = owner;
    c->waiter = NULL;
    send_u8(c, STORE_WAIT_STOP_WAITING);
}

void store_ops_forget_waiter(store_conn_t *c) {
    if (!c->waiter) return;
    kv_table_wait_cancel(c->srv->table, c->waiter);
    c->waiter = NULL;
}

static void op_wait(store_conn_t *c, const store_request_t *req) {
    kv_table_t *t = c->srv->table;
    if (c->waiter) {
        if (c->dialect != STORE_DIALECT_LEGACY) {
            store_conn_drop(c, "WAIT sent while its previous WAIT is still pending");
            return;
        }
        /* torch <= 2.1 abandons a timed-out WAIT without cancelling it and keeps using the
         * connection (its next get() starts with a WAIT), as torch's own server allows: the new
         * WAIT replaces the abandoned one. */
        store_ops_forget_waiter(c);
    }
    kv_waiter_t *w = NULL;
    int rc = kv_table_wait_begin(t, req->n_items, on_wait_done, c, &w);
    size_t cursor = 0;
    store_bytes_t key;
    while (rc == 0 && store_proto_next_item(req, &cursor, &key, NULL))
        rc = kv_table_wait_add_key(t, w, key.ptr, key.len);
    if (rc < 0) {
        if (w) kv_table_wait_cancel(t, w);
        store_conn_drop(c, "WAIT on %llu keys failed: %s", (unsigned long long)req->n_items,
                        rc == -ENOSPC ? "the store is full" : strerror(-rc));
        return;
    }
    if (kv_table_wait_commit(t, w) == 1) send_u8(c, STORE_WAIT_STOP_WAITING);
    else c->waiter = w;
}

static void op_multi_get(store_conn_t *c, const store_request_t *req) {
    kv_table_t *t = c->srv->table;
    size_t cursor = 0, total = 0, n;
    store_bytes_t key;
    while (store_proto_next_item(req, &cursor, &key, NULL)) {
        kv_table_get(t, key.ptr, key.len, &n);
        total += 8 + n;
        if (total > c->srv->limits.max_output_bytes) {
            /* Many keys naming one big value would multiply it: bound the reply, not the claim. */
            store_conn_drop(c, "MULTI_GET reply above the output limit of %zu bytes",
                            c->srv->limits.max_output_bytes);
            return;
        }
    }
    uint8_t *buf = malloc(total ? total : 1);
    if (!buf) {
        store_conn_drop(c, "out of memory building a %zu-byte MULTI_GET reply", total);
        return;
    }
    store_writer_t w;
    store_writer_init(&w, buf, total);
    for (cursor = 0; store_proto_next_item(req, &cursor, &key, NULL);) {
        const uint8_t *v = kv_table_get(t, key.ptr, key.len, &n);
        store_put_bytes(&w, v, n);
    }
    store_conn_send(c, buf, w.len, NULL, 0);
    free(buf);
}

static void op_list_keys(store_conn_t *c) {
    kv_table_t *t = c->srv->table;
    size_t cursor = 0, total = 8, n;
    const uint8_t *key;
    int64_t count = 0;
    while (kv_table_next_key(t, &cursor, &key, &n)) {
        total += 8 + n;
        count++;
    }
    if (total > c->srv->limits.max_output_bytes) {
        store_conn_drop(c, "LIST_KEYS reply of %zu bytes above the output limit of %zu bytes",
                        total, c->srv->limits.max_output_bytes);
        return;
    }
    uint8_t *buf = malloc(total);
    if (!buf) {
        store_conn_drop(c, "out of memory building a %zu-byte LIST_KEYS reply", total);
        return;
    }
    store_writer_t w;
    store_writer_init(&w, buf, total);
    store_put_i64(&w, count);
    for (cursor = 0; kv_table_next_key(t, &cursor, &key, &n);) store_put_bytes(&w, key, n);
    store_conn_send(c, buf, w.len, NULL, 0);
    free(buf);
}

static void op_barrier(store_conn_t *c, const store_request_t *req) {
    if (c->waiter) {
        store_conn_drop(c, "BARRIER sent while a WAIT is still pending");
        return;
    }
    kv_waiter_t *w = NULL;
    int rc = kv_table_barrier(c->srv->table, req->key.ptr, req->key.len, req->add_delta,
                              on_wait_done, c, &w);
    if (rc == 1) send_u8(c, STORE_WAIT_STOP_WAITING);
    else if (rc == 0) c->waiter = w;
    else if (rc == -EINVAL || rc == -ERANGE)
        store_conn_drop(c, "BARRIER on a key whose value is not a 64-bit integer");
    else drop_on_write_error(c, req, rc);
}

static void op_auth_hello(store_conn_t *c, const store_request_t *req) {
    if (req->u32 != STORE_AUTH_VERSION) {
        store_conn_drop(c, "auth hello of unsupported version %u", req->u32);
        return;
    }
    if (!c->srv->secret.is_set) {
        send_u8(c, STORE_AUTH_OPEN);
        return;
    }
    uint8_t reply[1 + STORE_AUTH_NONCE_BYTES] = {STORE_AUTH_CHALLENGE};
    store_auth_random_nonce(c->server_nonce);
    memcpy(reply + 1, c->server_nonce, STORE_AUTH_NONCE_BYTES);
    c->is_challenged = true;
    store_conn_send(c, reply, sizeof reply, NULL, 0);
}

static void op_auth_proof(store_conn_t *c, const store_request_t *req) {
    if (!c->is_challenged || c->is_authed) {
        store_conn_drop(c, "auth proof without a pending challenge");
        return;
    }
    const uint8_t *client_nonce = req->auth, *proof = req->auth + STORE_AUTH_NONCE_BYTES;
    uint8_t expect[STORE_AUTH_MAC_BYTES];
    store_auth_client_mac(&c->srv->secret, c->server_nonce, client_nonce, expect);
    c->is_challenged = false;
    if (!store_auth_mac_equal(expect, proof)) {
        send_u8(c, STORE_AUTH_DENIED);
        store_conn_drop(c, "authentication failed: the client holds a different shared secret");
        return;
    }
    uint8_t reply[1 + STORE_AUTH_MAC_BYTES] = {STORE_AUTH_OK};
    store_auth_server_mac(&c->srv->secret, c->server_nonce, client_nonce, reply + 1);
    c->is_authed = true;
    store_conn_send(c, reply, sizeof reply, NULL, 0);
}

void store_ops_handle(store_conn_t *c, const store_request_t *req) {
    kv_table_t *t = c->srv->table;
    const store_bytes_t *k = &req->key;
    int rc = 0;
    size_t n;
    const uint8_t *v;

    if (!c->is_authed && req->op != STORE_OP_VALIDATE && req->op != STORE_OP_AUTH_HELLO &&
        req->op != STORE_OP_AUTH_PROOF) {
        store_conn_drop(c, "%s before authentication refused: this store requires the shared "
                           "secret (ddprun's --secret-file / DDPRUN_STORE_SECRET)",
                        store_op_name(req->op));
        return;
    }
    switch (req->op) {
    case STORE_OP_VALIDATE:
        if (c->is_validated) store_conn_drop(c, "VALIDATE sent twice");
        c->is_validated = true;
        return;
    case STORE_OP_AUTH_HELLO: op_auth_hello(c, req); return;
    case STORE_OP_AUTH_PROOF: op_auth_proof(c, req); return;
    case STORE_OP_PING: {
        uint8_t b[4];
        store_writer_t w;
        store_writer_init(&w, b, sizeof b);
        store_put_u32(&w, req->u32);
        store_conn_send(c, b, sizeof b, NULL, 0);
        return;
    }
    case STORE_OP_SET: rc = kv_table_set(t, k->ptr, k->len, req->value.ptr, req->value.len); break;
    case STORE_OP_COMPARE_SET:
        rc = kv_table_compare_set(t, k->ptr, k->len, req->value.ptr, req->value.len,
                                  req->value2.ptr, req->value2.len, &v, &n);
        if (rc == 0) send_bytes(c, v, n);
        break;
    case STORE_OP_GET:
        v = kv_table_get(t, k->ptr, k->len, &n);
        send_bytes(c, v, n);
        return;
    case STORE_OP_ADD: {
        int64_t result;
        rc = kv_table_add(t, k->ptr, k->len, req->add_delta, &result);
        if (rc == 0) send_i64(c, result);
        if (rc == -EINVAL || rc == -ERANGE) {
            char key[64];
            print_key(k, key, sizeof key);
            store_conn_drop(c, "ADD on key '%s' whose value is not a 64-bit integer", key);
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
        send_u8(c, is_ready ? STORE_CHECK_READY : STORE_CHECK_NOT_READY);
        return;
    }
    case STORE_OP_WAIT: op_wait(c, req); return;
    case STORE_OP_GETNUMKEYS: send_i64(c, kv_table_num_keys(t)); return;
    case STORE_OP_DELETE_KEY: send_i64(c, kv_table_delete(t, k->ptr, k->len)); return;
    case STORE_OP_APPEND:
        v = kv_table_get(t, k->ptr, k->len, &n);
        if (n + req->value.len > c->srv->limits.max_value_bytes) {
            store_conn_drop(c, "APPEND would make a value longer than the value-size limit (%zu "
                               "bytes)", c->srv->limits.max_value_bytes);
            return;
        }
        rc = kv_table_append(t, k->ptr, k->len, req->value.ptr, req->value.len);
        break;
    case STORE_OP_MULTI_GET: op_multi_get(c, req); return;
    case STORE_OP_MULTI_SET: {
        size_t cursor = 0;
        store_bytes_t key, val;
        while (rc == 0 && store_proto_next_item(req, &cursor, &key, &val))
            rc = kv_table_set(t, key.ptr, key.len, val.ptr, val.len);
        break;
    }
    case STORE_OP_CANCEL_WAIT:
        store_ops_forget_waiter(c);
        send_u8(c, STORE_WAIT_CANCELED);
        return;
    case STORE_OP_QUEUE_PUSH:
        rc = kv_table_queue_push(t, k->ptr, k->len, req->value.ptr, req->value.len);
        break;
    case STORE_OP_QUEUE_POP: {
        int64_t len_before;
        uint8_t *item;
        rc = kv_table_queue_pop(t, k->ptr, k->len, &len_before, &item, &n);
        if (rc < 0) break;
        uint8_t head[16];
        store_writer_t w;
        store_writer_init(&w, head, sizeof head);
        store_put_i64(&w, len_before);
        if (len_before > 0) store_put_u64(&w, n);
        store_conn_send(c, head, w.len, item, n);
        free(item);
        return;
    }
    case STORE_OP_QUEUE_LEN: send_i64(c, kv_table_queue_len(t, k->ptr, k->len)); return;
    case STORE_OP_LIST_KEYS: op_list_keys(c); return;
    case STORE_OP_BARRIER: op_barrier(c, req); return;
    case STORE_OP_WATCH_KEY:
        store_conn_drop(c, "WATCH_KEY (torch's legacy watch_key callback API) is not supported");
        return;
    default: store_conn_drop(c, "unhandled operation %d", (int)req->op); return;
    }
    if (rc < 0) drop_on_write_error(c, req, rc);
}
