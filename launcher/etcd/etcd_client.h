/* etcd_client: etcd's v3 API through its JSON gateway (/v3/kv/range, put, txn, /v3/lease/grant,
 * keepalive, /v3/watch, /v3/auth/authenticate), blocking, over common/http (libcurl). Keys and
 * values are base64 in the JSON, int64s decimal strings, as the gateway speaks them.
 *
 * Member failover: a request that fails in transport, that gets no answer within try_timeout_ms,
 * or that the member answers with "unavailable" (no leader yet, leader changed, stopping), goes
 * to the next endpoint until op_timeout_ms; a watch continues on the next member from the
 * revision after the last event it delivered, and is made again every try_timeout_ms (on the
 * same member when that one had confirmed it, else on the next). A compare-and-swap whose member
 * failed after taking it may have committed: its retry then finds the revision moved and reports
 * is_put false (the caller reads again; an ADD may count twice, and rendezvous survives that).
 * Auth: with a user, a token from /v3/auth/authenticate, fetched again when the member says it
 * expired. One client per thread; etcd_interrupt from any thread. Errors: 0 or a negative code,
 * etcd_error() says what and where (endpoint, key); the password is never in it. */
#ifndef DDP_LAUNCHER_ETCD_CLIENT_H
#define DDP_LAUNCHER_ETCD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "etcd/etcd_answer.h" /* the answers' types: etcd_value_t, the watch and range callbacks */

#define ETCD_MAX_ENDPOINTS 16

typedef struct {
    const char *endpoints; /* "h1:2379,h2:2379" (http://, https:// optional; https when a
                              CA or certificate is given; port 2379 when none) */
    const char *cacert, *cert, *key;
    const char *user, *password; /* password: the caller keeps it out of logs */
    int64_t connect_timeout_ms;  /* default 2000 */
    int64_t op_timeout_ms;       /* every operation's bound, failover included; default 30000 */
    int64_t try_timeout_ms;      /* one request to one member (0: op_timeout_ms): a member that
                                    holds a request longer (frozen, partitioned) is left for the
                                    next, so a lease refresh gets through within its TTL */
} etcd_opts_t;

typedef struct etcd etcd_t;

/* Checks the options (endpoints parse, at most ETCD_MAX_ENDPOINTS); no I/O. On failure *out
 * still holds a client whose etcd_error() explains; destroy it. */
int etcd_create(const etcd_opts_t *opts, etcd_t **out);
void etcd_destroy(etcd_t *c);
void etcd_interrupt(etcd_t *c);
const char *etcd_error(const etcd_t *c);
/* The endpoint list as given, for messages. */
const char *etcd_endpoints(const etcd_t *c);

/* *revision (optional): the store's revision when it answered. */
int etcd_get(etcd_t *c, const char *key, etcd_value_t *out, int64_t *revision);
void etcd_value_free(etcd_value_t *v);
int etcd_get_prefix(etcd_t *c, const char *prefix, etcd_kv_fn fn, void *arg, int64_t *revision);
/* The same without the values (fn gets an empty one): which keys are there, at a fraction of
 * the bytes (a round's lease-bound node records, which every member looks at). */
int etcd_get_prefix_keys(etcd_t *c, const char *prefix, etcd_kv_fn fn, void *arg,
                         int64_t *revision);
/* lease 0: none. */
int etcd_put(etcd_t *c, const char *key, const void *val, size_t len, int64_t lease);
/* Puts only when the key's mod_revision is still mod_revision (0: the key does not exist);
 * *is_put says whether it did. The compare-and-swap every counter and round is made of.
 * mark_key (optional): mark is put there too, in the same transaction, and read back when the
 * compare fails: the transaction sent again after its answer was lost (the failover) then knows
 * that its first send put the key (an ADD must count once). */
int etcd_put_if(etcd_t *c, const char *key, int64_t mod_revision, const void *val, size_t len,
                int64_t lease, const char *mark_key, const char *mark, bool *is_put);
/* Creates key (no lease) unless it exists, in one transaction; *create_revision: the revision
 * that created it (this call's, or, when a lost answer made the call try again, the first
 * try's). count_prefix (optional): *count = the keys under it right after this call's put, in
 * the same transaction; -1 when the key existed before (count at *create_revision instead).
 * look (optional): another key read in the same transaction into *looked (etcd_value_free it);
 * when it is not there, looked->mod_revision is the revision at which it was not. */
int etcd_put_new(etcd_t *c, const char *key, const void *val, size_t len, const char *count_prefix,
                 const char *look, etcd_value_t *looked, int64_t *create_revision, int64_t *count);
/* How many keys under prefix there were at revision (0: now), counted by etcd (count_only):
 * DDP_EPROTO with etcd's message when revision was compacted. */
int etcd_count_prefix(etcd_t *c, const char *prefix, int64_t revision, int64_t *count);
/* Puts n keys (no lease) in one transaction, n <= ETCD_TXN_OPS_MAX (etcd's --max-txn-ops
 * default). */
#define ETCD_TXN_OPS_MAX 128
int etcd_put_many(etcd_t *c, const char *const *keys, const void *const *vals, const size_t *lens,
                  size_t n);
int etcd_lease_grant(etcd_t *c, int64_t ttl_s, int64_t *id);
/* *ttl_s: the lease's time left after the refresh; 0 when it had already expired. */
int etcd_lease_keepalive(etcd_t *c, int64_t id, int64_t *ttl_s);
/* Watch key (is_prefix: every key under it) from start_revision (> 0) until fn returns true
 * (returns 0) or timeout_ms passes (DDP_ETIMEOUT); -ESTALE when etcd compacted start_revision
 * away (its history is gone: read the key, then watch from the revision the read saw). */
int etcd_watch(etcd_t *c, const char *key, bool is_prefix, int64_t start_revision,
               int64_t timeout_ms, etcd_event_fn fn, void *arg);

#endif
