/* rendezvous: see rendezvous.h. Records are JSON objects (rdzv_record.h). */
#include "rdzv/rendezvous.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "clock.h"
#include "ddp_error.h"
#include "rdzv/liveness.h"

/* The shortest slice of the wait for a round to close between looks at its ticket count. */
#define CLOSE_CHECK_MS 2000
/* The exit barrier's slice between looks at its done tickets. */
#define FINISH_SLICE_MS 2000

static void key(const rdzv_t *r, char *out, size_t len, int round, const char *what) {
    if (round < 0)
        snprintf(out, len, "%s/%s", r->prefix, what);
    else
        snprintf(out, len, "%s/r%d/%s", r->prefix, round, what);
}

void rdzv_init(rdzv_t *r, const ddprun_opts_t *opts, bool is_store_host) {
    memset(r, 0, sizeof *r);
    r->opts = opts;
    r->is_store_host = is_store_host;
    r->node_rank_hint = opts->node_rank;
    snprintf(r->prefix, sizeof r->prefix, "/ddprun/%s", opts->rdzv_id);
}

/* The integer at k, in [lo, hi]; otherwise a failure with err naming k and what it holds (the
 * store is anyone's: any bytes may be there). */
static int get_int(rdzv_kv_t *c, const char *k, int64_t lo, int64_t hi, int64_t *out, char *err,
                   size_t err_len) {
    uint8_t *v;
    size_t n;
    int rc = c->ops->get(c, k, &v, &n);
    if (rc < 0) {
        snprintf(err, err_len, "%s", c->ops->error(c));
        return rc;
    }
    char text[32];
    size_t m = n < sizeof text - 1 ? n : sizeof text - 1;
    memcpy(text, v, m);
    text[m] = '\0';
    free(v);
    char *end;
    errno = 0;
    *out = strtoll(text, &end, 10);
    if (end == text || *end || m < n || errno || *out < lo || *out > hi) {
        for (char *p = text; *p; p++) /* shown to people */
            if (*p < 0x20 || *p > 0x7e) *p = '?';
        snprintf(err, err_len, "%s holds '%s%s', not a number from %lld to %lld", k, text,
                 m < n ? "..." : "", (long long)lo, (long long)hi);
        return DDP_EPROTO;
    }
    return 0;
}

void rdzv_set_own_store(rdzv_t *r, const char *host, uint16_t port) {
    snprintf(r->own_store_host, sizeof r->own_store_host, "%s", host);
    r->own_store_port = port;
}

void rdzv_set_own_peer(rdzv_t *r, const char *host, uint16_t port) {
    snprintf(r->own_peer_host, sizeof r->own_peer_host, "%s", host);
    r->own_peer_port = port;
}

/* The store (no leases): keys owed by members join_index[i], none of which may be more than
 * grace_ms late. A key still missing then is its member's that died (DDP_ELOST, err names it). */
static int wait_owed_on_store(rdzv_kv_t *c, int round, const char *const *keys,
                              const int *join_index, int n, int64_t grace_ms, char *err,
                              size_t err_len) {
    int rc = c->ops->wait(c, keys, (size_t)n, grace_ms);
    if (rc != DDP_ETIMEOUT) return rc;
    uint8_t **vals = calloc((size_t)n, sizeof *vals);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    rc = vals && lens ? c->ops->multi_get(c, keys, (size_t)n, vals, lens) : -ENOMEM;
    int lost = -1;
    for (int i = 0; rc == 0 && i < n; i++) {
        if (lens[i] == 0 && lost < 0) lost = i; /* records are never empty: a missing key */
        free(vals[i]);
    }
    free(vals);
    free(lens);
    if (rc < 0 || lost < 0) return rc; /* 0: the last of them came meanwhile */
    snprintf(err, err_len,
             "round %d: the node that joined it as #%d wrote no %s within %g s "
             "(heartbeat_timeout: it died while it joined): ending the round",
             round, join_index[lost], keys[lost], (double)grace_ms / 1000);
    return DDP_ELOST;
}

/* Waits until each of keys (owed by the round's members join_index[i]) is there, or one of them
 * is lost (DDP_ELOST, err names it): a member that died after its join's ADD never writes them,
 * and waiting out the join's whole bound for it would wedge the round. etcd: a member's node
 * record r<R>/node/<i> is its lease-bound key: it lives while the member does. The store: a key
 * more than `hops` heartbeat_timeouts late (a node record is written right after the ticket; a
 * rank record once its publisher has every node record, for which it waits one such bound). */
static int wait_owed(rdzv_t *r, rdzv_kv_t *c, int round, const char *const *keys,
                     const int *join_index, int n, int hops, char *err, size_t err_len) {
    const ddprun_opts_t *o = r->opts;
    if (!c->ops->wait_live) {
        int64_t grace_ms = (int64_t)(hops * o->heartbeat_timeout_s * 1000),
                bound_ms = (int64_t)((o->join_timeout_s + o->read_timeout_s) * 1000);
        return wait_owed_on_store(c, round, keys, join_index, n,
                                  grace_ms > 0 && grace_ms < bound_ms ? grace_ms : bound_ms, err,
                                  err_len);
    }
    char(*names)[256] = calloc((size_t)n, sizeof *names);
    const char **alive = calloc((size_t)n, sizeof *alive);
    int rc = names && alive ? 0 : -ENOMEM, lost = -1;
    for (int i = 0; rc == 0 && i < n; i++) {
        snprintf(names[i], sizeof names[i], "%s/r%d/node/%d", r->prefix, round, join_index[i]);
        alive[i] = names[i];
    }
    /* a member's node record (under its lease: its mark of life) appears right after its
     * ticket: one never seen for two lease TTLs is a member that died in between */
    if (rc == 0)
        rc = c->ops->wait_live(c, keys, alive, (size_t)n, (int64_t)(2000 * o->lease_ttl_s),
                               (int64_t)((o->join_timeout_s + o->read_timeout_s) * 1000), &lost);
    if (rc == DDP_ELOST)
        snprintf(err, err_len,
                 "round %d: the node that joined it as #%d lost its etcd lease "
                 "before it wrote %s: ending the round",
                 round, join_index[lost], keys[lost]);
    free(names);
    free(alive);
    return rc;
}

int rdzv_current_round(rdzv_t *r, rdzv_kv_t *c, int *round, char *err, size_t err_len) {
    char k[256];
    key(r, k, sizeof k, -1, "round");
    int64_t v;
    int rc = c->ops->add(c, k, 0, &v);
    if (rc < 0) {
        snprintf(err, err_len, "%s", c->ops->error(c));
        return rc;
    }
    if (v < 0 || v >= INT_MAX) { /* round + 1 must be a round too */
        snprintf(err, err_len, "the job's round counter %s holds %lld, not a round number (0-%d)",
                 k, (long long)v, INT_MAX - 1);
        return DDP_EPROTO;
    }
    *round = (int)v;
    return 0;
}

int rdzv_job_has_failed(rdzv_t *r, rdzv_kv_t *c, int current, char *err, size_t err_len) {
    if (current == 0) return 0;
    char k[256];
    key(r, k, sizeof k, current - 1, "restart");
    const char *keys[] = {k};
    uint8_t *v = NULL;
    size_t n = 0;
    int rc = c->ops->multi_get(c, keys, 1, &v, &n); /* no wait: absent reads as empty */
    if (rc < 0) {
        snprintf(err, err_len, "%s", c->ops->error(c));
        return rc;
    }
    rdzv_why_t why;
    bool is_read = n > 0 && rdzv_record_why_parse((const char *)v, n, &why);
    free(v);
    /* a peer failure past the budget is decided by the next round's size (a lost node is no
     * restart): not an end by itself */
    if (!is_read || why.is_finished ||
        rdzv_why_outcome(&why, r->opts->max_restarts, true) != RDZV_WHY_ENDS)
        return 0;
    char text[256];
    rdzv_record_why_describe(&why, text, sizeof text);
    snprintf(err, err_len,
             "the job of --rdzv-id %s ended in round %d (%s, %s): a new run of it needs another "
             "--rdzv-id",
             r->opts->rdzv_id, current - 1, text,
             why.is_permanent ? "not retried" : "past --max-restarts");
    return 1;
}

typedef struct {
    int join_index, nproc, hint;
    bool is_host;
} member_t;

static int member_order(const void *a, const void *b) {
    const member_t *x = a, *y = b;
    if (x->is_host != y->is_host) return x->is_host ? -1 : 1;
    int hx = x->hint < 0 ? RDZV_MAX_NODES * 8 : x->hint,
        hy = y->hint < 0 ? RDZV_MAX_NODES * 8 : y->hint;
    if (hx != hy) return hx < hy ? -1 : 1;
    return x->join_index - y->join_index;
}

static void free_records(uint8_t **vals, size_t *lens, int n) {
    for (int i = 0; vals && i < n; i++)
        free(vals[i]);
    free(vals);
    free(lens);
}

/* Every member's node record r<R>/node/<i>, once each is there (a member writes it after its
 * join's ADD): one WAIT on all of them (etcd: one watch, ended too by a member's lost lease),
 * then one MULTI_GET (etcd: one range). */
static int read_records(rdzv_t *r, rdzv_kv_t *c, int round, int n, uint8_t ***vals_out,
                        size_t **lens_out, char *err, size_t err_len) {
    char(*names)[256] = calloc((size_t)n, sizeof *names);
    const char **keys = calloc((size_t)n, sizeof *keys);
    uint8_t **vals = calloc((size_t)n, sizeof *vals);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    int rc = names && keys && vals && lens ? 0 : -ENOMEM;
    for (int i = 0; rc == 0 && i < n; i++) {
        snprintf(names[i], sizeof names[i], "%s/r%d/node/%d", r->prefix, round, i);
        keys[i] = names[i];
    }
    int *join_index = rc == 0 ? calloc((size_t)n, sizeof *join_index) : NULL;
    if (rc == 0 && !join_index) rc = -ENOMEM;
    for (int i = 0; rc == 0 && i < n; i++)
        join_index[i] = i;
    if (rc == 0) rc = wait_owed(r, c, round, keys, join_index, n, 1, err, err_len);
    free(join_index);
    if (rc == 0) rc = c->ops->multi_get(c, keys, (size_t)n, vals, lens);
    free(names);
    free(keys);
    if (rc < 0) { /* multi_get frees what it got on failure */
        free(vals);
        free(lens);
        return rc;
    }
    *vals_out = vals;
    *lens_out = lens;
    return 0;
}

/* The round's last member (join index n - 1): every member's node record, the ranks from them,
 * and each member's place as r<R>/rank/<join index> in one MULTI_SET, so that each other member
 * reads one key instead of all N records (N^2 reads and parses for a round of N). On etcd each
 * node record carries its agent's store and every rank record node 0's: the members learn where
 * the round's store is from their rank, with no key of its own to wait for. A malformed record
 * (on etcd also one without a store) gives every member an error record instead. *own: this
 * agent's. */
static int publish_ranks(rdzv_t *r, rdzv_kv_t *c, int round, int n, rdzv_rank_record_t *own,
                         char *err, size_t err_len) {
    member_t *m = calloc((size_t)n, sizeof *m);
    rdzv_node_record_t *recs = calloc((size_t)n, sizeof *recs);
    rdzv_rank_record_t *ranks = calloc((size_t)n, sizeof *ranks);
    char(*texts)[RDZV_RECORD_MAX_BYTES] = calloc((size_t)n, sizeof *texts);
    char(*names)[256] = calloc((size_t)n, sizeof *names);
    const char **keys = calloc((size_t)n, sizeof *keys);
    const void **vals = calloc((size_t)n, sizeof *vals);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    uint8_t **records = NULL;
    size_t *record_lens = NULL;
    int rc = m && recs && ranks && texts && names && keys && vals && lens ? 0 : -ENOMEM;
    bool needs_store = r->own_store_host[0] != '\0'; /* etcd: node 0's store is the round's */
    if (rc == 0 && (rc = read_records(r, c, round, n, &records, &record_lens, err, err_len)) < 0 &&
        rc != DDP_ELOST) /* DDP_ELOST: err says whose lease */
        snprintf(err, err_len, "rendezvous round %d: %s", round, c->ops->error(c));
    char error[sizeof ranks[0].error] = "";
    bool is_lost = rc == DDP_ELOST;
    if (is_lost) { /* the others wait for their ranks: they must leave this round too */
        snprintf(error, sizeof error, "%s", err);
        rc = 0;
    }
    for (int i = 0; rc == 0 && !is_lost && i < n; i++) {
        rdzv_node_record_t *rec = &recs[i];
        if (record_lens[i] == 0 && c->ops->keep_alive) { /* etcd: its lease expired since */
            snprintf(error, sizeof error,
                     "round %d: the node that joined it as #%d lost its etcd lease: ending the "
                     "round",
                     round, i);
            is_lost = true;
            break;
        }
        /* never echoed: the bytes may be anything */
        bool is_parsed = rdzv_record_node_parse((const char *)records[i], record_lens[i], rec);
        if (!is_parsed || (needs_store && !rec->store_host[0])) {
            if (!error[0])
                snprintf(error, sizeof error, "round %d: node record %d (%zu bytes) is malformed%s",
                         round, i, record_lens[i], is_parsed ? " (no store address)" : "");
            continue;
        }
        m[i] = (member_t){
            .join_index = i, .nproc = rec->nproc, .hint = rec->hint, .is_host = rec->is_host};
    }
    if (records) free_records(records, record_lens, n);
    if (rc == 0) {
        qsort(m, (size_t)n, sizeof *m, member_order);
        int world_size = 0;
        for (int g = 0; g < n; g++) {
            rdzv_rank_record_t *x = &ranks[m[g].join_index];
            x->group_rank = g;
            x->rank_offset = world_size;
            x->host_join_index = m[0].join_index;
            snprintf(x->store_host, sizeof x->store_host, "%s", recs[m[0].join_index].store_host);
            x->store_port = recs[m[0].join_index].store_port;
            const rdzv_node_record_t *next = &recs[m[(g + 1) % n].join_index];
            snprintf(x->next_peer_host, sizeof x->next_peer_host, "%s", next->peer_host);
            x->next_peer_port = next->peer_port;
            world_size += m[g].nproc;
        }
        for (int i = 0; i < n && rc == 0; i++) {
            ranks[i].world_size = world_size;
            snprintf(ranks[i].error, sizeof ranks[i].error, "%s", error);
            ranks[i].is_lost = is_lost;
            int len = rdzv_record_rank_format(&ranks[i], texts[i], sizeof texts[i]);
            snprintf(names[i], sizeof names[i], "%s/r%d/rank/%d", r->prefix, round, i);
            keys[i] = names[i];
            vals[i] = texts[i];
            lens[i] = len > 0 ? (size_t)len : 0;
            if (len < 0) rc = -ENOSPC;
        }
    }
    if (rc == 0 && (rc = c->ops->multi_set(c, keys, vals, lens, (size_t)n)) < 0)
        snprintf(err, err_len, "rendezvous round %d: publishing the ranks: %s", round,
                 c->ops->error(c));
    if (rc == 0) *own = ranks[n - 1];
    free(m);
    free(recs);
    free(ranks);
    free(texts);
    free(names);
    free(keys);
    free(vals);
    free(lens);
    return rc;
}

/* Any other member: its own r<R>/rank/<index>, once the last member wrote it (etcd: ended too by
 * the last member's lost lease). */
static int read_rank(rdzv_t *r, rdzv_kv_t *c, int round, int index, int n, int64_t closed_revision,
                     rdzv_rank_record_t *out, char *err, size_t err_len) {
    char k[256];
    snprintf(k, sizeof k, "%s/r%d/rank/%d", r->prefix, round, index);
    /* the last member writes the ranks once it read closed */
    if (c->ops->expect_absent) c->ops->expect_absent(c, k, closed_revision);
    const char *keys[] = {k};
    int publisher = n - 1, rc = wait_owed(r, c, round, keys, &publisher, 1, 2, err, err_len);
    if (rc < 0) {
        if (rc != DDP_ELOST)
            snprintf(err, err_len, "rendezvous round %d: %s", round, c->ops->error(c));
        return rc;
    }
    uint8_t *v;
    size_t len;
    if ((rc = c->ops->get(c, k, &v, &len)) < 0) {
        snprintf(err, err_len, "rendezvous round %d: %s", round, c->ops->error(c));
        return rc;
    }
    bool is_ok = rdzv_record_rank_parse((const char *)v, len, out);
    free(v);
    if (!is_ok) {
        snprintf(err, err_len,
                 "round %d: the rank record of join index %d (%zu bytes) is malformed", round,
                 index, len);
        return DDP_EPROTO;
    }
    /* well-formed, but of this round: a node among its n, ranks inside the world */
    if (!out->error[0] && (out->group_rank >= n || out->host_join_index >= n ||
                           (int64_t)out->rank_offset + r->opts->nproc_per_node > out->world_size)) {
        snprintf(err, err_len,
                 "round %d: the rank record of join index %d places this node as node %d of %d "
                 "(node 0: #%d), ranks %d-%d of %d: not a place in this round",
                 round, index, out->group_rank, n, out->host_join_index, out->rank_offset,
                 out->rank_offset + r->opts->nproc_per_node - 1, out->world_size);
        return DDP_EPROTO;
    }
    return 0;
}

/* Compare-set closed to n members (the first such write wins; every member reads that one). */
static int close_round(rdzv_kv_t *c, const char *closed_key, int64_t n) {
    char count[24];
    snprintf(count, sizeof count, "%lld", (long long)n);
    uint8_t *cur;
    size_t cur_n;
    int rc = c->ops->compare_set(c, closed_key, "", 0, count, strlen(count), &cur, &cur_n);
    if (rc == 0) free(cur);
    return rc;
}

/* Wait for the round to close, within join_timeout. The joiner whose ticket reaches MIN or MAX
 * closes it; one that died right after its ticket never does, so every waiting member looks at
 * the count between slices of at least a last call and closes the round itself at MAX, or at MIN
 * and more once no ticket came for a whole slice (a last call without the dead closer). The
 * round then holds a dead member, whose missing node record ends it (wait_owed): never a wait
 * for join_timeout. *joined: the count last seen. */
static int wait_closed(rdzv_t *r, rdzv_kv_t *c, const char *tickets_key, const char *closed_key,
                       int64_t *joined) {
    const ddprun_opts_t *o = r->opts;
    const char *keys[] = {closed_key};
    int64_t slice_ms = (int64_t)(o->last_call_timeout_s * 1000);
    if (slice_ms < CLOSE_CHECK_MS) slice_ms = CLOSE_CHECK_MS;
    uint64_t deadline_ms = clock_now_ms() + (uint64_t)(o->join_timeout_s * 1000);
    int64_t seen = *joined;
    for (;;) {
        uint64_t now_ms = clock_now_ms();
        if (now_ms >= deadline_ms) return DDP_ETIMEOUT;
        int64_t left_ms = (int64_t)(deadline_ms - now_ms);
        int rc = c->ops->wait(c, keys, 1, left_ms < slice_ms ? left_ms : slice_ms);
        if (rc != DDP_ETIMEOUT) return rc;
        int64_t count;
        if ((rc = c->ops->count_tickets(c, tickets_key, &count)) < 0) return rc;
        *joined = count;
        bool is_full = count >= (int64_t)o->max_nodes,
             is_quiet = count >= (int64_t)o->min_nodes && count == seen;
        seen = count;
        if ((is_full || is_quiet) &&
            (rc = close_round(c, closed_key, is_full ? (int64_t)o->max_nodes : count)) < 0)
            return rc;
    }
}

int rdzv_join(rdzv_t *r, rdzv_kv_t *c, int round, rdzv_result_t *out, char *err, size_t err_len) {
    const ddprun_opts_t *o = r->opts;
    char k[256], record[RDZV_RECORD_MAX_BYTES], closed_key[256];
    int64_t joined;
    key(r, k, sizeof k, round, "joined");
    key(r, closed_key, sizeof closed_key, round, "closed");
    int64_t ticket; /* etcd: with a look at closed, which this join waits for next */
    int rc = c->ops->take_ticket(c, k, closed_key, &ticket);
    if (rc < 0) goto fail;
    joined = ticket + 1;
    int index = (int)ticket;
    rdzv_node_record_t mine = {.nproc = o->nproc_per_node,
                               .hint = r->node_rank_hint,
                               .is_host = r->is_store_host,
                               .store_port = r->own_store_port};
    snprintf(mine.store_host, sizeof mine.store_host, "%s", r->own_store_host);
    snprintf(mine.peer_host, sizeof mine.peer_host, "%s", r->own_peer_host);
    mine.peer_port = r->own_peer_port;
    if (rdzv_record_node_format(&mine, record, sizeof record) < 0) return -ENOSPC;
    char node_key[256];
    snprintf(node_key, sizeof node_key, "%s/r%d/node/%d", r->prefix, round, index);
    /* etcd: under this agent's lease, so the record is also its mark of life in the round
     * (rdzv_wait_member_lost); the store: a plain SET */
    if ((rc = c->ops->set_ephemeral(c, node_key, record, strlen(record))) < 0) goto fail;
    const char *keys[] = {closed_key};
    bool is_closed = false;
    if (joined >= (int64_t)o->min_nodes && joined < (int64_t)o->max_nodes) {
        /* MIN: a last call that lets more nodes in, which ends early when one of them closes the
         * round at MAX (a member learning its round later than the others beats late) */
        int64_t last_call_ms = (int64_t)(o->last_call_timeout_s * 1000);
        rc = last_call_ms > 0 ? c->ops->wait(c, keys, 1, last_call_ms) : DDP_ETIMEOUT;
        if (rc < 0 && rc != DDP_ETIMEOUT) goto fail;
        is_closed = rc == 0;
        if (!is_closed && (rc = c->ops->count_tickets(c, k, &joined)) < 0) goto fail;
    }
    if (joined >= (int64_t)o->min_nodes && !is_closed && /* at MAX at once, at MIN after the call */
        (rc = close_round(c, closed_key,
                          joined < (int64_t)o->max_nodes ? joined : (int64_t)o->max_nodes)) < 0)
        goto fail;
    rc = wait_closed(r, c, k, closed_key, &joined);
    if (rc == DDP_ETIMEOUT) {
        snprintf(err, err_len,
                 "round %d did not gather --nnodes %u:%u within join_timeout=%gs "
                 "(%lld joined)",
                 round, o->min_nodes, o->max_nodes, o->join_timeout_s, (long long)joined);
        return rc;
    }
    int64_t n_members;
    if (rc < 0) goto fail;
    char why[512];
    if ((rc = get_int(c, closed_key, 1, RDZV_MAX_NODES, &n_members, why, sizeof why)) < 0) {
        snprintf(err, err_len, "rendezvous round %d: %s", round, why);
        return rc;
    }
    int64_t closed_revision = c->ops->read_revision ? c->ops->read_revision(c, closed_key) : 0;
    memset(out, 0, sizeof *out);
    out->round = round;
    out->group_world_size = (int)n_members;
    out->is_member = index < n_members;
    out->join_index = index;
    out->closed_revision = closed_revision;
    if (!out->is_member) return 0;
    rdzv_rank_record_t place;
    if (index == n_members - 1)
        rc = publish_ranks(r, c, round, (int)n_members, &place, err, err_len);
    else
        rc = read_rank(r, c, round, index, (int)n_members, closed_revision, &place, err, err_len);
    if (rc < 0) return rc;
    if (place.error[0]) {
        snprintf(err, err_len, "%s", place.error);
        return place.is_lost ? DDP_ELOST : DDP_EPROTO;
    }
    out->group_rank = place.group_rank;
    out->rank_offset = place.rank_offset;
    out->world_size = place.world_size;
    if (r->own_store_host[0] && !place.store_host[0]) {
        snprintf(err, err_len, "round %d: the rank record of join index %d has no store address",
                 round, index);
        return DDP_EPROTO;
    }
    snprintf(out->store_host, sizeof out->store_host, "%s", place.store_host);
    out->store_port = place.store_port;
    snprintf(out->next_peer_host, sizeof out->next_peer_host, "%s", place.next_peer_host);
    out->next_peer_port = place.next_peer_port;
    return 0;
fail:
    snprintf(err, err_len, "rendezvous round %d: %s", round, c->ops->error(c));
    return rc;
}

int rdzv_request_restart(rdzv_t *r, rdzv_kv_t *c, int round, const rdzv_why_t *why) {
    char k[256], failures_key[256], text[RDZV_RECORD_MAX_BYTES];
    key(r, failures_key, sizeof failures_key, -1, "failures");
    int64_t failures;
    TRY(c->ops->add(c, failures_key, 0, &failures));
    if (why->code != 0) failures++;
    rdzv_why_t record = *why;
    record.failures = (int)failures;
    if (rdzv_record_why_format(&record, text, sizeof text) < 0) return -ENOSPC;
    key(r, k, sizeof k, round, "restart");
    uint8_t *cur;
    size_t n;
    TRY(c->ops->compare_set(c, k, "", 0, text, strlen(text), &cur, &n));
    bool is_winner = n == strlen(text) && memcmp(cur, text, n) == 0;
    rdzv_why_t there;
    bool is_finished =
        !is_winner && rdzv_record_why_parse((const char *)cur, n, &there) && there.is_finished;
    free(cur);
    if (is_finished) return 0; /* the job ended well before this report: no next round */
    /* an ADD, not the count read above written back: a refund landing between the two (a lost
     * node's, from the round before) would be undone */
    if (is_winner && why->code != 0) TRY(c->ops->add(c, failures_key, 1, &failures));
    /* The next round begins where agents that start late will look for it: round + 1, once,
     * however many agents report at the same time (a compare-set, not an ADD). */
    key(r, k, sizeof k, -1, "round");
    char was[24], next[24];
    snprintf(was, sizeof was, "%d", round);
    snprintf(next, sizeof next, "%d", round + 1);
    TRY(c->ops->compare_set(c, k, was, strlen(was), next, strlen(next), &cur, &n));
    /* `was` back: the counter is not there (etcd's ADD 0 does not create it): create it */
    bool is_missing = n == strlen(was) && memcmp(cur, was, n) == 0;
    free(cur);
    if (is_missing) {
        TRY(c->ops->compare_set(c, k, "", 0, next, strlen(next), &cur, &n));
        free(cur);
    }
    return 0;
}

int rdzv_refund_failure(rdzv_t *r, rdzv_kv_t *c) {
    char failures_key[256];
    key(r, failures_key, sizeof failures_key, -1, "failures");
    int64_t failures;
    return c->ops->add(c, failures_key, -1, &failures);
}

static int set_json(rdzv_kv_t *c, const char *k, cJSON *o) {
    char *text = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!text) return -ENOMEM;
    int rc = c->ops->set(c, k, text, strlen(text));
    cJSON_free(text);
    return rc;
}

int rdzv_publish_job(rdzv_t *r, rdzv_kv_t *c) {
    const ddprun_opts_t *o = r->opts;
    char k[256];
    key(r, k, sizeof k, -1, "job");
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "backend", o->rdzv_backend);
    cJSON_AddNumberToObject(j, "min_nodes", o->min_nodes);
    cJSON_AddNumberToObject(j, "max_nodes", o->max_nodes);
    cJSON_AddNumberToObject(j, "nproc_per_node", o->nproc_per_node);
    cJSON_AddNumberToObject(j, "max_restarts", o->max_restarts);
    return set_json(c, k, j);
}

int rdzv_publish_member(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round) {
    char k[512], what[64], host[256] = "";
    gethostname(host, sizeof host - 1);
    snprintf(what, sizeof what, "member/%d", round->group_rank);
    key(r, k, sizeof k, round->round, what);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "host", host);
    cJSON_AddNumberToObject(j, "node", round->group_rank);
    cJSON_AddNumberToObject(j, "first_rank", round->rank_offset);
    cJSON_AddNumberToObject(j, "nproc", r->opts->nproc_per_node);
    cJSON_AddNumberToObject(j, "world_size", round->world_size);
    cJSON_AddNumberToObject(j, "agent_pid", getpid());
    return set_json(c, k, j);
}

int rdzv_publish_failure(rdzv_t *r, rdzv_kv_t *c, int round, int group_rank,
                         const char *failure_json) {
    char k[512], what[64];
    snprintf(what, sizeof what, "failure/%d", group_rank);
    key(r, k, sizeof k, round, what);
    return c->ops->set(c, k, failure_json, strlen(failure_json));
}

int rdzv_wait_restart(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, char *why,
                      size_t why_len) {
    char k[256];
    key(r, k, sizeof k, round->round, "restart");
    const char *keys[] = {k};
    int rc;
    /* every report of a round's end comes from an agent that saw the round closed (a member, a
     * spare, a join that found a member lost): the restart key is written after closed */
    if (c->ops->expect_absent) c->ops->expect_absent(c, k, round->closed_revision);
    /* WAIT in slices: each slice is one bounded operation of the client. */
    while ((rc = c->ops->wait(c, keys, 1, 60000)) == DDP_ETIMEOUT) {
    }
    if (rc < 0) return rc;
    uint8_t *v;
    size_t n;
    TRY(c->ops->get(c, k, &v, &n));
    size_t m = n < why_len - 1 ? n : why_len - 1;
    memcpy(why, v, m);
    why[m] = '\0';
    free(v);
    return 0;
}

/* Every member of round is counted done: all_done, and the round's end for whoever still waits
 * on it: a spare of the full job leaves (it judged the members by heartbeats that now stop, and
 * asked for a next round that then ran the program again, or waited status_ttl on etcd's leftover
 * records); a restart reported first stays. */
static int mark_all_done(rdzv_t *r, rdzv_kv_t *c, int round, const char *all) {
    TRY(c->ops->set(c, all, "1", 1));
    char restart[256], text[RDZV_RECORD_MAX_BYTES];
    rdzv_why_t done = {.node = -1, .rank = -1, .is_finished = true};
    key(r, restart, sizeof restart, round, "restart");
    if (rdzv_record_why_format(&done, text, sizeof text) < 0) return -ENOSPC;
    uint8_t *cur = NULL;
    size_t cur_n = 0;
    TRY(c->ops->compare_set(c, restart, "", 0, text, strlen(text), &cur, &cur_n));
    free(cur);
    return 0;
}

/* One member counted done in round's exit barrier; the last of n marks it all done (the key
 * into all). */
static int count_done(rdzv_t *r, rdzv_kv_t *c, int round, int n, char *all, size_t all_len) {
    char k[256];
    key(r, k, sizeof k, round, "done");
    key(r, all, all_len, round, "all_done");
    int64_t ticket; /* etcd: a ticket, not an ADD's compare-and-swap, as for a join */
    TRY(c->ops->take_ticket(c, k, all, &ticket));
    if (ticket + 1 >= n) TRY(mark_all_done(r, c, round, all));
    return 0;
}

/* Whether this caller is the one to count `member` done: the first to mark r<R>/done_lost/<member>
 * (with `who`: the member itself, "self", or a judge's number), so that a member is counted once,
 * by itself or by however many judged it lost, in whichever order (a member killed after its own
 * count would otherwise be counted again, and the barrier end while another still runs). */
static int claim_count(rdzv_t *r, rdzv_kv_t *c, int round, int member, const char *who,
                       bool *is_mine) {
    char k[256], what[32];
    snprintf(what, sizeof what, "done_lost/%d", member);
    key(r, k, sizeof k, round, what);
    size_t m = strlen(who), cur_n;
    uint8_t *cur;
    TRY(c->ops->compare_set(c, k, "", 0, who, m, &cur, &cur_n));
    *is_mine = cur_n == m && memcmp(cur, who, m) == 0;
    free(cur);
    return 0;
}

int rdzv_finish(rdzv_t *r, rdzv_kv_t *c, int round, int n, int member, int64_t timeout_ms) {
    char all[256];
    bool is_mine;
    TRY(claim_count(r, c, round, member, "self", &is_mine));
    if (is_mine)
        TRY(count_done(r, c, round, n, all, sizeof all));
    else /* judged lost (silent a while) and counted already */
        key(r, all, sizeof all, round, "all_done");
    const char *keys[] = {all};
    /* in slices: the member whose ticket completed the count may have died before it marked
     * the round all done, and the others would wait out timeout_ms (join_timeout); a waiter
     * that finds every ticket taken marks it itself */
    char done_key[256];
    key(r, done_key, sizeof done_key, round, "done");
    uint64_t deadline = clock_deadline_ms(timeout_ms);
    for (;;) {
        int64_t left = clock_remaining_ms(deadline); /* -1: never */
        bool is_last = left >= 0 && left <= FINISH_SLICE_MS;
        int rc = c->ops->wait(c, keys, 1, is_last ? left : FINISH_SLICE_MS);
        if (rc != DDP_ETIMEOUT || is_last) return rc;
        int64_t taken;
        TRY(c->ops->count_tickets(c, done_key, &taken));
        if (taken >= n) return mark_all_done(r, c, round, all);
    }
}

int rdzv_finish_lost(rdzv_t *r, rdzv_kv_t *c, int round, int n, int member, int judge) {
    char all[256], me[16];
    snprintf(me, sizeof me, "%d", judge);
    bool is_mine;
    TRY(claim_count(r, c, round, member, me, &is_mine));
    if (!is_mine) return 0;
    TRY(count_done(r, c, round, n, all, sizeof all));
    return 1;
}

/* Every member's key r<R>/<what>/<i> in one MULTI_GET (a missing key reads as empty): on the
 * store the heartbeat counters, on etcd the lease-bound node records. */
static int read_member_keys(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, const char *what,
                            bool is_presence, int64_t *marks) {
    int n = round->group_world_size;
    char **keys = calloc((size_t)n, sizeof *keys);
    uint8_t **vals = calloc((size_t)n, sizeof *vals);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    int rc = keys && vals && lens ? 0 : -ENOMEM;
    for (int i = 0; i < n && rc == 0; i++) {
        keys[i] = malloc(256);
        if (!keys[i])
            rc = -ENOMEM;
        else
            snprintf(keys[i], 256, "%s/r%d/%s/%d", r->prefix, round->round, what, i);
    }
    if (rc == 0) rc = c->ops->multi_get(c, (const char *const *)keys, (size_t)n, vals, lens);
    for (int i = 0; i < n; i++) {
        if (rc == 0) {
            char text[32];
            size_t m = lens[i] < sizeof text - 1 ? lens[i] : sizeof text - 1;
            memcpy(text, vals[i], m);
            text[m] = '\0';
            if (is_presence)
                marks[i] = m ? LIVENESS_ALIVE : LIVENESS_GONE;
            else
                marks[i] = m ? strtoll(text, NULL, 10) : 0;
            free(vals[i]);
        }
        if (keys) free(keys[i]);
    }
    free(keys);
    free(vals);
    free(lens);
    return rc;
}

int rdzv_heartbeat(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, const bool *known,
                   int64_t *counters) {
    char k[256];
    snprintf(k, sizeof k, "%s/r%d/hb/%d", r->prefix, round->round, round->group_rank);
    int64_t mine;
    TRY(c->ops->add(c, k, 1, &mine));
    int n = round->group_world_size;
    for (int i = 0; i < n; i++)
        counters[i] = LIVENESS_ALIVE;
    if (n < 2) return 0;
    /* Only the next member's counter: in a ring where some member lives and some died, some
     * living member's next one is dead, so this finds any loss, at 2 operations per member and
     * beat instead of reading N counters each (N^2 for the store at every beat). Past the ones
     * known lost: their successor has nobody else to judge it (the exit barrier counts each). */
    int next = (round->group_rank + 1) % n;
    while (known && known[next] && next != round->group_rank)
        next = (next + 1) % n;
    if (next == round->group_rank) return 0; /* every other member is known lost */
    snprintf(k, sizeof k, "%s/r%d/hb/%d", r->prefix, round->round, next);
    const char *keys[] = {k};
    uint8_t *v = NULL;
    size_t len = 0;
    TRY(c->ops->multi_get(c, keys, 1, &v, &len));
    char text[32];
    size_t m = len < sizeof text - 1 ? len : sizeof text - 1;
    memcpy(text, v, m);
    text[m] = '\0';
    free(v);
    counters[next] = m ? strtoll(text, NULL, 10) : 0;
    return 0;
}

int rdzv_read_members(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, int64_t *marks) {
    /* etcd: members' lease-bound node records are by join index, and the members are the
     * first joiners */
    if (c->ops->keep_alive) return read_member_keys(r, c, round, "node", true, marks);
    return read_member_keys(r, c, round, "hb", false, marks);
}

int rdzv_wait_member_lost(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, const bool *known,
                          int64_t timeout_ms, int *join_index) {
    int n = round->group_world_size;
    if (!c->ops->wait_gone || n < 2) return -ENOTSUP;
    char(*names)[256] = calloc((size_t)n, sizeof *names);
    const char **keys = calloc((size_t)n, sizeof *keys);
    int *index_of = calloc((size_t)n, sizeof *index_of);
    int rc = names && keys && index_of ? 0 : -ENOMEM, m = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        if (i == round->join_index) continue; /* our own lease is keep_alive's business */
        if (known && known[i]) continue;      /* gone already: its absence is no news */
        char what[32];
        snprintf(what, sizeof what, "node/%d", i);
        key(r, names[m], sizeof names[m], round->round, what);
        keys[m] = names[m];
        index_of[m++] = i;
    }
    int gone = -1;
    if (rc == 0 && m == 0) rc = DDP_ETIMEOUT; /* every other member is known gone */
    if (rc == 0) rc = c->ops->wait_gone(c, keys, (size_t)m, timeout_ms, &gone);
    *join_index = rc == 0 && gone >= 0 ? index_of[gone] : -1;
    free(names);
    free(keys);
    free(index_of);
    return rc;
}

int rdzv_retire(rdzv_t *r, rdzv_kv_t *c, int world_size) {
    if (!c->ops->expire_prefix || !r->own_store_host[0]) return -ENOTSUP;
    ddprun_opts_t store_opts = *r->opts; /* the same job, through this agent's own store */
    strcpy(store_opts.rdzv_backend, "c10d");
    snprintf(store_opts.rdzv_host, sizeof store_opts.rdzv_host, "%s", r->own_store_host);
    store_opts.rdzv_port = r->own_store_port;
    rdzv_kv_t *store = NULL;
    int rc = rdzv_kv_connect(&store_opts, NULL, 5000, 5000, &store);
    for (int rank = 0; rc == 0 && rank < world_size; rank++) {
        char k[256], what[32];
        snprintf(what, sizeof what, "progress/%d", rank);
        key(r, k, sizeof k, -1, what);
        const char *keys[] = {k};
        uint8_t *v = NULL;
        size_t n = 0;
        rc = store->ops->multi_get(store, keys, 1, &v, &n);
        if (rc == 0 && n > 0) rc = c->ops->set(c, k, v, n);
        free(v);
    }
    rdzv_kv_destroy(store);
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s/", r->prefix);
    int expire_rc = c->ops->expire_prefix(c, prefix, (int64_t)r->opts->status_ttl_s);
    return rc < 0 ? rc : expire_rc;
}
