/* rdzv_kv_etcd: rdzv_kv over etcd's v3 API (etcd_client). TCPStore's meanings are built from
 * compare-and-swap transactions on a key's mod_revision: ADD reads, then puts the sum only if
 * nobody wrote in between, else reads again; a wait is a range, then a watch from the revision
 * after it. An agent's ephemeral keys carry its lease (rdzv_lease_t, one per agent). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "clock.h"
#include "ddp_error.h"
#include "etcd/etcd_client.h"
#include "rdzv/rdzv_kv.h"
#include "rdzv/rdzv_kv_impl.h"

struct rdzv_lease {
    pthread_mutex_t mu;
    int64_t id; /* 0: not granted yet */
    int64_t ttl_s;
};

rdzv_lease_t *rdzv_lease_new(int64_t ttl_s) {
    rdzv_lease_t *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    pthread_mutex_init(&l->mu, NULL);
    l->ttl_s = ttl_s;
    return l;
}

void rdzv_lease_free(rdzv_lease_t *l) {
    if (!l) return;
    pthread_mutex_destroy(&l->mu);
    free(l);
}

typedef struct {
    rdzv_kv_t kv;
    etcd_t *c;
    rdzv_lease_t *lease;
    int64_t op_timeout_ms;
    char error[1024];
} etcd_kv_t;

static etcd_kv_t *self(rdzv_kv_t *kv) { return (etcd_kv_t *)kv; }

static int failed(etcd_kv_t *e, int rc) {
    snprintf(e->error, sizeof e->error, "%s", etcd_error(e->c));
    return rc;
}

static int kv_set(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    int rc = etcd_put(self(kv)->c, key, val, len, 0);
    return rc < 0 ? failed(self(kv), rc) : 0;
}

typedef struct {
    const char *key;
} put_seen_t;

static bool is_put_of(void *arg, etcd_event_type_t type, const char *key, const uint8_t *v,
                      size_t n, int64_t rev) {
    (void)v, (void)n, (void)rev;
    return type == ETCD_EVENT_PUT && strcmp(key, ((put_seen_t *)arg)->key) == 0;
}

/* Until key exists or deadline_ms (clock_now_ms) passes; the value when asked for. */
static int wait_key(etcd_kv_t *e, const char *key, uint64_t deadline_ms, etcd_value_t *value) {
    for (;;) {
        etcd_value_t v;
        int64_t revision;
        int rc = etcd_get(e->c, key, &v, &revision);
        if (rc < 0) return failed(e, rc);
        if (v.is_found) {
            if (value) *value = v;
            else etcd_value_free(&v);
            return 0;
        }
        uint64_t now = clock_now_ms();
        if (now >= deadline_ms) {
            snprintf(e->error, sizeof e->error, "etcd %s: key %s did not appear in time",
                     etcd_endpoints(e->c), key);
            return DDP_ETIMEOUT;
        }
        put_seen_t seen = {key};
        rc = etcd_watch(e->c, key, false, revision + 1, (int64_t)(deadline_ms - now), is_put_of,
                        &seen);
        if (rc == DDP_ETIMEOUT) {
            snprintf(e->error, sizeof e->error, "etcd %s: key %s did not appear in time",
                     etcd_endpoints(e->c), key);
            return rc;
        }
        if (rc < 0) return failed(e, rc);
    }
}

static int kv_wait(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms) {
    etcd_kv_t *e = self(kv);
    uint64_t deadline = clock_now_ms() + (uint64_t)(timeout_ms < 0 ? e->op_timeout_ms : timeout_ms);
    for (size_t i = 0; i < n; i++) TRY(wait_key(e, keys[i], deadline, NULL));
    return 0;
}

static int kv_get(rdzv_kv_t *kv, const char *key, uint8_t **val, size_t *len) {
    etcd_kv_t *e = self(kv);
    etcd_value_t v;
    TRY(wait_key(e, key, clock_now_ms() + (uint64_t)e->op_timeout_ms, &v));
    *val = v.value;
    *len = v.len;
    return 0;
}

/* After a lost compare-and-swap: a random pause of up to 2^lost ms (32 at most). Every attempt is
 * a raft proposal, and N agents retrying at once (a round's joins) would make N^2 of them. */
static void contention_pause(int lost) {
    uint32_t cap_ms = 1u << (lost < 5 ? lost : 5);
    uint32_t us = randombytes_uniform(cap_ms * 1000);
    struct timespec ts = {0, (long)us * 1000L};
    nanosleep(&ts, NULL);
}

static int kv_add(rdzv_kv_t *kv, const char *key, int64_t delta, int64_t *result) {
    etcd_kv_t *e = self(kv);
    for (int lost = 0;; contention_pause(++lost)) { /* someone else's ADD landed first */
        etcd_value_t v;
        int rc = etcd_get(e->c, key, &v, NULL);
        if (rc < 0) return failed(e, rc);
        int64_t now = 0;
        if (v.is_found && v.len > 0) {
            char *end;
            now = strtoll((const char *)v.value, &end, 10);
            if (end == (const char *)v.value || *end) {
                etcd_value_free(&v);
                snprintf(e->error, sizeof e->error, "etcd: key %s holds no decimal count", key);
                return DDP_EPROTO;
            }
        }
        if (delta == 0 && v.is_found) { /* a read: writing the same count back would only
                                           contend with the ADDs that change it */
            etcd_value_free(&v);
            *result = now;
            return 0;
        }
        char text[24];
        snprintf(text, sizeof text, "%" PRId64, now + delta);
        bool is_put;
        rc = etcd_put_if(e->c, key, v.is_found ? v.mod_revision : 0, text, strlen(text), 0,
                         &is_put);
        etcd_value_free(&v);
        if (rc < 0) return failed(e, rc);
        if (is_put) {
            *result = now + delta;
            return 0;
        }
    }
}

static int copy_out(const void *data, size_t len, uint8_t **out, size_t *out_len) {
    *out = malloc(len + 1);
    if (!*out) return -ENOMEM;
    memcpy(*out, data, len);
    (*out)[len] = 0;
    *out_len = len;
    return 0;
}

/* TCPStore's: a missing key is created when expected is empty (else expected comes back); an
 * existing one is replaced when it holds expected; the value it then holds comes back. */
static int kv_compare_set(rdzv_kv_t *kv, const char *key, const void *expected, size_t expected_len,
                          const void *desired, size_t desired_len, uint8_t **current,
                          size_t *current_len) {
    etcd_kv_t *e = self(kv);
    for (int lost = 0;; contention_pause(++lost)) {
        etcd_value_t v;
        int rc = etcd_get(e->c, key, &v, NULL);
        if (rc < 0) return failed(e, rc);
        if (!v.is_found && expected_len > 0) return copy_out(expected, expected_len, current, current_len);
        bool is_match = !v.is_found || (v.len == expected_len && memcmp(v.value, expected, v.len) == 0);
        if (!is_match) {
            *current = v.value;
            *current_len = v.len;
            return 0;
        }
        bool is_put;
        rc = etcd_put_if(e->c, key, v.is_found ? v.mod_revision : 0, desired, desired_len, 0, &is_put);
        etcd_value_free(&v);
        if (rc < 0) return failed(e, rc);
        if (is_put) return copy_out(desired, desired_len, current, current_len);
    }
}

static int kv_multi_get(rdzv_kv_t *kv, const char *const *keys, size_t n, uint8_t **vals,
                        size_t *lens) {
    etcd_kv_t *e = self(kv);
    for (size_t i = 0; i < n; i++) {
        etcd_value_t v;
        int rc = etcd_get(e->c, keys[i], &v, NULL);
        if (rc == 0 && !v.is_found) rc = copy_out("", 0, &v.value, &v.len);
        if (rc < 0) {
            for (size_t j = 0; j < i; j++) free(vals[j]);
            return failed(e, rc);
        }
        vals[i] = v.value;
        lens[i] = v.len;
    }
    return 0;
}

static int lease_id(etcd_kv_t *e, int64_t *id) {
    rdzv_lease_t *l = e->lease;
    pthread_mutex_lock(&l->mu);
    int rc = 0;
    if (!l->id) rc = etcd_lease_grant(e->c, l->ttl_s, &l->id);
    *id = l->id;
    pthread_mutex_unlock(&l->mu);
    return rc < 0 ? failed(e, rc) : 0;
}

static int kv_set_ephemeral(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    etcd_kv_t *e = self(kv);
    int64_t id;
    TRY(lease_id(e, &id));
    int rc = etcd_put(e->c, key, val, len, id);
    return rc < 0 ? failed(e, rc) : 0;
}

static int kv_keep_alive(rdzv_kv_t *kv) {
    etcd_kv_t *e = self(kv);
    pthread_mutex_lock(&e->lease->mu);
    int64_t id = e->lease->id;
    pthread_mutex_unlock(&e->lease->mu);
    if (!id) return 0;
    int64_t ttl;
    int rc = etcd_lease_keepalive(e->c, id, &ttl);
    if (rc < 0) return failed(e, rc);
    if (ttl > 0) return 0;
    snprintf(e->error, sizeof e->error, "etcd %s: lease %" PRIx64 " expired: the other nodes "
             "consider this one lost", etcd_endpoints(e->c), (uint64_t)id);
    return DDP_ELEASE;
}

typedef struct {
    const char *const *keys;
    size_t n;
    int gone;
    bool *is_present;
} gone_t;

static int key_index(const gone_t *g, const char *key) {
    for (size_t i = 0; i < g->n; i++)
        if (strcmp(g->keys[i], key) == 0) return (int)i;
    return -1;
}

static void note_present(void *arg, const char *key, const uint8_t *v, size_t n) {
    (void)v, (void)n;
    gone_t *g = arg;
    int i = key_index(g, key);
    if (i >= 0) g->is_present[i] = true;
}

static bool is_delete_of_one(void *arg, etcd_event_type_t type, const char *key, const uint8_t *v,
                             size_t n, int64_t rev) {
    (void)v, (void)n, (void)rev;
    gone_t *g = arg;
    int i = key_index(g, key);
    if (type != ETCD_EVENT_DELETE || i < 0) return false;
    g->gone = i;
    return true;
}

static int kv_wait_gone(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms,
                        int *gone) {
    etcd_kv_t *e = self(kv);
    if (n == 0) return DDP_ETIMEOUT;
    size_t common = strlen(keys[0]); /* one watch over the keys' common prefix */
    for (size_t i = 1; i < n; i++) {
        size_t j = 0;
        while (j < common && keys[i][j] == keys[0][j]) j++;
        common = j;
    }
    char *prefix = strndup(keys[0], common);
    bool *is_present = calloc(n, sizeof *is_present);
    int rc = prefix && is_present ? 0 : -ENOMEM;
    gone_t g = {.keys = keys, .n = n, .gone = -1, .is_present = is_present};
    int64_t revision = 0;
    if (rc == 0 && (rc = etcd_get_prefix(e->c, prefix, note_present, &g, &revision)) < 0)
        failed(e, rc);
    for (size_t i = 0; rc == 0 && i < n && g.gone < 0; i++)
        if (!is_present[i]) g.gone = (int)i; /* gone before we looked */
    if (rc == 0 && g.gone < 0) {
        rc = etcd_watch(e->c, prefix, true, revision + 1, timeout_ms, is_delete_of_one, &g);
        if (rc < 0 && rc != DDP_ETIMEOUT) failed(e, rc);
    }
    *gone = g.gone;
    free(prefix);
    free(is_present);
    return rc;
}

typedef struct {
    char **keys;
    uint8_t **vals;
    size_t *lens, n, cap;
    bool is_short;
} listing_t;

static void collect(void *arg, const char *key, const uint8_t *v, size_t len) {
    listing_t *l = arg;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        char **k = realloc(l->keys, cap * sizeof *k);
        if (k) l->keys = k;
        uint8_t **vs = realloc(l->vals, cap * sizeof *vs);
        if (vs) l->vals = vs;
        size_t *ls = realloc(l->lens, cap * sizeof *ls);
        if (ls) l->lens = ls;
        if (!k || !vs || !ls) {
            l->is_short = true;
            return;
        }
        l->cap = cap;
    }
    l->keys[l->n] = strdup(key);
    l->vals[l->n] = malloc(len + 1);
    if (!l->keys[l->n] || !l->vals[l->n]) {
        free(l->keys[l->n]);
        free(l->vals[l->n]);
        l->is_short = true;
        return;
    }
    memcpy(l->vals[l->n], v, len);
    l->lens[l->n++] = len;
}

static int kv_expire_prefix(rdzv_kv_t *kv, const char *prefix, int64_t ttl_s) {
    etcd_kv_t *e = self(kv);
    listing_t l = {0};
    int64_t lease;
    int rc = etcd_lease_grant(e->c, ttl_s, &lease);
    if (rc == 0) rc = etcd_get_prefix(e->c, prefix, collect, &l, NULL);
    if (rc == 0 && l.is_short) rc = -ENOMEM;
    for (size_t i = 0; rc == 0 && i < l.n; i++)
        rc = etcd_put(e->c, l.keys[i], l.vals[i], l.lens[i], lease);
    for (size_t i = 0; i < l.n; i++) {
        free(l.keys[i]);
        free(l.vals[i]);
    }
    free(l.keys);
    free(l.vals);
    free(l.lens);
    return rc < 0 && rc != -ENOMEM ? failed(e, rc) : rc;
}

static void kv_interrupt(rdzv_kv_t *kv) { etcd_interrupt(self(kv)->c); }

static const char *kv_error(const rdzv_kv_t *kv) { return ((const etcd_kv_t *)kv)->error; }

static void kv_destroy(rdzv_kv_t *kv) {
    etcd_destroy(self(kv)->c);
    free(kv);
}

static const rdzv_kv_ops_t etcd_ops = {
    .set = kv_set, .get = kv_get, .add = kv_add, .compare_set = kv_compare_set, .wait = kv_wait,
    .multi_get = kv_multi_get, .set_ephemeral = kv_set_ephemeral, .keep_alive = kv_keep_alive,
    .wait_gone = kv_wait_gone, .expire_prefix = kv_expire_prefix, .interrupt = kv_interrupt, .error = kv_error,
    .destroy = kv_destroy};

int rdzv_kv_etcd_connect(const ddprun_opts_t *o, rdzv_lease_t *lease, int64_t connect_timeout_ms,
                         int64_t op_timeout_ms, rdzv_kv_t **out) {
    etcd_kv_t *e = calloc(1, sizeof *e);
    *out = (rdzv_kv_t *)e;
    if (!e) return -ENOMEM;
    e->kv.ops = &etcd_ops;
    e->lease = lease;
    e->op_timeout_ms = op_timeout_ms;
    etcd_opts_t eo = {.endpoints = o->rdzv_endpoints, .cacert = o->etcd_cacert,
                      .cert = o->etcd_cert, .key = o->etcd_key, .user = o->etcd_user,
                      .password = o->etcd_password,
                      .connect_timeout_ms = connect_timeout_ms < 2000 ? connect_timeout_ms : 2000,
                      .op_timeout_ms = op_timeout_ms};
    int rc = etcd_create(&eo, &e->c);
    if (rc < 0) return failed(e, rc);
    /* reach the cluster now, so that a wrong endpoint or password says so at once */
    etcd_value_t v;
    if ((rc = etcd_get(e->c, "/ddprun", &v, NULL)) < 0) return failed(e, rc);
    etcd_value_free(&v);
    return 0;
}
