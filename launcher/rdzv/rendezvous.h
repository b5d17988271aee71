/* rendezvous: agents of one job agree on a round's members and ranks through the store, and tell
 * each other about failures and completion. Blocking calls on an rdzv_kv (the agent runs them
 * on libuv's thread pool, so its loop never blocks); every call is bounded by the client's and the
 * join deadlines. Keys live under /ddprun/<run_id>/ (docs/protocol.md, "Rendezvous keys").
 *
 * A round: each agent takes a ticket of r<R>/joined (its join index; an ADD on the store),
 * SETs its record r<R>/node/<i> (set_ephemeral); the join that reaches --nnodes MAX closes the
 * round at once, the one that reaches MIN after the last-call window; closing is a COMPARE_SET of
 * r<R>/closed to the member count N. Members are the first N joiners; ranks are deterministic: the
 * store host first, then --node-rank hints, then join order. The last member (join index N-1) alone
 * reads the N records and writes each member's place r<R>/rank/<i> in one MULTI_SET; every other
 * member reads its own: a join is O(1) requests and keys, whatever N is. A failure anywhere sets
 * r<R>/restart (first writer wins), which every agent WAITs on.
 *
 * On etcd there is no store host: a joining agent writes its node record under its lease (so a
 * member that dies is seen by its record vanishing, rdzv_wait_member_lost), each node
 * record carries its agent's own store (HOST:PORT), and the last member copies node 0's into every
 * rank record: the round's workers use node 0's store. */
#ifndef DDP_LAUNCHER_RENDEZVOUS_H
#define DDP_LAUNCHER_RENDEZVOUS_H

#include <stdbool.h>
#include <stdint.h>

#include "options.h"
#include "rdzv/rdzv_record.h"
#include "rdzv/rdzv_kv.h"

typedef struct {
    const ddprun_opts_t *opts;
    char prefix[200];
    bool is_store_host;
    int node_rank_hint;
    char own_store_host[256]; /* etcd: this agent's store, offered when it is a round's node 0 */
    uint16_t own_store_port;
    char own_peer_host[256]; /* this agent's memory-snapshot listener, "" when none */
    uint16_t own_peer_port;
} rdzv_t;

void rdzv_init(rdzv_t *r, const ddprun_opts_t *opts, bool is_store_host);
/* etcd: the store this agent serves the workers of a round where it is node 0. */
void rdzv_set_own_store(rdzv_t *r, const char *host, uint16_t port);
/* This agent's memory-snapshot listener: its node record carries it, and the previous node's
 * join hands it back (rdzv_result_t.next_peer_*), so that no agent looks for its successor. */
void rdzv_set_own_peer(rdzv_t *r, const char *host, uint16_t port);
/* The round a newly started agent should join (0 unless the job already ran rounds). 0, or a
 * negative code with err saying why (the store's error, or a counter that is no round number). */
int rdzv_current_round(rdzv_t *r, rdzv_kv_t *c, int *round, char *err, size_t err_len);
/* Whether the job of this --rdzv-id already gave up (round current - 1 ended with a failure that
 * is not retried, or past --max-restarts, the way its agents decided): 1 with err saying so, 0
 * when not, or a negative code (the store's error in err). For an agent's first join: a
 * resubmission with the same id, or a node that comes after its job failed, would otherwise run
 * a round of it with the spent budget. */
int rdzv_job_has_failed(rdzv_t *r, rdzv_kv_t *c, int current, char *err, size_t err_len);
/* Join round `round` and wait until it closes (--rdzv-conf join_timeout). DDP_ELOST (etcd): a
 * member lost its lease before it wrote its record, err says which: the round can never start; ask
 * for the next (rdzv_request_restart) and join that. */
int rdzv_join(rdzv_t *r, rdzv_kv_t *c, int round, rdzv_result_t *out, char *err, size_t err_len);
/* Ask every agent to end round `round`. The first report wins; later ones are ignored. The winner
 * of a failure report also advances the job-wide failure count. */
int rdzv_request_restart(rdzv_t *r, rdzv_kv_t *c, int round, const rdzv_why_t *why);
/* Take one failure back from the job-wide count (a restart that turned out to be a lost node).
 * Call from one agent only. */
int rdzv_refund_failure(rdzv_t *r, rdzv_kv_t *c);
/* For `ddprun status` (rdzv_status.h reads them): the job's settings under "job" (any agent; the
 * same values from all: the agent has each round's node 0 write them), this member's record
 * r<R>/member/<group_rank> (host, ranks, agent pid), and a local worker's failure
 * r<R>/failure/<group_rank> (failure: a JSON object, by the agent whose worker failed). Each is one
 * SET; 0 or a store error. */
int rdzv_publish_job(rdzv_t *r, rdzv_kv_t *c);
int rdzv_publish_member(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round);
int rdzv_publish_failure(rdzv_t *r, rdzv_kv_t *c, int round, int group_rank,
                         const char *failure_json);
/* Block until the restart key of `round` (as rdzv_join returned it) is set (by anyone, us
 * included); copy its value. */
int rdzv_wait_restart(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, char *why,
                      size_t why_len);
/* Heartbeat: bump this member's counter r<R>/hb/<group_rank> and read the next member's (group
 * rank + 1, around the ring, past those known[] lost: NULL for none) into counters[next]; the
 * others read LIVENESS_ALIVE. Counters, not clocks: each agent judges staleness on its own
 * monotonic clock (liveness.h). Any member's loss is found by some living member, at O(N) for the
 * store per beat of the round. */
int rdzv_heartbeat(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, const bool *known,
                   int64_t *counters);
/* Without beating: read whether each member of `round` still lives, for liveness.h (marks[i]:
 * member i's heartbeat counter on the store; on etcd LIVENESS_ALIVE while its lease-bound key is
 * there, else LIVENESS_GONE). An agent that is no member of the round (it arrived after the round
 * closed) calls it to find a round whose members all died. */
int rdzv_read_members(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, int64_t *marks);
/* etcd, node 0 after the exit barrier: copy the workers' progress records from this agent's
 * store into etcd and let the job's keys expire in --rdzv-conf status_ttl, so that `ddprun status`
 * still tells how the job ended. */
int rdzv_retire(rdzv_t *r, rdzv_kv_t *c, int world_size);
/* etcd: block until another member of the round lost its lease (*join_index: its join index),
 * or timeout_ms passes (DDP_ETIMEOUT). known (NULL: none): by join index, members already seen
 * lost, not watched (the exit barrier goes on watching the others). */
int rdzv_wait_member_lost(rdzv_t *r, rdzv_kv_t *c, const rdzv_result_t *round, const bool *known,
                          int64_t timeout_ms, int *join_index);
/* Exit barrier: count this agent (`member`: numbered as rdzv_finish_lost's judges number it, by
 * join index on etcd, by group rank on the store) done, unless a judge already counted it lost,
 * and wait until all n members are (so the store host does not leave while others still need the
 * store). */
int rdzv_finish(rdzv_t *r, rdzv_kv_t *c, int round, int n, int member, int64_t timeout_ms);
/* Exit barrier: count `member`, judged lost by `judge` (this agent's member number, so that two
 * judges are told apart), done on its behalf: a member that will never count itself must not
 * hold the others until the barrier's timeout. Counted once however many judge it lost, and not
 * when it counted itself (the first mark r<R>/done_lost/<member>, the member's own or a judge's);
 * 1 when this judge counted it, 0 when it was counted already. */
int rdzv_finish_lost(rdzv_t *r, rdzv_kv_t *c, int round, int n, int member, int judge);

#endif
