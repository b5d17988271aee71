/* rdzv_kv: the key-value operations rendezvous is written against, with TCPStore's meanings
 * (GET waits for the key, ADD counts in decimal text, COMPARE_SET with an empty expected value
 * creates; one difference: etcd's ADD 0 of a missing key reads 0 and does not create it),
 * implemented by the job's TCP store (rdzv_kv_store.c) and by etcd (rdzv_kv_etcd.c).
 *
 * Liveness is the one place the two differ: on etcd, an agent's keys written with set_ephemeral
 * live as long as its lease, keep_alive refreshes it, and wait_gone blocks until another agent's
 * key vanishes (its lease expired); the TCP store has counters and clocks instead (agent.c), so
 * there set_ephemeral is a plain set and the other two are NULL. Blocking; one thread at a time
 * per kv, interrupt from any thread. Errors: 0 or a negative code, error() says what. */
#ifndef DDP_LAUNCHER_RDZV_KV_H
#define DDP_LAUNCHER_RDZV_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "options.h"

typedef struct rdzv_kv rdzv_kv_t;

typedef struct {
    int (*set)(rdzv_kv_t *kv, const char *key, const void *val, size_t len);
    int (*get)(rdzv_kv_t *kv, const char *key, uint8_t **val, size_t *len);
    int (*add)(rdzv_kv_t *kv, const char *key, int64_t delta, int64_t *result);
    int (*compare_set)(rdzv_kv_t *kv, const char *key, const void *expected, size_t expected_len,
                       const void *desired, size_t desired_len, uint8_t **current,
                       size_t *current_len);
    /* every key exists; timeout_ms < 0: the kv's own bound. DDP_ETIMEOUT when it passes */
    int (*wait)(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms);
    /* no waiting: a missing key reads as empty */
    int (*multi_get)(rdzv_kv_t *kv, const char *const *keys, size_t n, uint8_t **vals,
                     size_t *lens);
    /* one request where the backend can (the store's MULTI_SET; etcd: a transaction per 128) */
    int (*multi_set)(rdzv_kv_t *kv, const char *const *keys, const void *const *vals,
                     const size_t *lens, size_t n);
    /* A ticket of counter key: *index = how many were taken before this one (0, 1, ...), one
     * request and no retry however many agents take one at once. store: ADD key 1 (minus 1);
     * etcd: a key of its own created under key/, numbered by its creation's revision (ADD's
     * compare-and-swap would make N^2/2 raft proposals of N agents). look (optional): a key
     * to read in the same request where the backend can (etcd; the store ignores it): the
     * next WAIT or GET of look through this kv then asks nothing more when it was there, and
     * on etcd watches from the ticket's revision, without a range first, when it was not. */
    int (*take_ticket)(rdzv_kv_t *kv, const char *key, const char *look, int64_t *index);
    /* How many tickets of key were taken so far. */
    int (*count_tickets)(rdzv_kv_t *kv, const char *key, int64_t *count);
    int (*set_ephemeral)(rdzv_kv_t *kv, const char *key, const void *val, size_t len);
    /* Optional (NULL: not known): the revision at which the last GET through this kv read key
     * (etcd: its mod_revision); 0 when that GET was of another key. */
    int64_t (*read_revision)(rdzv_kv_t *kv, const char *key);
    /* Optional (NULL: nothing to do): key did not exist at `revision` (a read_revision of this
     * backend, maybe through another kv: key is only ever created after the key read then); the
     * next wait for key through this kv may begin there instead of reading key first (etcd: a
     * watch from revision + 1, no range). */
    void (*expect_absent)(rdzv_kv_t *kv, const char *key, int64_t revision);
    /* 0, also when the lease had expired and a new one now holds this agent's keys again
     * (*is_renewed, error() says so: the other members have seen this agent lost); DDP_ELEASE
     * when it expired and no new one could be had */
    int (*keep_alive)(rdzv_kv_t *kv, bool *is_renewed);
    /* Blocks until every one of keys exists (0), or the agent that owes keys[i] is lost: its
     * alive[i] was there and vanished, or did not appear within grace_ms (DDP_ELOST, *lost = i),
     * or timeout_ms passes (DDP_ETIMEOUT). etcd only (NULL for the store). */
    int (*wait_live)(rdzv_kv_t *kv, const char *const *keys, const char *const *alive, size_t n,
                     int64_t grace_ms, int64_t timeout_ms, int *lost);
    /* Blocks until one of keys is deleted after having existed (*gone: its index) or timeout_ms
     * passes (DDP_ETIMEOUT). */
    int (*wait_gone)(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms,
                     int *gone);
    /* Every key under prefix expires ttl_s from now (etcd: put again under a lease of that TTL);
     * NULL for the store, whose keys end with it. */
    int (*expire_prefix)(rdzv_kv_t *kv, const char *prefix, int64_t ttl_s);
    void (*interrupt)(rdzv_kv_t *kv);
    const char *(*error)(const rdzv_kv_t *kv);
    void (*destroy)(rdzv_kv_t *kv);
} rdzv_kv_ops_t;

struct rdzv_kv {
    const rdzv_kv_ops_t *ops;
};

/* This agent's lease on etcd, shared by its kv clients (granted by the first set_ephemeral). */
typedef struct rdzv_lease rdzv_lease_t;

/* A kv for the job's rendezvous as the options name it (c10d or static: the TCP store at
 * --rdzv-endpoint; etcd: the endpoint list and --rdzv-conf's TLS, auth and lease_ttl).
 * connect_timeout_ms bounds reaching it, op_timeout_ms each operation. lease: etcd only (NULL for
 * the store). On failure *out may still hold a kv whose error() explains: destroy it. */
int rdzv_kv_connect(const ddprun_opts_t *o, rdzv_lease_t *lease, int64_t connect_timeout_ms,
                    int64_t op_timeout_ms, rdzv_kv_t **out);
static inline void rdzv_kv_destroy(rdzv_kv_t *kv) {
    if (kv) kv->ops->destroy(kv);
}
rdzv_lease_t *rdzv_lease_new(int64_t ttl_s);
void rdzv_lease_free(rdzv_lease_t *l);
/* Whether etcd can be used now: 0, or a negative code with the reason in err (built without
 * libcurl, or libcurl cannot be loaded: it is loaded at the first use, not linked). */
int rdzv_kv_etcd_check(char *err, size_t err_len);

#endif
