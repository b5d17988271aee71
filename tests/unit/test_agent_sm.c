/* Unit tests of launcher/agent/agent_sm: the agent's rounds driven by events alone, no processes,
 * no store. One node and several: success, restarts within the budget and past it, permanent exit
 * codes, membership changes, a lost node's refund, heartbeats, signals while joining, running,
 * reporting and in the exit barrier, start failures, spares. Each test checks the actions and
 * their order, which is what agent.c carries out. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "agent/agent_sm.h"
#include "exit_codes.h"

static agent_sm_t sm;
static agent_sm_actions_t acts;

#define END (-1)

static void setup(bool is_multi, int max_restarts, int max_nodes) {
    agent_sm_config_t cfg = {.is_multi = is_multi,
                             .nproc_per_node = 2,
                             .max_nodes = max_nodes,
                             .max_restarts = max_restarts,
                             .shutdown_timeout_s = 30};
    agent_sm_init(&sm, &cfg);
}

static void step(agent_sm_event_t ev) {
    agent_sm_step(&sm, &ev, &acts);
}

#define EV(...) step((agent_sm_event_t){__VA_ARGS__})

/* The actions of the last step are exactly these kinds, in this order (END-terminated). */
static void expect(int first, ...) {
    va_list ap;
    va_start(ap, first);
    int i = 0;
    for (int k = first; k != END; k = va_arg(ap, int), i++) {
        cr_assert_lt(i, acts.n, "action %d missing: want kind %d, got %d actions", i, k, acts.n);
        cr_assert_eq((int)acts.a[i].kind, k, "action %d: kind %d, want %d", i, (int)acts.a[i].kind,
                     k);
    }
    va_end(ap);
    cr_assert_eq(acts.n, i, "%d actions, want %d", acts.n, i);
}

static const agent_sm_action_t *find(agent_sm_action_kind_t kind) {
    for (int i = 0; i < acts.n; i++)
        if (acts.a[i].kind == kind) return &acts.a[i];
    return NULL;
}

static const agent_sm_action_t *must_find(agent_sm_action_kind_t kind) {
    const agent_sm_action_t *a = find(kind);
    cr_assert_not_null(a, "no action of kind %d", (int)kind);
    return a;
}

static bool said(const char *text) {
    for (int i = 0; i < acts.n; i++)
        if (acts.a[i].kind == AGENT_ACT_SAY && strstr(acts.a[i].text, text)) return true;
    return false;
}

static void expect_state(agent_sm_state_t s) {
    cr_assert_eq(sm.state, s, "state %s, want %s", agent_sm_state_name(sm.state),
                 agent_sm_state_name(s));
}

static void expect_exit(int code) {
    cr_assert_eq(must_find(AGENT_ACT_EXIT)->code, code);
    cr_assert_eq(acts.a[acts.n - 1].kind, AGENT_ACT_EXIT, "EXIT comes last");
    expect_state(AGENT_SM_DONE);
    cr_assert_eq(sm.exit_code, code);
}

static void worker_exits(int rank, int status, int sig) {
    EV(.kind = AGENT_EV_WORKER_EXITED, .exit = {.rank = rank,
                                                .local_rank = rank % 2,
                                                .pid = 1000 + rank,
                                                .exit_status = status,
                                                .term_signal = sig});
}

static void key_seen(int code, int permanent, int failures, int node, int rank) {
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN,
                           .is_valid = true,
                           .why = {.code = code,
                                   .is_permanent = permanent,
                                   .failures = failures,
                                   .node = node,
                                   .rank = rank}};
    snprintf(ev.text, sizeof ev.text, "code=%d permanent=%d failures=%d node=%d rank=%d", code,
             permanent, failures, node, rank);
    step(ev);
}

/* One node: START, START_OK. */
static void start_one_node(void) {
    EV(.kind = AGENT_EV_START);
    expect(AGENT_ACT_START_WORKERS, END);
    EV(.kind = AGENT_EV_START_OK);
    expect(END);
    expect_state(AGENT_SM_RUNNING);
}

/* Several nodes: the join of the current round answers with this membership. */
static void joined(int group_rank, int n_nodes, bool is_member) {
    EV(.kind = AGENT_EV_JOIN_DONE, .joined = {.round = sm.round.round,
                                              .group_rank = group_rank,
                                              .group_world_size = n_nodes,
                                              .rank_offset = 2 * group_rank,
                                              .world_size = 2 * n_nodes,
                                              .is_member = is_member});
}

static void join_and_run(int group_rank, int n_nodes) {
    joined(group_rank, n_nodes, true);
    expect_state(AGENT_SM_STARTING);
    EV(.kind = AGENT_EV_START_OK);
    expect(END);
    expect_state(AGENT_SM_RUNNING);
}

static void start_several(int group_rank, int n_nodes) {
    EV(.kind = AGENT_EV_START);
    expect(AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN, END);
    expect_state(AGENT_SM_JOINING);
    join_and_run(group_rank, n_nodes);
}

/* ---- one node ----------------------------------------------------------------------------- */

Test(agent_sm_one_node, success) {
    setup(false, 3, 1);
    EV(.kind = AGENT_EV_START);
    expect(AGENT_ACT_START_WORKERS, END);
    expect_state(AGENT_SM_STARTING);
    cr_assert_eq(acts.a[0].round.round, 0);
    cr_assert_eq(acts.a[0].round.world_size, 2);
    cr_assert_eq(acts.a[0].restart_count, 0);
    EV(.kind = AGENT_EV_START_OK);
    expect(END);
    worker_exits(0, 0, 0);
    expect(END);
    worker_exits(1, 0, 0);
    expect(END);
    expect_state(AGENT_SM_RUNNING);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    expect_exit(0);
}

Test(agent_sm_one_node, restarts_within_budget_then_gives_up) {
    setup(false, 2, 1);
    start_one_node();
    for (int attempt = 0; attempt < 3; attempt++) {
        worker_exits(1, 5, 0);
        expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
        cr_assert(said("worker rank 1 (pid 1001) exited with 5; stopping every worker"));
        cr_assert_eq(acts.a[1].signum, SIGTERM);
        cr_assert_eq(acts.a[1].timeout_s, 30);
        expect_state(AGENT_SM_STOPPING);
        worker_exits(0, 143 - 128, SIGTERM); /* the others, stopped: not the root cause */
        expect(END);
        cr_assert_eq(sm.root_cause.rank, 1);
        EV(.kind = AGENT_EV_WORKERS_DONE);
        if (attempt == 2) break;
        expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_START_WORKERS, END);
        char want[64];
        snprintf(want, sizeof want, "restarting every worker (restart %d of 2)", attempt + 1);
        cr_assert(said(want), "%s", acts.a[0].text);
        cr_assert_eq(acts.a[2].round.round, attempt + 1);
        cr_assert_eq(acts.a[2].restart_count, attempt + 1, "TORCHELASTIC_RESTART_COUNT");
        EV(.kind = AGENT_EV_START_OK);
    }
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    cr_assert_eq(acts.a[0].root.rank, 1);
    cr_assert_eq(acts.a[0].root.exit_status, 5);
    cr_assert_eq(acts.a[0].round.round, 2, "the root cause names the last attempt");
    expect_exit(5);
}

Test(agent_sm_one_node, permanent_exit_is_not_retried) {
    setup(false, 3, 1);
    start_one_node();
    worker_exits(0, DDP_EXIT_CONFIG, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT,
           END);
    cr_assert(said("exit 78 is not retried"));
    expect_exit(DDP_EXIT_CONFIG);
}

/* Workers are reaped in spawn order: rank 0's exit 75 (its peer went first) may be seen before
 * rank 1's permanent 65 that caused it. The permanent one is the root cause, and is not retried. */
Test(agent_sm_one_node, the_root_cause_is_the_most_telling_failure_not_the_first_reaped) {
    setup(false, 3, 1);
    start_one_node();
    worker_exits(0, DDP_EXIT_PEER_FAILURE, 0);
    worker_exits(2, 128 + SIGTERM, 0); /* stopped by this agent: no cause */
    cr_assert_eq(sm.root_cause.rank, 0);
    worker_exits(1, DDP_EXIT_DATA, 0);
    cr_assert(said("worker rank 1 (pid 1001) exited with 65: the root cause rather than rank 0"));
    worker_exits(3, 0, SIGTERM);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    cr_assert_eq(must_find(AGENT_ACT_PRINT_ROOT_CAUSE)->root.rank, 1);
    cr_assert(said("exit 65 is not retried"));
    expect_exit(DDP_EXIT_DATA);
}

Test(agent_sm_one_node, killed_worker_is_128_plus_signal) {
    setup(false, 0, 1);
    start_one_node();
    worker_exits(1, 0, SIGKILL);
    cr_assert(said("worker rank 1 (pid 1001) was killed by signal 9"));
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    expect_exit(128 + SIGKILL);
}

Test(agent_sm_one_node, signal_is_forwarded_then_sigkill_on_the_second) {
    setup(false, 3, 1);
    start_one_node();
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    cr_assert(said("received: forwarding it to the workers, SIGKILL after 30 s"));
    cr_assert_eq(acts.a[1].signum, SIGTERM);
    expect_state(AGENT_SM_STOPPING);
    worker_exits(0, 0, SIGTERM);
    expect(END);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGINT);
    expect(AGENT_ACT_STOP_WORKERS, END);
    cr_assert_eq(acts.a[0].signum, SIGKILL);
    cr_assert_eq(acts.a[0].timeout_s, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    expect_exit(128 + SIGTERM);
}

Test(agent_sm_one_node, start_failure_never_reports_success) {
    setup(false, 3, 1);
    EV(.kind = AGENT_EV_START);
    /* the failed start ended its set before it returned: WORKERS_DONE comes first */
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END);
    expect_state(AGENT_SM_STARTING);
    EV(.kind = AGENT_EV_START_FAILED, .has_workers = true);
    expect(AGENT_ACT_EXIT, END);
    expect_exit(DDP_EXIT_EXEC_FAILED);
    worker_exits(1, 0, SIGKILL); /* the ones it started, killed */
    expect(END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END);
}

Test(agent_sm_one_node, restart_that_cannot_start) {
    setup(false, 3, 1);
    start_one_node();
    worker_exits(0, 1, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_START_WORKERS, END);
    EV(.kind = AGENT_EV_START_FAILED, .has_workers = false);
    expect(AGENT_ACT_EXIT, END);
    expect_exit(DDP_EXIT_EXEC_FAILED);
}

/* ---- several nodes: the round --------------------------------------------------------------- */

Test(agent_sm_nodes, success_goes_through_the_exit_barrier) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    expect(AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN, END);
    cr_assert_eq(acts.a[1].plan.round, 0);
    cr_assert_eq(acts.a[1].plan.last_round_nodes, 0);
    cr_assert_not(agent_sm_is_beating(&sm, 0), "no beats while joining");
    joined(1, 2, true);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS, AGENT_ACT_START_WORKERS,
           END);
    cr_assert(said("round 0: node 1 of 2, ranks 2-3 of 4"), "%s", acts.a[1].text);
    cr_assert_eq(acts.a[0].round.round, 0);
    cr_assert_eq(acts.a[3].round.rank_offset, 2);
    EV(.kind = AGENT_EV_START_OK);
    expect_state(AGENT_SM_RUNNING);
    cr_assert(agent_sm_is_beating(&sm, 0));
    cr_assert_not(agent_sm_is_beating(&sm, 1), "a beat for another round");
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_BARRIER, END);
    cr_assert_eq(acts.a[1].round.group_world_size, 2);
    expect_state(AGENT_SM_FINISHING);
    cr_assert(agent_sm_is_beating(&sm, 0), "beats go on in the exit barrier");
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect(AGENT_ACT_EXIT, END);
    expect_exit(0);
    cr_assert_not(agent_sm_is_beating(&sm, 0));
}

Test(agent_sm_nodes, one_node_of_several_has_no_heartbeats) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 1, true);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_WORKERS, END);
}

/* Several nodes: the first report sets the key every agent decides from. A peer failure (75) reaped
 * first is a consequence: its report waits, and the permanent cause reaped after it is reported. */
Test(agent_sm_nodes, a_consequence_reaped_first_does_not_hide_the_cause_from_the_key) {
    setup(true, 3, 2);
    start_several(1, 2);
    worker_exits(2, DDP_EXIT_PEER_FAILURE, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END); /* no report yet */
    worker_exits(3, DDP_EXIT_DATA, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[1].why.code, DDP_EXIT_DATA);
    cr_assert(acts.a[1].why.is_permanent);
    cr_assert_eq(acts.a[1].why.rank, 3);
}

/* ... and when no telling failure comes, the consequence is reported once the workers ended. */
Test(agent_sm_nodes, a_consequence_alone_is_reported_when_the_workers_ended) {
    setup(true, 3, 2);
    start_several(1, 2);
    worker_exits(2, DDP_EXIT_PEER_FAILURE, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    worker_exits(3, 0, SIGTERM); /* stopped by this agent */
    expect(END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[0].why.code, DDP_EXIT_PEER_FAILURE);
    cr_assert_not(acts.a[0].why.is_permanent);
}

Test(agent_sm_nodes, local_failure_waits_for_the_key_then_restarts) {
    setup(true, 3, 2);
    start_several(1, 2);
    worker_exits(3, 1, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, AGENT_ACT_REPORT, END);
    const agent_sm_action_t *r = &acts.a[2];
    cr_assert_eq(r->why.code, 1);
    cr_assert_not(r->why.is_permanent);
    cr_assert_eq(r->why.node, 1);
    cr_assert_eq(r->why.rank, 3);
    cr_assert_eq(r->round.round, 0);
    cr_assert_not(agent_sm_is_beating(&sm, 0), "a failed round is not judged by heartbeats");
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END); /* every agent decides from the key, this one too */
    expect_state(AGENT_SM_STOPPING);
    key_seen(1, 0, 1, 1, 3);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN,
           END);
    cr_assert(said("restarting every worker (restart 1 of 3)"));
    const agent_sm_join_plan_t *p = &acts.a[3].plan;
    cr_assert_eq(p->round, 1);
    cr_assert_eq(p->last_round_nodes, 2);
    cr_assert_eq(p->last_restart_code, 1);
    cr_assert_eq(p->failures, 1);
    joined(1, 2, true);
    cr_assert_eq(must_find(AGENT_ACT_START_WORKERS)->restart_count, 1);
    cr_assert_eq(must_find(AGENT_ACT_START_WORKERS)->round.round, 1);
}

Test(agent_sm_nodes, key_before_the_local_workers_end) {
    setup(true, 3, 2);
    start_several(0, 2);
    key_seen(9, 0, 1, 1, 2);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    cr_assert(said("round 0 ends (code=9 permanent=0 failures=1 node=1 rank=2): stopping local "
                   "workers"));
    expect_state(AGENT_SM_STOPPING);
    worker_exits(0, 0, SIGTERM); /* stopped by us: not a failure of this node */
    expect(END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN,
           END);
    cr_assert_eq(sm.failures, 1, "the budget is the store's count");
}

Test(agent_sm_nodes, permanent_failure_elsewhere) {
    setup(true, 3, 2);
    start_several(1, 2);
    key_seen(DDP_EXIT_CONFIG, 1, 1, 0, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    cr_assert(said("the job failed on another node (code=78 permanent=1"));
    cr_assert(said("exit 78 is not retried"));
    expect_exit(DDP_EXIT_CONFIG);
}

Test(agent_sm_nodes, local_root_cause_printed_with_the_key) {
    setup(true, 0, 2);
    start_several(0, 2);
    worker_exits(1, 5, 0);
    EV(.kind = AGENT_EV_REPORT_DONE);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    key_seen(5, 0, 1, 0, 1);
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    cr_assert_eq(acts.a[0].root.rank, 1);
    expect_exit(5);
}

Test(agent_sm_nodes, budget_used_up) {
    setup(true, 2, 2);
    start_several(1, 2);
    key_seen(1, 0, 3, 0, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    cr_assert(said("the job failed on another node (code=1"));
    expect_exit(1);
}

Test(agent_sm_nodes, membership_change_costs_no_restart) {
    setup(true, 3, 3);
    start_several(0, 2);
    key_seen(0, 0, 0, 2, -1); /* a node arrived and asked for a new round */
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN,
           END);
    cr_assert(said("membership changes: every node joins round 1"));
    cr_assert_eq(acts.a[3].plan.last_restart_code, 0);
    joined(0, 3, true);
    cr_assert_eq(must_find(AGENT_ACT_START_WORKERS)->restart_count, 0);
    cr_assert_eq(must_find(AGENT_ACT_START_WORKERS)->round.world_size, 6);
}

Test(agent_sm_nodes, malformed_key_is_a_permanent_peer_failure) {
    setup(true, 3, 2);
    start_several(1, 2);
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN, .is_valid = false};
    snprintf(ev.text, sizeof ev.text, "garbage");
    step(ev);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    cr_assert(said("the job failed on another node (garbage)"));
    expect_exit(DDP_EXIT_PEER_FAILURE);
}

Test(agent_sm_nodes, failure_key_during_the_exit_barrier_restarts_this_node_too) {
    /* this node's workers succeeded, another's failed: every worker restarts (the others could
     * not gather the next round without this node) */
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect_state(AGENT_SM_FINISHING);
    key_seen(1, 0, 1, 1, 2);
    expect(AGENT_ACT_INTERRUPT_BARRIER, END);
    expect_state(AGENT_SM_FINISHING);
    cr_assert_not(agent_sm_is_beating(&sm, 0));
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 1);
    expect(END); /* the exit barrier holds the store connection */
    EV(.kind = AGENT_EV_FINISH_DONE);
    cr_assert(said("restarting every worker (restart 1 of 3)"));
    cr_assert_not_null(find(AGENT_ACT_JOIN));
    cr_assert_null(find(AGENT_ACT_EXIT));
    expect_state(AGENT_SM_JOINING);
}

Test(agent_sm_nodes, failure_key_during_the_exit_barrier_past_the_budget_fails_here_too) {
    setup(true, 1, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    key_seen(3, 0, 2, 1, 2); /* the second failure, budget 1 */
    expect(AGENT_ACT_INTERRUPT_BARRIER, END);
    EV(.kind = AGENT_EV_FINISH_DONE);
    cr_assert(said("the job failed on another node"));
    expect_exit(3);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    expect(END); /* DONE ignores everything */
}

Test(agent_sm_nodes, membership_change_during_the_exit_barrier_is_no_rerun) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    key_seen(0, 0, 0, 1, -1);
    expect(END);
    cr_assert(agent_sm_is_beating(&sm, 0), "still a member of the round it finished");
    EV(.kind = AGENT_EV_RESTART_SEEN, .is_store_lost = true); /* the store host left */
    expect(END);
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect_exit(0);
}

Test(agent_sm_nodes, a_member_lost_in_the_exit_barrier_is_counted_done_once) {
    /* it never counts itself: without this every node would wait for the barrier's timeout */
    setup(true, 3, 3);
    start_several(0, 3);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect_state(AGENT_SM_FINISHING);
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 2);
    expect(AGENT_ACT_SAY, AGENT_ACT_BARRIER_LOST, END);
    cr_assert_eq(acts.a[1].code, 2);
    cr_assert_eq(acts.a[1].round.round, 0);
    cr_assert(said("was lost after this node's workers succeeded"));
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 2); /* judged again at the next beat */
    expect(END);
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 1); /* etcd: another lease gone */
    expect(AGENT_ACT_SAY, AGENT_ACT_BARRIER_LOST, END);
    cr_assert_eq(acts.a[1].code, 1);
    cr_assert_null(find(AGENT_ACT_REPORT), "a finished node reports nothing");
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect_exit(0);
}

/* The same store lost, noticed by the heartbeats instead of the watch: the same exit, and at once
 * (the barrier, waiting on a silent store, is ended), said once for the beats that keep failing. */
Test(agent_sm_nodes, silent_store_in_the_exit_barrier_is_no_failure) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect_state(AGENT_SM_FINISHING);
    EV(.kind = AGENT_EV_STORE_SILENT);
    expect(AGENT_ACT_SAY, AGENT_ACT_INTERRUPT_BARRIER, END);
    cr_assert(said("not every node confirmed the end of the job (its store is silent)"));
    EV(.kind = AGENT_EV_STORE_SILENT);
    expect(END);
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect_exit(0);
}

/* A failure key seen in the exit barrier interrupted it already: a silent store then says nothing
 * of success, and FINISH_DONE decides as after any failure key. */
Test(agent_sm_nodes, silent_store_after_a_failure_key_in_the_exit_barrier_says_nothing) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    key_seen(1, 0, 1, 1, 2);
    expect(AGENT_ACT_INTERRUPT_BARRIER, END);
    EV(.kind = AGENT_EV_STORE_SILENT);
    expect(END);
    cr_assert_not(said("its store is silent"));
}

Test(agent_sm_nodes, join_failure) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    agent_sm_event_t ev = {.kind = AGENT_EV_JOIN_DONE, .rc = -110};
    snprintf(ev.text, sizeof ev.text, "rendezvous timed out");
    step(ev);
    expect(AGENT_ACT_SAY, AGENT_ACT_EXIT, END);
    cr_assert_eq(acts.a[0].say, AGENT_SAY_PLAIN);
    cr_assert_str_eq(acts.a[0].text, "rendezvous timed out");
    expect_exit(1);
}

/* ---- several nodes: a lost node and the budget ---------------------------------------------- */

Test(agent_sm_lost_node, refund_when_the_next_round_is_smaller) {
    setup(true, 3, 3);
    start_several(0, 3);
    key_seen(DDP_EXIT_PEER_FAILURE, 0, 1, 1, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    const agent_sm_join_plan_t plan = must_find(AGENT_ACT_JOIN)->plan;
    cr_assert_eq(plan.last_round_nodes, 3);
    cr_assert_eq(plan.last_restart_code, DDP_EXIT_PEER_FAILURE);
    rdzv_result_t smaller = {.round = 1, .group_world_size = 2, .is_member = true};
    rdzv_result_t same = {.round = 1, .group_world_size = 3, .is_member = true};
    cr_assert(agent_sm_join_is_refund(&plan, &smaller));
    cr_assert_not(agent_sm_join_is_refund(&plan, &same));
    EV(.kind = AGENT_EV_JOIN_DONE, .joined = smaller, .is_refunded = true);
    expect(AGENT_ACT_SAY, AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS,
           AGENT_ACT_START_WORKERS, END);
    cr_assert(said("round 1 has a node fewer"), "%s", acts.a[0].text);
    cr_assert(said("(0 of 3 used)"), "%s", acts.a[0].text);
    cr_assert_eq(sm.failures, 0);
    cr_assert_eq(acts.a[4].restart_count, 0, "TORCHELASTIC_RESTART_COUNT: restarts used");
}

Test(agent_sm_lost_node, refund_rules) {
    agent_sm_join_plan_t p = {.round = 1,
                              .last_round_nodes = 3,
                              .last_restart_code = DDP_EXIT_PEER_FAILURE,
                              .failures = 1};
    rdzv_result_t j = {.round = 1, .group_world_size = 2, .is_member = true};
    cr_assert(agent_sm_join_is_refund(&p, &j));
    agent_sm_join_plan_t q = p;
    q.last_restart_code = 1;
    cr_assert_not(agent_sm_join_is_refund(&q, &j), "only a peer failure can be a lost node");
    q = p;
    q.failures = 0;
    cr_assert_not(agent_sm_join_is_refund(&q, &j), "nothing to give back");
    q = p;
    q.last_round_nodes = 0;
    cr_assert_not(agent_sm_join_is_refund(&q, &j), "a spare's last round is not a round it ran");
    rdzv_result_t spare = j;
    spare.is_member = false;
    cr_assert_not(agent_sm_join_is_refund(&p, &spare));
}

Test(agent_sm_lost_node, past_the_budget_the_next_round_decides) {
    setup(true, 1, 3);
    start_several(0, 3);
    key_seen(DDP_EXIT_PEER_FAILURE, 0, 2, 1, 2); /* past --max-restarts 1 */
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN,
           END);
    cr_assert(sm.is_budget_pending);
    cr_assert(
        said("a peer failure past the restart budget (2 of 1): the next round's size decides"),
        "%s", acts.a[0].text);
    cr_assert_not(said("restarting every worker"), "no restart is promised past the budget");
    EV(.kind = AGENT_EV_JOIN_DONE, .joined = {.round = 1, .group_world_size = 2, .is_member = true},
       .is_refunded = true);
    cr_assert(said("has a node fewer"));
    cr_assert_not_null(find(AGENT_ACT_START_WORKERS), "a lost node: the job goes on");
    cr_assert_eq(sm.failures, 1);
    cr_assert_not(sm.is_budget_pending);
}

/* A spare of a full 3-node job: the members' restart record says how many the ended round had,
 * so the spare judges the next round's size as they do (it took the job for failed: "no node was
 * lost, restarts used up", exit 75, while the members refunded and went on without it). */
Test(agent_sm_lost_node, a_spare_judges_the_refund_from_the_ended_rounds_size) {
    setup(true, 0, 3);
    EV(.kind = AGENT_EV_START);
    joined(0, 3, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS, END);
    agent_sm_event_t ev = {
        .kind = AGENT_EV_RESTART_SEEN,
        .is_valid = true,
        .why = {.code = DDP_EXIT_PEER_FAILURE, .failures = 1, .node = 0, .rank = 0, .nodes = 3}};
    step(ev);
    const agent_sm_action_t *join = must_find(AGENT_ACT_JOIN);
    cr_assert_eq(join->plan.last_round_nodes, 3, "the ended round's size, from the record");
    cr_assert(agent_sm_join_is_refund(
        &join->plan, &(rdzv_result_t){.round = 1, .group_world_size = 2, .is_member = true}));
}

Test(agent_sm_lost_node, past_the_budget_with_no_node_lost) {
    setup(true, 1, 3);
    start_several(0, 3);
    key_seen(DDP_EXIT_PEER_FAILURE, 0, 2, 1, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    EV(.kind = AGENT_EV_JOIN_DONE,
       .joined = {.round = 1, .group_world_size = 3, .is_member = true});
    expect(AGENT_ACT_SAY, AGENT_ACT_EXIT, END);
    cr_assert(said("the job failed (code=75 permanent=0 failures=2 node=1 rank=2), no node was "
                   "lost, and its restarts (--max-restarts 1) are used up"),
              "%s", acts.a[0].text);
    expect_exit(DDP_EXIT_PEER_FAILURE);
}

/* ---- heartbeats ----------------------------------------------------------------------------- */

Test(agent_sm_heartbeats, silent_peer_ends_the_round_as_a_membership_change) {
    setup(true, 3, 3);
    start_several(0, 3);
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 2);
    expect(AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[0].why.code, 0);
    cr_assert_eq(acts.a[0].why.rank, -1);
    expect_state(AGENT_SM_RUNNING); /* the key, seen by every agent, ends the round */
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 2);
    expect(END); /* one report at a time */
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END);
    key_seen(0, 0, 0, 0, -1);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    cr_assert(said("membership changes: every node joins round 1"));
}

Test(agent_sm_heartbeats, failure_while_a_membership_change_is_reported) {
    setup(true, 3, 3);
    start_several(0, 3);
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 2);
    worker_exits(1, 1, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END); /* rides on the report in flight */
    EV(.kind = AGENT_EV_REPORT_DONE);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END);
    key_seen(0, 0, 0, 0, -1);
    cr_assert(said("membership changes"));
}

Test(agent_sm_heartbeats, silent_store_leaves_the_job) {
    setup(true, 3, 2);
    start_several(1, 2);
    EV(.kind = AGENT_EV_STORE_SILENT);
    expect(AGENT_ACT_STOP_WORKERS, END);
    expect_state(AGENT_SM_STOPPING);
    cr_assert_not(agent_sm_is_beating(&sm, 0));
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_SAY, AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    cr_assert(
        said("the job failed on another node (exit 75, failure 1 of the job, not retryable)"));
    expect_exit(DDP_EXIT_PEER_FAILURE);
}

/* After a local failure the agent waits on the store for the round's end: the heartbeats no
 * longer judge the peers, but a silent store still ends the wait (a store host that vanished
 * without a FIN leaves the restart watch reconnecting forever). */
Test(agent_sm_heartbeats, silent_store_after_a_local_failure_leaves_the_job) {
    setup(true, 3, 2);
    start_several(1, 2);
    worker_exits(3, 1, 0);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, AGENT_ACT_REPORT, END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END);
    cr_assert_not(agent_sm_is_beating(&sm, 0));
    cr_assert(agent_sm_needs_store(&sm, 0), "waiting on the store for the key");
    cr_assert_not(agent_sm_needs_store(&sm, 1), "another round's beat");
    EV(.kind = AGENT_EV_STORE_SILENT);
    cr_assert_not(agent_sm_needs_store(&sm, 0));
    EV(.kind = AGENT_EV_REPORT_DONE); /* the report in flight fails too, in its time */
    cr_assert(said("exit 75 is not retried"));
    expect_exit(DDP_EXIT_PEER_FAILURE);
}

Test(agent_sm_heartbeats, watch_that_loses_the_store) {
    setup(true, 3, 2);
    start_several(1, 2);
    EV(.kind = AGENT_EV_RESTART_SEEN, .is_store_lost = true);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END);
    cr_assert(said("round 0 ends (exit 75, failure 1 of the job, not retryable)"));
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect_exit(DDP_EXIT_PEER_FAILURE);
}

/* ---- signals -------------------------------------------------------------------------------- */

Test(agent_sm_signals, during_join) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    /* no workers: at once, without waiting for the join (its connect may retry for minutes) */
    expect(AGENT_ACT_SAY, AGENT_ACT_INTERRUPT_JOIN, AGENT_ACT_EXIT, END);
    cr_assert(said("Terminated received while joining a round: leaving"), "%s", acts.a[0].text);
    expect_exit(128 + SIGTERM);
    joined(0, 2, true); /* whatever the join brought */
    expect(END);
}

Test(agent_sm_signals, during_run) {
    setup(true, 3, 2);
    start_several(1, 2);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGINT);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[1].signum, SIGINT);
    cr_assert_eq(acts.a[2].why.code, 128 + SIGINT);
    cr_assert(acts.a[2].why.is_permanent);
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END);
    key_seen(128 + SIGINT, 1, 0, 1, 0);
    expect(END); /* already stopping */
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    expect_exit(128 + SIGINT);
}

Test(agent_sm_signals, during_report_of_a_failure) {
    setup(true, 3, 2);
    start_several(0, 2);
    worker_exits(1, 1, 0);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_WORKERS, END); /* the failure's report is in flight */
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(END);
    EV(.kind = AGENT_EV_REPORT_DONE);
    /* a signal does not wait for the key; the local failure is still named */
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT, END);
    expect_exit(128 + SIGTERM);
}

Test(agent_sm_signals, during_the_exit_barrier) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    /* at once, not after the others: this node's workers succeeded and it counted itself done */
    expect(AGENT_ACT_SAY, AGENT_ACT_INTERRUPT_BARRIER, AGENT_ACT_EXIT, END);
    expect_exit(0);
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect(END);
}

Test(agent_sm_signals, during_the_exit_barrier_after_a_failure_elsewhere) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    key_seen(1, 0, 1, 1, 2); /* its workers would run again */
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGINT);
    expect(AGENT_ACT_SAY, AGENT_ACT_INTERRUPT_BARRIER, AGENT_ACT_EXIT, END);
    expect_exit(128 + SIGINT);
}

Test(agent_sm_signals, while_stopping_after_a_failure_whose_workers_ended) {
    setup(true, 3, 2);
    start_several(0, 2);
    worker_exits(1, 1, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END); /* waits for the key */
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    /* the report (a lost compare-set if the key is there) goes out alone */
    expect(AGENT_ACT_SAY, AGENT_ACT_REPORT, AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_DESTROY_WORKERS,
           AGENT_ACT_EXIT, END);
    cr_assert(said("Terminated received while no worker runs: leaving"));
    expect_exit(128 + SIGTERM);
}

Test(agent_sm_signals, while_a_spare) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS,
           END); /* no room: no report */
    EV(.kind = AGENT_EV_SIGNAL, .signum = SIGTERM);
    /* no report: the members' round runs on (a 143 report ended every node's job) */
    expect(AGENT_ACT_SAY, AGENT_ACT_EXIT, END);
    cr_assert(said("Terminated received while waiting for the next round: leaving"));
    expect_exit(128 + SIGTERM);
}

/* A spare of a job with room asks for a new round: if that report fails it must go again
 * (agent.c asks), or nobody ends the round and the spare waits for good; a spare of a full job
 * or one whose round ended has nothing to send. */
Test(agent_sm_signals, a_spares_request_for_a_new_round_is_sent_again) {
    setup(true, 3, 3);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_REPORT, END);
    cr_assert(agent_sm_report_is_wanted(&sm, 0), "the spare's report is wanted until it is taken");
    cr_assert_not(agent_sm_report_is_wanted(&sm, 1), "not another round's");
    key_seen(0, 0, 0, -1, -1);
    cr_assert_not(agent_sm_report_is_wanted(&sm, 0), "the round ended: nothing to send");
}

Test(agent_sm_signals, a_spare_leaves_with_0_when_the_job_finished) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS, END);
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN,
                           .is_valid = true,
                           .why = {.node = -1, .rank = -1, .is_finished = true}};
    snprintf(ev.text, sizeof ev.text, "the job finished");
    step(ev);
    /* not a membership change: no next round, which would run the program again */
    cr_assert_null(find(AGENT_ACT_JOIN));
    cr_assert(said("the job finished in round 0 without this node: leaving"));
    expect_exit(0);
}

/* A member judged lost (frozen in the exit barrier) wakes up, its worker fails, and its report
 * finds the job finished: no next round (it ran the program again alone, or waited out
 * join_timeout); the failure is its exit code. */
Test(agent_sm_nodes, a_failure_after_the_job_finished_starts_no_round) {
    setup(true, 3, 2);
    start_several(0, 2);
    worker_exits(0, 1, 0);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    EV(.kind = AGENT_EV_REPORT_DONE);
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN,
                           .is_valid = true,
                           .why = {.node = -1, .rank = -1, .is_finished = true}};
    step(ev);
    cr_assert_null(find(AGENT_ACT_JOIN), "a round after the job's end");
    cr_assert(said("the job finished in round 0 without this node"));
    must_find(AGENT_ACT_PRINT_ROOT_CAUSE);
    expect_exit(1);
}

Test(agent_sm_nodes, the_end_of_the_job_seen_in_the_exit_barrier_is_no_rerun) {
    setup(true, 3, 2);
    start_several(0, 2);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect(AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_BARRIER, END);
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN,
                           .is_valid = true,
                           .why = {.node = -1, .rank = -1, .is_finished = true}};
    step(ev);
    expect(END); /* the barrier decides */
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect(AGENT_ACT_EXIT, END);
    expect_exit(0);
}

/* ---- start failures, spares ----------------------------------------------------------------- */

Test(agent_sm_start, failure_on_several_nodes_is_reported_and_permanent) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(1, 2, true);
    EV(.kind = AGENT_EV_WORKERS_DONE); /* the failed start ended its set first */
    expect(END);
    EV(.kind = AGENT_EV_START_FAILED, .has_workers = true);
    expect(AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[0].why.code, DDP_EXIT_EXEC_FAILED);
    cr_assert(acts.a[0].why.is_permanent);
    expect_state(AGENT_SM_STOPPING);
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END);
    cr_assert_null(find(AGENT_ACT_BARRIER));
    key_seen(DDP_EXIT_EXEC_FAILED, 1, 1, 1, 0);
    expect(AGENT_ACT_PRINT_ROOT_CAUSE, AGENT_ACT_SAY, AGENT_ACT_DESTROY_WORKERS, AGENT_ACT_EXIT,
           END);
    cr_assert_eq(acts.a[0].root.exit_status, DDP_EXIT_EXEC_FAILED);
    expect_exit(DDP_EXIT_EXEC_FAILED);
}

Test(agent_sm_start, failure_before_its_workers_end) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, true);
    EV(.kind = AGENT_EV_START_FAILED, .has_workers = true);
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END); /* the workers it started are still being stopped */
    key_seen(DDP_EXIT_EXEC_FAILED, 1, 1, 0, 0);
    expect(END);
    EV(.kind = AGENT_EV_WORKERS_DONE);
    expect_exit(DDP_EXIT_EXEC_FAILED);
}

Test(agent_sm_spare, asks_for_a_new_round_when_there_is_room) {
    setup(true, 3, 3);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_REPORT, END);
    cr_assert(said("round 0 runs with 2 nodes without this one; asking for a new round"));
    cr_assert_eq(acts.a[2].why.code, 0);
    expect_state(AGENT_SM_SPARE);
    cr_assert_not(agent_sm_is_beating(&sm, 0));
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END); /* a spare waits for the round's end */
    key_seen(0, 0, 0, 2, -1);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN, END);
    cr_assert(said("membership changes: every node joins round 1"));
    cr_assert_eq(acts.a[2].plan.last_round_nodes, 0, "a spare ran no round");
    joined(2, 3, true);
    cr_assert_not_null(find(AGENT_ACT_START_WORKERS));
}

Test(agent_sm_spare, waits_when_the_job_is_full) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    expect(AGENT_ACT_WATCH, AGENT_ACT_SAY, AGENT_ACT_START_HEARTBEATS, END);
    cr_assert(said("waiting for the next round"));
    cr_assert(agent_sm_is_beating(&sm, 0), "a waiting spare judges the members' heartbeats");
    key_seen(1, 0, 1, 0, 1); /* a member failed: everyone, the spare too, joins the next round */
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN, END);
    cr_assert(said("restarting every worker (restart 1 of 3)"));
}

Test(agent_sm_spare, members_gone_end_the_round_it_waits_for) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_START);
    joined(0, 2, false);
    EV(.kind = AGENT_EV_PEER_SILENT, .node = 1); /* its judgement of the members */
    expect(AGENT_ACT_REPORT, END);
    cr_assert_eq(acts.a[0].why.code, 0, "a membership change");
    cr_assert_eq(acts.a[0].why.node, -1, "a spare is no node of the round");
    EV(.kind = AGENT_EV_REPORT_DONE);
    expect(END);
    key_seen(0, 0, 0, -1, -1);
    expect(AGENT_ACT_SAY, AGENT_ACT_STOP_HEARTBEATS, AGENT_ACT_JOIN, END);
    cr_assert(said("membership changes: every node joins round 1"));
    cr_assert_eq(sm.failures, 0);
}

/* ---- odds and ends -------------------------------------------------------------------------- */

Test(agent_sm_misc, names) {
    cr_assert_str_eq(agent_sm_state_name(AGENT_SM_STOPPING), "STOPPING");
    cr_assert_str_eq(agent_sm_event_name(AGENT_EV_FINISH_DONE), "FINISH_DONE");
    cr_assert_str_eq(agent_sm_state_name((agent_sm_state_t)99), "?");
}

Test(agent_sm_misc, events_out_of_place_change_nothing) {
    setup(true, 3, 2);
    EV(.kind = AGENT_EV_FINISH_DONE);
    expect(END);
    EV(.kind = AGENT_EV_START_OK);
    expect(END);
    expect_state(AGENT_SM_IDLE);
    EV(.kind = AGENT_EV_START);
    EV(.kind = AGENT_EV_START);
    expect(END); /* one round 0 */
    expect_state(AGENT_SM_JOINING);
}
