/* Unit tests of proto/store_proto: framing of every request in both numberings, fed byte by byte,
 * dialect detection, every decoder error and limit (absurd lengths must fail from the header
 * alone), every reply kind, the item walker and the writer. Pure: no I/O. */
#include <criterion/criterion.h>
#include <string.h>

#include "store_proto.h"

static store_limits_t lim;

static void setup(void) {
    store_limits_default(&lim);
}

TestSuite(store_proto, .init = setup);

/* ---- helpers ------------------------------------------------------------------------------ */

/* Frame builder over a static buffer. */
typedef struct {
    uint8_t buf[1 << 16];
    store_writer_t w;
} frame_t;

static void frame_raw(frame_t *f, uint8_t wire) {
    store_writer_init(&f->w, f->buf, sizeof f->buf);
    store_put_u8(&f->w, wire);
}

static void frame_begin(frame_t *f, store_dialect_t d, store_op_t op) {
    int wire = store_proto_wire_opcode(d, op);
    cr_assert_geq(wire, 0, "op %s missing from dialect %d", store_op_name(op), d);
    frame_raw(f, (uint8_t)wire);
}

static void put_str(frame_t *f, const char *s) {
    store_put_bytes(&f->w, s, strlen(s));
}

/* n bytes of filler as a u64-length string. */
static void put_filler(frame_t *f, size_t n) {
    store_put_u64(&f->w, n);
    for (size_t i = 0; i < n; i++)
        store_put_u8(&f->w, (uint8_t)('a' + i % 26));
}

static int decode_with(store_dialect_t d, const store_limits_t *l, const frame_t *f, size_t len,
                       store_request_t *req, size_t *need) {
    return store_proto_decode_request(d, l, f->buf, len, req, need);
}

static int decode(store_dialect_t d, const frame_t *f, size_t len, store_request_t *req,
                  size_t *need) {
    return decode_with(d, &lim, f, len, req, need);
}

/* The frame decodes exactly:
 * - every proper prefix is NEED_MORE with a need hint beyond the prefix, within the frame and never
 *   shrinking as bytes arrive;
 * - a reader that waits for exactly `need` bytes each time reaches the frame in a few steps;
 * - decoding resumed where the previous prefix left off answers as decoding afresh;
 * - trailing bytes of a next frame are not consumed. */
static void expect_frame(store_dialect_t d, const frame_t *f, store_request_t *req) {
    cr_assert_not(f->w.is_overflow);
    size_t len = f->w.len, need = 0, last_need = 0;
    for (size_t n = 0; n < len; n++) {
        int rc = decode(d, f, n, req, &need);
        cr_assert_eq(rc, STORE_PROTO_NEED_MORE, "prefix %zu of %zu: rc %d", n, len, rc);
        cr_assert_gt(need, n, "need hint %zu not beyond the %zu bytes held", need, n);
        cr_assert_leq(need, len, "need hint %zu beyond the %zu-byte frame", need, len);
        cr_assert_geq(need, last_need, "need hint shrank from %zu to %zu", last_need, need);
        last_need = need;
    }
    size_t have = 0;
    int steps = 0, rc;
    while ((rc = decode(d, f, have, req, &need)) == STORE_PROTO_NEED_MORE) {
        cr_assert_gt(need, have, "waiting for need=%zu bytes would not make progress", need);
        have = need;
        cr_assert_lt(++steps, 64, "too many steps to decode a %zu-byte frame", len);
    }
    cr_assert_eq(rc, (int)len, "frame read by need hints: rc %d, want %zu", rc, len);

    store_proto_resume_t resume = {0};
    for (size_t n = 0; n <= len; n++) {
        size_t plain_need = 0, resumed_need = 0;
        int plain = decode(d, f, n, req, &plain_need);
        rc = store_proto_decode_request_resume(d, &lim, f->buf, n, req, &resumed_need, &resume);
        cr_assert_eq(rc, plain, "prefix %zu resumed: rc %d, afresh %d", n, rc, plain);
        if (rc == STORE_PROTO_NEED_MORE)
            cr_assert_eq(resumed_need, plain_need, "prefix %zu resumed: need %zu, afresh %zu", n,
                         resumed_need, plain_need);
    }

    frame_t g = *f;
    g.w.data = g.buf;
    store_put_raw(&g.w, "\x03garbage", 8);
    rc = decode(d, &g, g.w.len, req, &need);
    cr_assert_eq(rc, (int)len, "with trailing bytes: rc %d, want %zu", rc, len);
    /* Decode the original last, so req points into the caller's frame. */
    cr_assert_eq(decode(d, f, len, req, &need), (int)len);
}

static bool bytes_eq_n(store_bytes_t b, const void *p, size_t n) {
    return b.len == n && (n == 0 || memcmp(b.ptr, p, n) == 0);
}

static bool bytes_eq(store_bytes_t b, const char *s) {
    return bytes_eq_n(b, s, strlen(s));
}

static const store_dialect_t dialects[] = {STORE_DIALECT_CURRENT, STORE_DIALECT_LEGACY};

/* ---- wire numbering ----------------------------------------------------------------------- */

Test(store_proto, legacy_numbering_table) {
    const store_op_t legacy[] = {
        STORE_OP_SET,         STORE_OP_COMPARE_SET, STORE_OP_GET,        STORE_OP_ADD,
        STORE_OP_CHECK,       STORE_OP_WAIT,        STORE_OP_GETNUMKEYS, STORE_OP_WATCH_KEY,
        STORE_OP_DELETE_KEY,  STORE_OP_APPEND,      STORE_OP_MULTI_GET,  STORE_OP_MULTI_SET,
        STORE_OP_CANCEL_WAIT,
    };
    for (int wire = 0; wire < 13; wire++) {
        cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, legacy[wire]), wire, "%s",
                     store_op_name(legacy[wire]));
    }
    const store_op_t absent[] = {STORE_OP_VALIDATE,  STORE_OP_PING,       STORE_OP_QUEUE_PUSH,
                                 STORE_OP_QUEUE_POP, STORE_OP_QUEUE_LEN,  STORE_OP_LIST_KEYS,
                                 STORE_OP_BARRIER,   STORE_OP_AUTH_HELLO, STORE_OP_AUTH_PROOF};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++)
        cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_LEGACY, absent[i]), -1, "%s",
                     store_op_name(absent[i]));
    /* Every byte from 13 up is unknown in the legacy numbering. */
    store_request_t q;
    for (unsigned b = 13; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        cr_assert_eq(store_proto_decode_request(STORE_DIALECT_LEGACY, &lim, &byte, 1, &q, NULL),
                     STORE_PROTO_E_OPCODE, "legacy byte %u", b);
    }
}

Test(store_proto, current_numbering_table) {
    for (int op = STORE_OP_VALIDATE; op <= STORE_OP_BARRIER; op++)
        cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, (store_op_t)op), op);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_QUEUE_LEN), 16);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_AUTH_HELLO), 0xD0);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_AUTH_PROOF), 0xD1);
    cr_assert_eq(store_proto_wire_opcode(STORE_DIALECT_CURRENT, STORE_OP_WATCH_KEY), -1);
    store_request_t q;
    for (unsigned b = 0; b < 256; b++) {
        bool is_known = b <= 18 || b == 0xD0 || b == 0xD1;
        uint8_t byte = (uint8_t)b;
        int rc = store_proto_decode_request(STORE_DIALECT_CURRENT, &lim, &byte, 1, &q, NULL);
        if (is_known)
            cr_assert_geq(rc, 0, "current byte %u refused (%d)", b, rc);
        else
            cr_assert_eq(rc, STORE_PROTO_E_OPCODE, "current byte %u: rc %d", b, rc);
    }
    /* Byte 7 means GETNUMKEYS now (complete in 1 byte) and WATCH_KEY (needs a key) before. */
    uint8_t b7 = 7;
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_CURRENT, &lim, &b7, 1, &q, NULL), 1);
    cr_assert_eq(q.op, STORE_OP_GETNUMKEYS);
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_LEGACY, &lim, &b7, 1, &q, NULL),
                 STORE_PROTO_NEED_MORE);
}

Test(store_proto, names_and_messages) {
    for (int op = 0; op < STORE_OP__COUNT; op++) {
        const char *name = store_op_name((store_op_t)op);
        cr_assert(name && strcmp(name, "?") != 0, "op %d has no name", op);
    }
    cr_assert_str_eq(store_op_name(STORE_OP_COMPARE_SET), "COMPARE_SET");
    cr_assert_str_eq(store_op_name(STORE_OP__COUNT), "?");
    const int statuses[] = {
        STORE_PROTO_NEED_MORE,        STORE_PROTO_E_OPCODE,        STORE_PROTO_E_KEY_TOO_LONG,
        STORE_PROTO_E_VALUE_TOO_LONG, STORE_PROTO_E_TOO_MANY_KEYS, STORE_PROTO_E_FRAME_TOO_LONG,
        STORE_PROTO_E_BAD_MAGIC,      STORE_PROTO_E_NOT_VALIDATED, STORE_PROTO_E_BAD_VALUE};
    const int n = sizeof statuses / sizeof statuses[0];
    for (int i = 0; i < n; i++) {
        const char *m = store_proto_strerror(statuses[i]);
        cr_assert(m && *m);
        for (int j = 0; j < i; j++)
            cr_assert_str_neq(m, store_proto_strerror(statuses[j]), "statuses %d and %d",
                              statuses[i], statuses[j]);
    }
}

/* ---- every request, both numberings ------------------------------------------------------- */

static const char KEY[] = "key/\x01\xff";
static const uint8_t VAL[] = {'v', 0, 'a', 0xff, 'l'};
static const char DESIRED[] = "desired";
static const char *const ITEM_KEYS[] = {"a", "", "ccc"};
static const char *const ITEM_VALS[] = {"1", "two", ""};
#define N_ITEMS 3

/* Write a representative body for op; check_request then verifies every decoded field. */
static void put_body(frame_t *f, store_op_t op, uint8_t proof[64]) {
    switch (op) {
    case STORE_OP_VALIDATE:
        store_put_u32(&f->w, STORE_PROTO_MAGIC);
        break;
    case STORE_OP_PING:
        store_put_u32(&f->w, 0xA1B2C3D4u);
        break;
    case STORE_OP_SET:
    case STORE_OP_APPEND:
    case STORE_OP_QUEUE_PUSH:
        put_str(f, KEY);
        store_put_bytes(&f->w, VAL, sizeof VAL);
        break;
    case STORE_OP_COMPARE_SET:
        put_str(f, KEY);
        store_put_bytes(&f->w, VAL, sizeof VAL);
        put_str(f, DESIRED);
        break;
    case STORE_OP_GET:
    case STORE_OP_DELETE_KEY:
    case STORE_OP_QUEUE_POP:
    case STORE_OP_QUEUE_LEN:
    case STORE_OP_WATCH_KEY:
        put_str(f, KEY);
        break;
    case STORE_OP_ADD:
    case STORE_OP_BARRIER:
        put_str(f, KEY);
        store_put_i64(&f->w, INT64_C(-1234567890123));
        break;
    case STORE_OP_CHECK:
    case STORE_OP_WAIT:
    case STORE_OP_MULTI_GET:
    case STORE_OP_MULTI_SET:
        store_put_u64(&f->w, N_ITEMS);
        for (int i = 0; i < N_ITEMS; i++) {
            put_str(f, ITEM_KEYS[i]);
            if (op == STORE_OP_MULTI_SET) put_str(f, ITEM_VALS[i]);
        }
        break;
    case STORE_OP_GETNUMKEYS:
    case STORE_OP_CANCEL_WAIT:
    case STORE_OP_LIST_KEYS:
        break;
    case STORE_OP_AUTH_HELLO:
        store_put_u8(&f->w, STORE_AUTH_VERSION);
        break;
    case STORE_OP_AUTH_PROOF:
        for (int i = 0; i < 64; i++)
            proof[i] = (uint8_t)(i * 7 + 1);
        store_put_raw(&f->w, proof, 64);
        break;
    default:
        cr_assert_fail("no body for %s", store_op_name(op));
    }
}

static void check_request(store_op_t op, const store_request_t *q, const uint8_t proof[64]) {
    cr_assert_eq(q->op, op, "decoded %s as %s", store_op_name(op), store_op_name(q->op));
    switch (op) {
    case STORE_OP_VALIDATE:
        cr_assert_eq(q->u32, STORE_PROTO_MAGIC);
        break;
    case STORE_OP_PING:
        cr_assert_eq(q->u32, 0xA1B2C3D4u);
        break;
    case STORE_OP_SET:
    case STORE_OP_APPEND:
    case STORE_OP_QUEUE_PUSH:
        cr_assert(bytes_eq(q->key, KEY));
        cr_assert(bytes_eq_n(q->value, VAL, sizeof VAL));
        break;
    case STORE_OP_COMPARE_SET:
        cr_assert(bytes_eq(q->key, KEY));
        cr_assert(bytes_eq_n(q->value, VAL, sizeof VAL), "expected value");
        cr_assert(bytes_eq(q->value2, DESIRED), "desired value");
        break;
    case STORE_OP_GET:
    case STORE_OP_DELETE_KEY:
    case STORE_OP_QUEUE_POP:
    case STORE_OP_QUEUE_LEN:
    case STORE_OP_WATCH_KEY:
        cr_assert(bytes_eq(q->key, KEY));
        cr_assert_eq(q->value.len, 0);
        break;
    case STORE_OP_ADD:
    case STORE_OP_BARRIER:
        cr_assert(bytes_eq(q->key, KEY));
        cr_assert_eq(q->add_delta, INT64_C(-1234567890123));
        break;
    case STORE_OP_CHECK:
    case STORE_OP_WAIT:
    case STORE_OP_MULTI_GET:
    case STORE_OP_MULTI_SET: {
        cr_assert_eq(q->n_items, N_ITEMS);
        size_t cursor = 0;
        store_bytes_t k, v;
        for (int i = 0; i < N_ITEMS; i++) {
            cr_assert(store_proto_next_item(q, &cursor, &k, &v), "item %d missing", i);
            cr_assert(bytes_eq(k, ITEM_KEYS[i]), "key %d", i);
            if (op == STORE_OP_MULTI_SET)
                cr_assert(bytes_eq(v, ITEM_VALS[i]), "value %d", i);
            else
                cr_assert(v.ptr == NULL && v.len == 0);
        }
        cr_assert_not(store_proto_next_item(q, &cursor, &k, &v));
        break;
    }
    case STORE_OP_GETNUMKEYS:
    case STORE_OP_CANCEL_WAIT:
    case STORE_OP_LIST_KEYS:
        break;
    case STORE_OP_AUTH_HELLO:
        cr_assert_eq(q->u32, STORE_AUTH_VERSION);
        break;
    case STORE_OP_AUTH_PROOF:
        cr_assert_not_null(q->auth);
        cr_assert_eq(memcmp(q->auth, proof, 64), 0);
        break;
    default:
        cr_assert_fail("unchecked %s", store_op_name(op));
    }
}

Test(store_proto, every_request_in_both_numberings_byte_by_byte) {
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        int n_ops = 0;
        for (int op = 0; op < STORE_OP__COUNT; op++) {
            if (store_proto_wire_opcode(d, (store_op_t)op) < 0) continue;
            frame_t f;
            uint8_t proof[64];
            store_request_t q;
            frame_begin(&f, d, (store_op_t)op);
            put_body(&f, (store_op_t)op, proof);
            expect_frame(d, &f, &q);
            check_request((store_op_t)op, &q, proof);
            n_ops++;
        }
        /* legacy: SET..CANCEL_WAIT (13); current: VALIDATE..BARRIER (19) + the two auth ops */
        cr_assert_eq(n_ops, d == STORE_DIALECT_LEGACY ? 13 : 21, "dialect %d: %d ops", d, n_ops);
    }
}

Test(store_proto, legacy_byte_zero_is_set_not_validate) {
    frame_t f;
    store_request_t q;
    frame_raw(&f, 0);
    put_str(&f, "k");
    put_str(&f, "v");
    expect_frame(STORE_DIALECT_LEGACY, &f, &q);
    cr_assert_eq(q.op, STORE_OP_SET);
    cr_assert(bytes_eq(q.key, "k") && bytes_eq(q.value, "v"));
}

Test(store_proto, empty_keys_values_and_zero_items) {
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        frame_t f;
        store_request_t q;
        frame_begin(&f, d, STORE_OP_SET);
        put_str(&f, "");
        put_str(&f, "");
        expect_frame(d, &f, &q);
        cr_assert(q.key.len == 0 && q.value.len == 0);
        const store_op_t multi[] = {STORE_OP_CHECK, STORE_OP_WAIT, STORE_OP_MULTI_GET,
                                    STORE_OP_MULTI_SET};
        for (int i = 0; i < 4; i++) {
            frame_begin(&f, d, multi[i]);
            store_put_u64(&f.w, 0);
            expect_frame(d, &f, &q);
            cr_assert_eq(q.n_items, 0);
            size_t cursor = 0;
            store_bytes_t k, v;
            cr_assert_not(store_proto_next_item(&q, &cursor, &k, &v), "%s",
                          store_op_name(multi[i]));
        }
    }
}

/* ---- dialect detection -------------------------------------------------------------------- */

Test(store_proto, detect_dialect_on_0_to_5_bytes) {
    const uint8_t current[] = {0x00, 0xCE, 0xF7, 0x85, 0x3C, 0x07};
    cr_assert_eq(store_proto_detect_dialect(current, 0), STORE_DIALECT_UNKNOWN);
    for (size_t n = 1; n < 5; n++)
        cr_assert_eq(store_proto_detect_dialect(current, n), STORE_DIALECT_UNKNOWN, "n=%zu", n);
    cr_assert_eq(store_proto_detect_dialect(current, 5), STORE_DIALECT_CURRENT);
    cr_assert_eq(store_proto_detect_dialect(current, 6), STORE_DIALECT_CURRENT);

    /* Any non-zero first byte is a legacy request (GET=2, ADD=3, ..., CANCEL_WAIT=12). */
    for (unsigned b = 1; b < 256; b++) {
        uint8_t buf[5] = {(uint8_t)b, 0xCE, 0xF7, 0x85, 0x3C};
        for (size_t n = 1; n <= 5; n++)
            cr_assert_eq(store_proto_detect_dialect(buf, n), STORE_DIALECT_LEGACY, "b=%u n=%zu", b,
                         n);
    }
    /* A legacy SET starts with 0x00 then the key length: decided at the first byte that differs
     * from the magic, undecided before. */
    const uint8_t legacy_set[] = {0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    cr_assert_eq(store_proto_detect_dialect(legacy_set, 1), STORE_DIALECT_UNKNOWN);
    for (size_t n = 2; n <= sizeof legacy_set; n++)
        cr_assert_eq(store_proto_detect_dialect(legacy_set, n), STORE_DIALECT_LEGACY, "n=%zu", n);
    for (size_t bad = 1; bad <= 4; bad++) {
        uint8_t buf[5];
        memcpy(buf, current, 5);
        buf[bad] ^= 0x01;
        for (size_t n = 0; n <= 5; n++) {
            store_dialect_t want = n <= bad ? STORE_DIALECT_UNKNOWN : STORE_DIALECT_LEGACY;
            cr_assert_eq(store_proto_detect_dialect(buf, n), want, "magic byte %zu off, n=%zu", bad,
                         n);
        }
    }
}

/* ---- errors and limits -------------------------------------------------------------------- */

/* Key-bearing ops in each numbering (key first in the body). */
static const store_op_t key_ops[] = {STORE_OP_SET,        STORE_OP_COMPARE_SET, STORE_OP_GET,
                                     STORE_OP_ADD,        STORE_OP_DELETE_KEY,  STORE_OP_APPEND,
                                     STORE_OP_QUEUE_PUSH, STORE_OP_QUEUE_POP,   STORE_OP_QUEUE_LEN,
                                     STORE_OP_BARRIER,    STORE_OP_WATCH_KEY};
#define N_KEY_OPS (sizeof key_ops / sizeof key_ops[0])
static const store_op_t multi_ops[] = {STORE_OP_CHECK, STORE_OP_WAIT, STORE_OP_MULTI_GET,
                                       STORE_OP_MULTI_SET};

/* Finish a key-op frame after its key, with small legal fields. */
static void put_rest_after_key(frame_t *f, store_op_t op) {
    switch (op) {
    case STORE_OP_SET:
    case STORE_OP_APPEND:
    case STORE_OP_QUEUE_PUSH:
        put_str(f, "v");
        break;
    case STORE_OP_COMPARE_SET:
        put_str(f, "e");
        put_str(f, "d");
        break;
    case STORE_OP_ADD:
    case STORE_OP_BARRIER:
        store_put_i64(&f->w, 1);
        break;
    default:
        break;
    }
}

Test(store_proto, key_limit_boundary_every_key_op) {
    store_limits_t small = lim;
    small.max_key_bytes = 16;
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        for (size_t i = 0; i < N_KEY_OPS; i++) {
            store_op_t op = key_ops[i];
            if (store_proto_wire_opcode(d, op) < 0) continue;
            frame_t f;
            store_request_t q;
            size_t need;
            frame_begin(&f, d, op);
            put_filler(&f, 16);
            put_rest_after_key(&f, op);
            cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, &need), (int)f.w.len,
                         "%s: key at the limit refused", store_op_name(op));
            cr_assert_eq(q.key.len, 16);
            frame_begin(&f, d, op);
            put_filler(&f, 17);
            put_rest_after_key(&f, op);
            /* Refused from the 9-byte header alone, and with the whole frame present. */
            cr_assert_eq(decode_with(d, &small, &f, 9, &q, &need), STORE_PROTO_E_KEY_TOO_LONG, "%s",
                         store_op_name(op));
            cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, &need), STORE_PROTO_E_KEY_TOO_LONG,
                         "%s", store_op_name(op));
        }
    }
}

/* A claimed length above limit: a itself when it is, else just past the limit. */
static uint64_t beyond(uint64_t limit, uint64_t a) {
    return a > limit ? a : limit + 1;
}

Test(store_proto, absurd_lengths_fail_from_the_header_alone) {
    const uint64_t absurd[] = {UINT64_C(1) << 63, UINT64_MAX, UINT64_C(1) << 32,
                               (uint64_t)STORE_DEFAULT_MAX_KEY_BYTES + 1};
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        for (size_t a = 0; a < sizeof absurd / sizeof absurd[0]; a++) {
            for (size_t i = 0; i < N_KEY_OPS; i++) {
                if (store_proto_wire_opcode(d, key_ops[i]) < 0) continue;
                frame_t f;
                store_request_t q;
                size_t need = 0;
                frame_begin(&f, d, key_ops[i]);
                store_put_u64(&f.w, absurd[a]);
                cr_assert_eq(f.w.len, 9);
                cr_assert_eq(decode(d, &f, 9, &q, &need), STORE_PROTO_E_KEY_TOO_LONG,
                             "%s with key length %llu", store_op_name(key_ops[i]),
                             (unsigned long long)absurd[a]);
                /* With fewer bytes it is simply incomplete, and the hint stays small. */
                cr_assert_eq(decode(d, &f, 8, &q, &need), STORE_PROTO_NEED_MORE);
                cr_assert_eq(need, 9);
            }
            for (int i = 0; i < 4; i++) {
                frame_t f;
                store_request_t q;
                frame_begin(&f, d, multi_ops[i]);
                store_put_u64(&f.w, beyond(lim.max_keys_per_op, absurd[a]));
                cr_assert_eq(decode(d, &f, 9, &q, NULL), STORE_PROTO_E_TOO_MANY_KEYS, "%s",
                             store_op_name(multi_ops[i]));
            }
            /* A value length: refused once the key and the 8-byte length are in. */
            frame_t f;
            store_request_t q;
            frame_begin(&f, d, STORE_OP_SET);
            put_str(&f, "k");
            store_put_u64(&f.w, beyond(lim.max_value_bytes, absurd[a]));
            cr_assert_eq(decode(d, &f, f.w.len, &q, NULL), STORE_PROTO_E_VALUE_TOO_LONG,
                         "SET value length %llu",
                         (unsigned long long)beyond(lim.max_value_bytes, absurd[a]));
        }
    }
}

Test(store_proto, value_limit_boundary_every_value_field) {
    store_limits_t small = lim;
    small.max_value_bytes = 32;
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        /* field 0: SET/APPEND/QUEUE_PUSH value; CAS expected (1) and desired (2); MULTI_SET (3) */
        struct {
            store_op_t op;
            int field;
        } cases[] = {{STORE_OP_SET, 0},         {STORE_OP_APPEND, 0},      {STORE_OP_QUEUE_PUSH, 0},
                     {STORE_OP_COMPARE_SET, 1}, {STORE_OP_COMPARE_SET, 2}, {STORE_OP_MULTI_SET, 3}};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            store_op_t op = cases[i].op;
            if (store_proto_wire_opcode(d, op) < 0) continue;
            for (size_t len = 32; len <= 33; len++) {
                frame_t f;
                store_request_t q;
                frame_begin(&f, d, op);
                if (op == STORE_OP_MULTI_SET) {
                    store_put_u64(&f.w, 2);
                    put_str(&f, "k1");
                    put_str(&f, "ok");
                    put_str(&f, "k2");
                } else {
                    put_str(&f, "k");
                }
                if (cases[i].field == 2) put_str(&f, "expected");
                size_t header = f.w.len + 8;
                put_filler(&f, len);
                if (cases[i].field == 1) put_str(&f, "desired");
                int rc = decode_with(d, &small, &f, f.w.len, &q, NULL);
                if (len == 32) {
                    cr_assert_eq(rc, (int)f.w.len, "%s field %d at the limit: %d",
                                 store_op_name(op), cases[i].field, rc);
                } else {
                    cr_assert_eq(rc, STORE_PROTO_E_VALUE_TOO_LONG, "%s field %d", store_op_name(op),
                                 cases[i].field);
                    cr_assert_eq(decode_with(d, &small, &f, header, &q, NULL),
                                 STORE_PROTO_E_VALUE_TOO_LONG, "%s field %d from its length alone",
                                 store_op_name(op), cases[i].field);
                }
            }
        }
    }
}

Test(store_proto, keys_per_op_limit_every_multi_op) {
    store_limits_t small = lim;
    small.max_keys_per_op = 4;
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        for (int i = 0; i < 4; i++) {
            store_op_t op = multi_ops[i];
            for (uint64_t n = 4; n <= 5; n++) {
                frame_t f;
                store_request_t q;
                frame_begin(&f, d, op);
                store_put_u64(&f.w, n);
                for (uint64_t k = 0; k < n; k++) {
                    put_str(&f, "key");
                    if (op == STORE_OP_MULTI_SET) put_str(&f, "val");
                }
                if (n == 4) {
                    cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, NULL), (int)f.w.len,
                                 "%s with 4 keys", store_op_name(op));
                } else {
                    cr_assert_eq(decode_with(d, &small, &f, 9, &q, NULL),
                                 STORE_PROTO_E_TOO_MANY_KEYS, "%s", store_op_name(op));
                    cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, NULL),
                                 STORE_PROTO_E_TOO_MANY_KEYS, "%s", store_op_name(op));
                }
            }
            /* An item key above the key limit inside a multi op. */
            store_limits_t tiny_keys = lim;
            tiny_keys.max_key_bytes = 2;
            frame_t f;
            store_request_t q;
            frame_begin(&f, d, op);
            store_put_u64(&f.w, 1);
            store_put_u64(&f.w, 3);
            cr_assert_eq(decode_with(d, &tiny_keys, &f, f.w.len, &q, NULL),
                         STORE_PROTO_E_KEY_TOO_LONG, "%s item key", store_op_name(op));
        }
    }
}

Test(store_proto, frame_limit_boundary) {
    store_limits_t small = lim;
    small.max_frame_bytes = 1000;
    const size_t header = 1 + 8 + 1 + 8; /* op, "k", value length */
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        frame_t f;
        store_request_t q;
        size_t need = 0;
        frame_begin(&f, d, STORE_OP_SET);
        put_str(&f, "k");
        put_filler(&f, 1000 - header);
        cr_assert_eq(f.w.len, 1000);
        cr_assert_eq(decode_with(d, &small, &f, header, &q, &need), STORE_PROTO_NEED_MORE);
        cr_assert_eq(need, 1000, "the hint is the whole frame");
        cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, &need), 1000);

        frame_begin(&f, d, STORE_OP_SET);
        put_str(&f, "k");
        put_filler(&f, 1001 - header);
        cr_assert_eq(decode_with(d, &small, &f, header, &q, &need), STORE_PROTO_E_FRAME_TOO_LONG,
                     "one byte over: refused from the header");

        /* Many small keys add up beyond the frame limit; refused before the frame is all in. */
        frame_begin(&f, d, STORE_OP_MULTI_GET);
        store_put_u64(&f.w, 200);
        for (int i = 0; i < 200; i++)
            put_str(&f, "key-key-key");
        cr_assert_eq(decode_with(d, &small, &f, f.w.len, &q, &need), STORE_PROTO_E_FRAME_TOO_LONG);
        cr_assert_eq(decode_with(d, &small, &f, 1000, &q, &need), STORE_PROTO_E_FRAME_TOO_LONG);
        /* The hint of an incomplete frame never exceeds the frame limit. */
        for (size_t n = 0; n < 1000; n += 37) {
            int rc = decode_with(d, &small, &f, n, &q, &need);
            if (rc == STORE_PROTO_NEED_MORE) cr_assert_leq(need, 1000, "n=%zu need=%zu", n, need);
        }
    }
    /* A large legal value: the hint is the whole frame, so a server can size its buffer once. */
    frame_t f;
    store_request_t q;
    size_t need;
    frame_begin(&f, STORE_DIALECT_CURRENT, STORE_OP_SET);
    put_str(&f, "k");
    store_put_u64(&f.w, 1u << 20);
    cr_assert_eq(decode(STORE_DIALECT_CURRENT, &f, f.w.len, &q, &need), STORE_PROTO_NEED_MORE);
    cr_assert_eq(need, header + (1u << 20));
}

Test(store_proto, validate_magic) {
    frame_t f;
    store_request_t q;
    frame_begin(&f, STORE_DIALECT_CURRENT, STORE_OP_VALIDATE);
    store_put_u32(&f.w, STORE_PROTO_MAGIC ^ 0x100u);
    for (size_t n = 0; n < 5; n++)
        cr_assert_eq(decode(STORE_DIALECT_CURRENT, &f, n, &q, NULL), STORE_PROTO_NEED_MORE);
    cr_assert_eq(decode(STORE_DIALECT_CURRENT, &f, 5, &q, NULL), STORE_PROTO_E_BAD_MAGIC);
    frame_begin(&f, STORE_DIALECT_CURRENT, STORE_OP_VALIDATE);
    store_put_u32(&f.w, 0);
    cr_assert_eq(decode(STORE_DIALECT_CURRENT, &f, 5, &q, NULL), STORE_PROTO_E_BAD_MAGIC);
    /* The magic on the wire is little-endian. */
    const uint8_t wire[] = {0x00, 0xCE, 0xF7, 0x85, 0x3C};
    cr_assert_eq(store_proto_decode_request(STORE_DIALECT_CURRENT, &lim, wire, 5, &q, NULL), 5);
    cr_assert_eq(q.op, STORE_OP_VALIDATE);
}

/* ---- replies ------------------------------------------------------------------------------ */

/* Every prefix of a reply is NEED_MORE; the whole decodes to its length, trailing bytes unread. */
static void expect_reply(store_reply_kind_t kind, const uint8_t *buf, size_t len,
                         store_reply_t *r) {
    for (size_t n = 0; n < len; n++) {
        int rc = store_proto_decode_reply(kind, &lim, buf, n, r);
        cr_assert_eq(rc, STORE_PROTO_NEED_MORE, "kind %d prefix %zu of %zu: rc %d", kind, n, len,
                     rc);
    }
    uint8_t more[512];
    cr_assert_leq(len + 4, sizeof more);
    memcpy(more, buf, len);
    memcpy(more + len, "\x01\x02\x03\x04", 4);
    cr_assert_eq(store_proto_decode_reply(kind, &lim, more, len + 4, r), (int)len);
    cr_assert_eq(store_proto_decode_reply(kind, &lim, buf, len, r), (int)len);
}

Test(store_proto, reply_of_every_kind_byte_by_byte) {
    uint8_t buf[256];
    store_writer_t w;
    store_reply_t r;

    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_CHECK_NOT_READY);
    expect_reply(STORE_REPLY_U8, buf, w.len, &r);
    cr_assert_eq(r.u8, STORE_CHECK_NOT_READY);

    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, INT64_MIN + 5);
    expect_reply(STORE_REPLY_I64, buf, w.len, &r);
    cr_assert_eq(r.i64, INT64_MIN + 5);

    store_writer_init(&w, buf, sizeof buf);
    store_put_u32(&w, 0xCAFEF00Du);
    expect_reply(STORE_REPLY_U32, buf, w.len, &r);
    cr_assert_eq(r.u32, 0xCAFEF00Du);

    store_writer_init(&w, buf, sizeof buf);
    store_put_bytes(&w, "hel\0lo", 6);
    expect_reply(STORE_REPLY_BYTES, buf, w.len, &r);
    cr_assert(bytes_eq_n(r.bytes, "hel\0lo", 6));
    store_writer_init(&w, buf, sizeof buf);
    store_put_bytes(&w, "", 0);
    expect_reply(STORE_REPLY_BYTES, buf, w.len, &r);
    cr_assert_eq(r.bytes.len, 0);

    /* QUEUE_POP: an empty queue is just the length; otherwise the length then the item. */
    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, 0);
    expect_reply(STORE_REPLY_QUEUE_POP, buf, w.len, &r);
    cr_assert(r.i64 == 0 && r.bytes.len == 0);
    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, 3);
    store_put_bytes(&w, "item", 4);
    expect_reply(STORE_REPLY_QUEUE_POP, buf, w.len, &r);
    cr_assert(r.i64 == 3 && bytes_eq(r.bytes, "item"));

    /* LIST_KEYS: the count; the keys follow as BYTES replies. */
    store_writer_init(&w, buf, sizeof buf);
    store_put_i64(&w, 2);
    expect_reply(STORE_REPLY_KEY_COUNT, buf, w.len, &r);
    cr_assert_eq(r.i64, 2);

    /* AUTH_HELLO: OPEN alone, or CHALLENGE + nonce. */
    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_AUTH_OPEN);
    expect_reply(STORE_REPLY_AUTH_HELLO, buf, w.len, &r);
    cr_assert_eq(r.u8, STORE_AUTH_OPEN);
    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_AUTH_CHALLENGE);
    for (int i = 0; i < (int)STORE_AUTH_NONCE_BYTES; i++)
        store_put_u8(&w, (uint8_t)(100 + i));
    expect_reply(STORE_REPLY_AUTH_HELLO, buf, w.len, &r);
    cr_assert(r.u8 == STORE_AUTH_CHALLENGE && r.bytes.len == STORE_AUTH_NONCE_BYTES);
    cr_assert(r.bytes.ptr == buf + 1 && r.bytes.ptr[31] == 131);

    /* AUTH_PROOF: OK + server MAC, or DENIED alone. */
    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_AUTH_OK);
    for (int i = 0; i < (int)STORE_AUTH_MAC_BYTES; i++)
        store_put_u8(&w, (uint8_t)(200 + i));
    expect_reply(STORE_REPLY_AUTH_PROOF, buf, w.len, &r);
    cr_assert(r.u8 == STORE_AUTH_OK && r.bytes.len == STORE_AUTH_MAC_BYTES);
    cr_assert_eq(r.bytes.ptr[0], 200);
    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, STORE_AUTH_DENIED);
    expect_reply(STORE_REPLY_AUTH_PROOF, buf, w.len, &r);
    cr_assert_eq(r.u8, STORE_AUTH_DENIED);
}

Test(store_proto, bad_replies) {
    uint8_t buf[64];
    store_writer_t w;
    store_reply_t r;
    /* A reply length beyond the value limit fails from its 8 bytes, whatever follows. */
    const uint64_t lens[] = {(uint64_t)STORE_DEFAULT_MAX_VALUE_BYTES + 1, UINT64_C(1) << 63,
                             UINT64_MAX};
    for (int i = 0; i < 3; i++) {
        store_writer_init(&w, buf, sizeof buf);
        store_put_u64(&w, lens[i]);
        cr_assert_eq(store_proto_decode_reply(STORE_REPLY_BYTES, &lim, buf, 8, &r),
                     STORE_PROTO_E_VALUE_TOO_LONG);
        store_writer_init(&w, buf, sizeof buf);
        store_put_i64(&w, 1);
        store_put_u64(&w, lens[i]);
        cr_assert_eq(store_proto_decode_reply(STORE_REPLY_QUEUE_POP, &lim, buf, 16, &r),
                     STORE_PROTO_E_VALUE_TOO_LONG);
    }
    /* Auth replies with an unknown code; a reply kind that has no bytes. */
    const uint8_t bad_hello[] = {STORE_AUTH_OK, STORE_AUTH_DENIED, 9};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_HELLO, &lim, &bad_hello[i], 1, &r),
                     STORE_PROTO_E_BAD_VALUE, "hello reply %u", bad_hello[i]);
    const uint8_t bad_proof[] = {STORE_AUTH_OPEN, STORE_AUTH_CHALLENGE, 0xff};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(store_proto_decode_reply(STORE_REPLY_AUTH_PROOF, &lim, &bad_proof[i], 1, &r),
                     STORE_PROTO_E_BAD_VALUE, "proof reply %u", bad_proof[i]);
    cr_assert_eq(store_proto_decode_reply(STORE_REPLY_NONE, &lim, buf, 8, &r),
                 STORE_PROTO_E_BAD_VALUE);
}

Test(store_proto, reply_kind_of_every_op) {
    const struct {
        store_op_t op;
        store_reply_kind_t kind;
    } want[] = {
        {STORE_OP_VALIDATE, STORE_REPLY_NONE},
        {STORE_OP_SET, STORE_REPLY_NONE},
        {STORE_OP_COMPARE_SET, STORE_REPLY_BYTES},
        {STORE_OP_GET, STORE_REPLY_BYTES},
        {STORE_OP_ADD, STORE_REPLY_I64},
        {STORE_OP_CHECK, STORE_REPLY_U8},
        {STORE_OP_WAIT, STORE_REPLY_U8},
        {STORE_OP_GETNUMKEYS, STORE_REPLY_I64},
        {STORE_OP_DELETE_KEY, STORE_REPLY_I64},
        {STORE_OP_APPEND, STORE_REPLY_NONE},
        {STORE_OP_MULTI_GET, STORE_REPLY_BYTES},
        {STORE_OP_MULTI_SET, STORE_REPLY_NONE},
        {STORE_OP_CANCEL_WAIT, STORE_REPLY_U8},
        {STORE_OP_PING, STORE_REPLY_U32},
        {STORE_OP_QUEUE_PUSH, STORE_REPLY_NONE},
        {STORE_OP_QUEUE_POP, STORE_REPLY_QUEUE_POP},
        {STORE_OP_QUEUE_LEN, STORE_REPLY_I64},
        {STORE_OP_LIST_KEYS, STORE_REPLY_KEY_COUNT},
        {STORE_OP_BARRIER, STORE_REPLY_U8},
        {STORE_OP_AUTH_HELLO, STORE_REPLY_AUTH_HELLO},
        {STORE_OP_AUTH_PROOF, STORE_REPLY_AUTH_PROOF},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert_eq(store_proto_reply_kind(want[i].op), want[i].kind, "%s",
                     store_op_name(want[i].op));
}

/* ---- item walker -------------------------------------------------------------------------- */

Test(store_proto, next_item_walks_multi_set_pairs_and_wait_keys) {
    for (int di = 0; di < 2; di++) {
        store_dialect_t d = dialects[di];
        frame_t f;
        store_request_t q;
        frame_begin(&f, d, STORE_OP_MULTI_SET);
        store_put_u64(&f.w, 4);
        const char *kv[] = {"a", "1", "bb", "", "", "empty key", "ccc", "333"};
        for (int j = 0; j < 8; j++)
            put_str(&f, kv[j]);
        store_put_bytes(&f.w, "\0\1", 2); /* not an item: a next frame's bytes */
        int rc = decode(d, &f, f.w.len, &q, NULL);
        cr_assert_eq(rc, (int)f.w.len - 10);
        cr_assert_eq(q.n_items, 4);
        size_t cursor = 0, last = 0;
        store_bytes_t k, v;
        for (int j = 0; j < 4; j++) {
            cr_assert(store_proto_next_item(&q, &cursor, &k, &v));
            cr_assert(bytes_eq(k, kv[2 * j]) && bytes_eq(v, kv[2 * j + 1]), "pair %d", j);
            cr_assert_gt(cursor, last);
            last = cursor;
        }
        cr_assert_not(store_proto_next_item(&q, &cursor, &k, &v));
        cr_assert_eq(cursor, q.items.len);

        const store_op_t key_lists[] = {STORE_OP_WAIT, STORE_OP_CHECK, STORE_OP_MULTI_GET};
        for (int o = 0; o < 3; o++) {
            frame_begin(&f, d, key_lists[o]);
            store_put_u64(&f.w, 3);
            put_str(&f, "x");
            put_str(&f, "");
            put_str(&f, "yy/zz");
            expect_frame(d, &f, &q);
            cursor = 0;
            cr_assert(store_proto_next_item(&q, &cursor, &k, NULL) && bytes_eq(k, "x"));
            cr_assert(store_proto_next_item(&q, &cursor, &k, NULL) && bytes_eq(k, ""));
            cr_assert(store_proto_next_item(&q, &cursor, &k, NULL) && bytes_eq(k, "yy/zz"));
            cr_assert_not(store_proto_next_item(&q, &cursor, &k, NULL));
        }
    }
}

/* ---- writer ------------------------------------------------------------------------------- */

Test(store_proto, writer_is_little_endian_and_bounded) {
    uint8_t buf[32];
    store_writer_t w;
    store_writer_init(&w, buf, sizeof buf);
    store_put_u8(&w, 0xAB);
    store_put_u32(&w, 0x01020304u);
    store_put_u64(&w, UINT64_C(0x1122334455667788));
    store_put_i64(&w, -2);
    const uint8_t want[] = {0xAB, 0x04, 0x03, 0x02, 0x01, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33,
                            0x22, 0x11, 0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF};
    cr_assert_eq(w.len, sizeof want);
    cr_assert_eq(memcmp(buf, want, sizeof want), 0);
    cr_assert_eq(store_load_u32(buf + 1), 0x01020304u);
    cr_assert_eq(store_load_u64(buf + 5), UINT64_C(0x1122334455667788));
    cr_assert_eq((int64_t)store_load_u64(buf + 13), -2);
    cr_assert_not(w.is_overflow);

    store_writer_init(&w, buf, 4);
    store_put_u32(&w, 1);
    cr_assert_not(w.is_overflow);
    store_put_u8(&w, 1);
    cr_assert(w.is_overflow, "a write past cap is reported");
    cr_assert_eq(w.len, 4, "and dropped");
    store_writer_init(&w, buf, 10);
    store_put_bytes(&w, "0123456789", 10);
    cr_assert(w.is_overflow);
    cr_assert_eq(w.len, 8, "the length fits, the bytes do not");
}
