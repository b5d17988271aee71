/* libFuzzer harness over proto/store_proto. Input: one limits byte, then a connection's bytes.
 * The bytes are decoded as a stream, frame after frame, in both numberings; every frame is walked
 * item by item, re-encoded with the store_put_* writer (must give the same bytes back), and fed
 * again as a server would, waiting each time for need_bytes (must converge on exactly the frame).
 * The same bytes are also decoded as every reply kind and given to the dialect detector.
 * An odd limits byte selects small limits derived from it, so the limit paths are reached with
 * small inputs. Any violated invariant is a __builtin_trap the fuzzer keeps as a crash.
 * Runs single-threaded inside libFuzzer; no allocation, no I/O. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "store_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char *__ubsan_default_options(void);

/* UBSan only reports by default; stop at the first report so the fuzzer keeps the input, however
 * the harness is started (run_fuzz.sh also sets UBSAN_OPTIONS). */
const char *__ubsan_default_options(void) {
    return "halt_on_error=1:print_stacktrace=1";
}

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) __builtin_trap();                                                             \
    } while (0)

/* Scratch for re-encoding and for padding incomplete input; inputs are cut to fit (-max_len). */
#define SCRATCH_BYTES (1u << 16)
static uint8_t scratch[SCRATCH_BYTES];

static bool inside(const uint8_t *buf, size_t len, store_bytes_t b) {
    if (b.len == 0) return true;
    return b.ptr >= buf && b.len <= len && (size_t)(b.ptr - buf) <= len - b.len;
}

static void derive_limits(uint8_t b, store_limits_t *lim) {
    store_limits_default(lim);
    if (!(b & 1)) return;
    lim->max_key_bytes = 1u + ((b >> 1) & 7u) * 4u;       /* 1 .. 29 */
    lim->max_value_bytes = 1u + ((b >> 4) & 3u) * 32u;    /* 1 .. 97 */
    lim->max_keys_per_op = 1u + ((b >> 6) & 3u);          /* 1 .. 4 */
    lim->max_frame_bytes = 64u + ((b >> 1) & 0x7fu) * 4u; /* 64 .. 572 (ddprun store's minimum) */
}

/* The frame as the protocol lays it out, rebuilt from the decoded fields. */
static void encode_request(store_dialect_t d, const store_request_t *q, store_writer_t *w) {
    int wire = store_proto_wire_opcode(d, q->op);
    CHECK(wire >= 0 && wire <= 0xff);
    store_put_u8(w, (uint8_t)wire);
    switch (q->op) {
    case STORE_OP_VALIDATE:
    case STORE_OP_PING:
        store_put_u32(w, q->u32);
        break;
    case STORE_OP_SET:
    case STORE_OP_APPEND:
    case STORE_OP_QUEUE_PUSH:
        store_put_bytes(w, q->key.ptr, q->key.len);
        store_put_bytes(w, q->value.ptr, q->value.len);
        break;
    case STORE_OP_COMPARE_SET:
        store_put_bytes(w, q->key.ptr, q->key.len);
        store_put_bytes(w, q->value.ptr, q->value.len);
        store_put_bytes(w, q->value2.ptr, q->value2.len);
        break;
    case STORE_OP_GET:
    case STORE_OP_DELETE_KEY:
    case STORE_OP_QUEUE_POP:
    case STORE_OP_QUEUE_LEN:
    case STORE_OP_WATCH_KEY:
        store_put_bytes(w, q->key.ptr, q->key.len);
        break;
    case STORE_OP_ADD:
    case STORE_OP_BARRIER:
        store_put_bytes(w, q->key.ptr, q->key.len);
        store_put_i64(w, q->add_delta);
        break;
    case STORE_OP_CHECK:
    case STORE_OP_WAIT:
    case STORE_OP_MULTI_GET:
    case STORE_OP_MULTI_SET: {
        store_put_u64(w, q->n_items);
        size_t cursor = 0;
        store_bytes_t k, v;
        while (store_proto_next_item(q, &cursor, &k, &v)) {
            store_put_bytes(w, k.ptr, k.len);
            if (q->op == STORE_OP_MULTI_SET) store_put_bytes(w, v.ptr, v.len);
        }
        break;
    }
    case STORE_OP_GETNUMKEYS:
    case STORE_OP_CANCEL_WAIT:
    case STORE_OP_LIST_KEYS:
        break;
    case STORE_OP_AUTH_HELLO:
        store_put_u8(w, (uint8_t)q->u32);
        break;
    case STORE_OP_AUTH_PROOF:
        store_put_raw(w, q->auth, STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES);
        break;
    default:
        CHECK(0);
    }
}

/* Every field of one decoded frame lies inside it and within the limits. */
static void check_request(store_dialect_t d, const store_limits_t *lim, const uint8_t *frame,
                          size_t flen, const store_request_t *q) {
    CHECK((unsigned)q->op < STORE_OP__COUNT);
    CHECK(store_op_name(q->op)[0] != '?');
    CHECK(store_proto_wire_opcode(d, q->op) == frame[0]);
    CHECK(q->key.len <= lim->max_key_bytes && inside(frame, flen, q->key));
    CHECK(q->value.len <= lim->max_value_bytes && inside(frame, flen, q->value));
    CHECK(q->value2.len <= lim->max_value_bytes && inside(frame, flen, q->value2));
    CHECK(q->n_items <= lim->max_keys_per_op && inside(frame, flen, q->items));
    if (q->op == STORE_OP_VALIDATE) CHECK(q->u32 == STORE_PROTO_MAGIC && d != STORE_DIALECT_LEGACY);
    if (q->op == STORE_OP_AUTH_PROOF)
        CHECK(q->auth >= frame &&
              q->auth + STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES <= frame + flen);
    (void)store_proto_reply_kind(q->op);

    size_t cursor = 0, prev = 0;
    uint64_t n = 0;
    store_bytes_t k, v;
    while (store_proto_next_item(q, &cursor, &k, &v)) {
        CHECK(cursor > prev && cursor <= q->items.len);
        CHECK(k.len <= lim->max_key_bytes && inside(q->items.ptr, q->items.len, k));
        if (q->op == STORE_OP_MULTI_SET)
            CHECK(v.len <= lim->max_value_bytes && inside(q->items.ptr, q->items.len, v));
        else
            CHECK(v.len == 0);
        prev = cursor;
        n++;
    }
    CHECK(n == q->n_items && cursor == q->items.len);

    /* Decoding is lossless: the fields re-encode to exactly the frame, and a writer one byte
     * short reports the overflow instead of writing past its end. */
    if (flen <= SCRATCH_BYTES) {
        store_writer_t w;
        store_writer_init(&w, scratch, flen);
        encode_request(d, q, &w);
        CHECK(!w.is_overflow && w.len == flen && memcmp(scratch, frame, flen) == 0);
        store_writer_init(&w, scratch, flen - 1);
        encode_request(d, q, &w);
        CHECK(w.is_overflow && w.len <= flen - 1);
    }
}

/* Feed a complete frame as a server does: decode, wait for need_bytes, decode again. Every
 * prefix must be NEED_MORE (never an error: those bytes are part of a valid frame) with need
 * growing and never beyond the frame; the byte before the end must ask for exactly the frame. */
static void check_incremental(store_dialect_t d, const store_limits_t *lim, const uint8_t *frame,
                              size_t flen) {
    store_request_t q, whole;
    size_t have = 0, need = 0;
    CHECK(store_proto_decode_request(d, lim, frame, flen, &whole, NULL) == (int)flen);
    /* resumed: the same answers, and the same request once whole */
    store_proto_resume_t resume = {0};
    for (int steps = 0; steps < 64; steps++) {
        size_t plain_need = 0;
        int plain = store_proto_decode_request(d, lim, frame, have, &q, &plain_need);
        int rc = store_proto_decode_request_resume(d, lim, frame, have, &q, &need, &resume);
        CHECK(rc == plain && (rc > 0 || need == plain_need));
        if (rc > 0) {
            CHECK((size_t)rc == flen && have == flen);
            CHECK(q.op == whole.op && q.n_items == whole.n_items &&
                  q.items.ptr == whole.items.ptr && q.items.len == whole.items.len);
            break;
        }
        CHECK(rc == STORE_PROTO_NEED_MORE && need > have && need <= flen);
        have = need;
    }
    int rc = store_proto_decode_request(d, lim, frame, flen - 1, &q, &need);
    CHECK(rc == STORE_PROTO_NEED_MORE && need == flen);
}

/* An incomplete tail: padding it with zeros up to need_bytes must make progress (a complete
 * frame, an error, or a larger need), or a server waiting for need_bytes could stall forever. */
static void check_progress(store_dialect_t d, const store_limits_t *lim, const uint8_t *tail,
                           size_t len, size_t need) {
    if (need > SCRATCH_BYTES) return;
    memcpy(scratch, tail, len);
    for (int steps = 0; steps < 64; steps++) {
        memset(scratch + len, 0, need - len);
        len = need;
        store_request_t q;
        int rc = store_proto_decode_request(d, lim, scratch, len, &q, &need);
        if (rc > 0) {
            CHECK((size_t)rc == len);
            return;
        }
        if (rc < 0) return;
        CHECK(need > len && need <= lim->max_frame_bytes);
        if (need > SCRATCH_BYTES) return;
    }
}

static void decode_stream(store_dialect_t d, const store_limits_t *lim, const uint8_t *buf,
                          size_t len) {
    size_t off = 0;
    while (off < len) {
        store_request_t q;
        size_t need = 0;
        int rc = store_proto_decode_request(d, lim, buf + off, len - off, &q, &need);
        if (rc == STORE_PROTO_NEED_MORE) {
            CHECK(need > len - off && need <= lim->max_frame_bytes);
            check_progress(d, lim, buf + off, len - off, need);
            return;
        }
        if (rc < 0) {
            CHECK(rc >= STORE_PROTO_E_BAD_VALUE);
            CHECK(strcmp(store_proto_strerror(rc), "unknown codec status") != 0);
            return;
        }
        const uint8_t *frame = buf + off;
        size_t flen = (size_t)rc;
        CHECK(flen <= len - off && flen <= lim->max_frame_bytes);
        check_request(d, lim, frame, flen, &q);
        check_incremental(d, lim, frame, flen);
        off += flen;
    }
}

static void check_replies(const store_limits_t *lim, const uint8_t *buf, size_t len) {
    for (int kind = STORE_REPLY_U8; kind <= STORE_REPLY_NONE; kind++) {
        store_reply_t r;
        int rc = store_proto_decode_reply((store_reply_kind_t)kind, lim, buf, len, &r);
        if (kind == STORE_REPLY_NONE) CHECK(rc < 0);
        if (rc <= 0) {
            CHECK(rc >= STORE_PROTO_E_BAD_VALUE);
            continue;
        }
        CHECK((size_t)rc <= len && (size_t)rc <= lim->max_frame_bytes);
        CHECK(inside(buf, (size_t)rc, r.bytes));
        if (kind == STORE_REPLY_BYTES || kind == STORE_REPLY_QUEUE_POP)
            CHECK(r.bytes.len <= lim->max_value_bytes);
        if (r.bytes.len) CHECK(r.bytes.ptr + r.bytes.len == buf + rc);
        /* The reply is complete only with its last byte. */
        store_reply_t r2;
        CHECK(store_proto_decode_reply((store_reply_kind_t)kind, lim, buf, (size_t)rc - 1, &r2) ==
              STORE_PROTO_NEED_MORE);
    }
}

static void check_dialect(const store_limits_t *lim, const uint8_t *buf, size_t len) {
    static const uint8_t hello[5] = {0x00, 0xCE, 0xF7, 0x85, 0x3C}; /* VALIDATE + LE magic */
    store_dialect_t d = store_proto_detect_dialect(buf, len);
    size_t n = len < 5 ? len : 5;
    bool is_hello_prefix = memcmp(buf, hello, n) == 0;
    if (d == STORE_DIALECT_UNKNOWN) CHECK(is_hello_prefix && len < 5);
    if (d == STORE_DIALECT_CURRENT) CHECK(is_hello_prefix && len >= 5);
    if (d == STORE_DIALECT_LEGACY) CHECK(!is_hello_prefix);
    if (d == STORE_DIALECT_CURRENT) { /* ... and that opening is a complete VALIDATE */
        store_request_t q;
        CHECK(store_proto_decode_request(d, lim, buf, len, &q, NULL) == 5 &&
              q.op == STORE_OP_VALIDATE);
    }
    /* Once decided, more bytes never change the answer. */
    for (size_t k = 0; k <= n; k++) {
        store_dialect_t dk = store_proto_detect_dialect(buf, k);
        CHECK(dk == STORE_DIALECT_UNKNOWN || dk == d);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    store_limits_t lim;
    derive_limits(data[0], &lim);
    const uint8_t *buf = data + 1;
    size_t len = size - 1;
    if (len > SCRATCH_BYTES) len = SCRATCH_BYTES;
    decode_stream(STORE_DIALECT_CURRENT, &lim, buf, len);
    decode_stream(STORE_DIALECT_LEGACY, &lim, buf, len);
    check_replies(&lim, buf, len);
    check_dialect(&lim, buf, len);
    return 0;
}
