/* rdzv_kv_etcd: rdzv_kv over etcd's v3 API (etcd_client). TCPStore's meanings are built from
 * compare-and-swap transactions on a key's mod_revision: ADD reads, then puts the sum only if
 * nobody wrote in between, else reads again; a ticket (a join's ADD) is a key of its own and a
 * count at its revision instead, with no retries; a wait is a range, then a watch from the
 * revision after it. An agent's ephemeral keys carry its lease (rdzv_lease_t, one per agent). */
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
#include "log.h"
#include "rdzv/rdzv_kv.h"
#include "rdzv/rdzv_kv_impl.h"

/* The keys put under the lease, to put again under a new one when it expired: an agent has one
 * node record per round it joined; the last few are kept. */
#define LEASE_KEYS_MAX 4

struct rdzv_lease {
    pthread_mutex_t mu;
    int64_t id; /* 0: not granted yet */
    int64_t ttl_s;
    int n_keys;
    char *keys[LEASE_KEYS_MAX];
    uint8_t *vals[LEASE_KEYS_MAX];
    size_t lens[LEASE_KEYS_MAX];
};

rdzv_lease_t *rdzv_lease_new(int64_t ttl_s) {
    rdzv_lease_t *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    pthread_mutex_init(&l->mu, NULL);
    l->ttl_s = ttl_s;
    return l;
}

static void lease_drop_key(rdzv_lease_t *l, int i) {
    free(l->keys[i]);
    free(l->vals[i]);
    memmove(&l->keys[i], &l->keys[i + 1], (size_t)(l->n_keys - i - 1) * sizeof l->keys[0]);
    memmove(&l->vals[i], &l->vals[i + 1], (size_t)(l->n_keys - i - 1) * sizeof l->vals[0]);
    memmove(&l->lens[i], &l->lens[i + 1], (size_t)(l->n_keys - i - 1) * sizeof l->lens[0]);
    l->n_keys--;
}

void rdzv_lease_free(rdzv_lease_t *l) {
    if (!l) return;
    while (l->n_keys > 0)
        lease_drop_key(l, 0);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

typedef struct {
    rdzv_kv_t kv;
    etcd_t *c;
    rdzv_lease_t *lease;
    int64_t op_timeout_ms;
    int64_t slice_ms; /* a wait for one owed key looks at its owner's lease this often */
    /* What this kv last learnt of one key without being asked (seen_key NULL: nothing): its
     * value (seen.is_found; a wait found it, or a ticket's look), which the next WAIT and the
     * GET that follows take instead of another range; or that it was not there at revision
     * seen.mod_revision (a ticket's look, expect_absent), so the next wait for it watches from
     * the revision after, without a range first. A write of that key through this kv, or a GET
     * of another, forgets it. */
    char *seen_key;
    etcd_value_t seen;
    /* The key the last GET read and the revision it was written at (read_revision) */
    char *read_key;
    int64_t read_revision;
    char error[1024];
} etcd_kv_t;

static etcd_kv_t *self(rdzv_kv_t *kv) {
    return (etcd_kv_t *)kv;
}

static int failed(etcd_kv_t *e, int rc) {
    snprintf(e->error, sizeof e->error, "%s", etcd_error(e->c));
    return rc;
}

static void forget_seen(etcd_kv_t *e) {
    free(e->seen_key);
    e->seen_key = NULL;
    etcd_value_free(&e->seen);
}

/* A write of key: what was seen of it no longer holds. */
static void forget_seen_of(etcd_kv_t *e, const char *key) {
    if (e->seen_key && strcmp(e->seen_key, key) == 0) forget_seen(e);
}

/* v (found, or not found as of v->mod_revision) is now what this kv knows of key. */
static void remember_seen(etcd_kv_t *e, const char *key, etcd_value_t *v) {
    forget_seen(e);
    if ((e->seen_key = strdup(key)))
        e->seen = *v;
    else
        etcd_value_free(v);
}

static void remember_absent(etcd_kv_t *e, const char *key, int64_t revision) {
    etcd_value_t v = {.mod_revision = revision};
    remember_seen(e, key, &v);
}

static int kv_set(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    forget_seen_of(self(kv), key);
    int rc = etcd_put(self(kv)->c, key, val, len, 0);
    return rc < 0 ? failed(self(kv), rc) : 0;
}

typedef struct {
    const char *key;
    etcd_value_t got; /* the put's value */
    bool is_short;
} put_seen_t;

static bool is_put_of(void *arg, etcd_event_type_t type, const char *key, const uint8_t *v,
                      size_t n, int64_t rev) {
    put_seen_t *s = arg;
    if (type != ETCD_EVENT_PUT || strcmp(key, s->key) != 0) return false;
    if (!(s->got.value = malloc(n + 1))) {
        s->is_short = true;
        return true;
    }
    memcpy(s->got.value, v, n);
    s->got.value[n] = 0;
    s->got.len = n;
    s->got.mod_revision = rev;
    s->got.is_found = true;
    return true;
}

/* Until key exists or deadline_ms (clock_now_ms) passes; the value into *value, else kept for
 * the GET that follows (remember_seen). What this kv has seen of key (seen_key) spares the first
 * range: a value at once, or a watch from the revision after the one it was absent at (a
 * revision etcd compacted since: a range and a watch after all). */
static int wait_key(etcd_kv_t *e, const char *key, uint64_t deadline_ms, etcd_value_t *value) {
    int64_t absent_at = 0; /* > 0: key was not there at this revision */
    if (e->seen_key && strcmp(e->seen_key, key) == 0) {
        if (e->seen.is_found) {
            if (value) {
                *value = e->seen;
                e->seen = (etcd_value_t){0};
                forget_seen(e);
            }
            return 0;
        }
        absent_at = e->seen.mod_revision;
        forget_seen(e);
    }
    for (;;) {
        int64_t revision = absent_at;
        int rc;
        if (absent_at <= 0) {
            etcd_value_t v;
            if ((rc = etcd_get(e->c, key, &v, &revision)) < 0) return failed(e, rc);
            if (v.is_found) {
                if (value)
                    *value = v;
                else
                    remember_seen(e, key, &v);
                return 0;
            }
        }
        uint64_t now = clock_now_ms();
        if (now >= deadline_ms) {
            snprintf(e->error, sizeof e->error, "etcd %s: key %s did not appear in time",
                     etcd_endpoints(e->c), key);
            return DDP_ETIMEOUT;
        }
        put_seen_t seen = {.key = key};
        rc = etcd_watch(e->c, key, false, revision + 1, (int64_t)(deadline_ms - now), is_put_of,
                        &seen);
        if (rc == -ESTALE && absent_at > 0) { /* compacted: what we knew is history now */
            absent_at = 0;
            continue;
        }
        absent_at = 0;
        if (rc == DDP_ETIMEOUT) {
            snprintf(e->error, sizeof e->error, "etcd %s: key %s did not appear in time",
                     etcd_endpoints(e->c), key);
            return rc;
        }
        if (rc < 0) return failed(e, rc);
        if (seen.is_short) return -ENOMEM;
        if (seen.got.is_found) { /* the watch brought the value: no range again */
            if (value)
                *value = seen.got;
            else
                remember_seen(e, key, &seen.got);
            return 0;
        }
    }
}

static int kv_wait(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms) {
    etcd_kv_t *e = self(kv);
    uint64_t deadline = clock_now_ms() + (uint64_t)(timeout_ms < 0 ? e->op_timeout_ms : timeout_ms);
    for (size_t i = 0; i < n; i++)
        TRY(wait_key(e, keys[i], deadline, NULL));
    return 0;
}

static int kv_get(rdzv_kv_t *kv, const char *key, uint8_t **val, size_t *len) {
    etcd_kv_t *e = self(kv);
    etcd_value_t v;
    if (e->seen_key && strcmp(e->seen_key, key) != 0) forget_seen(e);
    TRY(wait_key(e, key, clock_now_ms() + (uint64_t)e->op_timeout_ms, &v));
    free(e->read_key);
    e->read_key = strdup(key); /* NULL: read_revision knows nothing */
    e->read_revision = v.mod_revision;
    *val = v.value;
    *len = v.len;
    return 0;
}

static int64_t kv_read_revision(rdzv_kv_t *kv, const char *key) {
    etcd_kv_t *e = self(kv);
    return e->read_key && strcmp(e->read_key, key) == 0 ? e->read_revision : 0;
}

static void kv_expect_absent(rdzv_kv_t *kv, const char *key, int64_t revision) {
    if (revision > 0) remember_absent(self(kv), key, revision);
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
    forget_seen_of(e, key);
    /* this ADD's mark beside the counter: a send whose answer was lost and that the client sent
     * again finds the counter moved, and only the mark tells whether it was this ADD that moved
     * it (else it would add once more: a lost node's restart refunded twice) */
    char mark_key[300], mark[2 * 8 + 1];
    snprintf(mark_key, sizeof mark_key, "%s/last-add", key);
    uint64_t nonce;
    randombytes_buf(&nonce, sizeof nonce);
    snprintf(mark, sizeof mark, "%016" PRIx64, nonce);
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
        if (delta == 0) { /* a read: writing the same count back, or a 0 that is not there
                             yet (the store's ADD creates it), would only contend with the
                             ADDs that change it: N agents that start together read the job's
                             round counter, and created it in a race of N txns */
            etcd_value_free(&v);
            *result = now;
            return 0;
        }
        char text[24];
        snprintf(text, sizeof text, "%" PRId64, now + delta);
        bool is_put;
        rc = etcd_put_if(e->c, key, v.is_found ? v.mod_revision : 0, text, strlen(text), 0,
                         mark_key, mark, &is_put);
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
    forget_seen_of(e, key);
    for (int lost = 0;; contention_pause(++lost)) {
        etcd_value_t v;
        int rc = etcd_get(e->c, key, &v, NULL);
        if (rc < 0) return failed(e, rc);
        if (!v.is_found && expected_len > 0)
            return copy_out(expected, expected_len, current, current_len);
        bool is_match =
            !v.is_found || (v.len == expected_len && memcmp(v.value, expected, v.len) == 0);
        if (!is_match) {
            *current = v.value;
            *current_len = v.len;
            return 0;
        }
        bool is_put;
        rc = etcd_put_if(e->c, key, v.is_found ? v.mod_revision : 0, desired, desired_len, 0, NULL,
                         NULL, &is_put);
        etcd_value_free(&v);
        if (rc < 0) return failed(e, rc);
        if (is_put) return copy_out(desired, desired_len, current, current_len);
    }
}

static int kv_multi_set(rdzv_kv_t *kv, const char *const *keys, const void *const *vals,
                        const size_t *lens, size_t n) {
    etcd_kv_t *e = self(kv);
    for (size_t i = 0; i < n; i++)
        forget_seen_of(e, keys[i]);
    for (size_t i = 0; i < n; i += ETCD_TXN_OPS_MAX) {
        size_t m = n - i < ETCD_TXN_OPS_MAX ? n - i : ETCD_TXN_OPS_MAX;
        int rc = etcd_put_many(e->c, keys + i, vals + i, lens + i, m);
        if (rc < 0) return failed(e, rc);
    }
    return 0;
}

/* A key of this ticket's own, key/<random>, created without a lease (a ticket that vanished
 * would lower the count of every later one), and the number of keys under key/ as of its
 * creation, in the same transaction: those created up to it, this one included. One proposal
 * per ticket, where ADD's compare-and-swap lets one of N concurrent agents win per round of
 * N^2/2 proposals. */
static int kv_take_ticket(rdzv_kv_t *kv, const char *key, const char *look, int64_t *index) {
    etcd_kv_t *e = self(kv);
    uint64_t id;
    randombytes_buf(&id, sizeof id);
    size_t n = strlen(key) + 32;
    char *prefix = malloc(n), *ticket = malloc(n);
    int rc = prefix && ticket ? 0 : -ENOMEM;
    int64_t revision = 0, count = 0;
    if (rc == 0) {
        snprintf(prefix, n, "%s/", key);
        snprintf(ticket, n, "%s%016" PRIx64, prefix, id);
        etcd_value_t looked = {0};
        rc = etcd_put_new(e->c, ticket, "1", 1, prefix, look, &looked, &revision, &count);
        if (rc == 0 && look) /* taken by the next wait for look (it may be found, or not yet) */
            remember_seen(e, look, &looked);
        if (rc == 0 && count < 0) /* a retry found it created: count as of its creation */
            rc = etcd_count_prefix(e->c, prefix, revision, &count);
        if (rc < 0) failed(e, rc);
    }
    if (rc == 0 && count < 1) {
        snprintf(e->error, sizeof e->error,
                 "etcd %s: %s counts no key at its own revision %" PRId64, etcd_endpoints(e->c),
                 ticket, revision);
        rc = DDP_EPROTO;
    }
    *index = count - 1;
    free(prefix);
    free(ticket);
    return rc;
}

static int kv_count_tickets(rdzv_kv_t *kv, const char *key, int64_t *count) {
    etcd_kv_t *e = self(kv);
    size_t n = strlen(key) + 2;
    char *prefix = malloc(n);
    if (!prefix) return -ENOMEM;
    snprintf(prefix, n, "%s/", key);
    int rc = etcd_count_prefix(e->c, prefix, 0, count);
    free(prefix);
    return rc < 0 ? failed(e, rc) : 0;
}

/* The longest prefix the n keys share (malloc'd). */
static char *common_prefix(const char *const *keys, size_t n) {
    size_t common = n ? strlen(keys[0]) : 0;
    for (size_t i = 1; i < n; i++) {
        size_t j = 0;
        while (j < common && keys[i][j] == keys[0][j])
            j++;
        common = j;
    }
    return n ? strndup(keys[0], common) : strdup("");
}

/* keys[i] == key: at once when key ends with i (a round's records: .../node/<i>), else by
 * looking at each (a round of 1024 reads 1024 records 1024 times). -1: none. */
static int find_key(const char *const *keys, size_t n, const char *key) {
    size_t len = strlen(key), d = len;
    while (d > 0 && key[d - 1] >= '0' && key[d - 1] <= '9')
        d--;
    if (d < len && len - d < 9) {
        size_t i = (size_t)strtoul(key + d, NULL, 10);
        if (i < n && strcmp(keys[i], key) == 0) return (int)i;
    }
    for (size_t i = 0; i < n; i++)
        if (strcmp(keys[i], key) == 0) return (int)i;
    return -1;
}

typedef struct {
    const char *const *keys;
    size_t n;
    uint8_t **vals;
    size_t *lens;
    bool is_short;
} picked_t;

static void pick(void *arg, const char *key, const uint8_t *v, size_t len) {
    picked_t *p = arg;
    int i = find_key(p->keys, p->n, key);
    if (i >= 0 && !p->vals[i] && copy_out(v, len, &p->vals[i], &p->lens[i]) < 0) p->is_short = true;
}

/* One range over the keys' common prefix (a round's records: r<R>/node/), not one GET each: a
 * round of N members reads N ranges, not N^2 GETs. */
static int kv_multi_get(rdzv_kv_t *kv, const char *const *keys, size_t n, uint8_t **vals,
                        size_t *lens) {
    etcd_kv_t *e = self(kv);
    char *prefix = common_prefix(keys, n);
    if (!prefix) return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        vals[i] = NULL;
    picked_t p = {.keys = keys, .n = n, .vals = vals, .lens = lens};
    int rc = etcd_get_prefix(e->c, prefix, pick, &p, NULL);
    free(prefix);
    if (rc < 0)
        failed(e, rc);
    else if (p.is_short)
        rc = -ENOMEM;
    for (size_t i = 0; rc == 0 && i < n; i++)
        if (!vals[i] && copy_out("", 0, &vals[i], &lens[i]) < 0) rc = -ENOMEM;
    if (rc < 0)
        for (size_t i = 0; i < n; i++) {
            free(vals[i]);
            vals[i] = NULL;
        }
    return rc;
}

/* ---- waiting for what live agents owe ----------------------------------------------------- */

typedef struct {
    const char *const *keys, *const *alive;
    size_t n, n_have;
    bool *has, *is_alive, *was_alive;
    int lost;
    int64_t next_revision; /* where the next slice's watch begins */
} owed_t;

static void owed_mark(owed_t *o, etcd_event_type_t type, const char *key) {
    int i = find_key(o->keys, o->n, key);
    if (i >= 0 && type == ETCD_EVENT_PUT && !o->has[i]) {
        o->has[i] = true;
        o->n_have++;
    }
    if ((i = find_key(o->alive, o->n, key)) < 0) return;
    o->is_alive[i] = type == ETCD_EVENT_PUT;
    o->was_alive[i] |= o->is_alive[i];
    if (!o->is_alive[i] && !o->has[i] && o->lost < 0) o->lost = i;
}

static void owed_seen(void *arg, const char *key, const uint8_t *v, size_t n) {
    (void)v, (void)n;
    owed_mark(arg, ETCD_EVENT_PUT, key);
}

static bool owed_event(void *arg, etcd_event_type_t type, const char *key, const uint8_t *v,
                       size_t n, int64_t rev) {
    (void)v, (void)n;
    owed_t *o = arg;
    if (rev >= o->next_revision) o->next_revision = rev + 1;
    owed_mark(o, type, key);
    return o->lost >= 0 || o->n_have == o->n;
}

/* One owed key (a member's rank): a watch of that key alone, in slices, and a look at its
 * owner's lease-bound node record after each. A range and a watch over both keys' common prefix
 * (the round's) would read every key of the round, N^2 for the N members of a round. */
static int wait_live_one(etcd_kv_t *e, const char *key, const char *alive, int64_t grace_ms,
                         int64_t timeout_ms, int *lost) {
    uint64_t start = clock_now_ms(), deadline = start + (uint64_t)timeout_ms;
    bool was_alive = false;
    for (;;) {
        uint64_t now = clock_now_ms(), until = now + (uint64_t)e->slice_ms;
        int rc = wait_key(e, key, until < deadline ? until : deadline, NULL);
        if (rc != DDP_ETIMEOUT) return rc;
        etcd_value_t v;
        if ((rc = etcd_get(e->c, alive, &v, NULL)) < 0) return failed(e, rc);
        bool is_alive = v.is_found;
        etcd_value_free(&v);
        was_alive |= is_alive;
        now = clock_now_ms();
        if (!is_alive && (was_alive || now - start >= (uint64_t)grace_ms)) {
            /* it may have written the key just before it left: one more look */
            if ((rc = wait_key(e, key, now, NULL)) != DDP_ETIMEOUT) return rc;
            *lost = 0;
            snprintf(e->error, sizeof e->error, "%s lost its lease before it wrote %s", alive, key);
            return DDP_ELOST;
        }
        if (now >= deadline) return DDP_ETIMEOUT; /* wait_key said which key */
    }
}

/* One range over everything's common prefix, then one watch from the revision after it: the
 * events update what is there; every grace check ends a slice of the watch. */
static int kv_wait_live(rdzv_kv_t *kv, const char *const *keys, const char *const *alive, size_t n,
                        int64_t grace_ms, int64_t timeout_ms, int *lost) {
    etcd_kv_t *e = self(kv);
    *lost = -1;
    if (n == 1) return wait_live_one(e, keys[0], alive[0], grace_ms, timeout_ms, lost);
    const char **all = calloc(2 * n + 1, sizeof *all);
    bool *flags = calloc(3 * n + 1, sizeof *flags);
    char *prefix = NULL;
    if (all) {
        for (size_t i = 0; i < n; i++)
            all[i] = keys[i], all[n + i] = alive[i];
        prefix = common_prefix(all, 2 * n);
    }
    free(all);
    if (!prefix || !flags) {
        free(prefix);
        free(flags);
        return -ENOMEM;
    }
    owed_t o = {.keys = keys,
                .alive = alive,
                .n = n,
                .has = flags,
                .is_alive = flags + n,
                .was_alive = flags + 2 * n,
                .lost = -1};
    uint64_t start = clock_now_ms(), deadline = start + (uint64_t)timeout_ms;
    int64_t revision = 0;
    int rc = etcd_get_prefix_keys(e->c, prefix, owed_seen, &o, &revision);
    if (rc < 0) failed(e, rc);
    o.next_revision = revision + 1;
    while (rc == 0 && o.lost < 0 && o.n_have < n) {
        uint64_t now = clock_now_ms();
        for (size_t i = 0; i < n && o.lost < 0; i++) /* never seen alive within the grace */
            if (!o.has[i] && !o.was_alive[i] && now - start >= (uint64_t)grace_ms) o.lost = (int)i;
        if (o.lost >= 0) break;
        if (now >= deadline) {
            rc = DDP_ETIMEOUT;
            snprintf(e->error, sizeof e->error,
                     "etcd %s: keys under %s did not all appear in "
                     "time",
                     etcd_endpoints(e->c), prefix);
            break;
        }
        uint64_t until = deadline;
        if (start + (uint64_t)grace_ms > now && start + (uint64_t)grace_ms < until)
            until = start + (uint64_t)grace_ms;
        rc =
            etcd_watch(e->c, prefix, true, o.next_revision, (int64_t)(until - now), owed_event, &o);
        if (rc == DDP_ETIMEOUT)
            rc = 0; /* a slice ended: check the grace, then again */
        else if (rc < 0)
            failed(e, rc);
    }
    free(prefix);
    bool is_lost = rc == 0 && o.lost >= 0;
    free(flags);
    if (is_lost) {
        *lost = o.lost;
        snprintf(e->error, sizeof e->error, "%s lost its lease before it wrote %s", alive[o.lost],
                 keys[o.lost]);
        return DDP_ELOST;
    }
    return rc;
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

/* Remembers key for a renewal (the same key again replaces its value; the oldest goes first). */
static int lease_note_key(rdzv_lease_t *l, const char *key, const void *val, size_t len) {
    char *k = strdup(key);
    uint8_t *v = malloc(len ? len : 1);
    if (!k || !v) {
        free(k);
        free(v);
        return -ENOMEM;
    }
    memcpy(v, val, len);
    pthread_mutex_lock(&l->mu);
    for (int i = 0; i < l->n_keys; i++)
        if (strcmp(l->keys[i], key) == 0) lease_drop_key(l, i--);
    if (l->n_keys == LEASE_KEYS_MAX) lease_drop_key(l, 0);
    l->keys[l->n_keys] = k;
    l->vals[l->n_keys] = v;
    l->lens[l->n_keys++] = len;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

static bool is_lease_gone(const etcd_kv_t *e) {
    return strstr(etcd_error(e->c), "requested lease not found") != NULL;
}

/* The lease `expired` is gone (its TTL passed without a refresh: a frozen agent, an etcd that
 * took no refresh in time): a new one, and every key this agent put under the old one again
 * under it. Whoever comes first renews; the other finds the id changed and uses the new one. */
static int lease_renew(etcd_kv_t *e, int64_t expired, int64_t *id, bool *is_mine) {
    rdzv_lease_t *l = e->lease;
    pthread_mutex_lock(&l->mu);
    int rc = 0;
    *is_mine = l->id == expired;
    if (l->id == expired) {
        int64_t fresh;
        rc = etcd_lease_grant(e->c, l->ttl_s, &fresh);
        if (rc == 0) l->id = fresh;
        for (int i = 0; rc == 0 && i < l->n_keys; i++)
            rc = etcd_put(e->c, l->keys[i], l->vals[i], l->lens[i], fresh);
    }
    *id = l->id;
    pthread_mutex_unlock(&l->mu);
    return rc < 0 ? failed(e, rc) : 0;
}

static int kv_set_ephemeral(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    etcd_kv_t *e = self(kv);
    forget_seen_of(e, key);
    int64_t id;
    TRY(lease_id(e, &id));
    TRY(lease_note_key(e->lease, key, val, len));
    int rc = etcd_put(e->c, key, val, len, id);
    if (rc < 0 && is_lease_gone(e)) { /* expired since: renew, which puts key too */
        int64_t expired = id;
        bool is_mine;
        if ((rc = lease_renew(e, expired, &id, &is_mine)) < 0) return DDP_ELEASE;
        /* another thread renewed it, maybe before this key was noted: put it under the new one */
        if (!is_mine && (rc = etcd_put(e->c, key, val, len, id)) < 0) return failed(e, rc);
        /* said here too: a join can find the lease gone before the agent's next keep-alive */
        if (is_mine)
            LOG_WARN("etcd %s: lease %" PRIx64 " expired (the other nodes consider this one lost "
                     "and end its round): this agent's keys are under lease %" PRIx64 " now",
                     etcd_endpoints(e->c), (uint64_t)expired, (uint64_t)id);
        return 0;
    }
    return rc < 0 ? failed(e, rc) : 0;
}

static int kv_keep_alive(rdzv_kv_t *kv, bool *is_renewed) {
    etcd_kv_t *e = self(kv);
    *is_renewed = false;
    pthread_mutex_lock(&e->lease->mu);
    int64_t id = e->lease->id;
    pthread_mutex_unlock(&e->lease->mu);
    if (!id) return 0;
    int64_t ttl = 0;
    int rc = etcd_lease_keepalive(e->c, id, &ttl);
    if (rc < 0 && !is_lease_gone(e)) return failed(e, rc);
    if (rc == 0 && ttl > 0) return 0;
    int64_t fresh;
    bool is_mine;
    if ((rc = lease_renew(e, id, &fresh, &is_mine)) < 0) {
        char why[sizeof e->error];
        memcpy(why, e->error, sizeof why);
        snprintf(e->error, sizeof e->error,
                 "lease %" PRIx64 " expired and no new one could be "
                 "had: %.900s",
                 (uint64_t)id, why);
        return DDP_ELEASE;
    }
    if (!is_mine) return 0; /* a join renewed it first, and said so */
    *is_renewed = true;
    snprintf(e->error, sizeof e->error,
             "etcd %s: lease %" PRIx64 " expired (the other nodes "
             "consider this one lost and end its round): this agent's keys are under lease %" PRIx64
             " now",
             etcd_endpoints(e->c), (uint64_t)id, (uint64_t)fresh);
    return 0;
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
        while (j < common && keys[i][j] == keys[0][j])
            j++;
        common = j;
    }
    char *prefix = strndup(keys[0], common);
    bool *is_present = calloc(n, sizeof *is_present);
    int rc = prefix && is_present ? 0 : -ENOMEM;
    gone_t g = {.keys = keys, .n = n, .gone = -1, .is_present = is_present};
    int64_t revision = 0;
    /* keys only: every member looks at every member's record (N^2 values a round) */
    if (rc == 0 && (rc = etcd_get_prefix_keys(e->c, prefix, note_present, &g, &revision)) < 0)
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

static void kv_interrupt(rdzv_kv_t *kv) {
    /* the loop's thread, while rdzv_kv_etcd_connect may still be making the client on the pool's:
     * none yet, nothing to interrupt (the connect is bounded by its own timeouts) */
    etcd_t *c = __atomic_load_n(&self(kv)->c, __ATOMIC_ACQUIRE);
    if (c) etcd_interrupt(c);
}

static const char *kv_error(const rdzv_kv_t *kv) {
    return ((const etcd_kv_t *)kv)->error;
}

static void kv_destroy(rdzv_kv_t *kv) {
    forget_seen(self(kv));
    free(self(kv)->read_key);
    etcd_destroy(self(kv)->c);
    free(kv);
}

static const rdzv_kv_ops_t etcd_ops = {.set = kv_set,
                                       .get = kv_get,
                                       .add = kv_add,
                                       .compare_set = kv_compare_set,
                                       .wait = kv_wait,
                                       .multi_get = kv_multi_get,
                                       .multi_set = kv_multi_set,
                                       .take_ticket = kv_take_ticket,
                                       .count_tickets = kv_count_tickets,
                                       .set_ephemeral = kv_set_ephemeral,
                                       .read_revision = kv_read_revision,
                                       .expect_absent = kv_expect_absent,
                                       .keep_alive = kv_keep_alive,
                                       .wait_live = kv_wait_live,
                                       .wait_gone = kv_wait_gone,
                                       .expire_prefix = kv_expire_prefix,
                                       .interrupt = kv_interrupt,
                                       .error = kv_error,
                                       .destroy = kv_destroy};

int rdzv_kv_etcd_connect(const ddprun_opts_t *o, rdzv_lease_t *lease, int64_t connect_timeout_ms,
                         int64_t op_timeout_ms, rdzv_kv_t **out) {
    etcd_kv_t *e = calloc(1, sizeof *e);
    if (!e) {
        __atomic_store_n(out, NULL, __ATOMIC_RELEASE);
        return -ENOMEM;
    }
    e->kv.ops = &etcd_ops;
    /* published whole (ops set): another thread may read it to interrupt the connect */
    __atomic_store_n(out, (rdzv_kv_t *)e, __ATOMIC_RELEASE);
    e->lease = lease;
    e->op_timeout_ms = op_timeout_ms;
    e->slice_ms = (int64_t)(o->lease_ttl_s * 1000 / 3);
    if (e->slice_ms < 100) e->slice_ms = 100;
    etcd_opts_t eo = {.endpoints = o->rdzv_endpoints,
                      .cacert = o->etcd_cacert,
                      .cert = o->etcd_cert,
                      .key = o->etcd_key,
                      .user = o->etcd_user,
                      .password = o->etcd_password,
                      .connect_timeout_ms = connect_timeout_ms < 2000 ? connect_timeout_ms : 2000,
                      .op_timeout_ms = op_timeout_ms,
                      /* a frozen member must leave time for the others within a lease TTL */
                      .try_timeout_ms = (int64_t)(o->lease_ttl_s * 1000 / 3)};
    etcd_t *c = NULL;
    int rc = etcd_create(&eo, &c);
    __atomic_store_n(&e->c, c, __ATOMIC_RELEASE); /* whole before kv_interrupt may use it */
    if (rc < 0) return failed(e, rc);
    /* reach the cluster now, so that a wrong endpoint or password says so at once */
    etcd_value_t v;
    if ((rc = etcd_get(e->c, "/ddprun", &v, NULL)) < 0) return failed(e, rc);
    etcd_value_free(&v);
    return 0;
}
