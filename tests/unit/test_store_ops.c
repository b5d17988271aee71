/* Unit tests of launcher/store/store_ops without sockets: frames are encoded and decoded by proto,
 * then handled; each test checks the result store_server.c would carry out (the reply, the sessions
 * woken, the reason to drop the peer). The same requests over real connections are
 * test_store_server.c's. */
#include <criterion/criterion.h>
#include <string.h>

#include "store/kv_table.h"
#include "store_auth.h"
#include "store_limits.h"
#include "store/store_ops.h"
#include "store_proto.h"

static kv_table_t *table;
static store_limits_t limits;
static store_secret_t secret;
static store_ops_t ops;
static store_ops_result_t res;
static uint8_t frame[1 << 16];

static void setup(void) {
    store_limits_default(&limits);
    cr_assert_eq(kv_table_create(1 << 20, &table), 0);
    store_ops_init(&ops, table, &limits, &secret);
}

static void teardown(void) {
    store_ops_result_free(&res);
    kv_table_destroy(table);
}

TestSuite(store_ops, .init = setup, .fini = teardown);

static void session(store_session_t *s, store_dialect_t d) {
    store_ops_session_init(&ops, s);
    s->dialect = d;
    s->is_validated = true;
}

/* ---- requests: encoded, decoded by proto, handled ------------------------------------------ */

static store_writer_t begin(const store_session_t *s, store_op_t op) {
    store_writer_t w;
    store_writer_init(&w, frame, sizeof frame);
    int wire = store_proto_wire_opcode(s->dialect, op);
    cr_assert_geq(wire, 0);
    store_put_u8(&w, (uint8_t)wire);
    return w;
}

static void handle(store_session_t *s, const store_writer_t *w) {
    cr_assert_not(w->is_overflow);
    store_request_t req;
    int rc = store_proto_decode_request(s->dialect, &limits, frame, w->len, &req, NULL);
    cr_assert_eq(rc, (int)w->len, "decode: %d", rc);
    store_ops_result_free(&res);
    store_ops_handle(&ops, s, &req, &res);
}

static void put_str(store_writer_t *w, const char *text) {
    store_put_bytes(w, text, strlen(text));
}

static void op_key(store_session_t *s, store_op_t op, const char *key) {
    store_writer_t w = begin(s, op);
    put_str(&w, key);
    handle(s, &w);
}

static void op_key_value(store_session_t *s, store_op_t op, const char *key, const char *value) {
    store_writer_t w = begin(s, op);
    put_str(&w, key);
    put_str(&w, value);
    handle(s, &w);
}

static void op_wait(store_session_t *s, const char *key) {
    store_writer_t w = begin(s, STORE_OP_WAIT);
    store_put_u64(&w, 1);
    put_str(&w, key);
    handle(s, &w);
}

static void op_plain(store_session_t *s, store_op_t op) {
    store_writer_t w = begin(s, op);
    handle(s, &w);
}

/* ---- what the result says ------------------------------------------------------------------ */

static void expect_nothing(void) {
    cr_assert_eq(res.head_len + res.body_len, 0, "no reply");
    cr_assert_null(res.woken);
    cr_assert_str_empty(res.drop);
}

static void expect_u8(uint8_t v) {
    cr_assert_eq(res.head_len, 1);
    cr_assert_eq(res.head[0], v);
    cr_assert_str_empty(res.drop);
}

static void expect_bytes(const char *value) {
    size_t n = strlen(value);
    cr_assert_eq(res.head_len, 8);
    cr_assert_eq(store_load_u64(res.head), n);
    cr_assert_eq(res.body_len, n);
    cr_assert(n == 0 || memcmp(res.body, value, n) == 0);
}

static bool is_woken(const store_session_t *s) {
    for (const store_session_t *w = res.woken; w; w = w->next_woken)
        if (w == s) return true;
    return false;
}

/* ---- tests -------------------------------------------------------------------------------- */

Test(store_ops, set_replies_nothing_get_borrows_the_value) {
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    op_key_value(&a, STORE_OP_SET, "k", "value");
    expect_nothing();
    op_key(&a, STORE_OP_GET, "k");
    expect_bytes("value");
    cr_assert_null(res.owned, "a GET reply is the table's value, not a copy");
    op_key(&a, STORE_OP_GET, "missing");
    expect_bytes("");
}

Test(store_ops, a_set_returns_the_waiters_it_woke) {
    store_session_t a, b, c;
    session(&a, STORE_DIALECT_CURRENT);
    session(&b, STORE_DIALECT_CURRENT);
    session(&c, STORE_DIALECT_CURRENT);
    op_wait(&a, "k");
    expect_nothing();
    cr_assert_not_null(a.waiter);
    op_wait(&b, "k");
    op_key_value(&c, STORE_OP_SET, "other", "1");
    expect_nothing();
    op_key_value(&c, STORE_OP_SET, "k", "1");
    cr_assert_eq(res.head_len + res.body_len, 0, "SET itself has no reply");
    cr_assert(is_woken(&a) && is_woken(&b));
    cr_assert_not(is_woken(&c));
    cr_assert_null(a.waiter);
    cr_assert_null(b.waiter);
    op_key_value(&c, STORE_OP_SET, "k", "2");
    cr_assert_null(res.woken, "a waiter is woken once");
}

Test(store_ops, wait_on_a_present_key_replies_at_once) {
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    op_key_value(&a, STORE_OP_SET, "k", "v");
    op_wait(&a, "k");
    expect_u8(STORE_WAIT_STOP_WAITING);
    cr_assert_null(a.waiter);
}

Test(store_ops, legacy_client_wakes_its_own_abandoned_wait) {
    store_session_t a;
    session(&a, STORE_DIALECT_LEGACY);
    op_wait(&a, "k");
    op_wait(&a, "k"); /* torch <= 2.1: the abandoned WAIT is replaced */
    cr_assert_str_empty(res.drop);
    store_writer_t w = begin(&a, STORE_OP_COMPARE_SET);
    put_str(&w, "k");
    put_str(&w, "");
    put_str(&w, "x");
    handle(&a, &w);
    cr_assert_eq(res.woken, &a, "its STOP_WAITING goes out before the reply");
    cr_assert_null(a.next_woken);
    expect_bytes("x");
}

Test(store_ops, second_wait_of_a_current_client_drops_it) {
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    op_wait(&a, "k");
    op_wait(&a, "k");
    cr_assert(strstr(res.drop, "previous WAIT is still pending"), "%s", res.drop);
}

Test(store_ops, cancel_wait_and_forget_waiter) {
    store_session_t a, b;
    session(&a, STORE_DIALECT_CURRENT);
    session(&b, STORE_DIALECT_CURRENT);
    op_wait(&a, "k");
    op_plain(&a, STORE_OP_CANCEL_WAIT);
    expect_u8(STORE_WAIT_CANCELED);
    op_wait(&a, "k2");
    store_ops_forget_waiter(&a); /* the connection closed */
    cr_assert_null(a.waiter);
    op_key_value(&b, STORE_OP_SET, "k", "1");
    op_key_value(&b, STORE_OP_SET, "k2", "1");
    expect_nothing();
}

Test(store_ops, queue_pop_owns_its_item) {
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    op_key_value(&a, STORE_OP_QUEUE_PUSH, "q", "item");
    expect_nothing();
    op_key(&a, STORE_OP_QUEUE_POP, "q");
    cr_assert_eq(res.head_len, 16);
    cr_assert_eq((int64_t)store_load_u64(res.head), 1, "length before the pop");
    cr_assert_eq(store_load_u64(res.head + 8), 4);
    cr_assert_not_null(res.owned);
    cr_assert_eq(res.body_len, 4);
    cr_assert_eq(memcmp(res.body, "item", 4), 0);
    op_key(&a, STORE_OP_QUEUE_POP, "q");
    cr_assert_eq(res.head_len, 8, "an empty queue: the length only");
    cr_assert_eq(res.body_len, 0);
}

Test(store_ops, a_full_store_drops_the_writer_naming_the_limit) {
    kv_table_destroy(table);
    cr_assert_eq(kv_table_create(64, &table), 0);
    store_ops_init(&ops, table, &limits, &secret);
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    char big[200];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    op_key_value(&a, STORE_OP_SET, "k", big);
    cr_assert(strstr(res.drop, "SET 'k' refused: the store holds 0 bytes, limit"), "%s", res.drop);
}

Test(store_ops, add_on_text_drops) {
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    op_key_value(&a, STORE_OP_SET, "k", "abc");
    store_writer_t w = begin(&a, STORE_OP_ADD);
    put_str(&w, "k");
    store_put_i64(&w, 1);
    handle(&a, &w);
    cr_assert_eq(res.head_len, 0);
    cr_assert(strstr(res.drop, "ADD on key 'k' whose value is not a 64-bit integer"), "%s",
              res.drop);
}

Test(store_ops, authentication) {
    cr_assert_eq(store_auth_init(), 0);
    char err[256];
    const char *text = "a shared secret of some length";
    cr_assert_eq(store_secret_from_text(text, strlen(text), "test", &secret, err, sizeof err), 0);
    store_session_t a;
    session(&a, STORE_DIALECT_CURRENT);
    cr_assert_not(a.is_authed);
    op_key(&a, STORE_OP_GET, "k");
    cr_assert(strstr(res.drop, "GET before authentication refused"), "%s", res.drop);

    store_writer_t w = begin(&a, STORE_OP_AUTH_HELLO);
    store_put_u8(&w, STORE_AUTH_VERSION);
    handle(&a, &w);
    cr_assert_eq(res.head_len, 1 + STORE_AUTH_NONCE_BYTES);
    cr_assert_eq(res.head[0], STORE_AUTH_CHALLENGE);
    cr_assert_eq(memcmp(res.head + 1, a.server_nonce, STORE_AUTH_NONCE_BYTES), 0);

    uint8_t proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES] = {1, 2, 3};
    store_auth_client_mac(&secret, a.server_nonce, proof, proof + STORE_AUTH_NONCE_BYTES);
    w = begin(&a, STORE_OP_AUTH_PROOF);
    store_put_raw(&w, proof, sizeof proof);
    handle(&a, &w);
    cr_assert_eq(res.head_len, 1 + STORE_AUTH_MAC_BYTES);
    cr_assert_eq(res.head[0], STORE_AUTH_OK);
    uint8_t server_mac[STORE_AUTH_MAC_BYTES];
    store_auth_server_mac(&secret, a.server_nonce, proof, server_mac);
    cr_assert_eq(memcmp(res.head + 1, server_mac, sizeof server_mac), 0);
    cr_assert(a.is_authed);
    cr_assert_str_empty(res.drop);

    store_session_t b;
    session(&b, STORE_DIALECT_CURRENT);
    w = begin(&b, STORE_OP_AUTH_HELLO);
    store_put_u8(&w, STORE_AUTH_VERSION);
    handle(&b, &w);
    proof[STORE_AUTH_NONCE_BYTES] ^= 1; /* a MAC for another nonce, and broken */
    w = begin(&b, STORE_OP_AUTH_PROOF);
    store_put_raw(&w, proof, sizeof proof);
    handle(&b, &w);
    cr_assert_eq(res.head_len, 1);
    cr_assert_eq(res.head[0], STORE_AUTH_DENIED, "the denial goes out before the drop");
    cr_assert(strstr(res.drop, "different shared secret"), "%s", res.drop);
    cr_assert_not(b.is_authed);
}
