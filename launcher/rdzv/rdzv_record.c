/* rdzv_record: see rdzv_record.h. */
#include "rdzv/rdzv_record.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cJSON.h>

#include "endpoint.h"
#include "exit_codes.h"

/* name: "HOST:PORT" when host is not empty; false when it does not fit. */
static bool add_address(cJSON *o, const char *name, const char *host, uint16_t port) {
    if (!host[0]) return true;
    char text[300];
    int n = snprintf(text, sizeof text, "%s:%u", host, port);
    return n > 0 && (size_t)n < sizeof text && cJSON_AddStringToObject(o, name, text);
}

static int print_to(cJSON *o, char *out, size_t out_len) {
    int rc = -1;
    if (o && cJSON_PrintPreallocated(o, out, (int)out_len, false)) rc = (int)strlen(out);
    cJSON_Delete(o);
    return rc;
}

int rdzv_record_node_format(const rdzv_node_record_t *n, char *out, size_t out_len) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "nproc", n->nproc);
    cJSON_AddNumberToObject(o, "hint", n->hint);
    cJSON_AddBoolToObject(o, "host", n->is_host);
    if (!add_address(o, "store", n->store_host, n->store_port) ||
        !add_address(o, "peer", n->peer_host, n->peer_port)) {
        cJSON_Delete(o);
        return -1;
    }
    return print_to(o, out, out_len);
}

int rdzv_record_why_format(const rdzv_why_t *w, char *out, size_t out_len) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "code", w->code);
    cJSON_AddBoolToObject(o, "permanent", w->is_permanent);
    cJSON_AddNumberToObject(o, "failures", w->failures);
    cJSON_AddNumberToObject(o, "node", w->node);
    cJSON_AddNumberToObject(o, "rank", w->rank);
    if (w->nodes > 0) cJSON_AddNumberToObject(o, "nodes", w->nodes);
    if (w->is_finished) cJSON_AddBoolToObject(o, "finished", true);
    return print_to(o, out, out_len);
}

int rdzv_record_rank_format(const rdzv_rank_record_t *r, char *out, size_t out_len) {
    cJSON *o = cJSON_CreateObject();
    if (r->error[0]) {
        cJSON_AddStringToObject(o, "error", r->error);
        cJSON_AddBoolToObject(o, "lost", r->is_lost);
    } else {
        cJSON_AddNumberToObject(o, "node", r->group_rank);
        cJSON_AddNumberToObject(o, "first_rank", r->rank_offset);
        cJSON_AddNumberToObject(o, "world_size", r->world_size);
        cJSON_AddNumberToObject(o, "node0", r->host_join_index);
        if (!add_address(o, "store", r->store_host, r->store_port) ||
            !add_address(o, "next_peer", r->next_peer_host, r->next_peer_port)) {
            cJSON_Delete(o);
            return -1;
        }
    }
    return print_to(o, out, out_len);
}

/* A JSON object from n_bytes of text, or NULL (too long, not JSON, not an object). */
static cJSON *parse_object(const char *text, size_t n_bytes) {
    if (n_bytes == 0 || n_bytes > RDZV_RECORD_MAX_BYTES) return NULL;
    cJSON *o = cJSON_ParseWithLength(text, n_bytes);
    if (o && !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static bool get_int(const cJSON *o, const char *key, int min, int max, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= min && d <= max) || d != floor(d)) return false;
    *out = (int)d;
    return true;
}

static bool get_bool(const cJSON *o, const char *key, bool *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsBool(v)) return false;
    *out = cJSON_IsTrue(v);
    return true;
}

/* An optional address: absent (host empty) or "HOST:PORT" as rdzv_record.h says; false else. */
static bool get_address(const cJSON *o, const char *name, char *host, size_t host_len,
                        uint16_t *port) {
    host[0] = '\0';
    *port = 0;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v) return true;
    if (!cJSON_IsString(v)) return false;
    const char *text = v->valuestring, *colon = strrchr(text, ':');
    if (!colon || colon == text || (size_t)(colon - text) >= host_len) return false;
    for (const char *p = text; p < colon; p++)
        if (*p <= 0x20 || *p >= 0x7f || *p == '"' || *p == '\\') return false; /* no escapes */
    uint64_t value;
    if (parse_u64(colon + 1, 1, 65535, &value) < 0) return false;
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = '\0';
    *port = (uint16_t)value;
    return true;
}

bool rdzv_record_node_parse(const char *text, size_t n_bytes, rdzv_node_record_t *out) {
    cJSON *o = parse_object(text, n_bytes);
    bool is_ok =
        o && get_int(o, "nproc", 1, INT_MAX, &out->nproc) &&
        get_int(o, "hint", -1, INT_MAX, &out->hint) && get_bool(o, "host", &out->is_host) &&
        get_address(o, "store", out->store_host, sizeof out->store_host, &out->store_port) &&
        get_address(o, "peer", out->peer_host, sizeof out->peer_host, &out->peer_port);
    cJSON_Delete(o);
    return is_ok;
}

bool rdzv_record_why_parse(const char *text, size_t n_bytes, rdzv_why_t *out) {
    cJSON *o = parse_object(text, n_bytes);
    bool is_ok = o && get_int(o, "code", 0, 255, &out->code) &&
                 get_bool(o, "permanent", &out->is_permanent) &&
                 get_int(o, "failures", 0, INT_MAX, &out->failures) &&
                 get_int(o, "node", -1, INT_MAX, &out->node) &&
                 get_int(o, "rank", -1, INT_MAX, &out->rank);
    out->nodes = 0; /* optional: records of older agents lack it */
    if (is_ok && cJSON_GetObjectItemCaseSensitive(o, "nodes"))
        is_ok = get_int(o, "nodes", 1, RDZV_MAX_NODES, &out->nodes);
    /* optional: only the end of a job says it, and only with code 0 */
    out->is_finished = false;
    if (is_ok && cJSON_GetObjectItemCaseSensitive(o, "finished"))
        is_ok = get_bool(o, "finished", &out->is_finished) && (!out->is_finished || !out->code);
    cJSON_Delete(o);
    return is_ok;
}

bool rdzv_record_rank_parse(const char *text, size_t n_bytes, rdzv_rank_record_t *out) {
    cJSON *o = parse_object(text, n_bytes);
    if (!o) return false;
    memset(out, 0, sizeof *out);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "error");
    bool is_ok;
    if (cJSON_IsString(e)) { /* shown to people: printable ASCII only */
        size_t n = 0;
        for (const char *p = e->valuestring; *p && n < sizeof out->error - 1; p++)
            out->error[n++] = *p >= 0x20 && *p < 0x7f ? *p : '?';
        out->error[n] = '\0';
        is_ok = n > 0 && cJSON_GetArraySize(o) == 2 && get_bool(o, "lost", &out->is_lost);
    } else {
        is_ok =
            get_int(o, "node", 0, RDZV_MAX_NODES - 1, &out->group_rank) &&
            get_int(o, "world_size", 1, INT_MAX, &out->world_size) &&
            get_int(o, "first_rank", 0, out->world_size - 1, &out->rank_offset) &&
            get_int(o, "node0", 0, RDZV_MAX_NODES - 1, &out->host_join_index) &&
            get_address(o, "store", out->store_host, sizeof out->store_host, &out->store_port) &&
            get_address(o, "next_peer", out->next_peer_host, sizeof out->next_peer_host,
                        &out->next_peer_port);
    }
    cJSON_Delete(o);
    return is_ok;
}

rdzv_why_outcome_t rdzv_why_outcome(const rdzv_why_t *w, int max_restarts, bool is_multi) {
    if (w->code == 0) return RDZV_WHY_RESTARTS;
    if (w->is_permanent) return RDZV_WHY_ENDS;
    if (w->failures <= max_restarts) return RDZV_WHY_RESTARTS;
    return is_multi && w->code == DDP_EXIT_PEER_FAILURE ? RDZV_WHY_SIZE_DECIDES : RDZV_WHY_ENDS;
}

void rdzv_record_why_describe(const rdzv_why_t *w, char *out, size_t out_len) {
    if (w->code == 0) {
        snprintf(out, out_len, "%s", w->is_finished ? "the job finished" : "a membership change");
        return;
    }
    char where[64] = "";
    if (w->node >= 0 && w->rank >= 0)
        snprintf(where, sizeof where, " on node %d rank %d", w->node, w->rank);
    else if (w->node >= 0)
        snprintf(where, sizeof where, " on node %d", w->node);
    snprintf(out, out_len, "exit %d%s, failure %d of the job%s", w->code, where, w->failures,
             w->is_permanent ? ", not retryable" : "");
}
