/* store_proto: request/reply framing of the TCPStore protocol (see store_proto.h).
 * A reader walks the buffer; every claimed length is checked against the limits the moment it is
 * read, so an absurd length fails at once instead of making the caller wait for its bytes. */
#include "store_proto.h"

#include <string.h>

void store_limits_default(store_limits_t *lim) {
    lim->max_key_bytes = STORE_DEFAULT_MAX_KEY_BYTES;
    lim->max_value_bytes = STORE_DEFAULT_MAX_VALUE_BYTES;
    lim->max_keys_per_op = STORE_DEFAULT_MAX_KEYS_PER_OP;
    lim->max_frame_bytes = STORE_DEFAULT_MAX_FRAME_BYTES;
    lim->max_output_bytes = STORE_DEFAULT_MAX_OUTPUT_BYTES;
    lim->max_total_buffer_bytes = STORE_DEFAULT_MAX_TOTAL_BUFFER;
    lim->max_store_bytes = STORE_DEFAULT_MAX_STORE_BYTES;
    lim->max_connections = STORE_DEFAULT_MAX_CONNECTIONS;
    lim->max_connections_per_peer = STORE_DEFAULT_MAX_CONNS_PER_PEER;
    lim->frame_timeout_ms = STORE_DEFAULT_FRAME_TIMEOUT_MS;
    lim->validate_timeout_ms = STORE_DEFAULT_VALIDATE_TIMEOUT_MS;
}

const char *store_proto_strerror(int status) {
    switch (status) {
    case STORE_PROTO_NEED_MORE:
        return "incomplete frame";
    case STORE_PROTO_E_OPCODE:
        return "unknown operation";
    case STORE_PROTO_E_KEY_TOO_LONG:
        return "key longer than the key-size limit";
    case STORE_PROTO_E_VALUE_TOO_LONG:
        return "value longer than the value-size limit";
    case STORE_PROTO_E_TOO_MANY_KEYS:
        return "more keys in one request than the per-op limit";
    case STORE_PROTO_E_FRAME_TOO_LONG:
        return "request larger than the frame-size limit";
    case STORE_PROTO_E_BAD_MAGIC:
        return "VALIDATE with a wrong magic number";
    case STORE_PROTO_E_NOT_VALIDATED:
        return "first request was not VALIDATE";
    case STORE_PROTO_E_BAD_VALUE:
        return "malformed field";
    default:
        return status > 0 ? "complete frame" : "unknown codec status";
    }
}

static const char *const op_names[STORE_OP__COUNT] = {
    [STORE_OP_VALIDATE] = "VALIDATE",
    [STORE_OP_SET] = "SET",
    [STORE_OP_COMPARE_SET] = "COMPARE_SET",
    [STORE_OP_GET] = "GET",
    [STORE_OP_ADD] = "ADD",
    [STORE_OP_CHECK] = "CHECK",
    [STORE_OP_WAIT] = "WAIT",
    [STORE_OP_GETNUMKEYS] = "GETNUMKEYS",
    [STORE_OP_DELETE_KEY] = "DELETE_KEY",
    [STORE_OP_APPEND] = "APPEND",
    [STORE_OP_MULTI_GET] = "MULTI_GET",
    [STORE_OP_MULTI_SET] = "MULTI_SET",
    [STORE_OP_CANCEL_WAIT] = "CANCEL_WAIT",
    [STORE_OP_PING] = "PING",
    [STORE_OP_QUEUE_PUSH] = "QUEUE_PUSH",
    [STORE_OP_QUEUE_POP] = "QUEUE_POP",
    [STORE_OP_QUEUE_LEN] = "QUEUE_LEN",
    [STORE_OP_LIST_KEYS] = "LIST_KEYS",
    [STORE_OP_BARRIER] = "BARRIER",
    [STORE_OP_WATCH_KEY] = "WATCH_KEY",
    [STORE_OP_AUTH_HELLO] = "AUTH_HELLO",
    [STORE_OP_AUTH_PROOF] = "AUTH_PROOF",
};

const char *store_op_name(store_op_t op) {
    return (unsigned)op < STORE_OP__COUNT ? op_names[op] : "?";
}

/* Legacy wire numbering, torch 1.9-2.1 (1.13 stops at DELETE_KEY; 2.0/2.1 add up to 12). */
static const store_op_t legacy_ops[] = {
    STORE_OP_SET,         STORE_OP_COMPARE_SET, STORE_OP_GET,        STORE_OP_ADD,
    STORE_OP_CHECK,       STORE_OP_WAIT,        STORE_OP_GETNUMKEYS, STORE_OP_WATCH_KEY,
    STORE_OP_DELETE_KEY,  STORE_OP_APPEND,      STORE_OP_MULTI_GET,  STORE_OP_MULTI_SET,
    STORE_OP_CANCEL_WAIT,
};
#define N_LEGACY_OPS (sizeof legacy_ops / sizeof legacy_ops[0])

static int op_from_wire(store_dialect_t dialect, uint8_t wire, store_op_t *op) {
    if (dialect == STORE_DIALECT_LEGACY) {
        if (wire >= N_LEGACY_OPS) return STORE_PROTO_E_OPCODE;
        *op = legacy_ops[wire];
        return 0;
    }
    if (wire <= STORE_OP_BARRIER) {
        *op = (store_op_t)wire;
        return 0;
    }
    if (wire == STORE_WIRE_AUTH_HELLO) {
        *op = STORE_OP_AUTH_HELLO;
        return 0;
    }
    if (wire == STORE_WIRE_AUTH_PROOF) {
        *op = STORE_OP_AUTH_PROOF;
        return 0;
    }
    return STORE_PROTO_E_OPCODE;
}

int store_proto_wire_opcode(store_dialect_t dialect, store_op_t op) {
    if (dialect == STORE_DIALECT_LEGACY) {
        for (unsigned i = 0; i < N_LEGACY_OPS; i++)
            if (legacy_ops[i] == op) return (int)i;
        return -1;
    }
    if (op <= STORE_OP_BARRIER) return (int)op;
    if (op == STORE_OP_AUTH_HELLO) return STORE_WIRE_AUTH_HELLO;
    if (op == STORE_OP_AUTH_PROOF) return STORE_WIRE_AUTH_PROOF;
    return -1;
}

store_dialect_t store_proto_detect_dialect(const uint8_t *buf, size_t len) {
    if (len == 0) return STORE_DIALECT_UNKNOWN;
    if (buf[0] != 0) return STORE_DIALECT_LEGACY;
    uint8_t magic[4] = {0xCE, 0xF7, 0x85, 0x3C};
    size_t n = len - 1 < 4 ? len - 1 : 4;
    if (memcmp(buf + 1, magic, n) != 0) return STORE_DIALECT_LEGACY;
    return n == 4 ? STORE_DIALECT_CURRENT : STORE_DIALECT_UNKNOWN;
}

uint32_t store_load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t store_load_u64(const uint8_t *p) {
    return (uint64_t)store_load_u32(p) | (uint64_t)store_load_u32(p + 4) << 32;
}

/* A bounds-checked reader. Each rd_* returns 1 when the field is complete, 0 when more bytes
 * are needed (r->need then holds the total frame length required so far), or a negative status. */
typedef struct {
    const uint8_t *buf;
    size_t len;
    size_t pos;
    size_t need;
    size_t max_frame;
    store_proto_resume_t *resume; /* NULL: every item is walked */
} reader_t;

static int rd_take(reader_t *r, size_t n, const uint8_t **out) {
    if (n > r->max_frame - r->pos) return STORE_PROTO_E_FRAME_TOO_LONG;
    if (n > r->len - r->pos) {
        r->need = r->pos + n;
        return 0;
    }
    *out = r->buf + r->pos;
    r->pos += n;
    return 1;
}

static int rd_u8(reader_t *r, uint8_t *v) {
    const uint8_t *p;
    int rc = rd_take(r, 1, &p);
    if (rc == 1) *v = p[0];
    return rc;
}

static int rd_u32(reader_t *r, uint32_t *v) {
    const uint8_t *p;
    int rc = rd_take(r, 4, &p);
    if (rc == 1) *v = store_load_u32(p);
    return rc;
}

static int rd_u64(reader_t *r, uint64_t *v) {
    const uint8_t *p;
    int rc = rd_take(r, 8, &p);
    if (rc == 1) *v = store_load_u64(p);
    return rc;
}

/* u64 length + bytes, the length bounded by max (error too_long) before any byte is awaited. */
static int rd_bytes(reader_t *r, size_t max, int too_long, store_bytes_t *out) {
    uint64_t n;
    int rc = rd_u64(r, &n);
    if (rc != 1) return rc;
    if (n > max) return too_long;
    const uint8_t *p;
    rc = rd_take(r, (size_t)n, &p);
    if (rc != 1) return rc;
    out->ptr = p;
    out->len = (size_t)n;
    return 1;
}

#define RD(expr)                                                                                   \
    do {                                                                                           \
        int rd_rc_ = (expr);                                                                       \
        if (rd_rc_ != 1) return rd_rc_;                                                            \
    } while (0)

static int rd_key(reader_t *r, const store_limits_t *lim, store_bytes_t *out) {
    return rd_bytes(r, lim->max_key_bytes, STORE_PROTO_E_KEY_TOO_LONG, out);
}

static int rd_value(reader_t *r, const store_limits_t *lim, store_bytes_t *out) {
    return rd_bytes(r, lim->max_value_bytes, STORE_PROTO_E_VALUE_TOO_LONG, out);
}

static int rd_items(reader_t *r, const store_limits_t *lim, bool has_values, store_request_t *q) {
    RD(rd_u64(r, &q->n_items));
    if (q->n_items > lim->max_keys_per_op) return STORE_PROTO_E_TOO_MANY_KEYS;
    size_t start = r->pos;
    uint64_t i = 0;
    if (r->resume && r->resume->items_done && r->resume->items_done < q->n_items &&
        r->resume->pos >= start && r->resume->pos <= r->len) {
        i = r->resume->items_done; /* those before were walked in a shorter prefix */
        r->pos = r->resume->pos;
    }
    for (; i < q->n_items; i++) {
        size_t at = r->pos;
        store_bytes_t k, v;
        int rc = rd_key(r, lim, &k);
        if (rc == 1 && has_values) rc = rd_value(r, lim, &v);
        if (rc == 0 && r->resume) *r->resume = (store_proto_resume_t){.items_done = i, .pos = at};
        if (rc != 1) return rc;
    }
    q->items.ptr = r->buf + start;
    q->items.len = r->pos - start;
    return 1;
}

static int decode_body(reader_t *r, const store_limits_t *lim, store_request_t *q) {
    switch (q->op) {
    case STORE_OP_VALIDATE:
    case STORE_OP_PING:
        return rd_u32(r, &q->u32);
    case STORE_OP_SET:
    case STORE_OP_APPEND:
    case STORE_OP_QUEUE_PUSH:
        RD(rd_key(r, lim, &q->key));
        return rd_value(r, lim, &q->value);
    case STORE_OP_COMPARE_SET:
        RD(rd_key(r, lim, &q->key));
        RD(rd_value(r, lim, &q->value));
        return rd_value(r, lim, &q->value2);
    case STORE_OP_GET:
    case STORE_OP_DELETE_KEY:
    case STORE_OP_QUEUE_POP:
    case STORE_OP_QUEUE_LEN:
    case STORE_OP_WATCH_KEY:
        return rd_key(r, lim, &q->key);
    case STORE_OP_ADD:
    case STORE_OP_BARRIER: {
        uint64_t v;
        RD(rd_key(r, lim, &q->key));
        RD(rd_u64(r, &v));
        q->add_delta = (int64_t)v;
        return 1;
    }
    case STORE_OP_CHECK:
    case STORE_OP_WAIT:
    case STORE_OP_MULTI_GET:
        return rd_items(r, lim, false, q);
    case STORE_OP_MULTI_SET:
        return rd_items(r, lim, true, q);
    case STORE_OP_GETNUMKEYS:
    case STORE_OP_CANCEL_WAIT:
    case STORE_OP_LIST_KEYS:
        return 1;
    case STORE_OP_AUTH_HELLO: {
        uint8_t version;
        RD(rd_u8(r, &version));
        q->u32 = version;
        return 1;
    }
    case STORE_OP_AUTH_PROOF:
        return rd_take(r, STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES, &q->auth);
    default:
        return STORE_PROTO_E_OPCODE;
    }
}

int store_proto_decode_request(store_dialect_t dialect, const store_limits_t *lim,
                               const uint8_t *buf, size_t len, store_request_t *out,
                               size_t *need_bytes) {
    return store_proto_decode_request_resume(dialect, lim, buf, len, out, need_bytes, NULL);
}

int store_proto_decode_request_resume(store_dialect_t dialect, const store_limits_t *lim,
                                      const uint8_t *buf, size_t len, store_request_t *out,
                                      size_t *need_bytes, store_proto_resume_t *resume) {
    reader_t r = {.buf = buf,
                  .len = len,
                  .pos = 0,
                  .need = 1,
                  .max_frame = lim->max_frame_bytes,
                  .resume = resume};
    memset(out, 0, sizeof *out);
    uint8_t wire;
    int rc = rd_u8(&r, &wire);
    if (rc == 1) {
        rc = op_from_wire(dialect, wire, &out->op);
        if (rc == 0) rc = decode_body(&r, lim, out);
    }
    if (need_bytes) *need_bytes = r.need;
    if (rc == 1) {
        if (out->op == STORE_OP_VALIDATE && out->u32 != STORE_PROTO_MAGIC)
            return STORE_PROTO_E_BAD_MAGIC;
        return (int)r.pos;
    }
    return rc;
}

bool store_proto_next_item(const store_request_t *req, size_t *cursor, store_bytes_t *key,
                           store_bytes_t *value) {
    if (*cursor >= req->items.len) return false;
    const uint8_t *p = req->items.ptr + *cursor;
    key->len = (size_t)store_load_u64(p);
    key->ptr = p + 8;
    p = key->ptr + key->len;
    if (req->op == STORE_OP_MULTI_SET) {
        value->len = (size_t)store_load_u64(p);
        value->ptr = p + 8;
        p = value->ptr + value->len;
    } else if (value) {
        value->ptr = NULL;
        value->len = 0;
    }
    *cursor = (size_t)(p - req->items.ptr);
    return true;
}

store_reply_kind_t store_proto_reply_kind(store_op_t op) {
    switch (op) {
    case STORE_OP_CHECK:
    case STORE_OP_WAIT:
    case STORE_OP_BARRIER:
    case STORE_OP_CANCEL_WAIT:
        return STORE_REPLY_U8;
    case STORE_OP_LIST_KEYS:
        return STORE_REPLY_KEY_COUNT;
    case STORE_OP_ADD:
    case STORE_OP_GETNUMKEYS:
    case STORE_OP_DELETE_KEY:
    case STORE_OP_QUEUE_LEN:
        return STORE_REPLY_I64;
    case STORE_OP_PING:
        return STORE_REPLY_U32;
    case STORE_OP_GET:
    case STORE_OP_COMPARE_SET:
    case STORE_OP_MULTI_GET:
        return STORE_REPLY_BYTES;
    case STORE_OP_QUEUE_POP:
        return STORE_REPLY_QUEUE_POP;
    case STORE_OP_AUTH_HELLO:
        return STORE_REPLY_AUTH_HELLO;
    case STORE_OP_AUTH_PROOF:
        return STORE_REPLY_AUTH_PROOF;
    default:
        return STORE_REPLY_NONE;
    }
}

int store_proto_decode_reply(store_reply_kind_t kind, const store_limits_t *lim, const uint8_t *buf,
                             size_t len, store_reply_t *out) {
    reader_t r = {.buf = buf, .len = len, .pos = 0, .need = 1, .max_frame = lim->max_frame_bytes};
    uint64_t v64 = 0;
    memset(out, 0, sizeof *out);
    int rc = 1;
    switch (kind) {
    case STORE_REPLY_NONE:
        return STORE_PROTO_E_BAD_VALUE;
    case STORE_REPLY_U8:
        rc = rd_u8(&r, &out->u8);
        break;
    case STORE_REPLY_U32:
        rc = rd_u32(&r, &out->u32);
        break;
    case STORE_REPLY_I64:
    case STORE_REPLY_KEY_COUNT:
        rc = rd_u64(&r, &v64);
        out->i64 = (int64_t)v64;
        break;
    case STORE_REPLY_BYTES:
        rc = rd_value(&r, lim, &out->bytes);
        break;
    case STORE_REPLY_QUEUE_POP:
        rc = rd_u64(&r, &v64);
        out->i64 = (int64_t)v64;
        if (rc == 1 && out->i64 > 0) rc = rd_value(&r, lim, &out->bytes);
        break;
    case STORE_REPLY_AUTH_HELLO:
    case STORE_REPLY_AUTH_PROOF: {
        rc = rd_u8(&r, &out->u8);
        if (rc != 1) break;
        uint8_t expect = kind == STORE_REPLY_AUTH_HELLO ? STORE_AUTH_CHALLENGE : STORE_AUTH_OK;
        uint8_t plain = kind == STORE_REPLY_AUTH_HELLO ? STORE_AUTH_OPEN : STORE_AUTH_DENIED;
        if (out->u8 == expect) {
            rc = rd_take(&r, STORE_AUTH_NONCE_BYTES, &out->bytes.ptr);
            out->bytes.len = STORE_AUTH_NONCE_BYTES;
        } else if (out->u8 != plain) {
            rc = STORE_PROTO_E_BAD_VALUE;
        }
        break;
    }
    }
    return rc == 1 ? (int)r.pos : rc;
}

void store_writer_init(store_writer_t *w, uint8_t *buf, size_t cap) {
    w->data = buf;
    w->len = 0;
    w->cap = cap;
    w->is_overflow = false;
}

void store_put_raw(store_writer_t *w, const void *p, size_t n) {
    if (n > w->cap - w->len) {
        w->is_overflow = true;
        return;
    }
    if (n) memcpy(w->data + w->len, p, n);
    w->len += n;
}

void store_put_u8(store_writer_t *w, uint8_t v) {
    store_put_raw(w, &v, 1);
}

void store_put_u32(store_writer_t *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    store_put_raw(w, b, 4);
}

void store_put_u64(store_writer_t *w, uint64_t v) {
    store_put_u32(w, (uint32_t)v);
    store_put_u32(w, (uint32_t)(v >> 32));
}

void store_put_i64(store_writer_t *w, int64_t v) {
    store_put_u64(w, (uint64_t)v);
}

void store_put_bytes(store_writer_t *w, const void *p, size_t n) {
    store_put_u64(w, n);
    store_put_raw(w, p, n);
}
