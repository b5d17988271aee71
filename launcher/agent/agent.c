/* agent: `ddprun [options] PROGRAM`, the per-node elastic agent, on one libuv loop. Hosts the
 * job's store when this node owns the rendezvous endpoint (embedded store_server), joins each
 * round (rendezvous.c, run on libuv's thread pool so the loop never blocks), runs the round's
 * local workers (workers.c), watches the round's restart key and beats the heartbeat.
 *
 * Decides nothing itself: every callback becomes an agent_sm event, and the actions agent_sm_step
 * returns (join, start or stop workers, report, the exit barrier, exit) become calls here. What
 * this file owns is the work in flight: the store clients, the thread-pool jobs, the heartbeat
 * clock, the root-cause summary's files, and closing everything at the end.
 *
 * One node (--standalone, or --nnodes 1) needs no rendezvous. Several nodes rendezvous through
 * the store: c10d (elastic MIN:MAX, heartbeats) or static (node 0 hosts MASTER_ADDR:MASTER_PORT,
 * --node-rank orders the nodes). */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent/agent_sm.h"
#include "clock.h"
#include "commands.h"
#include "ddp_error.h"
#include "workers/console.h"
#include "workers/error_file.h"
#include "exit_codes.h"
#include "fs.h"
#include "json_lines.h"
#include "rdzv/liveness.h"
#include "memory/memory_peer.h"
#include "memory/memory_region.h"
#include "log.h"
#include "options.h"
#include "agent/port_holder.h"
#include "agent/run_dir.h"
#include "rdzv/rendezvous.h"
#include "rdzv/rdzv_kv.h"
#include "store/store_server.h"
#include "workers/spares.h"
#include "workers/workers.h"

#define STORE_LINGER_MS      5000
#define EXIT_GRACE_MS        2000 /* after a signal, for what is on the thread pool to come back */
#define EVENT_QUEUE_LEN      8
#define JOIN_LOST_ROUNDS_MAX 16   /* rounds one join ends for members lost while they gathered */
#define REPORT_RETRY_MS      1000 /* between tries of a restart report the store did not take */

/* A blocking rendezvous call on libuv's thread pool. Each job owns what its thread reads and
 * writes (a copy of what the action asked for, and the result), so the loop and the thread share
 * nothing else while it runs. is_busy: queued, its after-callback not yet run. */
typedef struct {
    uv_work_t req;
    bool is_busy;
    int rc;
    rdzv_result_t round; /* the round it is for */
} job_t;

typedef struct {
    uv_loop_t *loop;
    ddprun_opts_t *opts;
    store_server_t *store;
    workers_t *workers;
    spares_t *spares; /* --warm-spares 1, else NULL */
    uv_signal_t sig_handles[DDP_MAX_SIGNALS];
    uv_timer_t exit_deadline; /* after a signal: see arm_exit_deadline */
    bool is_exit_deadline_armed;
    uv_timer_t linger;
    char self_exe[PATH_MAX];
    char shim_exe[PATH_MAX]; /* ddprun-shim, else self_exe (`ddprun __shim`) */
    char run_dir[1200];
    int run_dir_lock;           /* held while the agent lives (run_dir.h); -1 with --log-dir */
    char memory_dir[1200];      /* memory snapshots (memory_region), "" when none */
    memory_peer_t *memory_peer; /* their copies to and from other nodes, or NULL */
    char master_addr[256];
    uint16_t master_port;
    int exit_code;
    agent_sm_t sm; /* the round and every decision about it */
    /* Events raised while actions are carried out (workers_start may end its set before it
     * returns) wait here, in order, so that each step sees the state the last one left. */
    agent_sm_event_t queue[EVENT_QUEUE_LEN];
    int queue_head, queue_len;
    bool is_dispatching;
    /* several nodes */
    rdzv_t rdzv;
    bool is_etcd;           /* etcd: leases instead of heartbeat counters, a store per round */
    bool is_endpoint_taken; /* the endpoint is local, and binding it failed: we are a client */
    rdzv_lease_t *lease;    /* etcd: this agent's, shared by its clients */
    rdzv_kv_t *ops;         /* join, report, exit barrier: one at a time */
    rdzv_kv_t *watch;       /* blocked in the restart WAIT of the round */
    rdzv_kv_t *hb;          /* heartbeats (etcd: lease refreshes), with short deadlines */
    rdzv_kv_t *alive;       /* etcd: blocked until a member's lease expires */
    struct join_job {
        job_t job;
        agent_sm_join_plan_t plan;
        rdzv_result_t joined;
        bool is_refunded;
        rdzv_kv_t **failed_client; /* a client whose connect failed, for join_after_cb */
        char err[AGENT_SM_TEXT_BYTES];
    } join;
    struct {
        job_t job;
        char why[256]; /* the restart key's value */
    } watching;
    struct {
        job_t job;
        rdzv_why_t why;
        char failure[2048]; /* for `ddprun status`: the local failure's record, or "" */
        uv_timer_t retry;   /* a failed report is sent again while the round waits on it */
        bool is_retry_open;
    } report;
    job_t barrier;
    bool is_barrier_interrupted; /* a failure elsewhere: its client is then replaced */
    struct {
        job_t job;         /* on a client of its own: the barrier's waits in ops */
        rdzv_kv_t *client; /* published before it connects (finish interrupts it) */
        int member, is_counted;
        char err[256];
        bool is_pending[RDZV_MAX_NODES]; /* lost while another was being counted: next */
    } barrier_lost;
    /* heartbeats: a node that stops beating (killed, partitioned) ends the round */
    struct beat_job {
        job_t job;
        int64_t fresh[RDZV_MAX_NODES]; /* counters the beat read */
        uv_timer_t timer;
        bool is_timer_open;
        uint64_t ok_ms;         /* last heartbeat the store took */
        int n_failed;           /* beats that failed since */
        bool is_lease_only;     /* etcd between rounds: only keep this agent's lease alive */
        bool is_job_lease_only; /* ... as the job in flight was queued */
        bool is_lease_lost_said;
        bool is_renewed;       /* the last keep_alive found the lease expired and renewed it */
        bool is_unconnected;   /* the beat's client could not connect: hb_after_cb destroys it */
        char connect_err[256]; /* why, for the messages that would ask the client */
        liveness_t members;    /* judges the counters (a spare: the members', etcd: their keys) */
        bool known[RDZV_MAX_NODES]; /* the job's copy of liveness.known (the store's ring) */
    } beat;
    struct {
        job_t job;
        int lost;            /* the join index whose lease expired, -1: none */
        bool is_wanted;      /* a round's liveness watch should run (restart it when it returns) */
        bool is_unconnected; /* its client could not connect: liveness_after_cb destroys it */
        int known_round;     /* the round of known[] */
        bool known[RDZV_MAX_NODES]; /* seen lost in known_round already (known_lost) */
    } liveness;
} agent_t;

static void dispatch(agent_t *a, const agent_sm_event_t *ev);
static void queue_job(agent_t *a, job_t *job, const rdzv_result_t *round, uv_work_cb work,
                      uv_after_work_cb after);

static void post(agent_t *a, agent_sm_event_kind_t kind) {
    agent_sm_event_t ev = {.kind = kind};
    dispatch(a, &ev);
}

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

/* After the end: hang up the clients no job uses any more (so a hosting agent's linger can end);
 * called again by each job that comes back. */
static void close_idle_clients(agent_t *a) {
    if (a->watch && !a->watching.job.is_busy && !a->join.job.is_busy) {
        rdzv_kv_destroy(a->watch);
        a->watch = NULL;
    }
    if (a->ops && !a->join.job.is_busy && !a->report.job.is_busy && !a->barrier.is_busy) {
        rdzv_kv_destroy(a->ops);
        a->ops = NULL;
    }
}

/* The last resort after a signal: a job blocked on the thread pool (a store or etcd that does not
 * answer an interrupted request) must not keep the agent alive. Workers are gone by then, or go
 * with the agent (their shims' lifelines). */
static void on_exit_deadline(uv_timer_t *t) {
    agent_t *a = t->data;
    LOG_ERROR("still waiting for the %s %g s after the signal: exiting now",
              a->join.job.is_busy       ? "rendezvous"
              : a->report.job.is_busy   ? "report to the other agents"
              : a->barrier.is_busy      ? "exit barrier"
              : a->watching.job.is_busy ? "restart watch"
                                        : "store",
              (double)uv_timer_get_repeat(t) / 1000);
    console_stop(1000);
    fflush(NULL);
    _exit(a->sm.state == AGENT_SM_DONE ? a->exit_code : 128 + a->sm.stop_signal);
}

/* Arm the last resort once, on the first signal: an agent without workers gets EXIT_GRACE_MS,
 * one with workers --shutdown-timeout more (the SIGKILL comes then). Unreferenced: it never keeps
 * the loop alive by itself. */
static void arm_exit_deadline(agent_t *a) {
    if (a->is_exit_deadline_armed) return;
    a->is_exit_deadline_armed = true;
    uint64_t ms = EXIT_GRACE_MS;
    if (a->workers && a->sm.state != AGENT_SM_DONE)
        ms += (uint64_t)(a->opts->shutdown_timeout_s * 1000);
    uv_timer_init(a->loop, &a->exit_deadline);
    a->exit_deadline.data = a;
    uv_timer_start(&a->exit_deadline, on_exit_deadline, ms, ms); /* repeat: for its message */
    uv_unref((uv_handle_t *)&a->exit_deadline);
}

/* End the request (or connect) in flight on the client a pool job's thread publishes in *slot:
 * the thread stores it before connecting it (rdzv_kv_connect), so the loop reads it atomically. */
static void interrupt_published(rdzv_kv_t **slot) {
    rdzv_kv_t *c = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (c) c->ops->interrupt(c);
}

/* AGENT_ACT_EXIT: close what keeps the loop running; jobs still in flight close their own
 * clients when they come back. */
static void finish(agent_t *a, int code) {
    a->exit_code = code;
    memory_peer_stop(a->memory_peer);
    a->memory_peer = NULL;
    if (a->spares) spares_destroy(a->spares);
    a->spares = NULL;
    for (int i = 0; i < a->opts->n_signals; i++)
        uv_close((uv_handle_t *)&a->sig_handles[i], NULL);
    if (a->report.is_retry_open) {
        uv_close((uv_handle_t *)&a->report.retry, NULL);
        a->report.is_retry_open = false;
    }
    if (a->beat.is_timer_open) {
        uv_close((uv_handle_t *)&a->beat.timer, NULL);
        a->beat.is_timer_open = false;
    }
    /* a beat in flight may be reconnecting to a store that is gone (up to half the heartbeat
     * timeout): end it (still queued: it never runs), its callback destroys the client */
    if (a->beat.job.is_busy) {
        uv_cancel((uv_req_t *)&a->beat.job.req);
        interrupt_published(&a->hb);
    }
    if (a->hb && !a->beat.job.is_busy) {
        rdzv_kv_destroy(a->hb);
        a->hb = NULL;
    }
    a->liveness.is_wanted = false;
    if (a->liveness.job.is_busy) interrupt_published(&a->alive);
    if (a->alive && !a->liveness.job.is_busy) {
        rdzv_kv_destroy(a->alive);
        a->alive = NULL;
    }
    if (a->watch && a->watching.job.is_busy)
        a->watch->ops->interrupt(a->watch); /* end its WAIT too */
    if (a->barrier_lost.job.is_busy) {
        uv_cancel((uv_req_t *)&a->barrier_lost.job.req);
        interrupt_published(&a->barrier_lost.client);
    }
    close_idle_clients(a);
    if (!a->store) return;
    /* after a signal nobody waits: the store goes with its host (the other agents then lose it
     * and leave, as they would if the host had been killed) */
    if (!a->sm.cfg.is_multi || a->sm.stop_signal) {
        store_server_stop(a->store, NULL, NULL);
        return;
    }
    /* Other agents may still read the round's keys: keep the store until they hang up. */
    uv_timer_init(a->loop, &a->linger);
    a->linger.data = a;
    uv_timer_start(&a->linger, on_linger, 100, 100);
}

static void print_root_cause(agent_t *a, const agent_sm_exit_t *r, const rdzv_result_t *round) {
    char how[64];
    if (r->term_signal)
        snprintf(how, sizeof how, "was killed by signal %d (%s)", r->term_signal,
                 strsignal(r->term_signal));
    else
        snprintf(how, sizeof how, "exited with %d", r->exit_status);
    console_printf(
        2,
        "ddprun: root cause: node %d rank %d (local rank %d, pid %d) %s on attempt %d "
        "of %d\n",
        round->group_rank, r->rank, r->local_rank, r->pid, how,
        /* failures, this one included: rounds also change with membership, not attempts */
        a->sm.failures > 0 ? a->sm.failures : round->round + 1, a->opts->max_restarts + 1);
    const char *tail = a->workers ? workers_tail(a->workers, r->local_rank) : "";
    if (*tail) {
        const char *p = tail;
        int lines = 0;
        for (const char *q = tail + strlen(tail); q > tail; q--)
            if (q[-1] == '\n' && ++lines > 10) { /* the last 10 lines */
                p = q;
                break;
            }
        console_printf(2, "ddprun: last lines of its stderr:\n%s%s", p,
                       tail[strlen(tail) - 1] == '\n' ? "" : "\n");
    }
    char error_file[1400];
    snprintf(error_file, sizeof error_file, "%s/attempt_%d/%d/error.json", a->run_dir, round->round,
             r->local_rank);
    /* a PyTorch script's @record left the exception and its traceback: the real root cause */
    error_file_t ef;
    int rc = error_file_read(error_file, &ef);
    char *text = NULL;
    size_t text_len = 0;
    FILE *f = rc == 0 ? open_memstream(&text, &text_len) : NULL;
    if (f) { /* behind what the console queue holds */
        error_file_print(&ef, f);
        fclose(f);
        console_write(2, text, text_len);
        free(text);
    } else if (rc == 0) {
        error_file_print(&ef, stderr);
    } else if (rc != -ENOENT) {
        console_printf(2, "ddprun: %s is not a PyTorch error file (ignored)\n", error_file);
    }
}

/* ---- workers ------------------------------------------------------------------------------ */

static void on_worker_exit(workers_t *w, const worker_result_t *r, void *arg) {
    agent_t *a = arg;
    if (w != a->workers) return; /* a previous round's worker, given up on when it was stopped */
    agent_sm_event_t ev = {.kind = AGENT_EV_WORKER_EXITED,
                           .exit = {.rank = r->rank,
                                    .local_rank = r->local_rank,
                                    .pid = r->pid,
                                    .exit_status = r->exit_status,
                                    .term_signal = r->term_signal}};
    dispatch(a, &ev);
}

static void on_workers_done(workers_t *w, void *arg) {
    agent_t *a = arg;
    if (w != a->workers) return; /* a previous round's set, already replaced */
    post(a, AGENT_EV_WORKERS_DONE);
}

/* Spares start only beside a round that trains: on a GPU, one started while the round's workers
 * still allocate could take the memory they need. */
static bool round_is_training(void *arg) {
    agent_t *a = arg;
    return a->workers && workers_are_training(a->workers);
}

/* AGENT_ACT_START_WORKERS. A start that fails stops the workers it started, which may end the set
 * before workers_start returns: that WORKERS_DONE is queued ahead of START_FAILED. */
static void start_workers(agent_t *a, const agent_sm_action_t *act) {
    char attempt_dir[1300], err[512];
    snprintf(attempt_dir, sizeof attempt_dir, "%s/attempt_%d", a->run_dir, act->round.round);
    workers_spec_t spec = {.opts = a->opts,
                           .shim_exe = a->shim_exe,
                           .run_id = a->opts->rdzv_id,
                           .attempt = act->round.round,
                           .restart_count = act->restart_count,
                           .group_rank = act->round.group_rank,
                           .group_world_size = act->round.group_world_size,
                           .rank_offset = act->round.rank_offset,
                           .world_size = act->round.world_size,
                           .master_addr = a->master_addr,
                           .master_port = a->master_port,
                           .attempt_dir = attempt_dir,
                           .spares = a->spares,
                           .memory_dir = a->memory_dir};
    memory_peer_round(a->memory_peer, act->round.round, act->round.group_rank,
                      act->round.group_world_size, act->round.next_peer_host,
                      act->round.next_peer_port);
    if (act->round.store_host[0]) { /* etcd: the round's store is its node 0's */
        spec.master_addr = act->round.store_host;
        spec.master_port = act->round.store_port;
    }
    int rc = workers_start(a->loop, &spec, on_worker_exit, on_workers_done, a, &a->workers, err,
                           sizeof err);
    if (rc == 0) {
        post(a, AGENT_EV_START_OK);
        return;
    }
    LOG_ERROR("%s", err);
    agent_sm_event_t ev = {.kind = AGENT_EV_START_FAILED, .has_workers = a->workers != NULL};
    dispatch(a, &ev);
}

/* ---- reports, the restart watch, the exit barrier ------------------------------------------ */

/* A local worker's failure as `ddprun status` shows it: node, rank, exit code or signal, time, and
 * the first lines of its error (the PyTorch error file's message, else the end of its stderr). */
static void describe_failure(agent_t *a, const rdzv_result_t *round, char *out, size_t out_len) {
    out[0] = '\0';
    if (!a->sm.has_failure) return;
    const agent_sm_exit_t *r = &a->sm.root_cause;
    cJSON *o = json_line_new("failure");
    json_line_int(o, "node", round->group_rank);
    json_line_int(o, "rank", r->rank);
    json_line_int(o, "round", round->round);
    if (r->term_signal)
        json_line_int(o, "signal", r->term_signal);
    else
        json_line_int(o, "exit_code", r->exit_status);
    char error_file[1400];
    snprintf(error_file, sizeof error_file, "%s/attempt_%d/%d/error.json", a->run_dir, round->round,
             r->local_rank);
    error_file_t ef;
    if (error_file_read(error_file, &ef) == 0) {
        json_line_str(o, "error", ef.message);
    } else if (a->workers) {
        const char *tail = workers_tail(a->workers, r->local_rank);
        size_t n = strlen(tail);
        json_line_str(o, "error", n > 400 ? tail + n - 400 : tail);
    }
    char *text = json_line_text(o);
    cJSON_Delete(o);
    if (text && strlen(text) < out_len) strcpy(out, text);
    cJSON_free(text);
}

static void report_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const rdzv_result_t *round = &a->report.job.round;
    /* best effort (status only), but a closed connection ends the report: it may be an interrupt
     * (a silent store), which this call spent, and the request would connect again, with a bound
     * of its own, to a store that does not answer; report_after_cb sends it again if wanted */
    if (a->report.failure[0] &&
        rdzv_publish_failure(&a->rdzv, a->ops, round->round, round->group_rank,
                             a->report.failure) == DDP_ECLOSED) {
        a->report.job.rc = DDP_ECLOSED;
        return;
    }
    a->report.job.rc =
        rdzv_request_restart(&a->rdzv, a->ops, a->report.job.round.round, &a->report.why);
}

static void report_after_cb(uv_work_t *req, int status);

/* The report's retry: again while the round still waits on it, else done (the store's silence or
 * a signal decided meanwhile). */
static void on_report_retry(uv_timer_t *t) {
    agent_t *a = t->data;
    if (a->report.job.is_busy || a->sm.state == AGENT_SM_DONE) return;
    if (agent_sm_report_is_wanted(&a->sm, a->report.job.round.round))
        queue_job(a, &a->report.job, &a->report.job.round, report_work_cb, report_after_cb);
    else
        post(a, AGENT_EV_REPORT_DONE);
}

static void report_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->report.job.is_busy = false;
    /* the others learn of this round's end only through this report (the heartbeats still say
     * this node lives): a failed one goes again, until it is taken or the store is judged
     * silent; said before the clients close: leaving (DONE) destroys the one that failed */
    bool is_again = a->report.job.rc < 0 && a->sm.state != AGENT_SM_DONE &&
                    agent_sm_report_is_wanted(&a->sm, a->report.job.round.round);
    if (a->report.job.rc < 0)
        LOG_ERROR("cannot tell the other agents to restart: %s%s", a->ops->ops->error(a->ops),
                  is_again ? " (trying again in 1 s)" : "");
    if (is_again) {
        if (!a->report.is_retry_open) {
            uv_timer_init(a->loop, &a->report.retry);
            a->report.retry.data = a;
            a->report.is_retry_open = true;
        }
        uv_timer_start(&a->report.retry, on_report_retry, REPORT_RETRY_MS, 0);
        return;
    }
    if (a->sm.state == AGENT_SM_DONE) close_idle_clients(a);
    post(a, AGENT_EV_REPORT_DONE);
}

static void watch_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    a->watching.job.rc = rdzv_wait_restart(&a->rdzv, a->watch, &a->watching.job.round,
                                           a->watching.why, sizeof a->watching.why);
}

static void watch_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->watching.job.is_busy = false;
    if (a->sm.state == AGENT_SM_DONE) {
        close_idle_clients(a);
        return;
    }
    agent_sm_event_t ev = {.kind = AGENT_EV_RESTART_SEEN};
    if (a->watching.job.rc < 0) {
        LOG_ERROR("lost the job's store while watching round %d: %s", a->watching.job.round.round,
                  a->watch->ops->error(a->watch));
        ev.is_store_lost = true;
        /* the round ends on it: a report in flight to that store would wait out its operation
         * bound (join_timeout + read_timeout, 11 minutes) on one that froze */
        if (a->report.job.is_busy && a->ops) a->ops->ops->interrupt(a->ops);
    } else {
        ev.is_valid = rdzv_record_why_parse(a->watching.why, strlen(a->watching.why), &ev.why);
        if (ev.is_valid)
            rdzv_record_why_describe(&ev.why, ev.text, sizeof ev.text);
        else
            snprintf(ev.text, sizeof ev.text, "an unreadable restart record");
    }
    dispatch(a, &ev);
}

static void finish_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const rdzv_result_t *round = &a->barrier.round;
    /* numbered as the judges number a lost member: etcd by join index, the store by group rank */
    a->barrier.rc = rdzv_finish(&a->rdzv, a->ops, round->round, round->group_world_size,
                                a->is_etcd ? round->join_index : round->group_rank,
                                (int64_t)(a->opts->join_timeout_s * 1000));
    if (a->barrier.rc == 0 && a->is_etcd && a->barrier.round.group_rank == 0 &&
        rdzv_retire(&a->rdzv, a->ops, a->barrier.round.world_size) < 0) /* best effort */
        LOG_WARN("the job's record on etcd will not expire: %s", a->ops->ops->error(a->ops));
}

static void finish_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->barrier.is_busy = false;
    if (a->sm.state == AGENT_SM_DONE) {
        close_idle_clients(a);
        return;
    }
    if (a->is_barrier_interrupted) {
        /* the next round's join connects again: an interrupted client is in no state to reuse
         * (a WAIT left in flight, or an interrupt still pending if the barrier had just ended) */
        a->is_barrier_interrupted = false;
        rdzv_kv_destroy(a->ops);
        a->ops = NULL;
    } else if (a->barrier.rc < 0) {
        LOG_WARN("not every node confirmed the end of the job: %s", a->ops->ops->error(a->ops));
    }
    post(a, AGENT_EV_FINISH_DONE);
}

/* ---- heartbeats --------------------------------------------------------------------------- */

/* How long the store (etcd: our lease) may go without taking a heartbeat. */
static double beat_limit_s(const agent_t *a) {
    return a->is_etcd ? a->opts->lease_ttl_s : a->opts->heartbeat_timeout_s;
}

/* The members of the current round seen lost so far (by the judges' numbering: etcd join index,
 * the store group rank), emptied when a new round begins. Loop thread. */
static bool *known_lost(agent_t *a) {
    if (a->liveness.known_round != a->sm.round.round) {
        memset(a->liveness.known, 0, sizeof a->liveness.known);
        a->liveness.known_round = a->sm.round.round;
    }
    return a->liveness.known;
}

static void barrier_lost_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const rdzv_result_t *round = &a->barrier_lost.job.round;
    int64_t limit_ms = (int64_t)(beat_limit_s(a) * 1000);
    int rc = rdzv_kv_connect(a->opts, a->lease, limit_ms, limit_ms, &a->barrier_lost.client);
    rdzv_kv_t *c = a->barrier_lost.client; /* destroyed by barrier_lost_after_cb */
    if (rc == 0)
        rc = rdzv_finish_lost(&a->rdzv, c, round->round, round->group_world_size,
                              a->barrier_lost.member,
                              a->is_etcd ? round->join_index : round->group_rank);
    a->barrier_lost.is_counted = rc;
    a->barrier_lost.err[0] = '\0';
    if (rc < 0 && c)
        snprintf(a->barrier_lost.err, sizeof a->barrier_lost.err, "%s", c->ops->error(c));
}

static void barrier_lost_after_cb(uv_work_t *req, int status) {
    agent_t *a = req->data;
    a->barrier_lost.job.is_busy = false;
    rdzv_kv_destroy(a->barrier_lost.client);
    a->barrier_lost.client = NULL;
    if (status == UV_ECANCELED) return; /* finish took it off the queue */
    if (a->barrier_lost.is_counted < 0) /* the barrier's timeout still ends the wait */
        LOG_WARN("could not count the lost member #%d done: %s", a->barrier_lost.member,
                 a->barrier_lost.err[0] ? a->barrier_lost.err
                                        : ddp_strerror(a->barrier_lost.is_counted));
    else
        LOG_DEBUG("the lost member #%d is counted done (%s)", a->barrier_lost.member,
                  a->barrier_lost.is_counted ? "by this node" : "by another node");
    if (a->sm.state != AGENT_SM_FINISHING) return;
    for (int i = 0; i < RDZV_MAX_NODES; i++)
        if (a->barrier_lost.is_pending[i]) {
            a->barrier_lost.is_pending[i] = false;
            a->barrier_lost.member = i;
            queue_job(a, &a->barrier_lost.job, &a->barrier_lost.job.round, barrier_lost_work_cb,
                      barrier_lost_after_cb);
            return;
        }
}

static void hb_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    const ddprun_opts_t *o = a->opts;
    a->beat.job.rc = 0;
    a->beat.is_renewed = false;
    if (!a->hb) {
        /* the store's beats give up at half the limit: the two failures in a row that decide
         * (hb_after_cb) then fit in about the limit, not in twice it (a SIGSTOPped store made
         * the agents leave after 2.25 x heartbeat_timeout); etcd's lease calls bound each
         * member by themselves and need the whole TTL to try the others */
        int64_t limit_ms = (int64_t)(beat_limit_s(a) * 1000);
        int64_t op_ms = a->is_etcd ? limit_ms : limit_ms / 2;
        a->beat.job.rc = rdzv_kv_connect(o, a->lease, op_ms, op_ms, &a->hb);
        if (a->beat.job.rc < 0) {
            /* destroyed by hb_after_cb, on the loop's thread, which may be interrupting it */
            snprintf(a->beat.connect_err, sizeof a->beat.connect_err, "%s",
                     a->hb ? a->hb->ops->error(a->hb) : ddp_strerror(a->beat.job.rc));
            LOG_DEBUG("heartbeat: %s", a->beat.connect_err);
            a->beat.is_unconnected = true;
            return;
        }
    }
    const rdzv_result_t *round = &a->beat.job.round;
    if (a->beat.is_job_lease_only) { /* joining: nothing to judge */
        a->beat.job.rc = a->hb->ops->keep_alive(a->hb, &a->beat.is_renewed);
        return;
    }
    if (a->is_etcd)
        a->beat.job.rc = a->hb->ops->keep_alive(a->hb, &a->beat.is_renewed);
    else if (round->is_member)
        a->beat.job.rc = rdzv_heartbeat(&a->rdzv, a->hb, round, a->beat.known, a->beat.fresh);
    /* a spare beats for no round (etcd: it keeps its lease) and reads whether the members live */
    if (a->beat.job.rc == 0 && !round->is_member)
        a->beat.job.rc = rdzv_read_members(&a->rdzv, a->hb, round, a->beat.fresh);
}

/* Judges staleness on this node's monotonic clock: counters, not the peers' clocks. */
static void hb_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    struct beat_job *b = &a->beat;
    b->job.is_busy = false;
    const char *why = b->is_unconnected ? b->connect_err : NULL;
    if (a->sm.state == AGENT_SM_DONE || b->is_unconnected) {
        b->is_unconnected = false;
        rdzv_kv_destroy(a->hb);
        a->hb = NULL;
        if (a->sm.state == AGENT_SM_DONE) return;
    }
    if (!why) why = a->hb->ops->error(a->hb); /* the messages below: the client may be gone */
    /* a lease that had expired was renewed: the round's members see this agent lost and end
     * the round (its alive key vanished); this agent goes on to the next */
    if (b->is_renewed) LOG_WARN("%s", why);
    if (b->is_job_lease_only) {
        /* once: the join goes on, and the round's members will see this agent lost */
        if (b->job.rc == DDP_ELEASE && !b->is_lease_lost_said) LOG_WARN("%s (while joining)", why);
        b->is_lease_lost_said |= b->job.rc == DDP_ELEASE;
        return;
    }
    bool is_judging = agent_sm_is_beating(&a->sm, b->job.round.round);
    if (!is_judging && !agent_sm_needs_store(&a->sm, b->job.round.round))
        return; /* that round is over */
    uint64_t now = clock_now_ms();
    uint64_t limit_ms = (uint64_t)(beat_limit_s(a) * 1000);
    if (b->job.rc == DDP_ELEASE) {
        LOG_ERROR("%s: leaving the job", why);
        post(a, AGENT_EV_STORE_SILENT);
        return;
    }
    if (b->job.rc < 0) {
        /* one failed beat never decides: this agent may itself have been stopped (SIGSTOP, a
         * paused VM) with the beat in flight, which then times out as it wakes; the next one
         * tells whether the store is silent or this agent's lease merely expired (renewed) */
        if (++b->n_failed < 2 || now - b->ok_ms <= limit_ms) return;
        if (a->is_etcd)
            LOG_ERROR("etcd at %s took no lease refresh for %g s: leaving the job",
                      a->opts->rdzv_endpoints, beat_limit_s(a));
        else
            LOG_ERROR("the job's store at %s:%u took no heartbeat for %g s: leaving the job",
                      a->opts->rdzv_host, a->opts->rdzv_port, a->opts->heartbeat_timeout_s);
        /* a restart report in flight to that store would wait out its operation bound */
        if (a->report.job.is_busy && a->ops) a->ops->ops->interrupt(a->ops);
        post(a, AGENT_EV_STORE_SILENT);
        return;
    }
    b->ok_ms = now;
    b->n_failed = 0;
    if (!is_judging) return; /* a failure here: the store, not the peers, is what it waits on */
    const rdzv_result_t *round = &a->sm.round;
    if (a->is_etcd && round->is_member) return; /* peers: their leases (liveness_after_cb) */
    int lost =
        liveness_judge(&b->members, b->fresh, round->is_member ? round->group_rank : -1, now);
    if (lost < 0) return;
    if (round->is_member)
        LOG_WARN("node %d sent no heartbeat for %g s: ending round %d without it", lost,
                 beat_limit_s(a), round->round);
    else if (a->is_etcd) /* its members may all be gone: nobody else would end the round */
        LOG_WARN("round %d runs without this agent, but the member that joined it as #%d has "
                 "had no etcd lease for %g s: asking for the next round",
                 round->round, lost, beat_limit_s(a));
    else
        LOG_WARN("round %d runs without this agent, but its node %d sent no heartbeat for %g s: "
                 "asking for the next round",
                 round->round, lost, beat_limit_s(a));
    known_lost(a)[lost] = true; /* the exit barrier's judge then reads the one after it */
    agent_sm_event_t ev = {.kind = AGENT_EV_PEER_SILENT, .node = lost};
    dispatch(a, &ev);
}

static void on_hb_timer(uv_timer_t *t) {
    agent_t *a = t->data;
    if (a->beat.job.is_busy || a->sm.state == AGENT_SM_DONE) return;
    a->beat.job.is_busy = true;
    a->beat.job.round = a->sm.round;
    memcpy(a->beat.known, known_lost(a), sizeof a->beat.known);
    a->beat.is_job_lease_only = a->beat.is_lease_only;
    a->beat.job.req.data = a;
    uv_queue_work(a->loop, &a->beat.job.req, hb_work_cb, hb_after_cb);
}

/* How often to beat: keep_alive_interval, on etcd at least three times per lease. */
static uint64_t beat_every_ms(const agent_t *a) {
    double every_s = a->opts->keep_alive_interval_s;
    if (a->is_etcd && every_s > a->opts->lease_ttl_s / 3) every_s = a->opts->lease_ttl_s / 3;
    uint64_t every = (uint64_t)(every_s * 1000);
    return every ? every : 1;
}

/* etcd between rounds: the lease must outlive a join that takes long (hundreds of agents
 * contending for the round's counter), else this agent's alive key vanishes while it joins and
 * the round it joined sees it lost. */
static void keep_lease_alive(agent_t *a) {
    struct beat_job *b = &a->beat;
    if (!b->is_timer_open) {
        uv_timer_init(a->loop, &b->timer);
        b->timer.data = a;
        b->is_timer_open = true;
    }
    b->is_lease_only = true;
    uv_timer_start(&b->timer, on_hb_timer, beat_every_ms(a), beat_every_ms(a));
}

/* ---- etcd: a member whose lease expired ends the round ------------------------------------- */

static void liveness_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    a->liveness.lost = -1;
    a->liveness.job.rc = 0;
    if (!a->alive) {
        int64_t limit_ms = (int64_t)(a->opts->lease_ttl_s * 1000);
        a->liveness.job.rc = rdzv_kv_connect(a->opts, a->lease, limit_ms, limit_ms, &a->alive);
        if (a->liveness.job.rc < 0) {
            a->liveness.is_unconnected = true; /* destroyed on the loop's thread (as the beat's) */
            return;
        }
    }
    /* in slices, so a watch that outlives its round ends by itself too */
    a->liveness.job.rc = rdzv_wait_member_lost(&a->rdzv, a->alive, &a->liveness.job.round,
                                               a->liveness.known, 60000, &a->liveness.lost);
}

static void start_liveness(agent_t *a);

static void liveness_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    a->liveness.job.is_busy = false;
    if (a->sm.state == AGENT_SM_DONE || a->liveness.is_unconnected) {
        a->liveness.is_unconnected = false;
        rdzv_kv_destroy(a->alive);
        a->alive = NULL;
        if (a->sm.state == AGENT_SM_DONE) return;
    }
    bool is_current = agent_sm_is_beating(&a->sm, a->liveness.job.round.round);
    if (is_current && a->liveness.job.rc == 0 && a->liveness.lost >= 0) {
        LOG_WARN("the node that joined round %d as #%d lost its etcd lease: ending the round "
                 "without it",
                 a->liveness.job.round.round, a->liveness.lost);
        known_lost(a)[a->liveness.lost] = true;
        agent_sm_event_t ev = {.kind = AGENT_EV_PEER_SILENT, .node = a->liveness.lost};
        dispatch(a, &ev);
        /* in the exit barrier each lost member is counted done: the watch goes on for the
         * others (a running round has ended: the next round starts its own) */
        if (a->sm.state == AGENT_SM_FINISHING && a->liveness.is_wanted) start_liveness(a);
        return;
    }
    if (is_current && a->liveness.job.rc < 0 && a->liveness.job.rc != DDP_ETIMEOUT &&
        a->liveness.job.rc != DDP_ECLOSED && a->alive)
        LOG_DEBUG("liveness watch: %s", a->alive->ops->error(a->alive)); /* keep_alive judges */
    if (a->liveness.is_wanted) start_liveness(a); /* the same round's next slice, or a new round */
}

static void start_liveness(agent_t *a) {
    a->liveness.is_wanted = true;
    if (a->liveness.job.is_busy) { /* the last round's watch: end it, its callback restarts */
        if (a->liveness.job.round.round != a->sm.round.round) interrupt_published(&a->alive);
        return;
    }
    if (a->sm.round.group_world_size < 2 || !agent_sm_is_beating(&a->sm, a->sm.round.round)) {
        a->liveness.is_wanted = false;
        return;
    }
    known_lost(a);
    a->liveness.job.is_busy = true;
    a->liveness.job.round = a->sm.round;
    a->liveness.job.req.data = a;
    uv_queue_work(a->loop, &a->liveness.job.req, liveness_work_cb, liveness_after_cb);
}

static void start_heartbeats(agent_t *a) {
    struct beat_job *b = &a->beat;
    uint64_t now = clock_now_ms();
    b->ok_ms = now;
    b->n_failed = 0;
    liveness_reset(&b->members, a->sm.round.group_world_size, (uint64_t)(beat_limit_s(a) * 1000),
                   now);
    if (!b->is_timer_open) {
        uv_timer_init(a->loop, &b->timer);
        b->timer.data = a;
        b->is_timer_open = true;
    }
    b->is_lease_only = false;
    uv_timer_start(&b->timer, on_hb_timer, 0, beat_every_ms(a));
    if (a->is_etcd && a->sm.round.is_member) start_liveness(a);
}

/* ---- joining ------------------------------------------------------------------------------ */

static void join_work_cb(uv_work_t *req) {
    agent_t *a = req->data;
    struct join_job *j = &a->join;
    const ddprun_opts_t *o = a->opts;
    j->job.rc = 0;
    j->is_refunded = false;
    rdzv_kv_t **clients[2] = {&a->ops, &a->watch};
    for (int i = 0; i < 2 && j->job.rc == 0; i++) {
        if (*clients[i]) continue;
        j->job.rc =
            rdzv_kv_connect(o, a->lease, (int64_t)(o->join_timeout_s * 1000),
                            (int64_t)((o->join_timeout_s + o->read_timeout_s) * 1000), clients[i]);
        if (j->job.rc < 0) {
            snprintf(j->err, sizeof j->err, "%s",
                     *clients[i] ? (*clients[i])->ops->error(*clients[i])
                                 : ddp_strerror(j->job.rc));
            port_holder_t holder; /* who holds the port now, if the endpoint is ours */
            if (a->is_endpoint_taken) port_holder_find(o->rdzv_port, &holder);
            if (a->is_endpoint_taken && !holder.is_listening) {
                size_t n = strlen(j->err);
                snprintf(j->err + n, sizeof j->err - n, "; port %u on this machine is held by %s",
                         o->rdzv_port,
                         holder.is_found ? holder.text : "a socket this machine does not list");
            }
            j->failed_client = clients[i]; /* destroyed on the loop: INTERRUPT_JOIN may use it */
        }
    }
    int round = j->plan.round, current = 0;
    if (j->job.rc == 0)
        j->job.rc = rdzv_current_round(&a->rdzv, a->ops, &current, j->err, sizeof j->err);
    if (j->job.rc == 0 && round == 0) { /* this agent's first join */
        int has_failed = rdzv_job_has_failed(&a->rdzv, a->ops, current, j->err, sizeof j->err);
        j->job.rc = has_failed > 0 ? -ECANCELED : has_failed;
    }
    for (int lost = 0; j->job.rc == 0; lost++) {
        int at = current > round ? current : round;
        j->job.rc = rdzv_join(&a->rdzv, a->ops, at, &j->joined, j->err, sizeof j->err);
        if (j->job.rc != DDP_ELOST || lost == JOIN_LOST_ROUNDS_MAX) break;
        /* a member died while the round gathered: that round can never start; the next */
        LOG_WARN("%s", j->err);
        rdzv_why_t why = {.code = 0, .node = -1, .rank = -1};
        char why_err[512] = "";
        if ((j->job.rc = rdzv_request_restart(&a->rdzv, a->ops, at, &why)) < 0)
            snprintf(why_err, sizeof why_err, "%s", a->ops->ops->error(a->ops));
        else if ((j->job.rc = rdzv_current_round(&a->rdzv, a->ops, &current, why_err,
                                                 sizeof why_err)) == 0 &&
                 current <= at)
            current = at + 1;
        if (j->job.rc < 0) snprintf(j->err, sizeof j->err, "ending round %d: %s", at, why_err);
    }
    if (j->job.rc == 0 && j->joined.is_member) { /* for `ddprun status`; best effort */
        /* the job's settings are the same from every agent: node 0's put is enough (on etcd
         * each put is a raft proposal; N of them a round said the same thing N times) */
        if (j->joined.group_rank == 0) rdzv_publish_job(&a->rdzv, a->ops);
        rdzv_publish_member(&a->rdzv, a->ops, &j->joined);
    }
    /* A lost node's restart is given back once, in the store, by the new round's node 0. */
    j->is_refunded = j->job.rc == 0 && agent_sm_join_is_refund(&j->plan, &j->joined);
    if (j->is_refunded && j->joined.group_rank == 0)
        j->job.rc = rdzv_refund_failure(&a->rdzv, a->ops);
}

static void join_after_cb(uv_work_t *req, int status) {
    (void)status;
    agent_t *a = req->data;
    struct join_job *j = &a->join;
    j->job.is_busy = false;
    if (j->failed_client) {
        rdzv_kv_destroy(*j->failed_client);
        *j->failed_client = NULL;
        j->failed_client = NULL;
    }
    if (a->sm.state == AGENT_SM_DONE) { /* left while it joined (a signal) */
        close_idle_clients(a);
        return;
    }
    agent_sm_event_t ev = {.kind = AGENT_EV_JOIN_DONE,
                           .rc = j->job.rc,
                           .joined = j->joined,
                           .is_refunded = j->is_refunded};
    snprintf(ev.text, sizeof ev.text, "%s", j->err);
    dispatch(a, &ev);
}

/* ---- carrying out the state machine's actions --------------------------------------------- */

/* Queue a thread-pool job for `round`; the thread reads only the job and the agent's clients. */
static void queue_job(agent_t *a, job_t *job, const rdzv_result_t *round, uv_work_cb work,
                      uv_after_work_cb after) {
    job->is_busy = true;
    job->round = *round;
    job->req.data = a;
    uv_queue_work(a->loop, &job->req, work, after);
}

static void perform(agent_t *a, const agent_sm_action_t *act) {
    switch (act->kind) {
    case AGENT_ACT_SAY:
        if (act->say == AGENT_SAY_PLAIN)
            console_printf(2, "ddprun: %s\n", act->text);
        else
            log_write(act->say == AGENT_SAY_WARN ? LOG_LEVEL_WARN : LOG_LEVEL_INFO, "%s",
                      act->text);
        return;
    case AGENT_ACT_PRINT_ROOT_CAUSE:
        print_root_cause(a, &act->root, &act->round);
        return;
    case AGENT_ACT_JOIN:
        a->join.plan = act->plan;
        queue_job(a, &a->join.job, &act->round, join_work_cb, join_after_cb);
        return;
    case AGENT_ACT_INTERRUPT_JOIN:
        if (a->join.job.is_busy) { /* its two clients */
            interrupt_published(&a->ops);
            interrupt_published(&a->watch);
        }
        return;
    case AGENT_ACT_INTERRUPT_BARRIER:
        if (a->barrier.is_busy && a->ops) {
            a->ops->ops->interrupt(a->ops);
            a->is_barrier_interrupted = true;
        }
        return;
    case AGENT_ACT_WATCH:
        queue_job(a, &a->watching.job, &act->round, watch_work_cb, watch_after_cb);
        return;
    case AGENT_ACT_START_HEARTBEATS:
        start_heartbeats(a);
        return;
    case AGENT_ACT_STOP_HEARTBEATS:
        if (a->is_etcd)
            keep_lease_alive(a);
        else if (a->beat.is_timer_open)
            uv_timer_stop(&a->beat.timer);
        a->liveness.is_wanted = false;
        if (a->liveness.job.is_busy) interrupt_published(&a->alive);
        return;
    case AGENT_ACT_START_WORKERS:
        start_workers(a, act);
        return;
    case AGENT_ACT_STOP_WORKERS:
        if (a->workers) workers_stop(a->workers, act->signum, act->timeout_s);
        return;
    case AGENT_ACT_DESTROY_WORKERS:
        if (a->workers) workers_destroy(a->workers);
        a->workers = NULL;
        return;
    case AGENT_ACT_REPORT:
        a->report.why = act->why;
        describe_failure(a, &act->round, a->report.failure, sizeof a->report.failure);
        queue_job(a, &a->report.job, &act->round, report_work_cb, report_after_cb);
        return;
    case AGENT_ACT_BARRIER:
        queue_job(a, &a->barrier, &act->round, finish_work_cb, finish_after_cb);
        return;
    case AGENT_ACT_BARRIER_LOST:
        if (a->barrier_lost.job.is_busy) { /* one at a time: counted when this one is */
            if (act->code >= 0 && act->code < RDZV_MAX_NODES)
                a->barrier_lost.is_pending[act->code] = true;
            return;
        }
        a->barrier_lost.member = act->code;
        queue_job(a, &a->barrier_lost.job, &act->round, barrier_lost_work_cb,
                  barrier_lost_after_cb);
        return;
    case AGENT_ACT_EXIT:
        finish(a, act->code);
        return;
    }
}

/* Feed one event to the state machine and carry out its actions. An event raised by one of those
 * actions (synchronously, from inside a libuv call) is queued and stepped after them. */
static void dispatch(agent_t *a, const agent_sm_event_t *ev) {
    if (a->queue_len == EVENT_QUEUE_LEN) {
        LOG_ERROR("bug: agent event queue full (%s dropped)", agent_sm_event_name(ev->kind));
        abort();
    }
    a->queue[a->queue_len++] = *ev;
    if (a->is_dispatching) return;
    a->is_dispatching = true;
    while (a->queue_head < a->queue_len) {
        agent_sm_event_t e = a->queue[a->queue_head++];
        agent_sm_actions_t acts;
        LOG_DEBUG("agent: %s in %s", agent_sm_event_name(e.kind), agent_sm_state_name(a->sm.state));
        agent_sm_step(&a->sm, &e, &acts);
        for (int i = 0; i < acts.n; i++)
            perform(a, &acts.a[i]);
    }
    a->queue_head = a->queue_len = 0;
    a->is_dispatching = false;
}

static void on_signal(uv_signal_t *h, int signum) {
    agent_t *a = h->data;
    agent_sm_event_t ev = {.kind = AGENT_EV_SIGNAL, .signum = signum};
    arm_exit_deadline(a);
    dispatch(a, &ev);
}

/* ---- start -------------------------------------------------------------------------------- */

static int prepare_run_dir(agent_t *a) {
    const ddprun_opts_t *o = a->opts;
    if (o->log_dir[0]) {
        /* a directory of this run's own, as torchrun's mkdtemp(prefix=ID_): a rerun of the same
         * id, or another node writing to the same shared --log-dir, keeps its own files */
        if ((size_t)snprintf(a->run_dir, sizeof a->run_dir, "%s/%s_XXXXXX", o->log_dir,
                             o->rdzv_id) >= sizeof a->run_dir)
            return -ENAMETOOLONG;
        char parent[sizeof a->run_dir]; /* an id may hold a '/': its folders too */
        snprintf(parent, sizeof parent, "%.*s", (int)(strrchr(a->run_dir, '/') - a->run_dir),
                 a->run_dir);
        int rc = fs_mkdir_p(parent);
        if (rc < 0) return rc;
        if (!mkdtemp(a->run_dir)) {
            rc = -errno;
            snprintf(a->run_dir, sizeof a->run_dir, "%s/%s_XXXXXX", o->log_dir, o->rdzv_id);
            return rc;
        }
        return fs_check_writable(a->run_dir);
    }
    const char *tmp = getenv("TMPDIR");
    int swept = 0;
    int rc = run_dir_create(tmp && *tmp ? tmp : "/tmp", o->rdzv_id, a->run_dir, sizeof a->run_dir,
                            &a->run_dir_lock, &swept);
    if (swept > 0)
        LOG_INFO("removed %d run director%s of agents that were killed", swept,
                 swept == 1 ? "y" : "ies");
    return rc;
}

/* Host the store if this node owns the endpoint; another agent may already hold it. On etcd every
 * agent serves a store on a free port of --local-addr (else its host name), which the workers of
 * the rounds where it is node 0 use. */
static int host_store(agent_t *a) {
    const ddprun_opts_t *o = a->opts;
    store_server_opts_t so = {
        .host = o->rdzv_host, .port = o->rdzv_port, .secret = o->store_secret};
    char own_host[256] = "";
    /* on etcd even one node, which rendezvouses with nobody: the endpoint is etcd's, not a store's
     */
    if (strcmp(o->rdzv_backend, "etcd") == 0) {
        if (o->local_addr[0])
            snprintf(own_host, sizeof own_host, "%s", o->local_addr);
        else if (gethostname(own_host, sizeof own_host - 1) != 0)
            strcpy(own_host, "127.0.0.1");
        so.host = own_host;
        so.port = 0;
    }
    store_limits_default(&so.limits);
    so.limits.max_value_bytes = o->store_max_value_bytes;
    size_t frame_needed = so.limits.max_key_bytes + so.limits.max_value_bytes + 32;
    if (so.limits.max_frame_bytes < frame_needed) so.limits.max_frame_bytes = frame_needed;
    char err[512];
    bool is_static = strcmp(o->rdzv_backend, "static") == 0;
    int rc = 0;
    bool is_host =
        a->is_etcd || (o->is_host >= 0 ? o->is_host == 1 : !is_static || o->node_rank == 0);
    if (!is_host) { /* node 0 hosts a static job's store; with is_host=false, someone else */
        rc = UV_EADDRINUSE;
        snprintf(err, sizeof err,
                 "--rdzv-conf is_host=false, and a single node needs its own store");
    } else
        rc = store_server_start(a->loop, &so, &a->store, err, sizeof err);
    /* without is_host=true, an endpoint that another agent holds makes us a client */
    if (rc < 0 && a->sm.cfg.is_multi && o->is_host != 1 && !a->is_etcd &&
        (rc == UV_EADDRINUSE || rc == UV_EADDRNOTAVAIL)) {
        a->store = NULL; /* someone else hosts it: we are a client */
        /* a local port that is taken but where nothing listens: every agent would be a client
         * of a store nobody hosts; say so now, naming the holder, not after join_timeout */
        a->is_endpoint_taken = is_host && rc == UV_EADDRINUSE;
        port_holder_t holder = {.is_listening = true};
        if (a->is_endpoint_taken) {
            port_holder_find(o->rdzv_port, &holder);
            if (!holder.is_listening) { /* a store between its bind and its listen: look again */
                usleep(100 * 1000);
                port_holder_find(o->rdzv_port, &holder);
            }
        }
        if (!holder.is_listening)
            LOG_WARN("the rendezvous endpoint %s:%u is on this machine and its port is taken, but "
                     "nothing listens there (%s): no store will answer; this agent waits as a "
                     "client until join_timeout=%gs in case one starts. Free the port or pick "
                     "another endpoint",
                     o->rdzv_host, o->rdzv_port,
                     holder.is_found ? holder.text : "a socket this machine does not list",
                     o->join_timeout_s);
        rc = 0;
    } else if (rc < 0) {
        fprintf(stderr, "ddprun: cannot host the job's store: %s\n", err);
        return rc;
    }
    snprintf(a->master_addr, sizeof a->master_addr, "%s", so.host);
    a->master_port = a->store ? store_server_port(a->store) : so.port;
    return 0;
}

/* The shim every worker starts under: ddprun-shim next to ddprun (the build tree), else where
 * it is installed relative to ddprun (DDP_SHIM_RELPATH: ../libexec/ddprun/ddprun-shim), else
 * ddprun itself (`ddprun __shim`, the same code with the agent's libraries). */
static void find_shim(const char *self_exe, char *out, size_t out_len) {
    const char *paths[] = {"ddprun-shim", DDP_SHIM_RELPATH};
    if (fs_find_beside_self(paths, 2, X_OK, out, out_len) == 0) return;
    size_t len = strnlen(self_exe, out_len - 1);
    memcpy(out, self_exe, len);
    out[len] = '\0';
}

/* The built-in trainer: $DDPWORKER, else next to ddprun (installed), else the build tree's
 * worker/ddpworker (ddprun in build/launcher), else ddpworker on PATH. */
static void find_ddpworker(char *out, size_t out_len) {
    const char *env = getenv("DDPWORKER");
    if (env && *env) {
        snprintf(out, out_len, "%s", env);
        return;
    }
    const char *paths[] = {"ddpworker", "../worker/ddpworker"};
    if (fs_find_beside_self(paths, 2, X_OK, out, out_len) == 0) return;
    snprintf(out, out_len, "ddpworker");
}

/* `ddprun ... train.conf [key=value ...]` runs ddpworker train.conf [key=value ...]. */
static int use_builtin_trainer(ddprun_opts_t *o) {
    static char worker_path[PATH_MAX];
    find_ddpworker(worker_path, sizeof worker_path);
    char **argv = calloc((size_t)o->program_argc + 2, sizeof *argv);
    if (!argv) return -ENOMEM;
    argv[0] = worker_path;
    for (int i = 0; i < o->program_argc; i++)
        argv[i + 1] = o->program_argv[i];
    o->program_argv = argv; /* lives as long as the agent */
    o->program_argc++;
    o->is_no_python = true;
    o->is_module = false;
    return 0;
}

/* What makes a memory directory this job's (memory_region.h): agents with the same run id at
 * the same rendezvous are one job by definition (they gather into its rounds), whatever their
 * program's arguments (a restarted agent may name another metrics file); a standalone run's id is
 * its own, so a new run never takes an old one's state. The workers still check the state's
 * shape against their model. */
static void job_identity(const ddprun_opts_t *o, char *out, size_t len) {
    snprintf(out, len, "run %s\nrendezvous %s %s\nnodes %u:%u\nnproc %d\n", o->rdzv_id,
             o->rdzv_backend, o->rdzv_endpoints, o->min_nodes, o->max_nodes, o->nproc_per_node);
}

static void pool_started(uv_work_t *req) {
    (void)req;
}
static void pool_start_done(uv_work_t *req, int status) {
    (void)req, (void)status;
}

/* libuv reads UV_THREADPOOL_SIZE once, when its first work item starts the pool: start it now,
 * then take the variable out again unless the user set it, so that the workers' environment is
 * the user's (torchrun's workers see no variable of the launcher's own) */
static void widen_uv_pool(uv_loop_t *loop) {
    static uv_work_t start;
    bool user_set = getenv("UV_THREADPOOL_SIZE") != NULL;
    if (!user_set) setenv("UV_THREADPOOL_SIZE", "16", 0);
    uv_queue_work(loop, &start, pool_started, pool_start_done);
    if (!user_set) unsetenv("UV_THREADPOOL_SIZE");
}

int agent_main(ddprun_opts_t *o) {
    static agent_t agent;
    agent_t *a = &agent;
    a->opts = o;
    a->run_dir_lock = -1;
    /* libuv's pool (4 threads by default) runs every blocking step: the exit barrier, the restart
     * wait and the peers' liveness watch can all wait at once for a dead node, and the lease
     * refresh queued behind them let this agent's lease expire too. One node has no peers to wait
     * for: its start pays for no more threads */
    a->loop = uv_default_loop();
    if (o->max_nodes > 1) widen_uv_pool(a->loop);
    agent_sm_config_t cfg = {.is_multi = o->max_nodes > 1,
                             .nproc_per_node = o->nproc_per_node,
                             .max_nodes = (int)o->max_nodes,
                             .max_restarts = o->max_restarts,
                             .shutdown_timeout_s = o->shutdown_timeout_s};
    agent_sm_init(&a->sm, &cfg);
    ssize_t n = readlink("/proc/self/exe", a->self_exe, sizeof a->self_exe - 1);
    if (n <= 0) {
        fprintf(stderr, "ddprun: cannot find its own executable: %s\n", strerror(errno));
        return 1;
    }
    a->self_exe[n] = '\0';
    find_shim(a->self_exe, a->shim_exe, sizeof a->shim_exe);
    const char *prog = o->program_argv[0];
    size_t plen = strlen(prog);
    if (plen > 5 && strcmp(prog + plen - 5, ".conf") == 0 && use_builtin_trainer(o) < 0) {
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
    char mem_err[512], identity[4096];
    int adopted;
    job_identity(o, identity, sizeof identity);
    if (memory_region_create(a->memory_dir, sizeof a->memory_dir, identity, &adopted, mem_err,
                             sizeof mem_err) < 0)
        LOG_WARN("%s: restarts resume from snapshot.dir", mem_err);
    else if (adopted > 0)
        LOG_INFO("memory snapshots: %d file(s) of this job's agent that died on this node taken "
                 "over (its workers' generations and the copies it kept for other nodes)",
                 adopted);
    a->is_etcd = strcmp(o->rdzv_backend, "etcd") == 0 && a->sm.cfg.is_multi;
    char etcd_err[600];
    if (a->is_etcd && rdzv_kv_etcd_check(etcd_err, sizeof etcd_err) < 0) {
        fprintf(stderr, "ddprun: --rdzv-backend etcd: %s\n", etcd_err);
        return 1;
    }
    if (a->is_etcd && !(a->lease = rdzv_lease_new((int64_t)(o->lease_ttl_s + 0.999)))) {
        fprintf(stderr, "ddprun: --rdzv-backend etcd: out of memory\n");
        return 1;
    }
    if (host_store(a) < 0) return 1;
    rdzv_init(&a->rdzv, o, a->store != NULL && !a->is_etcd);
    if (a->is_etcd) {
        rdzv_set_own_store(&a->rdzv, a->master_addr, a->master_port);
        LOG_INFO("run %s: %d worker(s), rendezvous on etcd %s (lease %g s), this node's store on "
                 "%s port %u for the rounds it leads, logs in %s",
                 o->rdzv_id, o->nproc_per_node, o->rdzv_endpoints, o->lease_ttl_s, a->master_addr,
                 a->master_port, a->run_dir);
    } else {
        LOG_INFO("run %s: %d worker(s), store %s %s port %u, logs in %s", o->rdzv_id,
                 o->nproc_per_node, a->store ? "hosted on" : "at", a->master_addr, a->master_port,
                 a->run_dir);
    }
    if (a->memory_dir[0] && a->sm.cfg.is_multi) {
        if (memory_peer_start(a->loop, o, a->memory_dir, &a->memory_peer, mem_err, sizeof mem_err) <
            0) {
            LOG_WARN("%s: memory snapshots stay on this node", mem_err);
        } else {
            const char *peer_host;
            uint16_t peer_port;
            memory_peer_address(a->memory_peer, &peer_host, &peer_port);
            rdzv_set_own_peer(&a->rdzv, peer_host, peer_port);
        }
    }
    for (int i = 0; i < o->n_signals; i++) {
        uv_signal_init(a->loop, &a->sig_handles[i]);
        a->sig_handles[i].data = a;
        uv_signal_start(&a->sig_handles[i], on_signal, o->signals[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    if (o->warm_spares) {
        char err[512];
        if (spares_create(a->loop, o, a->shim_exe, a->run_dir, round_is_training, a, &a->spares,
                          err, sizeof err) < 0)
            LOG_WARN("%s: workers start fresh", err);
    }
    /* the workers' lines and the agent's own go out from a thread: a console that stops reading
     * cannot stop the loop (heartbeats, signals, the shutdown timeout) */
    if (console_start(a->loop, workers_console_room, NULL) < 0)
        LOG_WARN("cannot start the console's writer thread: the console is written directly");
    post(a, AGENT_EV_START);
    uv_run(a->loop, UV_RUN_DEFAULT);
    rdzv_kv_destroy(a->ops);
    rdzv_kv_destroy(a->watch);
    rdzv_lease_free(a->lease);
    memory_region_remove(a->memory_dir);
    /* Without --log-dir the run directory is scratch (error files): kept only for a failure, or
     * when it holds the only copy of output --redirects took off the console (torchrun keeps
     * its temporary log directory too) */
    if (!o->log_dir[0]) {
        bool has_redirects = false;
        for (int i = 0; i < o->nproc_per_node && i < DDP_MAX_LOCAL_WORKERS; i++)
            has_redirects |= o->redirects[i] != 0;
        if (has_redirects && a->exit_code == 0)
            LOG_INFO("the output --redirects took off the console is kept in %s", a->run_dir);
        run_dir_release(a->run_dir, a->run_dir_lock, a->exit_code != 0 || has_redirects);
    }
    /* what is queued goes out first; after a signal, a console that does not read gets 2 s */
    console_stop(a->sm.stop_signal ? 2000 : -1);
    return a->exit_code;
}
