/* agent_sm: the agent's rounds as a state machine (agent_sm.h). Pure: every function here only
 * reads its arguments and writes *sm and the action list; agent.c does the work. The messages
 * the user sees about a decision are written here, beside the decision. */
#include "agent/agent_sm.h"

#include <assert.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "exit_codes.h"

/* ---- building the action list ------------------------------------------------------------- */

static agent_sm_action_t *push(agent_sm_actions_t *out, agent_sm_action_kind_t kind) {
    assert(out->n < AGENT_SM_MAX_ACTIONS && "a step never needs more actions");
    agent_sm_action_t *a = &out->a[out->n++];
    memset(a, 0, sizeof *a);
    a->kind = kind;
    return a;
}

__attribute__((format(printf, 3, 4))) static void say(agent_sm_actions_t *out, agent_sm_say_t how,
                                                      const char *fmt, ...) {
    agent_sm_action_t *a = push(out, AGENT_ACT_SAY);
    a->say = how;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->text, sizeof a->text, fmt, ap);
    va_end(ap);
}

/* Only a set that exists is stopped (it may have ended already: stopping it then is harmless). */
static void stop_workers(const agent_sm_t *sm, agent_sm_actions_t *out, int signum,
                         double timeout_s) {
    if (!sm->has_workers) return;
    agent_sm_action_t *a = push(out, AGENT_ACT_STOP_WORKERS);
    a->signum = signum;
    a->timeout_s = timeout_s;
}

static void exit_with(agent_sm_t *sm, agent_sm_actions_t *out, int code) {
    sm->state = AGENT_SM_DONE;
    sm->exit_code = code;
    push(out, AGENT_ACT_EXIT)->code = code;
}

static int failure_code(const agent_sm_exit_t *r) {
    return r->term_signal ? 128 + r->term_signal : r->exit_status;
}

static bool failure_is_permanent(const agent_sm_exit_t *r) {
    return !r->term_signal && ddp_exit_is_permanent(r->exit_status);
}

/* The round ended for this node: RUNNING and SPARE wait in STOPPING; JOINING and FINISHING keep
 * their work in flight, which decides next. */
static void round_ended(agent_sm_t *sm) {
    if (sm->state == AGENT_SM_RUNNING || sm->state == AGENT_SM_SPARE) sm->state = AGENT_SM_STOPPING;
}

/* A synthetic restart reason for a store this node can no longer reach: permanent, so every
 * agent that still reaches the store decides on the real key, and this one leaves. */
static void restart_store_lost(agent_sm_t *sm) {
    sm->has_restart = true;
    sm->restart = (rdzv_why_t){.code = DDP_EXIT_PEER_FAILURE,
                               .is_permanent = true,
                               .failures = sm->failures + 1,
                               .node = -1,
                               .rank = -1};
    rdzv_record_why_describe(&sm->restart, sm->restart_text, sizeof sm->restart_text);
}

/* Tell every agent that this round ends (several nodes), with what the others need to decide.
 * code 0 is a membership change (a node arrived or vanished), which does not spend the budget.
 * ops is busy while joining (not a member yet) or in the exit barrier (already done). */
static void report(agent_sm_t *sm, agent_sm_actions_t *out, int code, bool is_permanent) {
    if (!sm->cfg.is_multi || sm->is_reporting || sm->state == AGENT_SM_JOINING ||
        sm->state == AGENT_SM_FINISHING)
        return;
    sm->is_reporting = true;
    agent_sm_action_t *a = push(out, AGENT_ACT_REPORT);
    a->round = sm->round;
    a->why = (rdzv_why_t){.code = code,
                          .is_permanent = is_permanent,
                          .node = sm->round.is_member ? sm->round.group_rank : -1,
                          .rank = code ? sm->root_cause.rank : -1,
                          .nodes = sm->round.group_world_size};
}

/* ---- rounds ------------------------------------------------------------------------------- */

static void begin_round(agent_sm_t *sm, agent_sm_actions_t *out, int round) {
    /* restart_text stays until the next key: past the budget, the join's outcome names it */
    sm->has_failure = sm->has_restart = sm->is_judging_members = sm->is_report_deferred = false;
    sm->round.round = round;
    if (!sm->cfg.is_multi) {
        sm->round = (rdzv_result_t){.round = round,
                                    .group_world_size = 1,
                                    .is_member = true,
                                    .world_size = sm->cfg.nproc_per_node};
        sm->state = AGENT_SM_STARTING;
        sm->is_workers_done = false;
        agent_sm_action_t *a = push(out, AGENT_ACT_START_WORKERS);
        a->round = sm->round;
        a->restart_count = sm->failures;
        return;
    }
    push(out, AGENT_ACT_STOP_HEARTBEATS);
    sm->state = AGENT_SM_JOINING;
    agent_sm_action_t *join = push(out, AGENT_ACT_JOIN);
    join->round = sm->round;
    join->plan = (agent_sm_join_plan_t){.round = round,
                                        .last_round_nodes = sm->last_round_nodes,
                                        .last_restart_code = sm->last_restart_code,
                                        .failures = sm->failures};
}

/* Everything about the round has settled: the next round, success, or giving up. */
static void decide(agent_sm_t *sm, agent_sm_actions_t *out) {
    if (sm->has_restart && sm->restart.is_finished && !sm->stop_signal) {
        /* a spare, or a member judged lost meanwhile (frozen past heartbeat_timeout in the
         * exit barrier): nothing left to run, never a next round; a failure of this node's own
         * workers since is still its exit code */
        say(out, AGENT_SAY_INFO,
            "the job finished in round %d without this node: leaving (a new run of it needs "
            "another --rdzv-id)",
            sm->round.round);
        if (sm->has_failure) {
            agent_sm_action_t *a = push(out, AGENT_ACT_PRINT_ROOT_CAUSE);
            a->root = sm->root_cause;
            a->round = sm->round;
        }
        if (sm->has_workers) push(out, AGENT_ACT_DESTROY_WORKERS);
        sm->has_workers = false;
        exit_with(sm, out, sm->has_failure ? failure_code(&sm->root_cause) : 0);
        return;
    }
    bool is_failed = sm->has_failure || sm->has_restart || sm->stop_signal;
    rdzv_why_t why = {0};
    if (sm->stop_signal) {
        why = (rdzv_why_t){.code = 128 + sm->stop_signal, .is_permanent = true};
    } else if (sm->has_restart) { /* several nodes: every agent decides from the same key */
        why = sm->restart;
        sm->failures = why.failures;
    } else if (sm->has_failure) { /* one node */
        why = (rdzv_why_t){.code = failure_code(&sm->root_cause),
                           .is_permanent = failure_is_permanent(&sm->root_cause),
                           .failures = ++sm->failures};
    }
    int code = why.code;
    rdzv_why_outcome_t outcome =
        is_failed ? rdzv_why_outcome(&why, sm->cfg.max_restarts, sm->cfg.is_multi) : RDZV_WHY_ENDS;
    bool is_membership_change = is_failed && code == 0; /* a stop signal has its code */
    /* past the budget, a peer failure may still be a lost node, which is no restart: the next
     * round's size decides (JOIN_DONE) */
    sm->is_budget_pending = outcome == RDZV_WHY_SIZE_DECIDES;
    if (outcome != RDZV_WHY_ENDS) {
        if (is_membership_change)
            say(out, AGENT_SAY_INFO, "membership changes: every node joins round %d",
                sm->round.round + 1);
        else if (sm->is_budget_pending)
            say(out, AGENT_SAY_WARN,
                "a peer failure past the restart budget (%d of %d): the next round's size decides "
                "(a node fewer: it was lost, no restart; else the job fails)",
                why.failures, sm->cfg.max_restarts);
        else
            say(out, AGENT_SAY_WARN, "restarting every worker (restart %d of %d)", why.failures,
                sm->cfg.max_restarts);
        if (sm->has_workers) push(out, AGENT_ACT_DESTROY_WORKERS);
        sm->has_workers = false;
        /* the reporter's count when the key says it, so that a spare (which ran no round)
         * judges a lost node's refund as the members do */
        sm->last_round_nodes = sm->has_restart && why.nodes > 0 ? why.nodes
                               : sm->round.is_member            ? sm->round.group_world_size
                                                                : 0;
        sm->last_restart_code = code;
        begin_round(sm, out, sm->round.round + 1);
        return;
    }
    if (is_failed) {
        if (sm->has_failure) {
            agent_sm_action_t *a = push(out, AGENT_ACT_PRINT_ROOT_CAUSE);
            a->root = sm->root_cause;
            a->round = sm->round;
        } else if (!sm->stop_signal) {
            say(out, AGENT_SAY_PLAIN, "the job failed on another node (%s)", sm->restart_text);
        }
        if (why.is_permanent && !sm->stop_signal)
            say(out, AGENT_SAY_PLAIN, "exit %d is not retried", code);
    }
    if (sm->has_workers) push(out, AGENT_ACT_DESTROY_WORKERS);
    sm->has_workers = false;
    if (sm->cfg.is_multi && !is_failed) {
        sm->state = AGENT_SM_FINISHING;
        sm->barrier_lost = -1;
        sm->is_barrier_abandoned = false;
        push(out, AGENT_ACT_BARRIER)->round = sm->round;
        return;
    }
    exit_with(sm, out, code);
}

/* Called whenever something settles (workers done, the key seen, a report out, a signal):
 * decides once nothing this round's decision needs is still in flight. */
static void settle(agent_sm_t *sm, agent_sm_actions_t *out) {
    if (sm->state != AGENT_SM_RUNNING && sm->state != AGENT_SM_SPARE &&
        sm->state != AGENT_SM_STOPPING)
        return;
    if (sm->is_reporting) return;
    if (sm->has_workers && !sm->is_workers_done) return;
    bool is_failed = sm->has_failure || sm->has_restart || sm->stop_signal;
    if (!is_failed && !sm->has_workers && sm->cfg.is_multi && !sm->round.is_member)
        return; /* a spare, until the round ends */
    if (sm->cfg.is_multi && is_failed && !sm->has_restart && !sm->stop_signal)
        return; /* a local failure on several nodes: every agent decides from the key */
    decide(sm, out);
}

/* ---- events ------------------------------------------------------------------------------- */

static void on_join_done(agent_sm_t *sm, const agent_sm_event_t *ev, agent_sm_actions_t *out) {
    if (sm->state != AGENT_SM_JOINING) return;
    if (sm->stop_signal) {
        exit_with(sm, out, 128 + sm->stop_signal);
        return;
    }
    if (ev->rc < 0) {
        say(out, AGENT_SAY_PLAIN, "%s", ev->text);
        exit_with(sm, out, 1);
        return;
    }
    sm->round = ev->joined;
    sm->last_round_nodes = 0;
    if (ev->is_refunded) {
        sm->failures--;
        say(out, AGENT_SAY_INFO,
            "round %d has a node fewer: the last restart was a lost node, not a failure, and "
            "does not count against --max-restarts (%d of %d used)",
            sm->round.round, sm->failures, sm->cfg.max_restarts);
    } else if (sm->is_budget_pending) {
        say(out, AGENT_SAY_PLAIN,
            "the job failed (%s), no node was lost, and its restarts (--max-restarts %d) are "
            "used up",
            sm->restart_text, sm->cfg.max_restarts);
        exit_with(sm, out, DDP_EXIT_PEER_FAILURE);
        return;
    }
    sm->is_budget_pending = false;
    push(out, AGENT_ACT_WATCH)->round = sm->round;
    if (!sm->round.is_member) {
        /* Arrived after the round closed: ask for a new round if there is room, else wait as a
         * spare for the round's end; either way the watch brings us to the next round. */
        bool has_room = sm->round.group_world_size < sm->cfg.max_nodes;
        sm->state = AGENT_SM_SPARE;
        say(out, AGENT_SAY_INFO, "round %d runs with %d nodes without this one; %s",
            sm->round.round, sm->round.group_world_size,
            has_room ? "asking for a new round" : "waiting for the next round");
        if (has_room) {
            report(sm, out, 0, false);
            return;
        }
        /* The round's members may all be dead already (killed while it ran, or while the round
         * closed): nobody else would ever end it. Judge their heartbeats as a member would. */
        sm->is_judging_members = true;
        push(out, AGENT_ACT_START_HEARTBEATS)->round = sm->round;
        return;
    }
    say(out, AGENT_SAY_INFO, "round %d: node %d of %d, ranks %d-%d of %d", sm->round.round,
        sm->round.group_rank, sm->round.group_world_size, sm->round.rank_offset,
        sm->round.rank_offset + sm->cfg.nproc_per_node - 1, sm->round.world_size);
    if (sm->round.group_world_size > 1) push(out, AGENT_ACT_START_HEARTBEATS)->round = sm->round;
    sm->state = AGENT_SM_STARTING;
    sm->is_workers_done = false;
    agent_sm_action_t *a = push(out, AGENT_ACT_START_WORKERS);
    a->round = sm->round;
    a->restart_count = sm->failures;
}

/* A start that failed may already have ended its set (WORKERS_DONE came first): it must be seen
 * as a failure, never as workers that ended well. */
static void on_start_failed(agent_sm_t *sm, const agent_sm_event_t *ev, agent_sm_actions_t *out) {
    sm->has_workers = ev->has_workers;
    if (!sm->cfg.is_multi) {
        exit_with(sm, out, DDP_EXIT_EXEC_FAILED);
        return;
    }
    sm->state = AGENT_SM_STOPPING;
    sm->has_failure = true;
    sm->root_cause = (agent_sm_exit_t){.exit_status = DDP_EXIT_EXEC_FAILED};
    report(sm, out, DDP_EXIT_EXEC_FAILED, true);
}

/* How much a failure tells of what went wrong: a permanent code (config, data) most; least a peer
 * failure (75: another rank went first) and the SIGTERM this agent sends the others once one
 * failed. Workers are reaped in spawn order, not in the order they died: the first failure seen
 * may be a consequence of a later one. */
static int telling(const agent_sm_exit_t *r) {
    if (failure_is_permanent(r)) return 2;
    bool is_consequence =
        r->term_signal ? r->term_signal == SIGTERM
                       : r->exit_status == DDP_EXIT_PEER_FAILURE || r->exit_status == 128 + SIGTERM;
    return is_consequence ? 0 : 1;
}

static void on_worker_exited(agent_sm_t *sm, const agent_sm_exit_t *r, agent_sm_actions_t *out) {
    bool is_failure = r->term_signal != 0 || r->exit_status != 0;
    if (is_failure && sm->has_failure && sm->state == AGENT_SM_STOPPING && !sm->stop_signal &&
        !sm->has_restart && sm->root_cause.pid && telling(r) > telling(&sm->root_cause)) {
        /* one node decides from it (several: the report is out, the key decides) */
        say(out, AGENT_SAY_WARN,
            "worker rank %d (pid %d) %s %d: the root cause rather than rank %d", r->rank, r->pid,
            r->term_signal ? "was killed by signal" : "exited with",
            r->term_signal ? r->term_signal : r->exit_status, sm->root_cause.rank);
        sm->root_cause = *r;
        if (sm->is_report_deferred) {
            sm->is_report_deferred = false;
            report(sm, out, failure_code(r), failure_is_permanent(r));
        }
        return;
    }
    if (!is_failure || sm->has_failure || sm->stop_signal || sm->has_restart) return;
    sm->has_failure = true;
    sm->root_cause = *r;
    round_ended(sm);
    say(out, AGENT_SAY_WARN, "worker rank %d (pid %d) %s %d; stopping every worker", r->rank,
        r->pid, r->term_signal ? "was killed by signal" : "exited with",
        r->term_signal ? r->term_signal : r->exit_status);
    stop_workers(sm, out, SIGTERM, sm->cfg.shutdown_timeout_s);
    /* several nodes: the first report sets the key for every agent, and a consequence reaped
     * first (workers are reaped in spawn order) would hide a permanent cause reaped after it;
     * another node's cause reports itself meanwhile */
    if (sm->cfg.is_multi && telling(r) == 0) {
        sm->is_report_deferred = true;
        return;
    }
    report(sm, out, failure_code(r), failure_is_permanent(r));
}

static void on_restart_seen(agent_sm_t *sm, const agent_sm_event_t *ev, agent_sm_actions_t *out) {
    /* In the exit barrier this node's workers have succeeded: a membership change elsewhere is
     * no reason to run them again, but a failure is (every worker restarts, or past the budget
     * the job fails here too); the others could not gather the next round without this node.
     * A watch that lost the store is left to the barrier, which ends when the last member's
     * done lets the store host go. */
    if (sm->state == AGENT_SM_FINISHING) {
        if (ev->is_store_lost || !ev->is_valid || ev->why.code == 0) return;
        push(out, AGENT_ACT_INTERRUPT_BARRIER);
    }
    if (ev->is_store_lost) {
        restart_store_lost(sm);
    } else {
        sm->has_restart = true;
        rdzv_why_t bad = {.code = DDP_EXIT_PEER_FAILURE, .is_permanent = true};
        sm->restart = ev->is_valid ? ev->why : bad;                /* unreadable: leave the job */
        size_t n = strnlen(ev->text, sizeof sm->restart_text - 1); /* the watch's 255 at most */
        memcpy(sm->restart_text, ev->text, n);
        sm->restart_text[n] = '\0';
    }
    round_ended(sm);
    if (sm->has_workers && !sm->has_failure && !sm->stop_signal) {
        say(out, AGENT_SAY_WARN, "round %d ends (%s): stopping local workers", sm->round.round,
            sm->restart_text);
        stop_workers(sm, out, SIGTERM, sm->cfg.shutdown_timeout_s);
    }
    settle(sm, out);
}

/* Kubernetes and Slurm send SIGTERM and expect an exit: without workers at once, with workers
 * once they ended (SIGKILL after --shutdown-timeout). Nothing in flight is waited for when there
 * are no workers: a join or an exit barrier is interrupted, a spare leaves without a word (agent.c
 * bounds how long the process waits for what is still on the thread pool). */
static void on_signal(agent_sm_t *sm, int signum, agent_sm_actions_t *out) {
    if (sm->stop_signal) { /* a second signal: no more grace */
        stop_workers(sm, out, SIGKILL, 0);
        return;
    }
    bool has_running = sm->has_workers && !sm->is_workers_done;
    if (has_running)
        say(out, AGENT_SAY_WARN, "%s received: forwarding it to the workers, SIGKILL after %g s",
            strsignal(signum), sm->cfg.shutdown_timeout_s);
    else
        say(out, AGENT_SAY_WARN, "%s received while %s: leaving", strsignal(signum),
            sm->state == AGENT_SM_JOINING     ? "joining a round"
            : sm->state == AGENT_SM_FINISHING ? "in the exit barrier (this node's workers "
                                                "succeeded)"
            : sm->state == AGENT_SM_SPARE     ? "waiting for the next round"
                                              : "no worker runs");
    sm->stop_signal = signum;
    if (sm->state == AGENT_SM_JOINING) {
        push(out, AGENT_ACT_INTERRUPT_JOIN);
        exit_with(sm, out, 128 + signum);
        return;
    }
    if (sm->state == AGENT_SM_SPARE) {
        /* not a member: the round runs on without it, as torchrun's running group goes on when
         * a waiting node leaves (a permanent report here ended every node's job with 143) */
        exit_with(sm, out, 128 + signum);
        return;
    }
    if (sm->state == AGENT_SM_FINISHING) {
        /* this node counted itself done: the others' barrier ends without it. A failure seen
         * meanwhile would have run the workers again, which the signal now forbids. */
        push(out, AGENT_ACT_INTERRUPT_BARRIER);
        exit_with(sm, out, sm->has_restart ? 128 + signum : 0);
        return;
    }
    round_ended(sm);
    if (has_running) stop_workers(sm, out, signum, sm->cfg.shutdown_timeout_s);
    report(sm, out, 128 + signum, true);
    if (!has_running) {
        decide(sm, out); /* a report in flight goes out on its own */
        return;
    }
    settle(sm, out);
}

/* A lost member never counts itself done: without a count on its behalf every other node (the
 * store's host with them) would wait for it until the barrier's timeout, as torchrun's exit
 * barrier does. Once per member; the judges agree in the store on which of them counts it. */
static void on_member_lost_in_barrier(agent_sm_t *sm, int node, agent_sm_actions_t *out) {
    if (node == sm->barrier_lost) return;
    sm->barrier_lost = node;
    say(out, AGENT_SAY_WARN,
        "a member of round %d (#%d) was lost after this node's workers succeeded: counting it "
        "done so that the exit barrier does not wait for it",
        sm->round.round, node);
    agent_sm_action_t *a = push(out, AGENT_ACT_BARRIER_LOST);
    a->round = sm->round;
    a->code = node;
}

void agent_sm_step(agent_sm_t *sm, const agent_sm_event_t *ev, agent_sm_actions_t *out) {
    out->n = 0;
    if (sm->state == AGENT_SM_DONE) return;
    switch (ev->kind) {
    case AGENT_EV_START:
        if (sm->state == AGENT_SM_IDLE) begin_round(sm, out, 0);
        return;
    case AGENT_EV_JOIN_DONE:
        on_join_done(sm, ev, out);
        return;
    case AGENT_EV_START_OK:
        if (sm->state != AGENT_SM_STARTING) return;
        sm->has_workers = true;
        sm->state = AGENT_SM_RUNNING;
        return;
    case AGENT_EV_START_FAILED:
        if (sm->state == AGENT_SM_STARTING) on_start_failed(sm, ev, out);
        return;
    case AGENT_EV_WORKER_EXITED:
        on_worker_exited(sm, &ev->exit, out);
        return;
    case AGENT_EV_WORKERS_DONE:
        sm->is_workers_done = true;
        if (sm->is_report_deferred) { /* no more telling failure came */
            sm->is_report_deferred = false;
            if (!sm->has_restart && !sm->stop_signal)
                report(sm, out, failure_code(&sm->root_cause),
                       failure_is_permanent(&sm->root_cause));
        }
        settle(sm, out);
        return;
    case AGENT_EV_RESTART_SEEN:
        on_restart_seen(sm, ev, out);
        return;
    case AGENT_EV_STORE_SILENT:
        /* this node's workers succeeded: the barrier ends as when it loses the store itself (exit
         * 0), at once rather than after its own reconnects and timeouts on a silent store */
        if (sm->state == AGENT_SM_FINISHING) {
            /* after a failure key the barrier is ending already, and FINISH_DONE decides */
            if (sm->is_barrier_abandoned || sm->has_restart) return;
            sm->is_barrier_abandoned = true;
            say(out, AGENT_SAY_WARN,
                "not every node confirmed the end of the job (its store is silent); this node's "
                "workers succeeded");
            push(out, AGENT_ACT_INTERRUPT_BARRIER);
            return;
        }
        restart_store_lost(sm);
        round_ended(sm);
        stop_workers(sm, out, SIGTERM, sm->cfg.shutdown_timeout_s);
        settle(sm, out);
        return;
    case AGENT_EV_PEER_SILENT:
        if (sm->state == AGENT_SM_FINISHING) {
            if (!sm->has_restart) on_member_lost_in_barrier(sm, ev->node, out);
            return;
        }
        report(sm, out, 0, false);
        return;
    case AGENT_EV_SIGNAL:
        on_signal(sm, ev->signum, out);
        return;
    case AGENT_EV_REPORT_DONE:
        sm->is_reporting = false;
        settle(sm, out);
        return;
    case AGENT_EV_FINISH_DONE:
        if (sm->state != AGENT_SM_FINISHING) return;
        if (!sm->has_restart) {
            exit_with(sm, out, 0);
            return;
        }
        say(out, AGENT_SAY_WARN, "round %d ends (%s) after this node's workers succeeded",
            sm->round.round, sm->restart_text);
        sm->state = AGENT_SM_STOPPING;
        decide(sm, out);
        return;
    }
}

/* ---- queries ------------------------------------------------------------------------------ */

void agent_sm_init(agent_sm_t *sm, const agent_sm_config_t *cfg) {
    memset(sm, 0, sizeof *sm);
    sm->cfg = *cfg;
    sm->state = AGENT_SM_IDLE;
}

bool agent_sm_needs_store(const agent_sm_t *sm, int round) {
    return sm->state != AGENT_SM_DONE && sm->state != AGENT_SM_JOINING &&
           (sm->round.is_member || (sm->state == AGENT_SM_SPARE && sm->is_judging_members)) &&
           !sm->has_restart && !sm->stop_signal && round == sm->round.round;
}

bool agent_sm_report_is_wanted(const agent_sm_t *sm, int round) {
    return agent_sm_needs_store(sm, round) || (sm->state == AGENT_SM_SPARE && !sm->has_restart &&
                                               !sm->stop_signal && round == sm->round.round);
}

bool agent_sm_is_beating(const agent_sm_t *sm, int round) {
    return agent_sm_needs_store(sm, round) && !sm->has_failure;
}

/* A node that vanished shows up first as its peers' workers failing ("peer failure"); once the
 * next round has fewer nodes, that restart was a membership change, which (as torchrun) costs
 * no restart. */
bool agent_sm_join_is_refund(const agent_sm_join_plan_t *plan, const rdzv_result_t *joined) {
    return joined->is_member && plan->last_round_nodes > 0 &&
           plan->last_restart_code == DDP_EXIT_PEER_FAILURE &&
           joined->group_world_size < plan->last_round_nodes && plan->failures > 0;
}

const char *agent_sm_state_name(agent_sm_state_t s) {
    static const char *const names[] = {"IDLE",  "JOINING",  "STARTING",  "RUNNING",
                                        "SPARE", "STOPPING", "FINISHING", "DONE"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "?";
}

const char *agent_sm_event_name(agent_sm_event_kind_t k) {
    static const char *const names[] = {"START",        "JOIN_DONE",     "START_OK",
                                        "START_FAILED", "WORKER_EXITED", "WORKERS_DONE",
                                        "RESTART_SEEN", "STORE_SILENT",  "PEER_SILENT",
                                        "SIGNAL",       "REPORT_DONE",   "FINISH_DONE"};
    return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "?";
}
