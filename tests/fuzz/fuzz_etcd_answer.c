/* libFuzzer harness over the decoding of etcd's answers (launcher/etcd/etcd_answer): what any
 * member of the cluster, or whatever answers on its address, sends back. The first byte picks the
 * path: a range answer (each key-value, the header's revision) or a watch stream fed in pieces
 * whose size the second byte sets. Checks that decoding never crashes or reads past the input, that
 * every key and value handed on is NUL-terminated at its length, that a watch never goes back in
 * revision, and that nothing is delivered after the callback ended the watch or it went bad. */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "etcd/etcd_answer.h"

typedef struct {
    size_t events;
    bool is_ended;
} seen_t;

static void on_kv(void *arg, const char *key, const uint8_t *value, size_t len) {
    seen_t *s = arg;
    assert(key && value && value[len] == 0);
    (void)strlen(key);
    s->events++;
}

static bool on_event(void *arg, etcd_event_type_t type, const char *key, const uint8_t *value,
                     size_t len, int64_t mod_revision) {
    seen_t *s = arg;
    assert(!s->is_ended);
    assert(type == ETCD_EVENT_PUT || type == ETCD_EVENT_DELETE);
    assert(key && value && value[len] == 0);
    (void)strlen(key);
    s->events++;
    s->is_ended = (mod_revision & 7) == 7; /* end some watches early */
    return s->is_ended;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    const char *text = (const char *)data + 2;
    size_t n = size - 2;
    seen_t seen = {0};
    if (data[0] & 1) {
        cJSON *answer = cJSON_ParseWithLength(text, n);
        (void)etcd_answer_revision(answer);
        (void)etcd_answer_each_kv(answer, on_kv, &seen);
        const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(answer, "kvs");
        etcd_value_t v = {0};
        if (cJSON_IsArray(kvs) && etcd_answer_kv(cJSON_GetArrayItem(kvs, 0), &v)) {
            assert(v.is_found && v.value[v.len] == 0);
            free(v.value);
        }
        cJSON_Delete(answer);
        return 0;
    }
    size_t piece = data[1] ? data[1] : n + 1;
    etcd_watch_stream_t w = {.fn = on_event, .arg = &seen, .next_revision = 1};
    bool is_reading = true;
    for (size_t at = 0; at < n && is_reading; at += piece) {
        int64_t before = w.next_revision;
        is_reading = etcd_watch_stream_feed(&w, text + at, n - at < piece ? n - at : piece);
        assert(w.next_revision >= before);
        assert(is_reading == (!w.is_done && !w.is_bad));
    }
    if (is_reading) etcd_watch_stream_end(&w);
    assert(w.is_done == seen.is_ended);
    etcd_watch_stream_free(&w);
    return 0;
}
