/* Unit tests of proto/store_proto: framing of every request and reply in both numberings,
 * byte-by-byte incremental decoding, dialect detection and every limit. */
#include <criterion/criterion.h>
#include <string.h>

#include "store_proto.h"

static store_limits_t lim;

static void setup(void) {
    store_limits_default(&lim);
}

TestSuite(store_proto, .init = setup);

/* Frame builder over a static buffer. */
typedef struct {
    uint8_t buf[1 << 16];
    store_writer_t w;
} frame_t;

static void frame_begin(frame_t *f, store_dialect_t d, store_op_t op) {
    store_writer_init(&f->w, f->buf, sizeof f->buf);
    int wire = store_proto_wire_opcode(d, op);
    cr_assert_geq(wire, 0, "op %s missing from dialect %d", store_op_name(op), d);
    store_put_u8(&f->w, (uint8_t)wire);
}

static void put_str(frame_t *f, const char *s) {
    store_put_bytes(&f->w, s, strlen(s));
}

static int decode(store_dialect_t d, const frame_t *f, size_t len, store_request_t *req,
                  size_t *need) {
    return store_proto_decode_request(d, &lim, f->buf, len, req, need);
}

/* Every prefix is NEED_MORE (with a growing, correct need hint); the whole frame decodes. */
static void expect_frame(store_dialect_t d, const frame_t *f, store_request_t *req) {
    size_t need = 0, last_need = 0;
    for (size_t n = 0; n < f->w.len; n++) {
        int rc = decode(d, f, n, req, &need);
        cr_assert_eq(rc, STORE_PROTO_NEED_MORE, "prefix %zu of %zu: rc %d", n, f->w.len, rc);
        cr_assert_gt(need, n, "need hint %zu not beyond %zu", need, n);
        cr_assert_leq(need, f->w.len, "need hint %zu beyond the frame %zu", need, f->w.len);
        cr_assert_geq(need, last_need);
        last_need = need;
    }
    int rc = decode(d, f, f->w.len, req, &need);
    cr_assert_eq(rc, (int)f->w.len, "full frame: rc %d, want %zu", rc, f->w.len);
}

static bool bytes_eq(store_bytes_t b, const char *s) {
    return b.len == strlen(s) && memcmp(b.ptr, s, b.len) == 0;
}

static const store_dialect_t dialects[] = {STORE_DIALECT_CURRENT, STORE_DIALECT_LEGACY};

Test(store_proto, set_get_add_cas_in_both_numberings) {
    for (int i = 0; i < 2; i++) {
        store_dialect_t d = dialects[i];
        frame_t f;
        store_request_t q;
        frame_begin(&f, d, STORE_OP_SET);
        put_str(&f, "key");
        put_str(&f, "value");
        expect_frame(d, &f, &q);
        cr_assert_eq(q.op, STORE_OP_SET);
        cr_assert(bytes_eq(q.key, "key") && bytes_eq(q.value, "value"));

        frame_begin(&f, d, STORE_OP_COMPARE_SET);
        put_str(&f, "k");
        put_str(&f, "");
        put_str(&f, "new");
        expect_frame(d, &f, &q);
        cr_assert_eq(q.op, STORE_OP_COMPARE_SET);
        cr_assert(bytes_eq(q.value, "") && bytes_eq(q.value2, "new"));

        frame_begin(&f, d, STORE_OP_ADD);
        put_str(&f, "ctr");
        store_put_i64(&f.w, -42);
        expect_frame(d, &f, &q);
        cr_assert_eq(q.op, STORE_OP_ADD);
        cr_assert_eq(q.add_delta, -42);

        const store_op_t key_ops[] = {STORE_OP_GET, STORE_OP_DELETE_KEY};
        for (int j = 0; j < 2; j++) {
            frame_begin(&f, d, key_ops[j]);
            put_str(&f, "some/key");
            expect_frame(d, &f, &q);
            cr_assert_eq(q.op, key_ops[j]);
            cr_assert(bytes_eq(q.key, "some/key"));
        }
        frame_begin(&f, d, STORE_OP_GETNUMKEYS);
        expect_frame(d, &f, &q);
        cr_assert_eq(q.op, STORE_OP_GETNUMKEYS);
    }
}

Test(store_proto, legacy_and_current_wire_numbers) {
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_SET), 0);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_GET), 2);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_WATCH_KEY), 7);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_DELETE_KEY), 8);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_CANCEL_WAIT), 12);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_PING), -1);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, STORE_OP_VALIDATE), -1);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_VALIDATE), 0);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_QUEUE_LEN), 16);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_BARRIER), 18);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_AUTH_HELLO), 0xD0);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_WATCH_KEY), -1);
    /* Byte 7 means GETNUMKEYS now and WATCH_KEY in the legacy numbering. */
    uint8_t b = 7;
    store_request_t q;
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_CURRENT, &lim, &b, 1, &q, NULL), 1);
    cr_assert_eq(q.op, STORE_OP_GETNUMKEYS);
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_LEGACY, &lim, &b, 1, &q, NULL),
                 STORE_PROTO_NEED_MORE);
}

Test(store_proto, current_only_operations) {
    store_dialect_t d = STORE_DIALECT_CURRENT;
    frame_t f;
    store_request_t q;
    frame_begin(&f, d, STORE_OP_VALIDATE);
    store_put_u32(&f.w, STORE_PROTO_MAGIC);
    expect_frame(d, &f, &q);
    cr_assert_eq(q.op, STORE_OP_VALIDATE);

    frame_begin(&f, d, STORE_OP_PING);
    store_put_u32(&f.w, 0xdeadbeef);
    expect_frame(d, &f, &q);
    cr_assert_eq(q.u32, 0xdeadbeef);

    frame_begin(&f, d, STORE_OP_QUEUE_PUSH);
    put_str(&f, "q");
    put_str(&f, "item");
    expect_frame(d, &f, &q);
    cr_assert(bytes_eq(q.key, "q") && bytes_eq(q.value, "item"));

    frame_begin(&f, d, STORE_OP_BARRIER);
    put_str(&f, "bar");
    store_put_i64(&f.w, 8);
    expect_frame(d, &f, &q);
    cr_assert_eq(q.op, STORE_OP_BARRIER);
    cr_assert_eq(q.add_delta, 8);

    frame_begin(&f, d, STORE_OP_LIST_KEYS);
    expect_frame(d, &f, &q);
    cr_assert_eq(q.op, STORE_OP_LIST_KEYS);

    frame_begin(&f, d, STORE_OP_AUTH_HELLO);
    store_put_u8(&f.w, 1);
    expect_frame(d, &f, &q);
    cr_assert_eq(q.u32, 1);

    frame_begin(&f, d, STORE_OP_AUTH_PROOF);
    uint8_t proof[64];
    for (int i = 0; i < 64; i++) proof[i] = (uint8_t)i;
    store_put_raw(&f.w, proof, sizeof proof);
    expect_frame(d, &f, &q);
    cr_assert_eq(memcmp(q.auth, proof, 64), 0);
}

Test(store_proto, multi_key_items_walk) {
    for (int i = 0; i < 2; i++) {
        store_dialect_t d = dialects[i];
        frame_t f;
        store_request_t q;
        frame_begin(&f, d, STORE_OP_MULTI_SET);
        store_put_u64(&f.w, 3);
        const char *kv[] = {"a", "1", "bb", "", "ccc", "333"};
        for (int j = 0; j < 6; j++) put_str(&f, kv[j]);
        expect_frame(d, &f, &q);
        cr_assert_eq(q.n_items, 3);
        size_t cursor = 0;
        store_bytes_t k, v;
        for (int j = 0; j < 3; j++) {
            cr_assert(store_proto_next_item(&q, &cursor, &k, &v));
            cr_assert(bytes_eq(k, kv[2 * j]) && bytes_eq(v, kv[2 * j + 1]), "pair %d", j);
        }
        cr_assert_not(store_proto_next_item(&q, &cursor, &k, &v));

        frame_begin(&f, d, STORE_OP_WAIT);
        store_put_u64(&f.w, 2);
        put_str(&f, "x");
        put_str(&f, "yy");
        expect_frame(d, &f, &q);
        cursor = 0;
        cr_assert(store_proto_next_item(&q, &cursor, &k, NULL) && bytes_eq(k, "x"));
        cr_assert(store_proto_next_item(&q, &cursor, &k, NULL) && bytes_eq(k, "yy"));
        cr_assert_not(store_proto_next_item(&q, &cursor, &k, NULL));

        frame_begin(&f, d, STORE_OP_CHECK);
        store_put_u64(&f.w, 0);
        expect_frame(d, &f, &q);
        cr_assert_eq(q.n_items, 0);
    }
}

Test(store_proto, detect_dialect_from_first_bytes) {
    const uint8_t current[] = {0x00, 0xCE, 0xF7, 0x85, 0x3C};
    cr_assert_eq(store_proto_detect_dialect(current, 0), STORE_DIALECT_UNKNOWN);
    for (size_t n = 1; n < 5; n++)
        cr_assert_eq(store_proto_detect_dialect(current, n), STORE_DIALECT_UNKNOWN, "n=%zu", n);
    cr_assert_eq(store_proto_detect_dialect(current, 5), STORE_DIALECT_CURRENT);
    const uint8_t legacy_get[] = {0x02, 0x00};
    cr_assert_eq(store_proto_detect_dialect(legacy_get, 1), STORE_DIALECT_LEGACY);
    const uint8_t legacy_set[] = {0x00, 0x03, 0x00, 0x00, 0x00};
    cr_assert_eq(store_proto_detect_dialect(legacy_set, 2), STORE_DIALECT_LEGACY);
    cr_assert_eq(store_proto_detect_dialect(legacy_set, 5), STORE_DIALECT_LEGACY);
    const uint8_t almost[] = {0x00, 0xCE, 0xF7, 0x85, 0x3D};
    cr_assert_eq(store_proto_detect_dialect(almost, 5), STORE_DIALECT_LEGACY);
}

Test(store_proto, every_limit_and_bad_input) {
    frame_t f;
    store_request_t q;
    size_t need;
    store_dialect_t d = STORE_DIALECT_CURRENT;

    uint8_t unknown = 0x7f;
    cr_assert_eq(store_proto_decode_request(d, &lim, &unknown, 1, &q, NULL), STORE_PROTO_E_OPCODE);
    uint8_t legacy_13 = 13;
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_LEGACY, &lim, &legacy_13, 1, &q, NULL),
                 STORE_PROTO_E_OPCODE);

    frame_begin(&f, d, STORE_OP_VALIDATE);
    store_put_u32(&f.w, 0x12345678);
    cr_assert_eq(decode(d, &f, f.w.len, &q, NULL), STORE_PROTO_E_BAD_MAGIC);

    /* Absurd lengths fail as soon as the 8-byte length is in, without waiting for the bytes. */
    frame_begin(&f, d, STORE_OP_GET);
    store_put_u64(&f.w, UINT64_C(1) << 63);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_E_KEY_TOO_LONG);
    frame_begin(&f, d, STORE_OP_GET);
    store_put_u64(&f.w, lim.max_key_bytes + 1);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_E_KEY_TOO_LONG);

    frame_begin(&f, d, STORE_OP_SET);
    put_str(&f, "k");
    store_put_u64(&f.w, lim.max_value_bytes + 1);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_E_VALUE_TOO_LONG);
    frame_begin(&f, d, STORE_OP_SET);
    put_str(&f, "k");
    store_put_u64(&f.w, UINT64_MAX);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_E_VALUE_TOO_LONG);

    frame_begin(&f, d, STORE_OP_WAIT);
    store_put_u64(&f.w, lim.max_keys_per_op + 1);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_E_TOO_MANY_KEYS);

    /* A value within its limit but a frame beyond max_frame_bytes. */
    store_limits_t small = lim;
    small.max_frame_bytes = 1000;
    frame_begin(&f, d, STORE_OP_SET);
    put_str(&f, "k");
    store_put_u64(&f.w, 5000);
    cr_assert_eq(store_proto_decode_request(d, &small, f.buf, f.w.len, &q, &need),
                 STORE_PROTO_E_FRAME_TOO_LONG);
    /* Many small keys add up beyond the frame limit too. */
    frame_begin(&f, d, STORE_OP_MULTI_GET);
    store_put_u64(&f.w, 200);
    for (int i = 0; i < 200; i++) put_str(&f, "key-key-key");
    cr_assert_eq(store_proto_decode_request(d, &small, f.buf, f.w.len, &q, &need),
                 STORE_PROTO_E_FRAME_TOO_LONG);

    /* The need hint of a large legal value is the whole frame, so a server can size once. */
    frame_begin(&f, d, STORE_OP_SET);
    put_str(&f, "k");
    store_put_u64(&f.w, 1u << 20);
    cr_assert_eq(decode(d, &f, f.w.len, &q, &need), STORE_PROTO_NEED_MORE);
    cr_assert_eq(need, 1 + 8 + 1 + 8 + (1u << 20));

    cr_assert_str_neq(store_proto_strerror(STORE_PROTO_E_KEY_TOO_LONG), "");
    cr_assert_str_eq(store_op_name(STORE_OP_COMPARE_SET), "COMPARE_SET");
}

Test(store_proto, replies_of_every_kind) {
    uint8_t buf[256];
    store_writer_t w;
    store_reply_t r;

    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_CHECK_NOT_READY);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_U8, &lim, buf, w.len, &r), 1);
    cr_assert_eq(r.u8, STORE_CHECK_NOT_READY);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_U8, &lim, buf, 0, &r), STORE_PROTO_NEED_MORE);

    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, -7);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_I64, &lim, buf, 7, &r), STORE_PROTO_NEED_MORE);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_I64, &lim, buf, 8, &r), 8);
    cr_assert_eq(r.i64, -7);

    store_writer_init(&w, buf, sizeof buf);
    store_put_u32(&w, 99);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_U32, &lim, buf, w.len, &r), 4);
    cr_assert_eq(r.u32, 99);

    store_writer_init(&w, buf, sizeof buf);
    store_put_bytes(&w, "hello", 5);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_BYTES, &lim, buf, w.len - 1, &r),
                 STORE_PROTO_NEED_MORE);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_BYTES, &lim, buf, w.len, &r), 13);
    cr_assert(bytes_eq(r.bytes, "hello"));

    store_writer_init(&w, buf, sizeof buf);
    store_put_u64(&w, lim.max_value_bytes + 1);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_BYTES, &lim, buf, w.len, &r),
                 STORE_PROTO_E_VALUE_TOO_LONG);

    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, 0);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_QUEUE_POP, &lim, buf, w.len, &r), 8);
    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, 2);
    store_put_bytes(&w, "it", 2);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_QUEUE_POP, &lim, buf, w.len, &r), 18);
    cr_assert(r.i64 == 2 && bytes_eq(r.bytes, "it"));

    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_AUTH_CHALLENGE);
    for (int i = 0; i < 32; i++) store_put_u8(&w, (uint8_t)i);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_HELLO, &lim, buf, 20, &r),
                 STORE_PROTO_NEED_MORE);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_HELLO, &lim, buf, w.len, &r), 33);
    cr_assert(r.bytes.len == 32 && r.bytes.ptr[31] == 31);
    buf[0] = STORE_AUTH_OPEN;
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_HELLO, &lim, buf, 1, &r), 1);
    buf[0] = 9;
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_HELLO, &lim, buf, 1, &r),
                 STORE_PROTO_E_BAD_VALUE);
    buf[0] = STORE_AUTH_DENIED;
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_PROOF, &lim, buf, 1, &r), 1);

    cr_assert_eq(store_proto_reply_kind(STORE_OP_SET), STORE_REPLY_NONE);
    cr_assert_eq(store_proto_reply_kind(STORE_OP_WAIT), STORE_REPLY_U8);
    cr_assert_eq(store_proto_reply_kind(STORE_OP_LIST_KEYS), STORE_REPLY_KEY_COUNT);
}

Test(store_proto, writer_reports_overflow) {
    uint8_t buf[4];
    store_writer_t w;
    store_writer_init(&w, buf, sizeof buf);
    store_put_u32(&w, 1);
    cr_assert_not(w.is_overflow);
    store_put_u8(&w, 1);
    cr_assert(w.is_overflow);
    cr_assert_eq(w.len, 4);
}
