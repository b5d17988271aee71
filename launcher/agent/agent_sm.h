/* agent_sm: the agent's rounds as a state machine. Pure: no I/O, no libuv, no clock, no
 * allocation; agent_sm_step only changes *sm and fills the action list. agent.c runs the libuv
 * work, turns its callbacks into events, and carries out the returned actions in order.
 *
 * Owns every decision of the agent: when a round has ended, whether the job restarts (the restart
 * budget, permanent exit codes, membership changes, a lost node's refund), finishes (the exit
 * barrier) or gives up, with which exit code, and what the user is told. Does not own how a
 * heartbeat is judged stale (agent.c's clock), nor the store, files or processes.
 * docs/architecture.md ("The agent") has the table of states, events and transitions. */
#ifndef DDP_LAUNCHER_AGENT_SM_H
#define DDP_LAUNCHER_AGENT_SM_H

#include <stdbool.h>

#include "rdzv/rdzv_record.h"

typedef enum {
    AGENT_SM_IDLE,      /* before AGENT_EV_START */
    AGENT_SM_JOINING,   /* several nodes: the join of round .round is in flight */
    AGENT_SM_STARTING,  /* START_WORKERS is being carried out: START_OK or START_FAILED is next */
    AGENT_SM_RUNNING,   /* this node's workers run and nothing has ended the round yet */
    AGENT_SM_SPARE,     /* joined after the round closed: waits for the round's end */
    AGENT_SM_STOPPING,  /* the round ended here (a failure, the restart key, a signal): waits for
                           the workers, a report in flight and (a local failure on several nodes)
                           the restart key, then decides */
    AGENT_SM_FINISHING, /* success on several nodes: in the exit barrier */
    AGENT_SM_DONE,      /* exit_code is final; every later event is ignored */
} agent_sm_state_t;

typedef enum {
    AGENT_EV_START,         /* begin round 0 */
    AGENT_EV_JOIN_DONE,     /* rc, joined, is_refunded, text (the join's error) */
    AGENT_EV_START_OK,      /* START_WORKERS started every local worker */
    AGENT_EV_START_FAILED,  /* START_WORKERS failed; has_workers: a set exists (WORKERS_DONE
                               comes, maybe came already) */
    AGENT_EV_WORKER_EXITED, /* exit: one local worker ended (before its output is drained) */
    AGENT_EV_WORKERS_DONE,  /* every local worker ended and its output is drained */
    AGENT_EV_RESTART_SEEN,  /* the round's restart key: why (is_valid: it parsed), text; or
                               is_store_lost: the watch lost the store */
    AGENT_EV_STORE_SILENT,  /* the store took no heartbeat for --heartbeat timeout */
    AGENT_EV_PEER_SILENT,   /* node: a member's heartbeat counter stood still too long (judged by
                               a member, or by a spare waiting for the round's end) */
    AGENT_EV_SIGNAL,        /* signum: one of the signals ddprun forwards */
    AGENT_EV_REPORT_DONE,   /* the REPORT went out (or failed: agent.c logs it) */
    AGENT_EV_FINISH_DONE,   /* the exit barrier ended (or timed out: agent.c logs it) */
} agent_sm_event_kind_t;

/* A local worker's end, as the root cause remembers it. */
typedef struct {
    int rank, local_rank, pid;
    int exit_status; /* valid when term_signal == 0 */
    int term_signal;
} agent_sm_exit_t;

#define AGENT_SM_TEXT_BYTES 512

typedef struct {
    agent_sm_event_kind_t kind;
    int rc;               /* JOIN_DONE: 0 or negative */
    int signum;           /* SIGNAL */
    int node;             /* PEER_SILENT: the store: its group rank; etcd: its join index */
    bool has_workers;     /* START_FAILED */
    bool is_refunded;     /* JOIN_DONE: agent_sm_join_is_refund() held (and node 0 refunded) */
    rdzv_result_t joined; /* JOIN_DONE */
    agent_sm_exit_t exit; /* WORKER_EXITED */
    bool is_valid;        /* RESTART_SEEN: why was parsed from text */
    bool is_store_lost;   /* RESTART_SEEN: the watch lost the store; why and text are unused */
    rdzv_why_t why;       /* RESTART_SEEN */
    char text[AGENT_SM_TEXT_BYTES]; /* RESTART_SEEN: the key's value; JOIN_DONE: the error */
} agent_sm_event_t;

/* What a join needs to tell a lost node from a failure (agent_sm_join_is_refund). */
typedef struct {
    int round;
    int last_round_nodes;  /* members of the round that ended last; 0: none, or we were a spare */
    int last_restart_code; /* why it ended */
    int failures;          /* restarts used so far */
} agent_sm_join_plan_t;

typedef enum {
    AGENT_SAY_INFO,  /* LOG_INFO */
    AGENT_SAY_WARN,  /* LOG_WARN */
    AGENT_SAY_PLAIN, /* "ddprun: TEXT" on stderr: the end-of-job summary */
} agent_sm_say_t;

typedef enum {
    AGENT_ACT_SAY,               /* say, text */
    AGENT_ACT_PRINT_ROOT_CAUSE,  /* root, round: the summary with the worker's last lines */
    AGENT_ACT_JOIN,              /* plan: join round plan.round on the thread pool */
    AGENT_ACT_INTERRUPT_JOIN,    /* end the join in flight early (a signal) */
    AGENT_ACT_INTERRUPT_BARRIER, /* end the exit barrier early (a failure elsewhere) */
    AGENT_ACT_WATCH,             /* round: WAIT on round.round's restart key */
    AGENT_ACT_START_HEARTBEATS,  /* round: beat and judge the members (a spare: judge only) */
    AGENT_ACT_STOP_HEARTBEATS,   /* no beats between rounds */
    AGENT_ACT_START_WORKERS,     /* round, restart_count; agent.c answers START_OK/START_FAILED */
    AGENT_ACT_STOP_WORKERS,      /* signum to the local workers, SIGKILL after timeout_s */
    AGENT_ACT_DESTROY_WORKERS,   /* free the ended set */
    AGENT_ACT_REPORT,            /* round, why: set round.round's restart key */
    AGENT_ACT_BARRIER,           /* round: the exit barrier of round.round's members */
    AGENT_ACT_BARRIER_LOST,      /* round, code: count member #code (lost) done in the barrier */
    AGENT_ACT_EXIT,              /* code: the agent's exit status; close everything */
} agent_sm_action_kind_t;

typedef struct {
    agent_sm_action_kind_t kind;
    agent_sm_say_t say;
    int signum;
    double timeout_s;
    int code;
    int restart_count;   /* TORCHELASTIC_RESTART_COUNT: restarts used */
    rdzv_result_t round; /* the round the action is about (a copy) */
    rdzv_why_t why;
    agent_sm_join_plan_t plan;
    agent_sm_exit_t root;
    char text[AGENT_SM_TEXT_BYTES];
} agent_sm_action_t;

#define AGENT_SM_MAX_ACTIONS 16

typedef struct {
    int n;
    agent_sm_action_t a[AGENT_SM_MAX_ACTIONS];
} agent_sm_actions_t;

typedef struct {
    bool is_multi; /* several nodes: rendezvous, watch, reports, exit barrier */
    int nproc_per_node;
    int max_nodes;             /* --nnodes MAX: room for a node that arrives late */
    int max_restarts;          /* the job's restart budget */
    double shutdown_timeout_s; /* grace between the stop signal and SIGKILL */
} agent_sm_config_t;

typedef struct {
    agent_sm_config_t cfg;
    agent_sm_state_t state;
    rdzv_result_t round; /* the current round's membership; .round is the attempt */
    int failures;        /* restarts used by the job (one node counts itself) */
    int last_round_nodes, last_restart_code; /* the round that ended last (join plan) */
    bool is_budget_pending;  /* a peer failure past the budget: the next round's size decides */
    bool has_workers;        /* a worker set exists (started, not yet destroyed) */
    bool is_workers_done;    /* ... and every worker in it ended */
    bool is_reporting;       /* a REPORT is in flight */
    bool is_judging_members; /* a spare of a full job: it judges the members' heartbeats */
    /* what ended the round; more than one may hold, the signal first, then the key */
    bool has_failure; /* a local worker failed (root_cause) or could not start */
    agent_sm_exit_t root_cause;
    /* several nodes: the root cause so far is a consequence (75, a SIGTERM's end); its report
     * waits for a telling local failure or the workers' end */
    bool is_report_deferred;
    bool has_restart; /* the restart key was seen (restart, restart_text) */
    rdzv_why_t restart;
    char restart_text[256];    /* the last key seen, kept across the join that follows it */
    int stop_signal;           /* the first forwarded signal, 0 if none */
    int barrier_lost;          /* FINISHING: the lost member last counted done for, -1 none */
    bool is_barrier_abandoned; /* FINISHING: the store went silent, the barrier was ended */
    int exit_code;             /* DONE */
} agent_sm_t;

/* Set up in IDLE. */
void agent_sm_init(agent_sm_t *sm, const agent_sm_config_t *cfg);
/* Apply one event: changes *sm and writes to *out (out->n >= 0) what agent.c must do, in order.
 * Events that cannot change anything in the current state are ignored (out->n == 0). */
void agent_sm_step(agent_sm_t *sm, const agent_sm_event_t *ev, agent_sm_actions_t *out);
/* Whether a heartbeat taken for `round` is to be judged now (STORE_SILENT, PEER_SILENT): it is
 * the current round, nothing has ended it, and this node is a member whose round runs or is in
 * its exit barrier, or a spare that waits for the round's end (it reads the members' heartbeats
 * without beating: a closed round whose members all died ends only through a spare). */
bool agent_sm_is_beating(const agent_sm_t *sm, int round);
/* Whether the store's silence, seen by a heartbeat taken for `round`, is still to be judged
 * (STORE_SILENT): as agent_sm_is_beating, and also after a local failure, when the agent waits on
 * the store for the round's end (a store whose host vanished without a FIN would otherwise keep
 * it waiting forever). */
bool agent_sm_needs_store(const agent_sm_t *sm, int round);
/* Whether a report of round that failed must go again: while the store is needed, and for a
 * spare that asked for a new round (nobody else will: the members' round runs on, and the spare
 * would wait on its restart key for good). */
bool agent_sm_report_is_wanted(const agent_sm_t *sm, int round);
/* Whether a join's result shows that the last restart was a lost node: a 'peer failure' whose
 * next round has a node fewer. Pure; agent.c calls it on the join thread, where node 0 then
 * gives the restart back in the store. */
bool agent_sm_join_is_refund(const agent_sm_join_plan_t *plan, const rdzv_result_t *joined);
const char *agent_sm_state_name(agent_sm_state_t s);
const char *agent_sm_event_name(agent_sm_event_kind_t k);

#endif
