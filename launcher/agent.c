/* agent: `ddprun [options] PROGRAM`, the per-node elastic agent, on one libuv loop. Hosts the
 * job's store when this node owns the rendezvous endpoint (embedded store_server), joins each
 * round (rendezvous.c, run on libuv's thread pool so the loop never blocks), runs the round's
 * local workers (workers.c), and ends the round on any failure anywhere: a local failure sets the
 * round's restart key, every agent WAITs on it, stops its workers and joins the next round until
 * --max-restarts is spent or the failure is permanent. Exits 0, or with the root-cause worker's code
 * (128+signal if killed) after a short summary.
 *
 * One node (--standalone, or --nnodes 1) needs no rendezvous. Several nodes rendezvous through
 * the store: c10d (elastic MIN:MAX, heartbeats) or static (node 0 hosts MASTER_ADDR:MASTER_PORT,
 * --node-rank orders the nodes). */
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "commands.h"
#include "ddp_error.h"
#include "exit_codes.h"
#include "fs.h"
#include "log.h"
#include "options.h"
#include "rendezvous.h"
#include "store_client.h"
#include "store_server.h"
#include "workers.h"

#define STORE_LINGER_MS 5000

typedef struct {
    uv_loop_t *loop;
    ddprun_opts_t *opts;
    store_server_t *store;
    workers_t *workers;
    uv_signal_t sig_handles[DDP_MAX_SIGNALS];
    uv_timer_t linger;
    char self_exe[PATH_MAX];
    char run_dir[1200];
    char master_addr[256];
    uint16_t master_port;
    rdzv_result_t round; /* membership of the current round; .round is the attempt number */
    rdzv_result_t joined; /* written by the join thread, taken over by the loop after it */
    bool has_failure;    /* a local worker failed this round */
    bool is_workers_done; /* every local worker ended and its output is drained */
    bool is_starting_workers; /* inside workers_start */
    worker_result_t root_cause;
    int stop_signal;     /* a signal we were asked to stop with, 0 if none */
    int exit_code;
    bool is_finished;
    /* several nodes */
    bool is_multi;
    rdzv_t rdzv;
    store_client_t *ops, *watch; /* watch: blocked in the restart WAIT of the round */
    store_client_t *hb;          /* heartbeats, with short deadlines */
    uv_timer_t hb_timer;
    uv_work_t hb_work;
    bool is_hb_busy, is_hb_timer_open;
    int hb_rc;
    uint64_t hb_ok_ms;             /* last heartbeat the store took */
    rdzv_result_t hb_round;        /* the round the beat in flight is for (a copy: threads) */
    int64_t hb_seen[RDZV_MAX_NODES], hb_fresh[RDZV_MAX_NODES];
    uint64_t hb_changed_ms[RDZV_MAX_NODES];
    uv_work_t join_work, watch_work, report_work, finish_work;
    bool is_joining, is_watching, is_reporting, is_finishing;
    bool has_restart; /* the round's restart key was seen */
    char restart_why[256];
    rdzv_why_t report_why;
    int failures; /* of the job so far: the restart budget (one node counts locally) */
    /* the round that ended last: its size and why, to tell a lost node from a failure */
    int last_round_nodes, last_restart_code;
    bool is_refunded; /* this join gave the last restart back (join thread -> loop) */
    /* a peer failure past the restart budget: joined only to see whether a node was lost */
    bool is_budget_pending;
    int join_rc, watch_rc, report_rc, finish_rc;
    char join_err[512];
} agent_t;

static void maybe_advance(agent_t *a);
static void begin_round(agent_t *a, int round);
static void report_restart(agent_t *a, int code, bool is_permanent);

/* ---- ending ------------------------------------------------------------------------------- */

static void on_linger(uv_timer_t *t) {
    agent_t *a = t->data;
    store_server_stats_t st;
    store_server_stats(a->store, &st);
    static int waited_ms;
    waited_ms += 100;
    if (st.n_connections > 0 && waited_ms < STORE_LINGER_MS) return;
    uv_close((uv_handle_t *)t, NULL);
    store_server_stop(a->store, NULL, NULL);
}

static void finish(agent_t *a, int code) {
    if (a->is_finished) return;
    a->is_finished = true;
    a->exit_code = code;
    for (int i = 0; i < a->opts->n_signals; i++) uv_close((uv_handle_t *)&a->sig_handles[i], NULL);
    if (a->is_hb_timer_open) {
        uv_close((uv_handle_t *)&a->hb_timer, NULL);
        a->is_hb_timer_open = false;
    }
    if (a->hb && !a->is_hb_busy) {
        store_client_destroy(a->hb);
        a->hb = NULL;
    }
    if (a->watch && a->is_watching) store_client_interrupt(a->watch); /* end its WAIT too */
    if (a->watch && !a->is_watching && !a->is_joining) {
        store_client_destroy(a->watch);
        a->watch = NULL;
    }
    if (a->ops && !a->is_joining && !a->is_reporting && !a->is_finishing) {
        store_client_destroy(a->ops); /* hang up, so a hosting agent's linger can end */
        a->ops = NULL;
    }
    if (!a->store) return;
    if (!a->is_multi) {
        store_server_stop(a->store, NULL, NULL);
        return;
    }
    /* Other agents may still read the round's keys: keep the store until they hang up. */
    uv_timer_init(a->loop, &a->linger);
    a->linger.data = a;
    uv_timer_start(&a->linger, on_linger, 100, 100);
}

static void print_file_indented(const char *path, size_t max_bytes) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char buf[4096];
    size_t n = fread(buf, 1, max_bytes < sizeof buf - 1 ? max_bytes : sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    fprintf(stderr, "ddprun: error file %s:\n  %s\n", path, buf);
}

static void print_root_cause(agent_t *a) {
    const worker_result_t *r = &a->root_cause;
    char how[64];
    if (r->term_signal)
        snprintf(how, sizeof how, "was killed by signal %d (%s)", r->term_signal, strsignal(r->term_signal));
    else snprintf(how, sizeof how, "exited with %d", r->exit_status);
    fprintf(stderr, "ddprun: root cause: node %d rank %d (local rank %d, pid %d) %s on attempt %d "
                    "of %d\n", a->round.group_rank, r->rank, r->local_rank, r->pid, how,
            a->round.round + 1, a->opts->max_restarts + 1);
    const char *tail = a->workers ? workers_tail(a->workers, r->local_rank) : "";
    if (*tail) {
        const char *p = tail;
        int lines = 0;
        for (const char *q = tail + strlen(tail); q > tail; q--)
            if (q[-1] == '\n' && ++lines > 10) { /* the last 10 lines */
                p = q;
                break;
            }
        fprintf(stderr, "ddprun: last lines of its stderr:\n%s%s", p,
                tail[strlen(tail) - 1] == '\n' ? "" : "\n");
    }
    char error_file[1400];
    snprintf(error_file, sizeof error_file, "%s/attempt_%d/%d/error.json", a->run_dir,
             a->round.round, r->local_rank);
    print_file_indented(error_file, 2048);
}

/* ---- workers ------------------------------------------------------------------------------ */

static int failure_code(const worker_result_t *r) {
    return r->term_signal ? 128 + r->term_signal : r->exit_status;
}

static bool failure_is_permanent(const worker_result_t *r) {
    return !r->term_signal && ddp_exit_is_permanent(r->exit_status);
}

static void report_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    a->report_rc = rdzv_request_restart(&a->rdzv, a->ops, a->round.round, &a->report_why);
}

static void report_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->is_reporting = false;
    if (a->report_rc < 0)
        LOG_ERROR("cannot tell the other agents to restart: %s", store_client_error(a->ops));
    maybe_advance(a);
}

/* Tell every agent that this round ends (multi-node), with what the others need to decide.
 * code 0 is a membership change (a node arrived), which does not spend the restart budget. */
static void report_restart(agent_t *a, int code, bool is_permanent) {
    /* ops is busy while joining (not a member yet) or in the exit barrier (already done). */
    if (!a->is_multi || a->is_reporting || a->is_joining || a->is_finishing) return;
    a->report_why = (rdzv_why_t){.code = code, .is_permanent = is_permanent,
                                 .node = a->round.group_rank,
                                 .rank = code ? a->root_cause.rank : -1};
    a->is_reporting = true;
    a->report_work.data = a;
    uv_queue_work(a->loop, &a->report_work, report_work_cb, report_after_cb);
}

static void on_worker_exit(workers_t *w, const worker_result_t *r, void *arg) {
    (void)w;
    agent_t *a = arg;
    bool is_failure = r->term_signal != 0 || r->exit_status != 0;
    if (!is_failure || a->has_failure || a->stop_signal || a->has_restart) return;
    a->has_failure = true;
    a->root_cause = *r;
    LOG_WARN("worker rank %d (pid %d) %s %d; stopping every worker", r->rank, r->pid,
             r->term_signal ? "was killed by signal" : "exited with",
             r->term_signal ? r->term_signal : r->exit_status);
    workers_stop(a->workers, SIGTERM, a->opts->shutdown_timeout_s);
    report_restart(a, failure_code(r), failure_is_permanent(r));
}

static void on_workers_done(workers_t *w, void *arg) {
    agent_t *a = arg;
    if (w != a->workers) return; /* a previous round's set, already replaced */
    a->is_workers_done = true;
    maybe_advance(a);
}

static int start_workers(agent_t *a) {
    char attempt_dir[1300], err[512];
    snprintf(attempt_dir, sizeof attempt_dir, "%s/attempt_%d", a->run_dir, a->round.round);
    workers_spec_t spec = {
        .opts = a->opts, .self_exe = a->self_exe, .run_id = a->opts->rdzv_id,
        .attempt = a->round.round, .restart_count = a->failures,
        .group_rank = a->round.group_rank,
        .group_world_size = a->round.group_world_size, .rank_offset = a->round.rank_offset,
        .world_size = a->round.world_size, .master_addr = a->master_addr,
        .master_port = a->master_port, .attempt_dir = attempt_dir};
    a->is_workers_done = false;
    /* a start that fails stops the workers it started, which may call on_workers_done before we
     * know it failed: the caller records the failure first, then advances */
    a->is_starting_workers = true;
    int rc = workers_start(a->loop, &spec, on_worker_exit, on_workers_done, a, &a->workers, err,
                           sizeof err);
    a->is_starting_workers = false;
    if (rc < 0) LOG_ERROR("%s", err);
    return rc;
}

/* ---- rounds ------------------------------------------------------------------------------- */

static void watch_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    a->watch_rc = rdzv_wait_restart(&a->rdzv, a->watch, a->round.round, a->restart_why,
                                    sizeof a->restart_why);
}

static void watch_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->is_watching = false;
    if (a->is_finished) {
        store_client_destroy(a->watch);
        a->watch = NULL;
        return;
    }
    if (a->watch_rc < 0) {
        LOG_ERROR("lost the job's store while watching round %d: %s", a->round.round,
                  store_client_error(a->watch));
        snprintf(a->restart_why, sizeof a->restart_why,
                 "code=%d permanent=1 failures=%d node=-1 rank=-1", DDP_EXIT_PEER_FAILURE,
                 a->failures + 1);
    }
    a->has_restart = true;
    if (a->workers && !a->has_failure && !a->stop_signal) {
        LOG_WARN("round %d ends (%s): stopping local workers", a->round.round, a->restart_why);
        workers_stop(a->workers, SIGTERM, a->opts->shutdown_timeout_s);
    }
    maybe_advance(a);
}

/* ---- heartbeats: a node that stops beating (killed, partitioned) ends the round ----------- */

static void hb_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const ddprun_opts_t *o = a->opts;
    a->hb_rc = 0;
    if (!a->hb) {
        int64_t limit_ms = (int64_t)(o->heartbeat_timeout_s * 1000);
        store_client_opts_t co = {.host = o->rdzv_host, .port = o->rdzv_port,
                                  .connect_timeout_ms = limit_ms, .op_timeout_ms = limit_ms,
                                  .max_value_bytes = o->store_max_value_bytes};
        a->hb_rc = store_client_connect(&co, &a->hb);
        if (a->hb_rc < 0) {
            store_client_destroy(a->hb);
            a->hb = NULL;
            return;
        }
    }
    a->hb_rc = rdzv_heartbeat(&a->rdzv, a->hb, &a->hb_round, a->hb_fresh);
}

static void hb_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->is_hb_busy = false;
    if (a->is_finished) {
        store_client_destroy(a->hb);
        a->hb = NULL;
        return;
    }
    if (a->has_restart || a->has_failure || a->stop_signal || !a->round.is_member ||
        a->is_joining || a->hb_round.round != a->round.round)
        return; /* the round this beat was for is over */
    uint64_t now = clock_now_ms();
    uint64_t limit_ms = (uint64_t)(a->opts->heartbeat_timeout_s * 1000);
    if (a->hb_rc < 0) {
        if (now - a->hb_ok_ms <= limit_ms) return;
        LOG_ERROR("the job's store at %s:%u took no heartbeat for %g s: leaving the job",
                  a->opts->rdzv_host, a->opts->rdzv_port, a->opts->heartbeat_timeout_s);
        snprintf(a->restart_why, sizeof a->restart_why,
                 "code=%d permanent=1 failures=%d node=-1 rank=-1", DDP_EXIT_PEER_FAILURE,
                 a->failures + 1);
        a->has_restart = true;
        if (a->workers) workers_stop(a->workers, SIGTERM, a->opts->shutdown_timeout_s);
        maybe_advance(a);
        return;
    }
    a->hb_ok_ms = now;
    const int64_t *counters = a->hb_fresh;
    for (int i = 0; i < a->round.group_world_size; i++) {
        if (i == a->round.group_rank) continue;
        if (counters[i] != a->hb_seen[i]) {
            a->hb_seen[i] = counters[i];
            a->hb_changed_ms[i] = now;
        } else if (now - a->hb_changed_ms[i] > limit_ms) {
            LOG_WARN("node %d sent no heartbeat for %g s: ending round %d without it", i,
                     a->opts->heartbeat_timeout_s, a->round.round);
            report_restart(a, 0, false);
            return;
        }
    }
}

static void on_hb_timer(uv_timer_t *t) {
    agent_t *a = t->data;
    if (a->is_hb_busy || a->is_finished) return;
    a->is_hb_busy = true;
    a->hb_round = a->round;
    a->hb_work.data = a;
    uv_queue_work(a->loop, &a->hb_work, hb_work_cb, hb_after_cb);
}

static void start_heartbeats(agent_t *a) {
    uint64_t now = clock_now_ms();
    a->hb_ok_ms = now;
    for (int i = 0; i < RDZV_MAX_NODES; i++) {
        a->hb_seen[i] = -1;
        a->hb_changed_ms[i] = now;
    }
    if (!a->is_hb_timer_open) {
        uv_timer_init(a->loop, &a->hb_timer);
        a->hb_timer.data = a;
        a->is_hb_timer_open = true;
    }
    uint64_t every = (uint64_t)(a->opts->keep_alive_interval_s * 1000);
    uv_timer_start(&a->hb_timer, on_hb_timer, 0, every ? every : 1);
}

static void join_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const ddprun_opts_t *o = a->opts;
    a->join_rc = 0;
    store_client_opts_t co = {.host = o->rdzv_host, .port = o->rdzv_port,
                              .connect_timeout_ms = (int64_t)(o->join_timeout_s * 1000),
                              .op_timeout_ms = (int64_t)((o->join_timeout_s + o->read_timeout_s) * 1000),
                              .max_value_bytes = o->store_max_value_bytes};
    store_client_t **clients[2] = {&a->ops, &a->watch};
    for (int i = 0; i < 2 && a->join_rc == 0; i++) {
        if (*clients[i]) continue;
        a->join_rc = store_client_connect(&co, clients[i]);
        if (a->join_rc < 0)
            snprintf(a->join_err, sizeof a->join_err, "%s", store_client_error(*clients[i]));
    }
    int round = a->joined.round, current = 0;
    if (a->join_rc == 0 && (a->join_rc = rdzv_current_round(&a->rdzv, a->ops, &current)) < 0)
        snprintf(a->join_err, sizeof a->join_err, "%s", store_client_error(a->ops));
    if (a->join_rc == 0)
        a->join_rc = rdzv_join(&a->rdzv, a->ops, current > round ? current : round, &a->joined,
                               a->join_err, sizeof a->join_err);
    /* A node that vanished shows up first as its peers' workers failing ("peer failure"); once
     * the next round has fewer nodes, that restart was a membership change, which (as torchrun)
     * costs no restart: give it back, counted once in the store by the new round's node 0. */
    a->is_refunded = a->join_rc == 0 && a->joined.is_member && a->last_round_nodes > 0 &&
                     a->last_restart_code == DDP_EXIT_PEER_FAILURE &&
                     a->joined.group_world_size < a->last_round_nodes && a->failures > 0;
    if (a->is_refunded && a->joined.group_rank == 0)
        a->join_rc = rdzv_refund_failure(&a->rdzv, a->ops);
}

static void join_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->is_joining = false;
    if (a->stop_signal) {
        finish(a, 128 + a->stop_signal);
        return;
    }
    if (a->join_rc < 0) {
        fprintf(stderr, "ddprun: %s\n", a->join_err);
        finish(a, 1);
        return;
    }
    a->round = a->joined;
    a->last_round_nodes = 0;
    if (a->is_refunded) {
        a->failures--;
        LOG_INFO("round %d has a node fewer: the last restart was a lost node, not a failure, and "
                 "does not count against --max-restarts (%d of %d used)", a->round.round,
                 a->failures, a->opts->max_restarts);
    } else if (a->is_budget_pending) {
        fprintf(stderr, "ddprun: the job failed (%s), no node was lost, and its restarts "
                        "(--max-restarts %d) are used up\n", a->restart_why, a->opts->max_restarts);
        finish(a, DDP_EXIT_PEER_FAILURE);
        return;
    }
    a->is_budget_pending = false;
    a->is_watching = true;
    a->watch_work.data = a;
    uv_queue_work(a->loop, &a->watch_work, watch_work_cb, watch_after_cb);
    if (!a->round.is_member) {
        /* Arrived after the round closed: ask for a new round if there is room, else wait as a
         * spare for the round's end; either way the watch above brings us to the next round. */
        bool has_room = a->round.group_world_size < (int)a->opts->max_nodes;
        LOG_INFO("round %d runs with %d nodes without this one; %s", a->round.round,
                 a->round.group_world_size,
                 has_room ? "asking for a new round" : "waiting for the next round");
        if (has_room) report_restart(a, 0, false);
        return;
    }
    LOG_INFO("round %d: node %d of %d, ranks %d-%d of %d", a->round.round, a->round.group_rank,
             a->round.group_world_size, a->round.rank_offset,
             a->round.rank_offset + a->opts->nproc_per_node - 1, a->round.world_size);
    if (a->round.group_world_size > 1) start_heartbeats(a);
    if (start_workers(a) < 0) {
        a->has_failure = true;
        a->root_cause = (worker_result_t){.exit_status = DDP_EXIT_EXEC_FAILED};
        report_restart(a, DDP_EXIT_EXEC_FAILED, true);
    }
}

static void begin_round(agent_t *a, int round) {
    a->has_failure = a->has_restart = false;
    a->restart_why[0] = '\0';
    a->round.round = round;
    if (!a->is_multi) {
        a->round = (rdzv_result_t){.round = round, .group_world_size = 1, .is_member = true,
                                   .world_size = a->opts->nproc_per_node};
        if (start_workers(a) < 0) finish(a, DDP_EXIT_EXEC_FAILED);
        return;
    }
    if (a->is_hb_timer_open) uv_timer_stop(&a->hb_timer); /* no beats between rounds */
    a->joined.round = round;
    a->is_joining = true;
    a->join_work.data = a;
    uv_queue_work(a->loop, &a->join_work, join_work_cb, join_after_cb);
}

static void finish_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    a->finish_rc = rdzv_finish(&a->rdzv, a->ops, a->round.round, a->round.group_world_size,
                               (int64_t)(a->opts->join_timeout_s * 1000));
}

static void finish_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->is_finishing = false;
    if (a->finish_rc < 0)
        LOG_WARN("not every node confirmed the end of the job: %s", store_client_error(a->ops));
    finish(a, 0);
}

/* Called whenever something settles: the local workers ended, the restart key was seen, a
 * report went out. Decides between the next round, success, and giving up. */
static void maybe_advance(agent_t *a) {
    if (a->is_finished || a->is_reporting || a->is_joining || a->is_finishing ||
        a->is_starting_workers)
        return;
    if (a->workers && !a->is_workers_done) return;
    bool is_failed = a->has_failure || a->has_restart || a->stop_signal;
    if (!is_failed && !a->workers && a->is_multi && !a->round.is_member) return; /* a spare */
    if (a->is_multi && is_failed && !a->has_restart && !a->stop_signal) return; /* await the key */
    rdzv_why_t why = {0};
    if (a->stop_signal) {
        why = (rdzv_why_t){.code = 128 + a->stop_signal, .is_permanent = true};
    } else if (a->has_restart) { /* several nodes: every agent decides from the same key */
        if (!rdzv_why_parse(a->restart_why, &why))
            why = (rdzv_why_t){.code = DDP_EXIT_PEER_FAILURE, .is_permanent = true};
        a->failures = why.failures;
    } else if (a->has_failure) { /* one node */
        why = (rdzv_why_t){.code = failure_code(&a->root_cause),
                           .is_permanent = failure_is_permanent(&a->root_cause),
                           .failures = ++a->failures};
    }
    int code = why.code;
    bool is_permanent = why.is_permanent;
    bool is_membership_change = is_failed && !a->stop_signal && code == 0;
    /* past the budget, a peer failure may still be a lost node, which is no restart: the next
     * round's size decides (join_after_cb) */
    a->is_budget_pending = is_failed && !is_permanent && a->is_multi &&
                           code == DDP_EXIT_PEER_FAILURE && why.failures > a->opts->max_restarts;
    if (is_membership_change || a->is_budget_pending ||
        (is_failed && !is_permanent && why.failures <= a->opts->max_restarts)) {
        if (is_membership_change)
            LOG_INFO("membership changes: every node joins round %d", a->round.round + 1);
        else
            LOG_WARN("restarting every worker (restart %d of %d)", why.failures,
                     a->opts->max_restarts);
        if (a->workers) workers_destroy(a->workers);
        a->workers = NULL;
        a->last_round_nodes = a->round.is_member ? a->round.group_world_size : 0;
        a->last_restart_code = code;
        begin_round(a, a->round.round + 1);
        return;
    }
    if (is_failed) {
        if (a->has_failure) print_root_cause(a);
        else if (!a->stop_signal)
            fprintf(stderr, "ddprun: the job failed on another node (%s)\n", a->restart_why);
        if (is_permanent && !a->stop_signal) fprintf(stderr, "ddprun: exit %d is not retried\n", code);
    }
    if (a->workers) workers_destroy(a->workers);
    a->workers = NULL;
    if (a->is_multi && !is_failed) {
        a->is_finishing = true;
        a->finish_work.data = a;
        uv_queue_work(a->loop, &a->finish_work, finish_work_cb, finish_after_cb);
        return;
    }
    finish(a, code);
}

static void on_signal(uv_signal_t *h, int signum) {
    agent_t *a = h->data;
    if (a->stop_signal) {
        if (a->workers) workers_stop(a->workers, SIGKILL, 0); /* second signal: no more grace */
        return;
    }
    LOG_WARN("%s received: forwarding it to the workers, SIGKILL after %g s", strsignal(signum),
             a->opts->shutdown_timeout_s);
    a->stop_signal = signum;
    if (a->is_joining && a->ops) store_client_interrupt(a->ops);
    if (a->workers) workers_stop(a->workers, signum, a->opts->shutdown_timeout_s);
    report_restart(a, 128 + signum, true);
    maybe_advance(a);
}

/* ---- start -------------------------------------------------------------------------------- */

static int prepare_run_dir(agent_t *a) {
    const ddprun_opts_t *o = a->opts;
    if (o->log_dir[0]) {
        snprintf(a->run_dir, sizeof a->run_dir, "%s/%s", o->log_dir, o->rdzv_id);
        int rc = fs_mkdir_p(a->run_dir);
        return rc < 0 ? rc : fs_check_writable(a->run_dir);
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(a->run_dir, sizeof a->run_dir, "%s/ddprun-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp",
             o->rdzv_id);
    return mkdtemp(a->run_dir) ? 0 : -errno;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st, (void)type, (void)ftw;
    return remove(path);
}

/* Host the store if this node owns the endpoint; another agent may already hold it. */
static int host_store(agent_t *a) {
    const ddprun_opts_t *o = a->opts;
    store_server_opts_t so = {.host = o->rdzv_host, .port = o->rdzv_port};
    store_limits_default(&so.limits);
    so.limits.max_value_bytes = o->store_max_value_bytes;
    size_t frame_needed = so.limits.max_key_bytes + so.limits.max_value_bytes + 32;
    if (so.limits.max_frame_bytes < frame_needed) so.limits.max_frame_bytes = frame_needed;
    char err[512];
    bool is_static = strcmp(o->rdzv_backend, "static") == 0;
    int rc = 0;
    bool is_host = o->is_host >= 0 ? o->is_host == 1 : !is_static || o->node_rank == 0;
    if (!is_host) { /* node 0 hosts a static job's store; with is_host=false, someone else */
        rc = UV_EADDRINUSE;
        snprintf(err, sizeof err, "--rdzv-conf is_host=false, and a single node needs its own store");
    }
    else rc = store_server_start(a->loop, &so, &a->store, err, sizeof err);
    /* without is_host=true, an endpoint that another agent holds makes us a client */
    if (rc < 0 && a->is_multi && o->is_host != 1 && (rc == UV_EADDRINUSE || rc == UV_EADDRNOTAVAIL)) {
        a->store = NULL; /* someone else hosts it: we are a client */
        rc = 0;
    } else if (rc < 0) {
        fprintf(stderr, "ddprun: cannot host the job's store: %s\n", err);
        return rc;
    }
    snprintf(a->master_addr, sizeof a->master_addr, "%s", so.host);
    a->master_port = a->store ? store_server_port(a->store) : so.port;
    return 0;
}

/* The built-in trainer: $DDPWORKER, else next to ddprun (installed), else the build tree's
 * worker/ddpworker (ddprun in build/launcher), else ddpworker on PATH. */
static void find_ddpworker(const char *self_exe, char *out, size_t out_len) {
    const char *env = getenv("DDPWORKER");
    if (env && *env) {
        snprintf(out, out_len, "%s", env);
        return;
    }
    const char *slash = strrchr(self_exe, '/');
    int dir_len = slash ? (int)(slash - self_exe) : 0;
    const char *candidates[] = {"/ddpworker", "/../worker/ddpworker"};
    for (size_t i = 0; slash && i < sizeof candidates / sizeof candidates[0]; i++) {
        int n = snprintf(out, out_len, "%.*s%s", dir_len, self_exe, candidates[i]);
        if (n > 0 && (size_t)n < out_len && access(out, X_OK) == 0) return;
    }
    snprintf(out, out_len, "ddpworker");
}

/* `ddprun ... train.conf [key=value ...]` runs ddpworker train.conf [key=value ...]. */
static int use_builtin_trainer(agent_t *a, ddprun_opts_t *o) {
    static char worker_path[PATH_MAX];
    find_ddpworker(a->self_exe, worker_path, sizeof worker_path);
    char **argv = calloc((size_t)o->program_argc + 2, sizeof *argv);
    if (!argv) return -ENOMEM;
    argv[0] = worker_path;
    for (int i = 0; i < o->program_argc; i++) argv[i + 1] = o->program_argv[i];
    o->program_argv = argv; /* lives as long as the agent */
    o->program_argc++;
    o->is_no_python = true;
    o->is_module = false;
    return 0;
}

int agent_main(ddprun_opts_t *o) {
    static agent_t agent;
    agent_t *a = &agent;
    a->opts = o;
    a->loop = uv_default_loop();
    a->is_multi = o->max_nodes > 1;
    ssize_t n = readlink("/proc/self/exe", a->self_exe, sizeof a->self_exe - 1);
    if (n <= 0) {
        fprintf(stderr, "ddprun: cannot find its own executable: %s\n", strerror(errno));
        return 1;
    }
    a->self_exe[n] = '\0';
    const char *prog = o->program_argv[0];
    size_t plen = strlen(prog);
    if (plen > 5 && strcmp(prog + plen - 5, ".conf") == 0 && use_builtin_trainer(a, o) < 0) {
        fprintf(stderr, "ddprun: out of memory\n");
        return 1;
    }
    int rc = prepare_run_dir(a);
    if (rc < 0 && o->log_dir[0]) {
        fprintf(stderr, "ddprun: --log-dir %s: cannot create or write %s: %s\n", o->log_dir,
                a->run_dir, strerror(-rc));
        return DDP_EXIT_CANT_CREATE;
    }
    if (rc < 0) {
        fprintf(stderr, "ddprun: cannot create a run directory: %s\n", strerror(-rc));
        return 1;
    }
    if (host_store(a) < 0) return 1;
    rdzv_init(&a->rdzv, o, a->store != NULL);
    LOG_INFO("run %s: %d worker(s), store %s %s port %u, logs in %s", o->rdzv_id,
             o->nproc_per_node, a->store ? "hosted on" : "at", a->master_addr, a->master_port,
             a->run_dir);
    for (int i = 0; i < o->n_signals; i++) {
        uv_signal_init(a->loop, &a->sig_handles[i]);
        a->sig_handles[i].data = a;
        uv_signal_start(&a->sig_handles[i], on_signal, o->signals[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    begin_round(a, 0);
    uv_run(a->loop, UV_RUN_DEFAULT);
    store_client_destroy(a->ops);
    store_client_destroy(a->watch);
    /* Without --log-dir the run directory is scratch (error files): kept only for a failure. */
    if (a->exit_code == 0 && !o->log_dir[0]) nftw(a->run_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return a->exit_code;
}
