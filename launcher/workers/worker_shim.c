/* worker_shim: `ddprun __shim AGENT_PID -- PROGRAM ARGS`, the first process of every worker's
 * process group. It makes sure no worker outlives its agent even when the agent is SIGKILLed: the
 * lifeline pipe on fd 3 (its write end lives only in the agent) reads EOF when the agent dies,
 * upon which the shim SIGKILLs its whole process group, grandchildren included; the program itself
 * also carries PR_SET_PDEATHSIG, so it dies with the shim. Otherwise the shim waits for the program
 * and exits exactly as it did (same status, or the same signal re-raised), so the agent sees the
 * program's own outcome. It also writes the program's pid where the agent reads it. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "commands.h"
#include "exit_codes.h"

#define LIFELINE_FD 3

static void forward(int sig) {
    (void)sig; /* the signal reaches the whole group anyway; the shim outlives its program */
}

/* The agent names the program's pid, not ours, in its logs (DDPRUN_PID_FILE, set by the agent).
 * Written whole then renamed, so a reader never sees half a number. Best effort: without it the
 * agent names the shim. */
static void write_pid_file(pid_t child) {
    const char *path = getenv("DDPRUN_PID_FILE");
    char tmp[4200];
    if (!path || !*path || snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    char text[24];
    int n = snprintf(text, sizeof text, "%d\n", (int)child);
    bool is_ok = write(fd, text, (size_t)n) == n;
    if (close(fd) != 0 || !is_ok || rename(tmp, path) != 0) unlink(tmp);
}

int worker_shim_main(int argc, char **argv) {
    if (argc < 5 || strcmp(argv[3], "--") != 0) {
        fprintf(stderr, "ddprun __shim: internal use: __shim AGENT_PID -- PROGRAM [ARGS]\n");
        return DDP_EXIT_USAGE;
    }
    pid_t agent = (pid_t)atol(argv[2]);
    if (getppid() != agent) return DDP_EXIT_EXEC_FAILED; /* the agent died before we started */
    prctl(PR_SET_CHILD_SUBREAPER, 1);                    /* orphaned grandchildren stay ours */
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "ddprun: cannot fork the worker: %s\n", strerror(errno));
        return DDP_EXIT_EXEC_FAILED;
    }
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1) _exit(DDP_EXIT_PEER_FAILURE); /* the shim is already gone */
        close(LIFELINE_FD);
        execvp(argv[4], argv + 4);
        fprintf(stderr, "ddprun: cannot run %s: %s\n", argv[4], strerror(errno));
        _exit(DDP_EXIT_EXEC_FAILED);
    }
    write_pid_file(child);
    struct sigaction sa = {.sa_handler = forward};
    sigemptyset(&sa.sa_mask);
    int handled[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof handled / sizeof handled[0]; i++)
        sigaction(handled[i], &sa, NULL);
    int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
    for (;;) {
        struct pollfd fds[2] = {{.fd = LIFELINE_FD, .events = POLLIN},
                                {.fd = pidfd, .events = POLLIN}};
        int n = poll(fds, pidfd >= 0 ? 2 : 1, pidfd >= 0 ? -1 : 100);
        if (n > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            kill(0, SIGKILL); /* the agent is gone: take the whole group down, ourselves too */
            _exit(DDP_EXIT_PEER_FAILURE);
        }
        int status;
        pid_t done = waitpid(child, &status, WNOHANG);
        if (done == child) {
            if (WIFSIGNALED(status)) {
                signal(WTERMSIG(status), SIG_DFL);
                raise(WTERMSIG(status));
            }
            return WIFEXITED(status) ? WEXITSTATUS(status) : DDP_EXIT_BUG;
        }
        if (done < 0 && errno != EINTR) return DDP_EXIT_BUG;
    }
}
