/* libFuzzer harness over proto/store_proto: the input is a connection's byte stream, decoded
 * frame by frame in both numberings, plus every reply kind and the dialect detector. The first
 * byte picks tight or default limits so that limit paths are reached too. Invariants are checked
 * with __builtin_trap so any violation is a crash the fuzzer keeps. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "store_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) __builtin_trap();                                                             \
    } while (0)

static bool inside(const uint8_t *buf, size_t len, store_bytes_t b) {
    return b.len == 0 || (b.ptr >= buf && b.len <= len && b.ptr - buf <= (ptrdiff_t)(len - b.len));
}

static void decode_stream(store_dialect_t d, const store_limits_t *lim, const uint8_t *buf,
                          size_t len) {
    size_t off = 0;
    while (off < len) {
        store_request_t q;
        size_t need = 0;
        int rc = store_proto_decode_request(d, lim, buf + off, len - off, &q, &need);
        if (rc == STORE_PROTO_NEED_MORE) {
            CHECK(need > len - off);
            CHECK(need <= lim->max_frame_bytes);
            return;
        }
        if (rc < 0) {
            CHECK(store_proto_strerror(rc) != NULL);
            return;
        }
        const uint8_t *frame = buf + off;
        size_t flen = (size_t)rc;
        CHECK(flen <= len - off && flen <= lim->max_frame_bytes);
        CHECK((unsigned)q.op < STORE_OP__COUNT);
        CHECK(q.key.len <= lim->max_key_bytes && inside(frame, flen, q.key));
        CHECK(q.value.len <= lim->max_value_bytes && inside(frame, flen, q.value));
        CHECK(q.value2.len <= lim->max_value_bytes && inside(frame, flen, q.value2));
        CHECK(q.n_items <= lim->max_keys_per_op && inside(frame, flen, q.items));
        if (q.op == STORE_OP_VALIDATE) CHECK(q.u32 == STORE_PROTO_MAGIC);
        if (q.op == STORE_OP_AUTH_PROOF)
            CHECK(q.auth >= frame && q.auth + 64 <= frame + flen);
        size_t cursor = 0, n = 0;
        store_bytes_t k, v;
        while (store_proto_next_item(&q, &cursor, &k, &v)) {
            CHECK(k.len <= lim->max_key_bytes && inside(q.items.ptr, q.items.len, k));
            if (q.op == STORE_OP_MULTI_SET) CHECK(inside(q.items.ptr, q.items.len, v));
            n++;
        }
        CHECK(n == q.n_items && cursor == q.items.len);
        CHECK(store_proto_wire_opcode(d, q.op) == frame[0]);
        off += flen;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    store_limits_t lim;
    store_limits_default(&lim);
    if (data[0] & 1) { /* tight limits: reach the limit paths with small inputs */
        lim.max_key_bytes = 16;
        lim.max_value_bytes = 64;
        lim.max_keys_per_op = 4;
        lim.max_frame_bytes = 256;
    }
    const uint8_t *buf = data + 1;
    size_t len = size - 1;
    decode_stream(STORE_DIALECT_CURRENT, &lim, buf, len);
    decode_stream(STORE_DIALECT_LEGACY, &lim, buf, len);
    store_dialect_t d = store_proto_detect_dialect(buf, len);
    if (d == STORE_DIALECT_UNKNOWN) CHECK(len < 5);
    for (int kind = STORE_REPLY_U8; kind <= STORE_REPLY_NONE; kind++) {
        store_reply_t r;
        int rc = store_proto_decode_reply((store_reply_kind_t)kind, &lim, buf, len, &r);
        if (rc > 0) CHECK((size_t)rc <= len && inside(buf, (size_t)rc, r.bytes));
    }
    return 0;
}
