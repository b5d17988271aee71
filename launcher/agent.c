/* agent: `ddprun [options] PROGRAM`, the per-node elastic agent, on one libuv loop. Hosts the
 * store (embedded store_server) the workers reach through MASTER_ADDR/MASTER_PORT, runs one
 * attempt of local workers at a time (workers.c), and on any failure stops them all and starts
 * the next attempt until --max-restarts is spent or the failure is permanent. Exits 0, or with the
 * root-cause worker's code (128+signal if it was killed) after a short summary.
 *
 * This build runs single-node jobs (--standalone, or --nnodes 1 with either backend); rendezvous
 * across nodes is the next step of issue 3. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "exit_codes.h"
#include "log.h"
#include "options.h"
#include "store_server.h"
#include "workers.h"

typedef struct {
    uv_loop_t *loop;
    ddprun_opts_t *opts;
    store_server_t *store;
    workers_t *workers;
    uv_signal_t sig_handles[DDP_MAX_SIGNALS];
    char self_exe[PATH_MAX];
    char run_dir[1200];
    char master_addr[256];
    uint16_t master_port;
    int attempt;
    bool has_failure;
    worker_result_t root_cause;
    int stop_signal; /* a signal we were asked to stop with, 0 if none */
    int exit_code;
    bool is_finished;
} agent_t;

static int start_attempt(agent_t *a);

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
    if (r->term_signal) snprintf(how, sizeof how, "was killed by %s", strsignal(r->term_signal));
    else snprintf(how, sizeof how, "exited with %d", r->exit_status);
    fprintf(stderr, "ddprun: root cause: node %d rank %d (local rank %d, pid %d) %s on attempt %d "
                    "of %d\n", 0, r->rank, r->local_rank, r->pid, how, a->attempt + 1,
            a->opts->max_restarts + 1);
    const char *tail = a->workers ? workers_tail(a->workers, r->local_rank) : "";
    if (*tail) {
        fprintf(stderr, "ddprun: last lines of its stderr:\n");
        const char *p = tail;
        /* at most the last 10 lines */
        int lines = 0;
        for (const char *q = tail + strlen(tail); q > tail; q--)
            if (q[-1] == '\n' && ++lines > 10) {
                p = q;
                break;
            }
        fprintf(stderr, "%s%s", p, tail[strlen(tail) - 1] == '\n' ? "" : "\n");
    }
    char error_file[1400];
    snprintf(error_file, sizeof error_file, "%s/attempt_%d/%d/error.json", a->run_dir, a->attempt,
             r->local_rank);
    print_file_indented(error_file, 2048);
}

static void finish(agent_t *a, int code) {
    if (a->is_finished) return;
    a->is_finished = true;
    a->exit_code = code;
    for (int i = 0; i < a->opts->n_signals; i++) uv_close((uv_handle_t *)&a->sig_handles[i], NULL);
    if (a->store) store_server_stop(a->store, NULL, NULL);
}

static void on_worker_exit(workers_t *w, const worker_result_t *r, void *arg) {
    (void)w;
    agent_t *a = arg;
    bool is_failure = r->term_signal != 0 || r->exit_status != 0;
    if (!is_failure || a->has_failure || a->stop_signal) return;
    a->has_failure = true;
    a->root_cause = *r;
    LOG_WARN("worker rank %d (pid %d) %s %d; stopping the other workers", r->rank, r->pid,
             r->term_signal ? "was killed by signal" : "exited with", r->term_signal ? r->term_signal
                                                                                      : r->exit_status);
    workers_stop(a->workers, SIGTERM, a->opts->shutdown_timeout_s);
}

static void on_workers_done(workers_t *w, void *arg) {
    agent_t *a = arg;
    int code = 0;
    if (a->stop_signal) {
        code = 128 + a->stop_signal;
    } else if (a->has_failure) {
        const worker_result_t *r = &a->root_cause;
        code = r->term_signal ? 128 + r->term_signal : r->exit_status;
        bool is_permanent = !r->term_signal && ddp_exit_is_permanent(r->exit_status);
        if (!is_permanent && a->attempt < a->opts->max_restarts) {
            LOG_WARN("restarting every worker (restart %d of %d)", a->attempt + 1,
                     a->opts->max_restarts);
            workers_destroy(w);
            a->workers = NULL;
            a->attempt++;
            a->has_failure = false;
            if (start_attempt(a) == 0) return;
            finish(a, 1);
            return;
        }
        print_root_cause(a);
        if (is_permanent) fprintf(stderr, "ddprun: exit %d is not retried\n", r->exit_status);
    }
    workers_destroy(w);
    a->workers = NULL;
    finish(a, code);
}

static int start_attempt(agent_t *a) {
    char attempt_dir[1300], err[512];
    snprintf(attempt_dir, sizeof attempt_dir, "%s/attempt_%d", a->run_dir, a->attempt);
    workers_spec_t spec = {
        .opts = a->opts, .self_exe = a->self_exe, .run_id = a->opts->rdzv_id,
        .attempt = a->attempt, .group_rank = 0, .group_world_size = 1, .rank_offset = 0,
        .world_size = a->opts->nproc_per_node, .master_addr = a->master_addr,
        .master_port = a->master_port, .attempt_dir = attempt_dir};
    int rc = workers_start(a->loop, &spec, on_worker_exit, on_workers_done, a, &a->workers, err,
                           sizeof err);
    if (rc < 0) LOG_ERROR("%s", err);
    return rc;
}

static void on_signal(uv_signal_t *h, int signum) {
    agent_t *a = h->data;
    if (a->stop_signal || !a->workers) {
        if (a->workers) workers_stop(a->workers, SIGKILL, 0); /* second signal: no more grace */
        return;
    }
    LOG_WARN("%s received: forwarding it to the workers, SIGKILL after %g s", strsignal(signum),
             a->opts->shutdown_timeout_s);
    a->stop_signal = signum;
    workers_stop(a->workers, signum, a->opts->shutdown_timeout_s);
}

static int prepare_run_dir(agent_t *a) {
    const ddprun_opts_t *o = a->opts;
    if (o->log_dir[0]) {
        snprintf(a->run_dir, sizeof a->run_dir, "%s/%s", o->log_dir, o->rdzv_id);
        return 0;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(a->run_dir, sizeof a->run_dir, "%s/ddprun-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp",
             o->rdzv_id);
    return mkdtemp(a->run_dir) ? 0 : -errno;
}

int agent_main(ddprun_opts_t *o) {
    if (o->max_nodes > 1) {
        fprintf(stderr, "ddprun: --nnodes %u:%u: rendezvous across nodes is not in this build yet; "
                        "run a single node (--standalone or --nnodes 1)\n", o->min_nodes,
                o->max_nodes);
        return DDP_EXIT_USAGE;
    }
    const char *prog = o->program_argv[0];
    size_t plen = strlen(prog);
    if (plen > 5 && strcmp(prog + plen - 5, ".conf") == 0) {
        fprintf(stderr, "ddprun: %s: the built-in trainer (ddpworker) is not in this build yet\n",
                prog);
        return DDP_EXIT_USAGE;
    }
    static agent_t agent;
    agent_t *a = &agent;
    a->opts = o;
    a->loop = uv_default_loop();
    ssize_t n = readlink("/proc/self/exe", a->self_exe, sizeof a->self_exe - 1);
    if (n <= 0) {
        fprintf(stderr, "ddprun: cannot find its own executable: %s\n", strerror(errno));
        return 1;
    }
    a->self_exe[n] = '\0';
    int rc = prepare_run_dir(a);
    if (rc < 0) {
        fprintf(stderr, "ddprun: cannot create a run directory: %s\n", strerror(-rc));
        return 1;
    }
    bool is_c10d = strcmp(o->rdzv_backend, "c10d") == 0;
    store_server_opts_t so = {.host = is_c10d ? o->rdzv_host : o->master_addr,
                              .port = is_c10d ? o->rdzv_port : o->master_port};
    store_limits_default(&so.limits);
    char err[512];
    rc = store_server_start(a->loop, &so, &a->store, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "ddprun: cannot host the job's store: %s\n", err);
        return 1;
    }
    snprintf(a->master_addr, sizeof a->master_addr, "%s", so.host);
    a->master_port = store_server_port(a->store);
    LOG_INFO("run %s: %d worker(s), store on %s port %u, logs in %s", o->rdzv_id,
             o->nproc_per_node, a->master_addr, a->master_port, a->run_dir);
    for (int i = 0; i < o->n_signals; i++) {
        uv_signal_init(a->loop, &a->sig_handles[i]);
        a->sig_handles[i].data = a;
        uv_signal_start(&a->sig_handles[i], on_signal, o->signals[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    if (start_attempt(a) < 0) finish(a, DDP_EXIT_EXEC_FAILED);
    uv_run(a->loop, UV_RUN_DEFAULT);
    return a->exit_code;
}
