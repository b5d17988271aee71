/* etcd_answer: what an etcd member answers, decoded (bytes from outside: never trusted). The
 * JSON gateway sends keys and values as base64, int64s as decimal strings, leaves out zeros and
 * empty values (proto3 JSON), and streams a watch as one JSON message per line. No I/O; fuzzed
 * by tests/fuzz/fuzz_etcd_answer.c. */
#ifndef DDP_LAUNCHER_ETCD_ANSWER_H
#define DDP_LAUNCHER_ETCD_ANSWER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

/* A key's value as a range answer gives it. */
typedef struct {
    bool is_found;
    uint8_t *value; /* malloc'd, NUL-terminated (not counted in len); NULL when !is_found */
    size_t len;
    int64_t mod_revision;
    int64_t lease;
} etcd_value_t;

/* What a watch saw happen to a key. */
typedef enum { ETCD_EVENT_PUT, ETCD_EVENT_DELETE } etcd_event_type_t;

/* One watched change; returning true ends the watch (etcd_watch returns 0). */
typedef bool (*etcd_event_fn)(void *arg, etcd_event_type_t type, const char *key,
                              const uint8_t *value, size_t len, int64_t mod_revision);
/* One key of a prefix read. */
typedef void (*etcd_kv_fn)(void *arg, const char *key, const uint8_t *value, size_t len);

/* A base64 field into a malloc'd NUL-terminated buffer; a missing field is empty. False (and
 * *out NULL) when it does not decode. */
bool etcd_answer_b64(const cJSON *field, uint8_t **out, size_t *n);
/* An int64 field; 0 when missing or not a number. */
int64_t etcd_answer_i64(const cJSON *o, const char *name);
/* The revision in an answer's header. */
int64_t etcd_answer_revision(const cJSON *answer);
/* One key-value of a range answer (value, mod_revision, lease); false on a bad encoding. */
bool etcd_answer_kv(const cJSON *kv, etcd_value_t *out);
/* Every key-value of a range answer to fn; false at the first with a bad encoding. */
bool etcd_answer_each_kv(const cJSON *answer, etcd_kv_fn fn, void *arg);

/* A watch's stream as it arrives, in pieces of any size. */
typedef struct {
    etcd_event_fn fn;
    void *arg;
    char *line; /* a message in arrival, up to '\n' */
    size_t len, cap;
    int64_t next_revision; /* after the last event delivered: where to resume elsewhere */
    bool is_created;     /* the member confirmed the watch: it answers (a frozen one never does) */
    bool is_done;        /* fn returned true */
    bool is_bad;         /* error says why: an error message, a compaction, bad encoding */
    bool is_compacted;   /* with is_bad: the start revision was compacted away */
    bool is_member_gone; /* with is_bad: the member's own trouble (gRPC unavailable, shutting
                            down, ...): another member can resume from next_revision */
    char error[256];
} etcd_watch_stream_t;

/* Feeds n bytes; every complete message goes through fn in order. False once the watch is
 * done or bad (stop reading). */
bool etcd_watch_stream_feed(etcd_watch_stream_t *w, const char *data, size_t n);
/* The stream ended: a last message without its '\n' is taken too. */
void etcd_watch_stream_end(etcd_watch_stream_t *w);
void etcd_watch_stream_free(etcd_watch_stream_t *w);

#endif
