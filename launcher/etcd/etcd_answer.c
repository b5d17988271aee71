/* etcd_answer: see etcd_answer.h. */
#include "etcd/etcd_answer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#define WATCH_MESSAGE_MAX (64u << 20)

bool etcd_answer_b64(const cJSON *field, uint8_t **out, size_t *n) {
    const char *text = cJSON_IsString(field) ? field->valuestring : "";
    size_t len = strlen(text);
    *out = malloc(len + 1);
    if (!*out) return false;
    if (sodium_base642bin(*out, len + 1, text, len, NULL, n, NULL,
                          sodium_base64_VARIANT_ORIGINAL) != 0) {
        free(*out);
        *out = NULL;
        return false;
    }
    (*out)[*n] = 0;
    return true;
}

int64_t etcd_answer_i64(const cJSON *o, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    if (cJSON_IsString(f)) return strtoll(f->valuestring, NULL, 10);
    if (cJSON_IsNumber(f) && f->valuedouble > -9.2e18 && f->valuedouble < 9.2e18)
        return (int64_t)f->valuedouble;
    return 0;
}

int64_t etcd_answer_revision(const cJSON *answer) {
    return etcd_answer_i64(cJSON_GetObjectItemCaseSensitive(answer, "header"), "revision");
}

bool etcd_answer_kv(const cJSON *kv, etcd_value_t *out) {
    size_t n;
    if (!etcd_answer_b64(cJSON_GetObjectItemCaseSensitive(kv, "value"), &out->value, &n))
        return false;
    out->is_found = true;
    out->len = n;
    out->mod_revision = etcd_answer_i64(kv, "mod_revision");
    out->lease = etcd_answer_i64(kv, "lease");
    return true;
}

bool etcd_answer_each_kv(const cJSON *answer, etcd_kv_fn fn, void *arg) {
    const cJSON *kv;
    cJSON_ArrayForEach(kv, cJSON_GetObjectItemCaseSensitive(answer, "kvs")) {
        uint8_t *k;
        size_t kn;
        etcd_value_t v = {0};
        if (!etcd_answer_b64(cJSON_GetObjectItemCaseSensitive(kv, "key"), &k, &kn)) return false;
        if (!etcd_answer_kv(kv, &v)) {
            free(k);
            return false;
        }
        fn(arg, (const char *)k, v.value, v.len);
        free(k);
        free(v.value);
    }
    return true;
}

/* One message: {"result": {"created": true, "events": [...], ...}} or {"error": {...}}. */
enum { /* gRPC status codes of a member's trouble */
       GRPC_CANCELLED = 1,
       GRPC_DEADLINE_EXCEEDED = 4,
       GRPC_ABORTED = 10,
       GRPC_INTERNAL = 13,
       GRPC_UNAVAILABLE = 14,
};

static void watch_message(etcd_watch_stream_t *w, const char *text, size_t n) {
    cJSON *m = cJSON_ParseWithLength(text, n);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "result");
    if (!cJSON_IsObject(r)) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(m, "error");
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(e, "message");
        snprintf(w->error, sizeof w->error, "%s",
                 cJSON_IsString(msg) ? msg->valuestring : "an unreadable message");
        w->is_bad = true;
        /* a member that stops (SIGTERM) ends its streams with {"error":{"grpc_code":14,...
         * "transport is closing"}}: the member's trouble, not the watch's */
        int64_t code = etcd_answer_i64(e, "grpc_code");
        if (code == 0) code = etcd_answer_i64(e, "code");
        w->is_member_gone = code == GRPC_CANCELLED || code == GRPC_DEADLINE_EXCEEDED ||
                            code == GRPC_ABORTED || code == GRPC_INTERNAL ||
                            code == GRPC_UNAVAILABLE;
        cJSON_Delete(m);
        return;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "created"))) w->is_created = true;
    if (etcd_answer_i64(r, "compact_revision") > 0) {
        snprintf(w->error, sizeof w->error, "revision %" PRId64 " was compacted", w->next_revision);
        w->is_bad = true;
        w->is_compacted = true;
    }
    const cJSON *ev;
    cJSON_ArrayForEach(ev, cJSON_GetObjectItemCaseSensitive(r, "events")) {
        if (w->is_done || w->is_bad) break;
        const cJSON *kv = cJSON_GetObjectItemCaseSensitive(ev, "kv");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(ev, "type");
        uint8_t *k = NULL, *v = NULL;
        size_t kn, vn;
        if (!etcd_answer_b64(cJSON_GetObjectItemCaseSensitive(kv, "key"), &k, &kn) ||
            !etcd_answer_b64(cJSON_GetObjectItemCaseSensitive(kv, "value"), &v, &vn)) {
            free(k);
            snprintf(w->error, sizeof w->error, "an event with a bad key or value encoding");
            w->is_bad = true;
            break;
        }
        int64_t rev = etcd_answer_i64(kv, "mod_revision");
        bool is_delete = cJSON_IsString(type) && strcmp(type->valuestring, "DELETE") == 0;
        if (rev >= w->next_revision && rev < INT64_MAX) w->next_revision = rev + 1;
        if (w->fn(w->arg, is_delete ? ETCD_EVENT_DELETE : ETCD_EVENT_PUT, (const char *)k, v, vn,
                  rev))
            w->is_done = true;
        free(k);
        free(v);
    }
    cJSON_Delete(m);
}

bool etcd_watch_stream_feed(etcd_watch_stream_t *w, const char *data, size_t n) {
    for (size_t i = 0; i < n && !w->is_done && !w->is_bad; i++) {
        if (data[i] == '\n') {
            watch_message(w, w->line, w->len);
            w->len = 0;
            continue;
        }
        if (w->len + 1 >= w->cap) {
            size_t cap = w->cap ? w->cap * 2 : 4096;
            char *l = cap <= WATCH_MESSAGE_MAX ? realloc(w->line, cap) : NULL;
            if (!l) {
                snprintf(w->error, sizeof w->error, "%s",
                         cap > WATCH_MESSAGE_MAX ? "a watch message over 64 MiB" : "out of memory");
                w->is_bad = true;
                break;
            }
            w->line = l;
            w->cap = cap;
        }
        w->line[w->len++] = data[i];
    }
    return !w->is_done && !w->is_bad;
}

void etcd_watch_stream_end(etcd_watch_stream_t *w) {
    if (w->len > 0 && !w->is_done && !w->is_bad) watch_message(w, w->line, w->len);
    w->len = 0;
}

void etcd_watch_stream_free(etcd_watch_stream_t *w) {
    free(w->line);
    w->line = NULL;
    w->len = w->cap = 0;
}
