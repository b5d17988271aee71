/* etcd_client: see etcd_client.h. */
#include "etcd/etcd_client.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cJSON.h>
#include <sodium.h>

#include "clock.h"
#include "ddp_error.h"
#include "etcd/etcd_answer.h"
#include "http.h"

#define DEFAULT_PORT   2379
#define RETRY_PAUSE_MS 50

struct etcd {
    etcd_opts_t opts;
    char endpoints_text[2048];
    char *urls[ETCD_MAX_ENDPOINTS]; /* "http://h:p" */
    int n_urls, current;
    http_t *http;
    char token[512]; /* auth: "" until authenticated */
    char *user, *password;
    atomic_bool is_interrupted;
    char error[1024];
};

/* ---- encoding ------------------------------------------------------------------------------ */

static char *b64(const void *data, size_t n) {
    size_t cap = sodium_base64_ENCODED_LEN(n, sodium_base64_VARIANT_ORIGINAL);
    char *out = malloc(cap);
    if (out) sodium_bin2base64(out, cap, data, n, sodium_base64_VARIANT_ORIGINAL);
    return out;
}

static void add_b64(cJSON *o, const char *name, const void *data, size_t n) {
    char *text = b64(data, n);
    cJSON_AddStringToObject(o, name, text ? text : "");
    free(text);
}

static void add_i64(cJSON *o, const char *name, int64_t v) {
    char text[24];
    snprintf(text, sizeof text, "%" PRId64, v);
    cJSON_AddStringToObject(o, name, text);
}

/* The end of a prefix's key range: the prefix with its last byte incremented. */
static void add_prefix_end(cJSON *o, const char *prefix) {
    size_t n = strlen(prefix);
    char *end = malloc(n + 1);
    if (!end) return;
    memcpy(end, prefix, n + 1);
    while (n > 0 && (uint8_t)end[n - 1] == 0xff)
        n--;
    if (n == 0)
        add_b64(o, "range_end", "\0", 1); /* every key */
    else {
        end[n - 1] = (char)((uint8_t)end[n - 1] + 1);
        add_b64(o, "range_end", end, n);
    }
    free(end);
}

/* ---- the client ---------------------------------------------------------------------------- */

static int fail(etcd_t *c, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(etcd_t *c, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
    return rc;
}

int etcd_create(const etcd_opts_t *opts, etcd_t **out) {
    etcd_t *c = calloc(1, sizeof *c);
    *out = c;
    if (!c) return -ENOMEM;
    c->opts = *opts;
    if (!c->opts.connect_timeout_ms) c->opts.connect_timeout_ms = 2000;
    if (!c->opts.op_timeout_ms) c->opts.op_timeout_ms = 30000;
    if (c->opts.try_timeout_ms <= 0 || c->opts.try_timeout_ms > c->opts.op_timeout_ms)
        c->opts.try_timeout_ms = c->opts.op_timeout_ms;
    snprintf(c->endpoints_text, sizeof c->endpoints_text, "%s",
             opts->endpoints ? opts->endpoints : "");
    c->user = opts->user && *opts->user ? strdup(opts->user) : NULL;
    c->password = opts->password ? strdup(opts->password) : NULL;
    c->opts.user = c->user;
    c->opts.password = c->password;
    bool is_tls = (opts->cacert && *opts->cacert) || (opts->cert && *opts->cert);
    char list[2048];
    snprintf(list, sizeof list, "%s", c->endpoints_text);
    char *save = NULL;
    for (char *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        while (*item == ' ')
            item++;
        if (!*item) continue;
        if (c->n_urls == ETCD_MAX_ENDPOINTS)
            return fail(c, -EINVAL, "etcd: more than %d endpoints in '%s'", ETCD_MAX_ENDPOINTS,
                        c->endpoints_text);
        const char *scheme = is_tls ? "https://" : "http://";
        const char *host = item;
        if (strncmp(item, "http://", 7) == 0 || strncmp(item, "https://", 8) == 0)
            scheme = "", host = item;
        const char *after_scheme = strstr(host, "://") ? strstr(host, "://") + 3 : host;
        bool has_port = after_scheme[0] == '[' ? strstr(after_scheme, "]:") != NULL
                                               : strchr(after_scheme, ':') != NULL;
        char url[600];
        int n = snprintf(url, sizeof url, "%s%s", scheme, host);
        if (!has_port) n = snprintf(url, sizeof url, "%s%s:%d", scheme, host, DEFAULT_PORT);
        while (n > 0 && url[n - 1] == '/')
            url[--n] = '\0';
        if (n <= 0 || (size_t)n >= sizeof url || strlen(after_scheme) == 0)
            return fail(c, -EINVAL, "etcd: bad endpoint '%s'", item);
        if (!(c->urls[c->n_urls++] = strdup(url))) return -ENOMEM;
    }
    if (c->n_urls == 0) return fail(c, -EINVAL, "etcd: no endpoint in '%s'", c->endpoints_text);
    http_opts_t ho = {.cacert = opts->cacert && *opts->cacert ? opts->cacert : NULL,
                      .cert = opts->cert && *opts->cert ? opts->cert : NULL,
                      .key = opts->key && *opts->key ? opts->key : NULL,
                      .connect_timeout_ms = c->opts.connect_timeout_ms};
    int rc = http_create(&ho, &c->http);
    if (rc == -ELIBACC) return fail(c, rc, "etcd: %s", http_load_error());
    if (rc < 0) return fail(c, rc, "etcd: out of memory");
    return 0;
}

void etcd_destroy(etcd_t *c) {
    if (!c) return;
    for (int i = 0; i < c->n_urls; i++)
        free(c->urls[i]);
    http_destroy(c->http);
    if (c->password) sodium_memzero(c->password, strlen(c->password));
    free(c->password);
    free(c->user);
    free(c);
}

void etcd_interrupt(etcd_t *c) {
    atomic_store(&c->is_interrupted, true);
    if (c->http) http_interrupt(c->http);
}

const char *etcd_error(const etcd_t *c) {
    return c->error;
}
const char *etcd_endpoints(const etcd_t *c) {
    return c->endpoints_text;
}

/* gRPC codes worth another member: CANCELLED, DEADLINE_EXCEEDED, ABORTED, INTERNAL, UNAVAILABLE
 * (no leader, leader changed, a member stopping). */
static bool is_retryable_code(int code) {
    return code == 1 || code == 4 || code == 10 || code == 13 || code == 14;
}

static bool is_token_error(const char *message) {
    return strstr(message, "invalid auth token") || strstr(message, "auth token is expired");
}

typedef struct {
    int rc; /* 0: answered; <0: transport (try the next member) */
    long status;
    cJSON *json; /* the parsed body */
} answer_t;

static int authenticate(etcd_t *c, const char *url, int64_t timeout_ms);

/* One POST of body to url+path; parses the answer. */
static answer_t post_once(etcd_t *c, const char *url, const char *path, const char *body,
                          int64_t timeout_ms, http_chunk_fn on_chunk, void *arg) {
    char full[700], auth[600];
    snprintf(full, sizeof full, "%s%s", url, path);
    snprintf(auth, sizeof auth, "Authorization: %s", c->token);
    http_request_t req = {.url = full,
                          .body = body,
                          .auth_header = c->token[0] ? auth : NULL,
                          .timeout_ms = timeout_ms,
                          .on_chunk = on_chunk,
                          .arg = arg};
    answer_t a = {0};
    char *text = NULL;
    a.rc = http_post(c->http, &req, &a.status, on_chunk ? NULL : &text);
    if (a.rc == 0 && text) {
        a.json = cJSON_Parse(text);
        if (!a.json && a.status == 200) {
            a.rc = DDP_EPROTO;
            fail(c, a.rc, "etcd %s%s: the answer is not JSON", url, path);
        }
    } else if (a.rc < 0) {
        fail(c, a.rc, "etcd %s", http_error(c->http));
    }
    free(text);
    return a;
}

/* POST with failover: *json gets a 200 answer's body. */
static int call(etcd_t *c, const char *path, cJSON *body_obj, cJSON **json) {
    *json = NULL;
    char *body = cJSON_PrintUnformatted(body_obj);
    if (!body) return fail(c, -ENOMEM, "etcd: out of memory");
    uint64_t deadline = clock_now_ms() + (uint64_t)c->opts.op_timeout_ms;
    int rc = DDP_ETIMEOUT, tries = 0;
    bool is_not_etcd[ETCD_MAX_ENDPOINTS] = {false}; /* answered 200 with no JSON */
    bool is_reauthed = false;
    for (;;) {
        if (atomic_exchange(&c->is_interrupted, false)) {
            rc = fail(c, DDP_ECLOSED, "etcd %s: interrupted", path);
            break;
        }
        uint64_t now = clock_now_ms();
        if (now >= deadline && tries > 0) break;
        const char *url = c->urls[c->current];
        int64_t left = (int64_t)(deadline > now ? deadline - now : 1);
        if (left > c->opts.try_timeout_ms) left = c->opts.try_timeout_ms; /* then the next */
        tries++;
        if (c->user && !c->token[0]) {
            rc = authenticate(c, url, left);
            if (rc == DDP_ECLOSED || rc == DDP_EAUTH) break;
            if (rc < 0) goto next;
        }
        answer_t a = post_once(c, url, path, body, left, NULL, NULL);
        rc = a.rc;
        if (rc == DDP_ECLOSED) break;
        /* 200 with a body that is not JSON: no etcd (a web server, a proxy's page) answers
         * there; once every endpoint did, no retry will change it (it was retried silently
         * until the operation's bound, 11 minutes by default) */
        if (rc == DDP_EPROTO && !a.json) {
            is_not_etcd[c->current] = true;
            bool is_every = true;
            for (int i = 0; i < c->n_urls; i++)
                is_every &= is_not_etcd[i];
            if (is_every) break;
        }
        if (rc == 0 && a.status == 200) {
            *json = a.json;
            break;
        }
        if (rc == 0) { /* an error answer: {"error": ..., "code": N, "message": ...} */
            const cJSON *m = cJSON_GetObjectItemCaseSensitive(a.json, "message");
            const char *message = cJSON_IsString(m) ? m->valuestring : "no message";
            int code = (int)etcd_answer_i64(a.json, "code");
            rc = fail(c, DDP_EPROTO, "etcd %s%s: HTTP %ld: %s", url, path, a.status, message);
            bool is_token = c->user && is_token_error(message) && !is_reauthed;
            cJSON_Delete(a.json);
            if (is_token) { /* expired: once more with a fresh token */
                c->token[0] = '\0';
                is_reauthed = true;
                continue;
            }
            if (!is_retryable_code(code) && a.status < 500) break;
        }
    next:
        /* this member cannot answer now: the next one, after a pause once around the ring */
        c->current = (c->current + 1) % c->n_urls;
        if (c->current == 0) {
            struct timespec ts = {0, RETRY_PAUSE_MS * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    cJSON_free(body);
    return *json ? 0 : rc;
}

static int authenticate(etcd_t *c, const char *url, int64_t timeout_ms) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", c->user);
    cJSON_AddStringToObject(o, "password", c->password ? c->password : "");
    char *body = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!body) return -ENOMEM;
    answer_t a = post_once(c, url, "/v3/auth/authenticate", body, timeout_ms, NULL, NULL);
    sodium_memzero(body, strlen(body));
    cJSON_free(body);
    if (a.rc < 0) return a.rc;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(a.json, "token");
    int rc = 0;
    if (a.status == 200 && cJSON_IsString(t) && strlen(t->valuestring) < sizeof c->token) {
        snprintf(c->token, sizeof c->token, "%s", t->valuestring);
    } else {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(a.json, "message");
        int code = (int)etcd_answer_i64(a.json, "code");
        rc = is_retryable_code(code) || a.status >= 500 ? -EIO : DDP_EAUTH;
        fail(c, rc, "etcd %s: authentication as '%s' failed: %s", url, c->user,
             cJSON_IsString(m) ? m->valuestring : "no token in the answer");
    }
    cJSON_Delete(a.json);
    return rc;
}

/* ---- key-value ----------------------------------------------------------------------------- */

int etcd_get(etcd_t *c, const char *key, etcd_value_t *out, int64_t *revision) {
    memset(out, 0, sizeof *out);
    cJSON *body = cJSON_CreateObject(), *answer;
    add_b64(body, "key", key, strlen(key));
    int rc = call(c, "/v3/kv/range", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    if (revision) *revision = etcd_answer_revision(answer);
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(answer, "kvs");
    const cJSON *kv = cJSON_IsArray(kvs) ? cJSON_GetArrayItem(kvs, 0) : NULL;
    if (kv && !etcd_answer_kv(kv, out))
        rc = fail(c, DDP_EPROTO, "etcd: key %s: bad value encoding", key);
    cJSON_Delete(answer);
    return rc;
}

void etcd_value_free(etcd_value_t *v) {
    free(v->value);
    v->value = NULL;
    v->is_found = false;
}

static int get_prefix(etcd_t *c, const char *prefix, bool is_keys_only, etcd_kv_fn fn, void *arg,
                      int64_t *revision) {
    cJSON *body = cJSON_CreateObject(), *answer;
    add_b64(body, "key", prefix, strlen(prefix));
    add_prefix_end(body, prefix);
    if (is_keys_only) cJSON_AddBoolToObject(body, "keys_only", true);
    int rc = call(c, "/v3/kv/range", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    if (revision) *revision = etcd_answer_revision(answer);
    if (!etcd_answer_each_kv(answer, fn, arg))
        rc = fail(c, DDP_EPROTO, "etcd: prefix %s: bad key or value encoding", prefix);
    cJSON_Delete(answer);
    return rc;
}

int etcd_get_prefix(etcd_t *c, const char *prefix, etcd_kv_fn fn, void *arg, int64_t *revision) {
    return get_prefix(c, prefix, false, fn, arg, revision);
}

int etcd_get_prefix_keys(etcd_t *c, const char *prefix, etcd_kv_fn fn, void *arg,
                         int64_t *revision) {
    return get_prefix(c, prefix, true, fn, arg, revision);
}

static cJSON *put_request(const char *key, const void *val, size_t len, int64_t lease) {
    cJSON *p = cJSON_CreateObject();
    add_b64(p, "key", key, strlen(key));
    add_b64(p, "value", val, len);
    if (lease) add_i64(p, "lease", lease);
    return p;
}

int etcd_put(etcd_t *c, const char *key, const void *val, size_t len, int64_t lease) {
    cJSON *body = put_request(key, val, len, lease), *answer;
    int rc = call(c, "/v3/kv/put", body, &answer);
    cJSON_Delete(body);
    cJSON_Delete(answer);
    return rc;
}

/* A range request of key, for a txn. */
static cJSON *range_op(const char *key) {
    cJSON *op = cJSON_CreateObject(), *range = cJSON_CreateObject();
    add_b64(range, "key", key, strlen(key));
    cJSON_AddItemToObject(op, "request_range", range);
    return op;
}

int etcd_put_if(etcd_t *c, const char *key, int64_t mod_revision, const void *val, size_t len,
                int64_t lease, const char *mark_key, const char *mark, bool *is_put) {
    cJSON *body = cJSON_CreateObject(), *answer;
    cJSON *cmp = cJSON_CreateObject();
    add_b64(cmp, "key", key, strlen(key));
    cJSON_AddStringToObject(cmp, "result", "EQUAL");
    cJSON_AddStringToObject(cmp, "target", "MOD");
    add_i64(cmp, "mod_revision", mod_revision); /* 0 for a key that does not exist */
    cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "compare"), cmp);
    cJSON *op = cJSON_CreateObject();
    cJSON_AddItemToObject(op, "request_put", put_request(key, val, len, lease));
    cJSON *success = cJSON_AddArrayToObject(body, "success");
    cJSON_AddItemToArray(success, op);
    if (mark_key) {
        cJSON *put_mark = cJSON_CreateObject();
        cJSON_AddItemToObject(put_mark, "request_put",
                              put_request(mark_key, mark, strlen(mark), 0));
        cJSON_AddItemToArray(success, put_mark);
        cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "failure"), range_op(mark_key));
    }
    int rc = call(c, "/v3/kv/txn", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    *is_put = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(answer, "succeeded"));
    if (!*is_put && mark_key) { /* responses[0].response_range.kvs[0].value: our mark? */
        const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(
                cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(answer, "responses"), 0),
                "response_range"),
            "kvs");
        uint8_t *seen;
        size_t seen_len;
        if (etcd_answer_b64(cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(kvs, 0), "value"),
                            &seen, &seen_len)) {
            *is_put = seen_len == strlen(mark) && memcmp(seen, mark, seen_len) == 0;
            free(seen);
        }
    }
    cJSON_Delete(answer);
    return 0;
}

/* responses[i].response_range's first key-value into *out; absent: not found, as of the txn's
 * revision. False on a bad encoding. */
static bool txn_range_value(const cJSON *answer, int i, etcd_value_t *out) {
    const cJSON *range = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(answer, "responses"), i),
        "response_range");
    const cJSON *kv = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(range, "kvs"), 0);
    memset(out, 0, sizeof *out);
    if (kv) return etcd_answer_kv(kv, out);
    out->mod_revision = etcd_answer_revision(answer);
    return true;
}

int etcd_put_new(etcd_t *c, const char *key, const void *val, size_t len, const char *count_prefix,
                 const char *look, etcd_value_t *looked, int64_t *create_revision, int64_t *count) {
    cJSON *body = cJSON_CreateObject(), *answer;
    cJSON *cmp = cJSON_CreateObject();
    add_b64(cmp, "key", key, strlen(key));
    cJSON_AddStringToObject(cmp, "result", "EQUAL");
    cJSON_AddStringToObject(cmp, "target", "CREATE");
    add_i64(cmp, "create_revision", 0); /* 0: the key does not exist */
    cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "compare"), cmp);
    cJSON *op = cJSON_CreateObject();
    cJSON_AddItemToObject(op, "request_put", put_request(key, val, len, 0));
    cJSON *success = cJSON_AddArrayToObject(body, "success");
    cJSON_AddItemToArray(success, op);
    if (count_prefix) { /* a txn's range sees its earlier puts: the count includes this key */
        cJSON *counting = cJSON_CreateObject(), *all = cJSON_CreateObject();
        add_b64(all, "key", count_prefix, strlen(count_prefix));
        add_prefix_end(all, count_prefix);
        cJSON_AddBoolToObject(all, "count_only", true);
        cJSON_AddItemToObject(counting, "request_range", all);
        cJSON_AddItemToArray(success, counting);
    }
    cJSON *failure = cJSON_AddArrayToObject(body, "failure");
    cJSON_AddItemToArray(failure, range_op(key));
    if (look) { /* last in either branch */
        cJSON_AddItemToArray(success, range_op(look));
        cJSON_AddItemToArray(failure, range_op(look));
    }
    int rc = call(c, "/v3/kv/txn", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    const cJSON *responses = cJSON_GetObjectItemCaseSensitive(answer, "responses");
    if (count) *count = -1;
    bool is_created = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(answer, "succeeded"));
    if (look && !txn_range_value(answer, is_created ? (count_prefix ? 2 : 1) : 1, looked)) {
        cJSON_Delete(answer);
        return fail(c, DDP_EPROTO, "etcd: creating %s: %s has a bad value encoding", key, look);
    }
    if (is_created) {
        *create_revision = etcd_answer_revision(answer);
        if (count) /* responses[1].response_range.count */
            *count = etcd_answer_i64(cJSON_GetObjectItemCaseSensitive(
                                         cJSON_GetArrayItem(responses, 1), "response_range"),
                                     "count");
    } else { /* responses[0].response_range.kvs[0].create_revision */
        const cJSON *resp = cJSON_GetArrayItem(responses, 0);
        const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(resp, "response_range"), "kvs");
        *create_revision = etcd_answer_i64(cJSON_GetArrayItem(kvs, 0), "create_revision");
    }
    if (*create_revision <= 0) {
        rc = fail(c, DDP_EPROTO, "etcd: creating %s: an answer without its revision", key);
        if (look) etcd_value_free(looked);
    }
    cJSON_Delete(answer);
    return rc;
}

int etcd_count_prefix(etcd_t *c, const char *prefix, int64_t revision, int64_t *count) {
    cJSON *body = cJSON_CreateObject(), *answer;
    add_b64(body, "key", prefix, strlen(prefix));
    add_prefix_end(body, prefix);
    if (revision > 0) add_i64(body, "revision", revision);
    cJSON_AddBoolToObject(body, "count_only", true);
    int rc = call(c, "/v3/kv/range", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    *count = etcd_answer_i64(answer, "count"); /* absent: 0 (proto3 JSON leaves zeros out) */
    cJSON_Delete(answer);
    return 0;
}

int etcd_put_many(etcd_t *c, const char *const *keys, const void *const *vals, const size_t *lens,
                  size_t n) {
    if (n > ETCD_TXN_OPS_MAX) return fail(c, -EINVAL, "etcd: %zu puts in one transaction", n);
    cJSON *body = cJSON_CreateObject(), *answer;
    cJSON *ops = cJSON_AddArrayToObject(body, "success");
    for (size_t i = 0; i < n; i++) {
        cJSON *op = cJSON_CreateObject();
        cJSON_AddItemToObject(op, "request_put", put_request(keys[i], vals[i], lens[i], 0));
        cJSON_AddItemToArray(ops, op);
    }
    int rc = call(c, "/v3/kv/txn", body, &answer);
    cJSON_Delete(body);
    cJSON_Delete(answer);
    return rc;
}

/* ---- leases -------------------------------------------------------------------------------- */

int etcd_lease_grant(etcd_t *c, int64_t ttl_s, int64_t *id) {
    cJSON *body = cJSON_CreateObject(), *answer;
    add_i64(body, "TTL", ttl_s);
    int rc = call(c, "/v3/lease/grant", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    *id = etcd_answer_i64(answer, "ID");
    if (*id == 0) rc = fail(c, DDP_EPROTO, "etcd: lease grant without an ID");
    cJSON_Delete(answer);
    return rc;
}

int etcd_lease_keepalive(etcd_t *c, int64_t id, int64_t *ttl_s) {
    cJSON *body = cJSON_CreateObject(), *answer;
    add_i64(body, "ID", id);
    int rc = call(c, "/v3/lease/keepalive", body, &answer);
    cJSON_Delete(body);
    if (rc < 0) return rc;
    /* a stream of one answer: {"result": {"ID": ..., "TTL": ...}}, TTL absent: expired; or
     * {"error": {"message": ...}} with HTTP 200, as a stream's errors come */
    const cJSON *result = cJSON_GetObjectItemCaseSensitive(answer, "result");
    if (!cJSON_IsObject(result)) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(answer, "error"), "message");
        rc = fail(c, DDP_EPROTO, "etcd %s/v3/lease/keepalive: %s", c->urls[c->current],
                  cJSON_IsString(m) ? m->valuestring : "an answer without a result");
    }
    *ttl_s = etcd_answer_i64(result, "TTL");
    cJSON_Delete(answer);
    return rc;
}

/* ---- watch --------------------------------------------------------------------------------- */

static bool on_watch_chunk(void *arg, const char *data, size_t n) {
    return etcd_watch_stream_feed(arg, data, n);
}

int etcd_watch(etcd_t *c, const char *key, bool is_prefix, int64_t start_revision,
               int64_t timeout_ms, etcd_event_fn fn, void *arg) {
    etcd_watch_stream_t w = {.fn = fn, .arg = arg, .next_revision = start_revision};
    uint64_t deadline = clock_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    int rc = DDP_ETIMEOUT;
    while (!w.is_done) {
        if (atomic_exchange(&c->is_interrupted, false)) {
            rc = fail(c, DDP_ECLOSED, "etcd watch of %s: interrupted", key);
            break;
        }
        uint64_t now = clock_now_ms();
        if (now >= deadline) {
            rc = fail(c, DDP_ETIMEOUT, "etcd watch of %s: nothing within %lld ms", key,
                      (long long)timeout_ms);
            break;
        }
        if (c->user && !c->token[0] &&
            (rc = authenticate(c, c->urls[c->current], (int64_t)(deadline - now))) < 0) {
            if (rc == DDP_EAUTH || rc == DDP_ECLOSED) break;
            /* no member takes a login now (all restarting: their tokens were lost with them):
             * the next one after a pause, not a spin of refused connections until the deadline */
            c->current = (c->current + 1) % c->n_urls;
            struct timespec ts = {0, RETRY_PAUSE_MS * 1000000L};
            nanosleep(&ts, NULL);
            continue;
        }
        cJSON *body = cJSON_CreateObject(), *create = cJSON_CreateObject();
        add_b64(create, "key", key, strlen(key));
        if (is_prefix) add_prefix_end(create, key);
        add_i64(create, "start_revision", w.next_revision);
        cJSON_AddItemToObject(body, "create_request", create);
        char *text = cJSON_PrintUnformatted(body);
        cJSON_Delete(body);
        if (!text) return fail(c, -ENOMEM, "etcd: out of memory");
        w.len = 0;
        w.is_created = false;
        int64_t left = (int64_t)(deadline - now);
        if (left > c->opts.try_timeout_ms) left = c->opts.try_timeout_ms;
        answer_t a = post_once(c, c->urls[c->current], "/v3/watch", text, left, on_watch_chunk, &w);
        cJSON_free(text);
        rc = a.rc;
        if (rc == 0)
            etcd_watch_stream_end(&w);
        else /* a line cut by the slice's end or the transport: its events come again from
              * next_revision, not as an unreadable message that would fail the watch */
            w.len = 0;
        if (w.is_done) {
            rc = 0;
            break;
        }
        if (rc == DDP_ECLOSED) break;
        bool is_member_gone = w.is_bad && w.is_member_gone;
        if (is_member_gone) { /* as a cut stream: elsewhere, from next_revision */
            w.is_bad = w.is_member_gone = false;
        } else if (w.is_bad) {
            if (c->user && is_token_error(w.error)) { /* expired token: fetch another */
                c->token[0] = '\0';
                w.is_bad = false;
                continue;
            }
            rc = fail(c, w.is_compacted ? -ESTALE : DDP_EPROTO, "etcd watch of %s at %s: %s", key,
                      c->urls[c->current], w.error);
            break;
        }
        if (rc == DDP_ETIMEOUT && clock_now_ms() >= deadline) {
            rc = fail(c, DDP_ETIMEOUT, "etcd watch of %s: nothing within %lld ms", key,
                      (long long)timeout_ms);
            break;
        }
        rc = DDP_ETIMEOUT;
        if (a.status == 200 && w.is_created && !is_member_gone)
            continue; /* a quiet slice: again, same member */
        /* the stream ended or never began (the member went away or froze): the next one */
        c->current = (c->current + 1) % c->n_urls;
        struct timespec ts = {0, RETRY_PAUSE_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    etcd_watch_stream_free(&w);
    return rc;
}
