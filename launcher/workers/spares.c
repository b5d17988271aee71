/* spares: see spares.h. Each spare owns its shim's process handle and the agent's end of its
 * handoff socket; the set owns the lifeline pipe every spare's shim watches and the refill timer. A
 * spare that dies unused is logged with its output file; after a permanent failure (its train.conf
 * or data are wrong: the round's own worker will say so) or MAX_UNUSED_DEATHS in a row, no more are
 * started. */
#include "workers/spares.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "exit_codes.h"
#include "fs.h"
#include "log.h"
#include "spare_handoff.h"

/* Spares start this long after a take, and then only once the agent says the round's workers
 * train (checked every RECHECK_MS), so that they do not compete with them while those start. */
#define REFILL_DELAY_MS   1000
#define RECHECK_MS        250
#define MAX_UNUSED_DEATHS 3
#define SEND_TIMEOUT_MS   1000
#define SPARE_SOCKET_FD   4 /* in the spare: after stdin/out/err and the shim's lifeline (3) */

struct spare {
    uv_process_t proc;
    spares_t *set;
    int local_rank;
    int sock;      /* the agent's end of the handoff socket; -1 once handed off or retired */
    bool is_ready; /* it said so (DDP_SPARE_READY): initialized, waiting for a round */
    bool is_taken, is_retired;
    spare_exit_cb on_exit;
    void *owner;
    char dir[1400];
    char pid_path[1500];
};

struct spares {
    uv_loop_t *loop;
    const ddprun_opts_t *opts;
    const char *shim_exe;
    spares_may_start_cb may_start;
    void *may_start_arg;
    char dir[1300];
    int lifeline[2];
    uv_timer_t refill;
    int n_open_handles; /* spares' process handles and the timer: the set is freed at 0 */
    int unused_deaths;  /* in a row */
    int seq;
    bool is_off, is_destroyed;
    spare_t
        *waiting[]; /* per local rank: the spare not yet taken (maybe still starting), or NULL */
};

static void handle_closed(spares_t *s) {
    if (--s->n_open_handles > 0 || !s->is_destroyed) return;
    close(s->lifeline[0]);
    close(s->lifeline[1]);
    free(s);
}

static void on_spare_closed(uv_handle_t *h) {
    spare_t *sp = h->data;
    spares_t *s = sp->set;
    free(sp);
    handle_closed(s);
}

static void on_spare_exit(uv_process_t *proc, int64_t exit_status, int term_signal);

static void turn_off(spares_t *s, const char *why) {
    if (s->is_off) return;
    s->is_off = true;
    LOG_WARN("no more warm spares: %s; restarts start fresh workers", why);
}

static int spawn_spare(spares_t *s, int local_rank) {
    spare_t *sp = calloc(1, sizeof *sp);
    if (!sp) return -ENOMEM;
    sp->set = s;
    sp->local_rank = local_rank;
    sp->sock = -1;
    snprintf(sp->dir, sizeof sp->dir, "%s/%d", s->dir, ++s->seq);
    snprintf(sp->pid_path, sizeof sp->pid_path, "%s/pid", sp->dir);
    char log_path[1500], pid_text[24];
    snprintf(log_path, sizeof log_path, "%s/output.log", sp->dir);
    snprintf(pid_text, sizeof pid_text, "%d", (int)getpid());
    int sv[2] = {-1, -1}, log_fd = -1, rc = fs_mkdir_p(sp->dir);
    if (rc == 0 && (log_fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
        rc = -errno;
    if (rc == 0 && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) rc = -errno;
    worker_env_t env = {0};
    char **argv = NULL;
    bool is_spawn_tried = false;
    if (rc == 0) {
        rc = worker_env_base(&env, s->opts->nproc_per_node);
        rc |= worker_env_set(&env, "LOCAL_RANK", "%d", local_rank);
        rc |= worker_env_set(&env, "LOCAL_WORLD_SIZE", "%d", s->opts->nproc_per_node);
        rc |= worker_env_set(&env, DDP_SPARE_FD_ENV, "%d", SPARE_SOCKET_FD);
        rc |= worker_env_set(&env, "DDPRUN_PID_FILE", "%s", sp->pid_path);
        argv = worker_env_argv(s->opts, s->shim_exe, pid_text);
        if (rc == 0 && !argv) rc = -ENOMEM;
    }
    if (rc == 0) {
        uv_stdio_container_t stdio[5] = {
            {.flags = UV_IGNORE},
            {.flags = UV_INHERIT_FD, .data.fd = log_fd},
            {.flags = UV_INHERIT_FD, .data.fd = log_fd},
            {.flags = UV_INHERIT_FD, .data.fd = s->lifeline[0]},
            {.flags = UV_INHERIT_FD, .data.fd = sv[1]},
        };
        uv_process_options_t po = {.exit_cb = on_spare_exit,
                                   .file = s->shim_exe,
                                   .args = argv,
                                   .env = env.vars,
                                   .stdio = stdio,
                                   .stdio_count = 5,
                                   .flags = UV_PROCESS_DETACHED};
        sp->proc.data = sp;
        is_spawn_tried = true;
        rc = uv_spawn(s->loop, &sp->proc, &po);
        s->n_open_handles++; /* uv_spawn initialises the handle even when it fails */
        if (rc < 0) uv_close((uv_handle_t *)&sp->proc, on_spare_closed);
    }
    free(argv);
    worker_env_free(&env);
    if (log_fd >= 0) close(log_fd);
    if (sv[1] >= 0) close(sv[1]);
    if (rc < 0) {
        if (sv[0] >= 0) close(sv[0]);
        LOG_WARN("cannot start a warm spare for local rank %d: %s", local_rank, uv_strerror(rc));
        if (!is_spawn_tried) free(sp); /* else on_spare_closed frees it */
        return rc;
    }
    sp->sock = sv[0];
    s->waiting[local_rank] = sp;
    LOG_DEBUG("warm spare for local rank %d: pid %d, output in %s", local_rank, sp->proc.pid,
              log_path);
    return 0;
}

static void on_refill(uv_timer_t *t) {
    spares_t *s = t->data;
    if (s->is_off || s->is_destroyed) return;
    if (!s->may_start(s->may_start_arg)) {
        uv_timer_start(&s->refill, on_refill, RECHECK_MS, 0);
        return;
    }
    for (int r = 0; r < s->opts->nproc_per_node && !s->is_off && !s->is_destroyed; r++)
        if (!s->waiting[r] && spawn_spare(s, r) < 0) turn_off(s, "a spare could not be started");
}

/* No round can take sp any more: its socket closed, its rank's place free for another. */
static void forget(spare_t *sp) {
    if (sp->sock >= 0) close(sp->sock);
    sp->sock = -1;
    if (sp->set->waiting[sp->local_rank] == sp) sp->set->waiting[sp->local_rank] = NULL;
}

static void retire(spare_t *sp) {
    sp->is_retired = true;
    forget(sp);
    kill(-sp->proc.pid, SIGKILL);
}

static void on_spare_exit(uv_process_t *proc, int64_t exit_status, int term_signal) {
    spare_t *sp = proc->data;
    spares_t *s = sp->set;
    kill(-proc->pid, SIGKILL); /* whatever it left in its process group */
    if (sp->is_taken) {
        sp->on_exit(sp->owner, exit_status, term_signal);
    } else {
        forget(sp);
        if (!sp->is_retired && !s->is_destroyed) {
            char how[64];
            if (term_signal)
                snprintf(how, sizeof how, "was killed by signal %d", term_signal);
            else
                snprintf(how, sizeof how, "exited with %d", (int)exit_status);
            int pid = worker_env_program_pid(sp->pid_path);
            LOG_WARN("the warm spare for local rank %d (pid %d) %s before a round took it; its "
                     "output: %s/output.log",
                     sp->local_rank, pid ? pid : proc->pid, how, sp->dir);
            if (!term_signal && ddp_exit_is_permanent((int)exit_status))
                turn_off(s, "a spare failed in a way a restart cannot mend");
            else if (++s->unused_deaths >= MAX_UNUSED_DEATHS)
                turn_off(s, "spares keep dying before any round takes them");
            else
                uv_timer_start(&s->refill, on_refill, REFILL_DELAY_MS, 0);
        }
    }
    uv_close((uv_handle_t *)proc, on_spare_closed);
}

int spares_create(uv_loop_t *loop, const ddprun_opts_t *opts, const char *shim_exe,
                  const char *run_dir, spares_may_start_cb may_start, void *arg, spares_t **out,
                  char *err, size_t err_len) {
    int n = opts->nproc_per_node;
    spares_t *s = calloc(1, sizeof *s + (size_t)n * sizeof(spare_t *));
    if (!s) return -ENOMEM;
    s->loop = loop;
    s->opts = opts;
    s->shim_exe = shim_exe;
    s->may_start = may_start;
    s->may_start_arg = arg;
    snprintf(s->dir, sizeof s->dir, "%s/spares", run_dir);
    /* the write end stays in the agent (close-on-exec): its death ends every spare */
    if (pipe2(s->lifeline, O_CLOEXEC) < 0) {
        int rc = -errno;
        snprintf(err, err_len, "cannot create the spares' lifeline pipe: %s", strerror(errno));
        free(s);
        return rc;
    }
    uv_timer_init(loop, &s->refill);
    s->refill.data = s;
    s->n_open_handles = 1;
    uv_timer_start(&s->refill, on_refill, RECHECK_MS, 0);
    *out = s;
    return 0;
}

/* Header and environment in one buffer; the descriptors ride on its first byte. */
static int send_handoff(int sock, char *const *env, int out_fd, int err_fd) {
    size_t env_bytes = 0;
    for (char *const *v = env; *v; v++)
        env_bytes += strlen(*v) + 1;
    if (env_bytes > DDP_SPARE_ENV_MAX_BYTES) return -E2BIG;
    size_t total = DDP_SPARE_HEADER_BYTES + env_bytes;
    uint8_t *msg = malloc(total);
    if (!msg) return -ENOMEM;
    spare_handoff_header_encode(msg, (uint32_t)env_bytes);
    size_t at = DDP_SPARE_HEADER_BYTES;
    for (char *const *v = env; *v; v++) {
        size_t len = strlen(*v) + 1;
        memcpy(msg + at, *v, len);
        at += len;
    }
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * DDP_SPARE_N_FDS)];
    } control;
    memset(&control, 0, sizeof control);
    int fds[DDP_SPARE_N_FDS] = {out_fd, err_fd};
    uint64_t deadline = clock_now_ms() + SEND_TIMEOUT_MS;
    int rc = 0;
    for (size_t sent = 0; sent < total;) {
        struct iovec iov = {.iov_base = msg + sent, .iov_len = total - sent};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (sent == 0) {
            m.msg_control = control.buf;
            m.msg_controllen = sizeof control.buf;
            struct cmsghdr *c = CMSG_FIRSTHDR(&m);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof fds);
            memcpy(CMSG_DATA(c), fds, sizeof fds);
        }
        ssize_t n = sendmsg(sock, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            sent += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        uint64_t now = clock_now_ms();
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            rc = -errno;
        else if (now >= deadline)
            rc = -ETIMEDOUT;
        if (rc < 0) break;
        struct pollfd p = {.fd = sock, .events = POLLOUT};
        poll(&p, 1, (int)(deadline - now));
    }
    free(msg);
    return rc;
}

int spares_take(spares_t *s, int local_rank, char *const *env, int out_fd, int err_fd,
                spare_exit_cb on_exit, void *owner, spare_taken_t *taken) {
    spare_t *sp = s->waiting[local_rank];
    if (!sp) return -1;
    if (!sp->is_ready) {
        char said;
        ssize_t n = recv(sp->sock, &said, 1, MSG_DONTWAIT);
        if (n < 0) return -1; /* still starting: it stays for a later round */
        if (n == 0) { /* ending: its exit is counted (on_spare_exit), so that a spare dying in
                       * its start over and over turns spares off instead of coming back */
            forget(sp);
            kill(-sp->proc.pid, SIGKILL);
            return -1;
        }
        if (said != DDP_SPARE_READY) { /* not speaking the handoff */
            retire(sp);
            uv_timer_start(&s->refill, on_refill, REFILL_DELAY_MS, 0);
            return -1;
        }
        sp->is_ready = true;
    }
    int rc = send_handoff(sp->sock, env, out_fd, err_fd);
    if (rc < 0) {
        LOG_WARN("the warm spare for local rank %d (pid %d) could not be handed its round (%s): "
                 "starting a fresh worker",
                 local_rank, sp->proc.pid, strerror(-rc));
        retire(sp);
    } else {
        close(sp->sock);
        sp->sock = -1;
        sp->is_taken = true;
        sp->on_exit = on_exit;
        sp->owner = owner;
        s->waiting[local_rank] = NULL;
        s->unused_deaths = 0;
        taken->group_pid = sp->proc.pid;
        taken->pid_path = sp->pid_path;
    }
    if (!s->is_off && !s->is_destroyed && !uv_is_active((uv_handle_t *)&s->refill))
        uv_timer_start(&s->refill, on_refill, REFILL_DELAY_MS, 0);
    return rc < 0 ? -1 : 0;
}

static void on_timer_closed(uv_handle_t *h) {
    handle_closed(h->data);
}

void spares_destroy(spares_t *s) {
    s->is_destroyed = true;
    for (int r = 0; r < s->opts->nproc_per_node; r++)
        if (s->waiting[r]) retire(s->waiting[r]);
    uv_close((uv_handle_t *)&s->refill, on_timer_closed);
}
