/* store_proto: the codec of PyTorch's c10d TCPStore wire protocol, plus ddprun's auth extension.
 *
 * Pure and incremental: bytes in -> NEED_MORE, one complete request/reply, or an error. No I/O,
 * no allocation; decoded strings point into the caller's buffer. Every length a peer claims is
 * checked against store_limits_t before the caller could be asked to buffer it.
 *
 * Two numberings exist on the wire (see docs/protocol.md):
 *   current (torch >= 2.2): VALIDATE=0 + u32 magic opens every connection, SET=1 ... QUEUE_LEN=16,
 *                           then LIST_KEYS=17 and BARRIER=18 in newer releases;
 *   legacy  (torch 1.9-2.1): no VALIDATE, SET=0 COMPARE_SET=1 ... DELETE_KEY=8 ... CANCEL_WAIT=12.
 * They are told apart by the first bytes of a connection (store_proto_detect_dialect).
 * Strings/byte vectors are u64 length + bytes, integers little-endian. ADD carries an i64; the
 * stored value is its decimal ASCII text.
 */
#ifndef DDP_PROTO_STORE_PROTO_H
#define DDP_PROTO_STORE_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store_limits.h"

#define STORE_PROTO_MAGIC 0x3C85F7CEu

/* Canonical operations; values equal the current wire numbering. */
typedef enum {
    STORE_OP_VALIDATE = 0,
    STORE_OP_SET = 1,
    STORE_OP_COMPARE_SET = 2,
    STORE_OP_GET = 3,
    STORE_OP_ADD = 4,
    STORE_OP_CHECK = 5,
    STORE_OP_WAIT = 6,
    STORE_OP_GETNUMKEYS = 7,
    STORE_OP_DELETE_KEY = 8,
    STORE_OP_APPEND = 9,
    STORE_OP_MULTI_GET = 10,
    STORE_OP_MULTI_SET = 11,
    STORE_OP_CANCEL_WAIT = 12,
    STORE_OP_PING = 13,
    STORE_OP_QUEUE_PUSH = 14,
    STORE_OP_QUEUE_POP = 15,
    STORE_OP_QUEUE_LEN = 16,
    STORE_OP_LIST_KEYS = 17, /* torch >= 2.10-ish */
    STORE_OP_BARRIER = 18,   /* torch >= 2.10-ish */
    STORE_OP_WATCH_KEY = 19, /* legacy only (7 on the wire); decoded so it can be refused clearly */
    STORE_OP_AUTH_HELLO = 20, /* ddprun extension, current dialect only: 0xD0 on the wire */
    STORE_OP_AUTH_PROOF = 21, /* ddprun extension: 0xD1 */
    STORE_OP__COUNT
} store_op_t;

#define STORE_WIRE_AUTH_HELLO 0xD0u
#define STORE_WIRE_AUTH_PROOF 0xD1u

typedef enum {
    STORE_DIALECT_UNKNOWN = 0,
    STORE_DIALECT_CURRENT, /* torch >= 2.2 */
    STORE_DIALECT_LEGACY,  /* torch 1.9 - 2.1 */
} store_dialect_t;

/* Reply constants shared by both numberings. */
enum { STORE_CHECK_READY = 0, STORE_CHECK_NOT_READY = 1 };
enum { STORE_WAIT_STOP_WAITING = 0, STORE_WAIT_CANCELED = 1 };

/* Auth extension (docs/protocol.md): HELLO -> OPEN | CHALLENGE(nonce); PROOF -> OK(mac) | DENIED.
 */
#define STORE_AUTH_VERSION     1u
#define STORE_AUTH_NONCE_BYTES 32u
#define STORE_AUTH_MAC_BYTES   32u
enum {
    STORE_AUTH_OPEN = 0,      /* server holds no secret: proceed */
    STORE_AUTH_CHALLENGE = 1, /* followed by the server nonce */
    STORE_AUTH_OK = 2,        /* followed by the server's MAC */
    STORE_AUTH_DENIED = 3,    /* wrong proof: the server closes the connection */
};

/* Decoder results: > 0 is the length of a complete frame; these are the rest. */
typedef enum {
    STORE_PROTO_NEED_MORE = 0,
    STORE_PROTO_E_OPCODE = -1,         /* unknown operation byte */
    STORE_PROTO_E_KEY_TOO_LONG = -2,   /* key longer than limits.max_key_bytes */
    STORE_PROTO_E_VALUE_TOO_LONG = -3, /* value longer than limits.max_value_bytes */
    STORE_PROTO_E_TOO_MANY_KEYS = -4,  /* multi-key op above limits.max_keys_per_op */
    STORE_PROTO_E_FRAME_TOO_LONG = -5, /* frame above limits.max_frame_bytes */
    STORE_PROTO_E_BAD_MAGIC = -6,      /* VALIDATE with the wrong magic */
    STORE_PROTO_E_NOT_VALIDATED = -7,  /* current dialect: first request was not VALIDATE */
    STORE_PROTO_E_BAD_VALUE = -8,      /* well-framed but meaningless (e.g. unknown auth version) */
} store_proto_status_t;

const char *store_proto_strerror(int status);
const char *store_op_name(store_op_t op);

typedef struct {
    const uint8_t *ptr;
    size_t len;
} store_bytes_t;

/* One decoded request. Pointers reference the decoded buffer and live as long as it does. */
typedef struct {
    store_op_t op;
    store_bytes_t key;    /* SET CAS GET ADD DELETE APPEND QUEUE_* BARRIER WATCH */
    store_bytes_t value;  /* SET APPEND QUEUE_PUSH; COMPARE_SET: expected value */
    store_bytes_t value2; /* COMPARE_SET: desired value */
    int64_t add_delta;    /* ADD; BARRIER: world size */
    uint32_t u32;         /* VALIDATE magic, PING nonce, AUTH_HELLO version */
    uint64_t n_items;     /* CHECK WAIT MULTI_GET: keys; MULTI_SET: key/value pairs */
    store_bytes_t items;  /* the raw items, walked with store_proto_next_item */
    const uint8_t *auth;  /* AUTH_PROOF: client nonce then MAC */
} store_request_t;

/* Tell the numbering from a connection's first bytes. Returns STORE_DIALECT_UNKNOWN when more
 * bytes are needed (at most 5). Current clients open with 0x00 + the LE magic; a legacy SET also
 * starts with 0x00 but is followed by a key length, which can never equal the magic (> limit). */
store_dialect_t store_proto_detect_dialect(const uint8_t *buf, size_t len);

/* Decode one request frame from buf[0..len).
 * Returns > 0: frame length (out filled), STORE_PROTO_NEED_MORE, or a negative status.
 * *need_bytes (optional) gets the total frame length known to be needed so far, so the caller can
 * wait for that many bytes before calling again; it is bounded by lim->max_frame_bytes. */
int store_proto_decode_request(store_dialect_t dialect, const store_limits_t *lim,
                               const uint8_t *buf, size_t len, store_request_t *out,
                               size_t *need_bytes);

/* Where an incomplete frame of many items (CHECK WAIT MULTI_GET MULTI_SET) was left: the items
 * already checked are not walked again when more of the frame arrives. Zero it for a new frame. */
typedef struct {
    uint64_t items_done;
    size_t pos; /* where item items_done starts */
} store_proto_resume_t;

/* store_proto_decode_request for a frame whose earlier prefixes (same bytes, shorter) were decoded
 * with the same *resume (a new frame: zeroed). */
int store_proto_decode_request_resume(store_dialect_t dialect, const store_limits_t *lim,
                                      const uint8_t *buf, size_t len, store_request_t *out,
                                      size_t *need_bytes, store_proto_resume_t *resume);

/* Walk CHECK/WAIT/MULTI_GET keys (value unused) or MULTI_SET pairs. *cursor starts at 0.
 * Only valid on a request returned by store_proto_decode_request. Returns false when done. */
bool store_proto_next_item(const store_request_t *req, size_t *cursor, store_bytes_t *key,
                           store_bytes_t *value);

/* Wire opcode of op in a dialect; -1 if the dialect lacks it. */
int store_proto_wire_opcode(store_dialect_t dialect, store_op_t op);

/* ---- replies (client side) ---------------------------------------------------------------- */

typedef enum {
    STORE_REPLY_U8,         /* CHECK WAIT CANCEL_WAIT: u8 */
    STORE_REPLY_I64,        /* ADD GETNUMKEYS DELETE_KEY QUEUE_LEN: i64 */
    STORE_REPLY_U32,        /* PING: u32 nonce echo */
    STORE_REPLY_BYTES,      /* GET COMPARE_SET: u64 length + bytes */
    STORE_REPLY_QUEUE_POP,  /* i64 queue length before the pop, then bytes if it was > 0 */
    STORE_REPLY_KEY_COUNT,  /* LIST_KEYS: i64 count, then that many keys (decode each as BYTES) */
    STORE_REPLY_AUTH_HELLO, /* u8 OPEN | u8 CHALLENGE + nonce */
    STORE_REPLY_AUTH_PROOF, /* u8 OK + mac | u8 DENIED */
    STORE_REPLY_NONE,       /* SET APPEND MULTI_SET QUEUE_PUSH VALIDATE: nothing */
} store_reply_kind_t;

store_reply_kind_t store_proto_reply_kind(store_op_t op);

typedef struct {
    uint8_t u8;
    uint32_t u32;
    int64_t i64;
    store_bytes_t bytes; /* BYTES, QUEUE_POP value, AUTH nonce/mac */
} store_reply_t;

/* Decode one reply of the given kind (MULTI_GET: call once per key with STORE_REPLY_BYTES).
 * Same return convention as store_proto_decode_request. */
int store_proto_decode_reply(store_reply_kind_t kind, const store_limits_t *lim, const uint8_t *buf,
                             size_t len, store_reply_t *out);

/* ---- encoding ----------------------------------------------------------------------------- */

/* A bounded writer over caller storage; writes past cap set is_overflow and are dropped. */
typedef struct {
    uint8_t *data;
    size_t len;
    size_t cap;
    bool is_overflow;
} store_writer_t;

void store_writer_init(store_writer_t *w, uint8_t *buf, size_t cap);
void store_put_u8(store_writer_t *w, uint8_t v);
void store_put_u32(store_writer_t *w, uint32_t v);
void store_put_u64(store_writer_t *w, uint64_t v);
void store_put_i64(store_writer_t *w, int64_t v);
void store_put_raw(store_writer_t *w, const void *p, size_t n);
void store_put_bytes(store_writer_t *w, const void *p, size_t n); /* u64 length + bytes */

/* Little-endian loads, for callers holding validated frames. */
uint32_t store_load_u32(const uint8_t *p);
uint64_t store_load_u64(const uint8_t *p);

#endif
