/* workers: see workers.h. Each worker owns a process handle, two output pipes, two optional log
 * files and a small tail buffer of its stderr for the root-cause summary. */
#include "workers/workers.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs.h"
#include "log.h"
#include "workers/console.h"
#include "workers/spares.h"

#define LINE_MAX_BYTES        65536
#define TAIL_BYTES            2048
#define GIVE_UP_AFTER_KILL_MS 5000
/* Output still open this long after its worker exited belongs to something the worker left behind
 * outside its process group (a daemon holding stdout): stop waiting for it. */
#define DRAIN_AFTER_EXIT_MS 2000

typedef struct worker worker_t;

typedef struct {
    uv_pipe_t pipe;
    worker_t *owner;
    int fd_index;    /* 1 stdout, 2 stderr */
    int log_fd;      /* -1 without --log-dir */
    bool is_console; /* shown on our console */
    bool is_open;
    char line[LINE_MAX_BYTES];
    size_t line_len;
} stream_t;

struct worker {
    uv_process_t proc;
    workers_t *set;
    worker_result_t result;
    stream_t out, err;
    int open_handles;
    char tail[TAIL_BYTES];
    size_t tail_len;
    char prefix[32];
    /* --hang-timeout: the worker's progress counter (DDPRUN_PROGRESS_FILE), once it wrote one */
    char progress_path[1600];
    /* the program's pid, which the shim writes here (DDPRUN_PID_FILE): result.pid until then is
     * the shim's, which is also the process group's id */
    char pid_path[1600];
    int group_pid;
    uint64_t started_ms, last_beat, last_change_ms;
    bool has_beat, is_hang_killed;
    bool has_progressed; /* it wrote a counter above 0 (workers_are_training) */
};

struct workers {
    uv_loop_t *loop;
    workers_spec_t spec;
    workers_exit_cb on_exit;
    workers_done_cb on_done;
    void *arg;
    int n;
    int n_active;       /* workers whose process or pipes are still open */
    int n_open_handles; /* of all workers; the set is freed only once this is 0 */
    bool is_destroyed;
    int n_open_timers;
    uv_timer_t kill_timer, drain_timer, hang_timer;
    bool is_stopping, is_done, is_timer_open;
    int lifeline[2];
    workers_t *next_live; /* the sets not freed yet: their console output pauses together */
    worker_t w[];
};

static workers_t *live_sets;
/* The console's queue is past its high mark: the console streams are not read (their workers
 * block on their own writes) until it has room again. */
static bool is_output_paused;

static void set_free(workers_t *s) {
    for (workers_t **p = &live_sets; *p; p = &(*p)->next_live)
        if (*p == s) {
            *p = s->next_live;
            break;
        }
    free(s);
}

/* Start or stop reading every open console stream of every set. */
static void read_console_streams(bool is_reading);

void workers_console_room(void *arg) {
    (void)arg;
    if (!is_output_paused) return;
    is_output_paused = false;
    read_console_streams(true);
}

static void check_done(workers_t *s) {
    if (s->n_active > 0 || s->is_done) return;
    s->is_done = true;
    if (s->is_timer_open) {
        uv_timer_stop(&s->kill_timer);
        uv_timer_stop(&s->drain_timer);
        uv_timer_stop(&s->hang_timer);
    }
    s->on_done(s, s->arg);
}

static void handle_closed(worker_t *w) {
    workers_t *s = w->set;
    s->n_open_handles--;
    if (--w->open_handles == 0) {
        s->n_active--;
        check_done(s);
    }
    if (s->is_destroyed && s->n_open_handles == 0) set_free(s);
}

static void on_proc_closed(uv_handle_t *h) {
    handle_closed(h->data);
}

static void on_stream_closed(uv_handle_t *h) {
    handle_closed(((stream_t *)h->data)->owner);
}

/* ---- output ------------------------------------------------------------------------------- */

static void keep_tail(worker_t *w, const char *p, size_t n) {
    if (n >= TAIL_BYTES) {
        p += n - (TAIL_BYTES - 1);
        n = TAIL_BYTES - 1;
    }
    if (w->tail_len + n >= TAIL_BYTES) {
        size_t drop = w->tail_len + n - (TAIL_BYTES - 1);
        memmove(w->tail, w->tail + drop, w->tail_len - drop);
        w->tail_len -= drop;
    }
    memcpy(w->tail + w->tail_len, p, n);
    w->tail_len += n;
    w->tail[w->tail_len] = '\0';
}

/* One line (with its newline, or a final partial line) to the console with the rank prefix. */
static void emit_line(stream_t *s, const char *p, size_t n) {
    worker_t *w = s->owner;
    if (s->fd_index == 2) keep_tail(w, p, n);
    if (!s->is_console) return;
    char buf[LINE_MAX_BYTES + 64];
    size_t len = (size_t)snprintf(buf, sizeof buf, "%s", w->prefix);
    memcpy(buf + len, p, n);
    len += n;
    if (buf[len - 1] != '\n') buf[len++] = '\n';
    if (console_write(s->fd_index, buf, len) && !is_output_paused) {
        is_output_paused = true;
        read_console_streams(false);
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    stream_t *s = h->data;
    static char chunk[65536];
    (void)s;
    *buf = uv_buf_init(chunk, sizeof chunk);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);

static void read_console_streams(bool is_reading) {
    for (workers_t *s = live_sets; s; s = s->next_live)
        for (int i = 0; i < s->n; i++) {
            stream_t *streams[2] = {&s->w[i].out, &s->w[i].err};
            for (int k = 0; k < 2; k++) {
                stream_t *st = streams[k];
                if (!st->is_open || !st->is_console) continue;
                if (is_reading)
                    uv_read_start((uv_stream_t *)&st->pipe, on_alloc, on_read);
                else
                    uv_read_stop((uv_stream_t *)&st->pipe);
            }
        }
}

static void close_stream(stream_t *s) {
    if (!s->is_open) return;
    s->is_open = false;
    if (s->line_len) emit_line(s, s->line, s->line_len);
    s->line_len = 0;
    if (s->log_fd >= 0) close(s->log_fd);
    s->log_fd = -1;
    uv_close((uv_handle_t *)&s->pipe, on_stream_closed);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
    stream_t *s = stream->data;
    if (nread < 0) {
        close_stream(s);
        return;
    }
    const char *p = buf->base;
    size_t n = (size_t)nread;
    if (s->log_fd >= 0) (void)fs_write_all(s->log_fd, p, n);
    while (n > 0) {
        const char *nl = memchr(p, '\n', n);
        size_t take = nl ? (size_t)(nl - p) + 1 : n;
        if (s->line_len + take > sizeof s->line) { /* an over-long line goes out in pieces */
            emit_line(s, s->line, s->line_len);
            s->line_len = 0;
        }
        if (take > sizeof s->line) {
            emit_line(s, p, take);
        } else {
            memcpy(s->line + s->line_len, p, take);
            s->line_len += take;
            if (nl) {
                emit_line(s, s->line, s->line_len);
                s->line_len = 0;
            }
        }
        p += take;
        n -= take;
    }
}

/* ---- processes ---------------------------------------------------------------------------- */

static void on_drain_timer(uv_timer_t *t) {
    workers_t *s = t->data;
    if (is_output_paused) { /* unread because the console is full, not left behind: wait on */
        uv_timer_start(&s->drain_timer, on_drain_timer, DRAIN_AFTER_EXIT_MS, 0);
        return;
    }
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!w->result.has_exited || (!w->out.is_open && !w->err.is_open)) continue;
        LOG_WARN("output of rank %d is still open %d ms after it exited (a process it left "
                 "behind?): no longer waiting for it",
                 w->result.rank, DRAIN_AFTER_EXIT_MS);
        close_stream(&w->out);
        close_stream(&w->err);
    }
}

/* Logs and summaries name the program's pid, not its shim's, once the shim has written it. */
static void learn_program_pid(worker_t *w) {
    if (w->result.pid != w->group_pid) return;
    int pid = worker_env_program_pid(w->pid_path);
    if (pid > 0) w->result.pid = pid;
}

static void worker_exited(worker_t *w, int64_t exit_status, int term_signal) {
    /* What the worker left behind in its process group (its own children) goes with it. */
    kill(-w->group_pid, SIGKILL);
    w->result.has_exited = true;
    /* a worker given up on (on_give_up) that dies after its set was destroyed, during a later
     * round: nobody is told, its timers are closed */
    if (!w->set->is_timer_open) return;
    uv_timer_start(&w->set->drain_timer, on_drain_timer, DRAIN_AFTER_EXIT_MS, 0);
    learn_program_pid(w);
    w->result.exit_status = (int)exit_status;
    w->result.term_signal = term_signal;
    w->set->on_exit(w->set, &w->result, w->set->arg);
}

static void on_process_exit(uv_process_t *proc, int64_t exit_status, int term_signal) {
    worker_t *w = proc->data;
    worker_exited(w, exit_status, term_signal);
    uv_close((uv_handle_t *)proc, on_proc_closed);
}

/* A taken spare's process handle is the spares set's: its exit counts as our handle closing. */
static void on_spare_exit(void *owner, int64_t exit_status, int term_signal) {
    worker_t *w = owner;
    worker_exited(w, exit_status, term_signal);
    handle_closed(w);
}

/* The round in local rank w's warm spare instead of a new process: fresh pipes for its output,
 * whose write ends go to the spare with the round's environment. Returns 0, or -1 when no spare
 * took it (the streams are then as they were, for uv_spawn). */
static int take_spare(workers_t *s, worker_t *w, int local_rank, char *const *env) {
    uv_file out[2] = {-1, -1}, err[2] = {-1, -1};
    if (uv_pipe(out, 0, 0) < 0) return -1;
    if (uv_pipe(err, 0, 0) < 0) {
        close(out[0]);
        close(out[1]);
        return -1;
    }
    spare_taken_t taken;
    int rc = spares_take(s->spec.spares, local_rank, env, out[1], err[1], on_spare_exit, w, &taken);
    close(out[1]);
    close(err[1]);
    if (rc < 0) {
        close(out[0]);
        close(err[0]);
        return -1;
    }
    /* the spare is ours now, whatever follows: no fresh process for this rank */
    w->open_handles++; /* the spare's process, until on_spare_exit */
    s->n_open_handles++;
    w->result.pid = w->group_pid = taken.group_pid;
    snprintf(w->pid_path, sizeof w->pid_path, "%s", taken.pid_path);
    uv_file fds[2] = {out[0], err[0]};
    uv_pipe_t *pipes[2] = {&w->out.pipe, &w->err.pipe};
    for (int i = 0; i < 2; i++) {
        if (uv_pipe_open(pipes[i], fds[i]) == 0) continue;
        /* cannot happen with a fresh pipe; a worker nobody can hear must not train */
        close(fds[i]);
        LOG_ERROR("local rank %d: cannot read the output of its warm spare (pid %d): ending it",
                  local_rank, taken.group_pid);
        kill(-taken.group_pid, SIGKILL);
    }
    LOG_DEBUG("local rank %d: the warm spare (pid %d) takes rank %d", local_rank, taken.group_pid,
              w->result.rank);
    return 0;
}

/* A new process for w through the shim, its output into w's (initialised) pipes. 0 or a negative
 * libuv error (the process handle then closes by itself). */
static int spawn_fresh(workers_t *s, worker_t *w, char **env) {
    const workers_spec_t *sp = &s->spec;
    char pid_text[24];
    snprintf(pid_text, sizeof pid_text, "%d", (int)getpid());
    char **argv = worker_env_argv(sp->opts, sp->shim_exe, pid_text);
    if (!argv) return UV_ENOMEM;
    uv_stdio_container_t stdio[4] = {
        {.flags = UV_IGNORE},
        {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE, .data.stream = (uv_stream_t *)&w->out.pipe},
        {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE, .data.stream = (uv_stream_t *)&w->err.pipe},
        {.flags = UV_INHERIT_FD, .data.fd = s->lifeline[0]},
    };
    uv_process_options_t po = {.exit_cb = on_process_exit,
                               .file = sp->shim_exe,
                               .args = argv,
                               .env = env,
                               .stdio = stdio,
                               .stdio_count = 4,
                               .flags = UV_PROCESS_DETACHED};
    w->proc.data = w;
    int rc = uv_spawn(s->loop, &w->proc, &po);
    free(argv);
    /* uv_spawn initialises the handle even when it fails */
    w->open_handles++;
    s->n_open_handles++;
    if (rc < 0) {
        uv_close((uv_handle_t *)&w->proc, on_proc_closed);
        return rc;
    }
    w->result.pid = w->group_pid = w->proc.pid;
    return 0;
}

static int open_log(const char *dir, const char *name) {
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

static int spawn_one(workers_t *s, int local_rank, char *err, size_t err_len) {
    const workers_spec_t *sp = &s->spec;
    const ddprun_opts_t *o = sp->opts;
    worker_t *w = &s->w[local_rank];
    w->set = s;
    w->result.local_rank = local_rank;
    w->result.rank = sp->rank_offset + local_rank;
    snprintf(w->prefix, sizeof w->prefix, "[%d/%d]: ", sp->group_rank, w->result.rank);
    char dir[1536];
    snprintf(dir, sizeof dir, "%s/%d", sp->attempt_dir, local_rank);
    snprintf(w->progress_path, sizeof w->progress_path, "%s/progress", dir);
    snprintf(w->pid_path, sizeof w->pid_path, "%s/pid", dir);
    int rc = fs_mkdir_p(dir);
    if (rc < 0) {
        snprintf(err, err_len, "cannot create %s: %s", dir, strerror(-rc));
        return rc;
    }
    stream_t *streams[2] = {&w->out, &w->err};
    int mask = o->redirects[local_rank] | o->tee[local_rank];
    for (int i = 0; i < 2; i++) {
        stream_t *st = streams[i];
        st->owner = w;
        st->fd_index = i + 1;
        st->log_fd = -1;
        /* Files: for every stream with --log-dir, else for the ones redirected or teed. */
        if (o->log_dir[0] || (mask & (1 << i)))
            st->log_fd = open_log(dir, i == 0 ? "stdout.log" : "stderr.log");
        st->is_console = o->is_rank_shown[local_rank] && !(o->redirects[local_rank] & (1 << i));
        uv_pipe_init(s->loop, &st->pipe, 0);
        st->pipe.data = st;
        st->is_open = true;
        w->open_handles++;
        s->n_open_handles++;
    }
    worker_env_t env = {0};
    rc = worker_env_round(sp, local_rank, &env);
    s->n_active++;
    if (rc == 0 && !(sp->spares && take_spare(s, w, local_rank, env.vars) == 0))
        rc = spawn_fresh(s, w, env.vars);
    worker_env_free(&env);
    if (rc < 0) {
        snprintf(err, err_len, "cannot start local rank %d: %s", local_rank, uv_strerror(rc));
        close_stream(&w->out);
        close_stream(&w->err);
        return rc;
    }
    w->started_ms = uv_now(s->loop);
    for (int i = 0; i < 2; i++) /* a full console's room starts the console streams later */
        if (!is_output_paused || !streams[i]->is_console)
            uv_read_start((uv_stream_t *)&streams[i]->pipe, on_alloc, on_read);
    return 0;
}

/* The counter the worker keeps in its progress file; false when it has written none yet. */
static bool read_progress(const worker_t *w, uint64_t *beat) {
    int fd = open(w->progress_path, O_RDONLY | O_CLOEXEC);
    bool is_read = fd >= 0 && pread(fd, beat, sizeof *beat, 0) == (ssize_t)sizeof *beat;
    if (fd >= 0) close(fd);
    return is_read;
}

static void kill_stuck(worker_t *w, double stuck_s, const char *what, const char *flag) {
    learn_program_pid(w);
    LOG_ERROR("worker rank %d (pid %d) %s for %.0f s (%s): killing it so the job restarts",
              w->result.rank, w->result.pid, what, stuck_s, flag);
    w->is_hang_killed = true;
    kill(-w->group_pid, SIGKILL);
}

/* A worker that has reported progress and then stops for --hang-timeout is killed, and so is one
 * that has reported none --start-timeout after its start; its exit then restarts the job like any
 * failure. Without --start-timeout, workers that never report are never judged. */
static void on_hang_timer(uv_timer_t *t) {
    workers_t *s = t->data;
    const ddprun_opts_t *o = s->spec.opts;
    uint64_t now = uv_now(s->loop), hang_ms = (uint64_t)(o->hang_timeout_s * 1000),
             start_ms = (uint64_t)(o->start_timeout_s * 1000);
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->group_pid <= 0 || w->result.has_exited || w->is_hang_killed) continue;
        uint64_t beat;
        if (!read_progress(w, &beat) || (!w->has_beat && beat == 0)) {
            if (start_ms && now - w->started_ms > start_ms)
                kill_stuck(w, (double)(now - w->started_ms) / 1000, "reported no progress",
                           "--start-timeout");
            continue;
        }
        if (!w->has_beat || beat != w->last_beat) {
            w->has_beat = true;
            w->last_beat = beat;
            w->last_change_ms = now;
        } else if (hang_ms && now - w->last_change_ms > hang_ms) {
            kill_stuck(w, (double)(now - w->last_change_ms) / 1000, "made no progress",
                       "--hang-timeout");
        }
    }
}

int workers_start(uv_loop_t *loop, const workers_spec_t *spec, workers_exit_cb on_exit_cb,
                  workers_done_cb on_done, void *arg, workers_t **out, char *err, size_t err_len) {
    int n = spec->opts->nproc_per_node;
    workers_t *s = calloc(1, sizeof *s + (size_t)n * sizeof(worker_t));
    if (!s) return -ENOMEM;
    s->loop = loop;
    s->spec = *spec;
    s->on_exit = on_exit_cb;
    s->on_done = on_done;
    s->arg = arg;
    s->n = n;
    s->next_live = live_sets;
    live_sets = s;
    /* The write end stays in the agent (close-on-exec): its death closes every lifeline. */
    if (pipe2(s->lifeline, O_CLOEXEC) < 0) {
        int e = errno;
        snprintf(err, err_len, "cannot create the lifeline pipe: %s", strerror(e));
        set_free(s);
        return -e;
    }
    uv_timer_init(loop, &s->kill_timer);
    s->kill_timer.data = s;
    uv_timer_init(loop, &s->drain_timer);
    s->drain_timer.data = s;
    uv_timer_init(loop, &s->hang_timer);
    s->hang_timer.data = s;
    double hang_s = spec->opts->hang_timeout_s, start_s = spec->opts->start_timeout_s;
    double shortest_s = hang_s > 0 && (start_s <= 0 || hang_s < start_s) ? hang_s : start_s;
    if (shortest_s > 0) {
        uint64_t period_ms = (uint64_t)(shortest_s * 1000 / 4);
        period_ms = period_ms < 50 ? 50 : period_ms > 1000 ? 1000 : period_ms;
        uv_timer_start(&s->hang_timer, on_hang_timer, period_ms, period_ms);
    }
    s->is_timer_open = true;
    *out = s;
    for (int i = 0; i < n; i++) {
        int rc = spawn_one(s, i, err, err_len);
        if (rc < 0) {
            workers_stop(s, SIGKILL, 0);
            return rc;
        }
    }
    return 0;
}

void workers_signal(workers_t *s, int signum) {
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->group_pid > 0 && !w->result.has_exited) kill(-w->group_pid, signum);
    }
}

static void on_give_up(uv_timer_t *t) {
    workers_t *s = t->data;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->group_pid > 0 && !w->result.has_exited)
            LOG_ERROR("worker rank %d (pid %d) survives SIGKILL (uninterruptible sleep?); giving "
                      "up on it",
                      w->result.rank, w->result.pid);
        close_stream(&w->out);
        close_stream(&w->err);
    }
    s->n_active = 0;
    check_done(s);
}

static void on_kill_timer(uv_timer_t *t) {
    workers_t *s = t->data;
    workers_signal(s, SIGKILL);
    uv_timer_start(&s->kill_timer, on_give_up, GIVE_UP_AFTER_KILL_MS, 0);
}

void workers_stop(workers_t *s, int signum, double timeout_s) {
    if (!s->is_stopping) {
        s->is_stopping = true;
        uv_timer_start(&s->kill_timer, on_kill_timer, (uint64_t)(timeout_s * 1000), 0);
    }
    workers_signal(s, signum);
    /* a stopped worker (SIGSTOP, a hang detector's suspect) acts on the signal only once it runs
     * again: without this it waited for the SIGKILL at --shutdown-timeout (systemd continues
     * what it stops too) */
    if (signum != SIGKILL && signum != SIGCONT) workers_signal(s, SIGCONT);
    if (signum == SIGKILL) uv_timer_start(&s->kill_timer, on_give_up, GIVE_UP_AFTER_KILL_MS, 0);
    check_done(s);
}

bool workers_are_training(workers_t *s) {
    if (s->is_stopping) return false;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        uint64_t beat;
        if (!w->has_progressed) w->has_progressed = read_progress(w, &beat) && beat > 0;
        if (w->result.has_exited || !w->has_progressed) return false;
    }
    return true;
}

const char *workers_tail(const workers_t *s, int local_rank) {
    return s->w[local_rank].tail;
}

/* A worker stuck in the kernel may keep its process handle open forever: the set then stays
 * allocated until that handle closes, instead of being freed under it. */
static void on_timer_closed(uv_handle_t *h) {
    workers_t *s = h->data;
    if (--s->n_open_timers > 0) return;
    s->is_destroyed = true;
    if (s->n_open_handles == 0) set_free(s);
}

void workers_destroy(workers_t *s) {
    close(s->lifeline[0]);
    close(s->lifeline[1]);
    s->is_timer_open = false;
    s->n_open_timers = 3;
    uv_close((uv_handle_t *)&s->kill_timer, on_timer_closed);
    uv_close((uv_handle_t *)&s->drain_timer, on_timer_closed);
    uv_close((uv_handle_t *)&s->hang_timer, on_timer_closed);
}
