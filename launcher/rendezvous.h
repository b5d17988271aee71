/* rendezvous: agents of one job agree on a round's members and ranks through the store, and tell
 * each other about failures and completion. Blocking calls on a store_client (the agent runs them
 * on libuv's thread pool, so its loop never blocks); every call is bounded by the client's and the
 * join deadlines. Keys live under /ddprun/<run_id>/ (docs/protocol.md, "Rendezvous keys").
 *
 * A round: each agent ADDs to r<R>/joined (its join index), SETs its record r<R>/node/<i>; the join
 * that reaches --nnodes MAX closes the round at once, the one that reaches MIN after the last-call
 * window; closing is a COMPARE_SET of r<R>/closed to the member count. Members are the first N
 * joiners; ranks are deterministic: the store host first, then --node-rank hints, then join order.
 * A failure anywhere sets r<R>/restart (first writer wins), which every agent WAITs on. */
#ifndef DDP_LAUNCHER_RENDEZVOUS_H
#define DDP_LAUNCHER_RENDEZVOUS_H

#include <stdbool.h>
#include <stdint.h>

#include "options.h"
#include "rdzv_record.h"
#include "store_client.h"

#define RDZV_MAX_NODES 1024

typedef struct {
    int round;
    int group_rank, group_world_size;
    int rank_offset, world_size;
    bool is_member; /* false: this agent joined too late for this round */
} rdzv_result_t;

typedef struct {
    const ddprun_opts_t *opts;
    char prefix[200];
    bool is_store_host;
    int node_rank_hint;
} rdzv_t;

void rdzv_init(rdzv_t *r, const ddprun_opts_t *opts, bool is_store_host);
/* The round a newly started agent should join (0 unless the job already ran rounds). */
int rdzv_current_round(rdzv_t *r, store_client_t *c, int *round);
/* Join round `round` and wait until it closes (--rdzv-conf join_timeout). */
int rdzv_join(rdzv_t *r, store_client_t *c, int round, rdzv_result_t *out, char *err,
              size_t err_len);
/* Ask every agent to end round `round`. The first report wins; later ones are ignored. The winner
 * of a failure report also advances the job-wide failure count. */
int rdzv_request_restart(rdzv_t *r, store_client_t *c, int round, const rdzv_why_t *why);
/* Take one failure back from the job-wide count (a restart that turned out to be a lost node).
 * Call from one agent only. */
int rdzv_refund_failure(rdzv_t *r, store_client_t *c);
/* For `ddprun status` (rdzv_status.h reads them): the job's settings under "job" (any agent; the
 * same values from all), this member's record r<R>/member/<group_rank> (host, ranks, agent pid),
 * and a local worker's failure r<R>/failure/<group_rank> (failure: a JSON object, by the agent
 * whose worker failed). Each is one SET; 0 or a store error. */
int rdzv_publish_job(rdzv_t *r, store_client_t *c);
int rdzv_publish_member(rdzv_t *r, store_client_t *c, const rdzv_result_t *round);
int rdzv_publish_failure(rdzv_t *r, store_client_t *c, int round, int group_rank,
                         const char *failure_json);
/* Block until round `round`'s restart key is set (by anyone, us included); copy its value. */
int rdzv_wait_restart(rdzv_t *r, store_client_t *c, int round, char *why, size_t why_len);
/* Heartbeat: bump this member's counter r<R>/hb/<group_rank> and read every member's counter
 * (counters, not clocks: each agent judges staleness on its own monotonic clock). */
int rdzv_heartbeat(rdzv_t *r, store_client_t *c, const rdzv_result_t *round, int64_t *counters);
/* Exit barrier: count this agent done and wait until all n members are (so the store host does
 * not leave while others still need the store). */
int rdzv_finish(rdzv_t *r, store_client_t *c, int round, int n, int64_t timeout_ms);

#endif
