/* rdzv_record: the rendezvous' records in the store, as JSON objects (cJSON): a node's record in a
 * round (r<R>/node/<i>), a member's place in a closed round (r<R>/rank/<i>) and why a round ended
 * (r<R>/restart); and what a join hands back
 * (rdzv_result_t), which the agent's pure state machine keeps (agent_sm.h). Parsing is strict and
 * bounded: a record from the store is outside input (another agent, or anyone who can reach the
 * store), so a malformed one is refused, never trusted in part. Pure: no I/O; any thread. */
#ifndef DDP_LAUNCHER_RDZV_RECORD_H
#define DDP_LAUNCHER_RDZV_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define RDZV_RECORD_MAX_BYTES 1024 /* two addresses of 255-character hosts fit */
#define RDZV_MAX_NODES        1024

/* A round as this agent joined it (rdzv_join, rendezvous.h). */
typedef struct {
    int round;
    int group_rank, group_world_size;
    int rank_offset, world_size;
    bool is_member; /* false: this agent joined too late for this round */
    int join_index;
    char store_host[256]; /* etcd: the round's store (node 0's), for MASTER_ADDR/MASTER_PORT */
    uint16_t store_port;
    /* etcd: the revision r<R>/closed was written at (0: unknown). Keys written only after the
     * round closed (its ranks, its restart) are waited for from there, without a read first. */
    int64_t closed_revision;
    /* the memory-snapshot listener of the node after this one (group rank + 1 mod the round's
     * nodes): where this agent sends its copies; empty host: that node keeps none */
    char next_peer_host[256];
    uint16_t next_peer_port;
} rdzv_result_t;

/* A node's record in a round. */
typedef struct {
    int nproc;    /* its workers, >= 1 */
    int hint;     /* --node-rank, -1 when not given */
    bool is_host; /* it hosts the store */
    /* etcd: the store its agent serves the workers of a round where it is node 0 ("store":
     * "HOST:PORT"); empty host: none (c10d, whose store is the job's) */
    char store_host[256];
    uint16_t store_port;
    /* its agent's memory-snapshot listener ("peer": "HOST:PORT"); empty host: none */
    char peer_host[256];
    uint16_t peer_port;
} rdzv_node_record_t;

/* Where a member stands in a closed round, as the round's last member publishes it for each member
 * (r<R>/rank/<join index>): every other member reads its own instead of every node record. */
typedef struct {
    int group_rank;       /* the member's node rank in the round */
    int rank_offset;      /* its first worker's global rank */
    int world_size;       /* workers in the round */
    int host_join_index;  /* the join index of node 0 (etcd: whose lease owes the store address) */
    char error[160];      /* non-empty: the round cannot start, and why (a malformed node record) */
    bool is_lost;         /* with error: a member was lost before it wrote its record (etcd), so
                             the next round may start without it */
    char store_host[256]; /* etcd: node 0's store (its node record's), the round's MASTER_ADDR */
    uint16_t store_port;  /* and MASTER_PORT; empty host: none (c10d) */
    char next_peer_host[256]; /* the next node's "peer" ("next_peer"); empty host: none */
    uint16_t next_peer_port;
} rdzv_rank_record_t;

/* Why a round ended, as every agent reads it from the round's restart key. */
typedef struct {
    int code;          /* 0: a membership change, not a failure */
    bool is_permanent; /* retrying cannot help: every agent exits with code */
    int failures;      /* failures of the job so far, this one included: the restart budget */
    int node, rank;    /* where it happened (-1: not a worker) */
    int nodes;         /* members of the round that ended, as its reporter saw it (0: not said,
                          an older agent's record): every agent, a spare too, then judges the
                          next round's size against the same number (a lost node's refund) */
    bool is_finished;  /* code 0: the round ended because the job did, well (its exit barrier
                          completed): a node still waiting for it has nothing left to run */
} rdzv_why_t;

/* What a failed round (a restart record, or this node's own failure) leads to under
 * --max-restarts: another round (a membership change, code 0, or a failure within the budget); a
 * round whose size decides (several nodes, a peer failure past the budget: a node fewer means it
 * was lost, which is no restart); or the job's end (a permanent failure, or one past the budget).
 * The agent's decision and a resubmission's check (rdzv_job_has_failed) both ask it. */
typedef enum { RDZV_WHY_RESTARTS, RDZV_WHY_SIZE_DECIDES, RDZV_WHY_ENDS } rdzv_why_outcome_t;
rdzv_why_outcome_t rdzv_why_outcome(const rdzv_why_t *w, int max_restarts, bool is_multi);

/* The record as JSON into out; returns its length, or -1 if it does not fit. */
int rdzv_record_node_format(const rdzv_node_record_t *n, char *out, size_t out_len);
int rdzv_record_why_format(const rdzv_why_t *w, char *out, size_t out_len);
int rdzv_record_rank_format(const rdzv_rank_record_t *r, char *out, size_t out_len);
/* Parse n_bytes of text (not NUL-terminated). Every field must be there with its type and range;
 * returns false otherwise (out then unspecified). A node or rank record's addresses ("store";
 * a node's "peer", a rank's "next_peer") may be absent (their host empty); when there, each is
 * "HOST:PORT": HOST 1-255 printable ASCII characters other
 * than space, '"' and '\\' (so that a record always fits RDZV_RECORD_MAX_BYTES), PORT 1-65535 in
 * decimal (the last ':' splits, so an IPv6 address needs no brackets). */
bool rdzv_record_node_parse(const char *text, size_t n_bytes, rdzv_node_record_t *out);
bool rdzv_record_why_parse(const char *text, size_t n_bytes, rdzv_why_t *out);
/* Either the four numbers (error empty) or an error text (printable ASCII, cut to fit) and
 * whether it is a lost member. */
bool rdzv_record_rank_parse(const char *text, size_t n_bytes, rdzv_rank_record_t *out);
/* For people: "exit 75 on node 1 rank 3 (failure 2)", "a membership change", ... */
void rdzv_record_why_describe(const rdzv_why_t *w, char *out, size_t out_len);

#endif
