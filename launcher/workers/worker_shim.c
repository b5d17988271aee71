/* worker_shim: `ddprun __shim AGENT_PID -- PROGRAM ARGS`, the first process of every worker's
 * process group. It makes sure no worker outlives its agent even when the agent is SIGKILLed: the
 * lifeline pipe on fd 3 (its write end lives only in the agent) reads EOF when the agent dies,
 * upon which the shim SIGKILLs its whole process group, grandchildren included; the program itself
 * also carries PR_SET_PDEATHSIG, so it dies with the shim. Otherwise the shim waits for the program
 * and exits exactly as it did (same status, or the same signal re-raised), so the agent sees the
 * program's own outcome. Descendants that left the group (setsid, setpgid: the agent's group kill
 * misses them) are the shim's as subreaper: killed when the program ends or the agent dies, and
 * signalled with the program when it left the group itself. The program inherits stdin, stdout,
 * stderr and a warm spare's handoff socket, no other descriptor of the agent's (as torchrun's
 * close_fds). It also writes the program's pid where the agent reads it. */
#include <dirent.h>
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
#include "spare_handoff.h"

#define LIFELINE_FD 3

static pid_t program;

/* A signal to the group reaches the program, unless it moved to a group of its own: then it is
 * sent to it (torchrun signals its worker process itself). The shim outlives its program. */
static void forward(int sig) {
    int saved = errno;
    if (program > 0 && getpgid(program) != getpgrp()) kill(program, sig);
    errno = saved;
}

/* SIGKILL every process left under the shim, with its group when that is not ours: the program's
 * descendants that outlived it, reparented to the shim as subreaper (a child made orphan by a kill
 * is the next pass's). Reaps them; bounded at about a second. */
static void kill_descendants(void) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
    for (int pass = 0; pass < 100; pass++) {
        bool is_any = false;
        FILE *f = fopen(path, "re");
        int pid;
        while (f && fscanf(f, "%d", &pid) == 1) {
            is_any = true;
            pid_t group = getpgid(pid);
            if (group > 0 && group != getpgrp()) kill(-group, SIGKILL);
            kill(pid, SIGKILL);
        }
        if (f) fclose(f);
        while (waitpid(-1, NULL, WNOHANG) > 0)
            is_any = true;
        if (!is_any) return;
        usleep(10 * 1000);
    }
}

/* Close every descriptor from 3 on but keep (-1: none). */
static void close_from_3(int keep) {
    if (keep >= 3) {
        if (keep > 3 && close_range(3, (unsigned)keep - 1, 0) < 0) goto slow;
        if (close_range((unsigned)keep + 1, ~0u, 0) < 0) goto slow;
        return;
    }
    if (close_range(3, ~0u, 0) == 0) return;
slow:; /* a kernel before 5.9 */
    DIR *d = opendir("/proc/self/fd");
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        int fd = atoi(e->d_name);
        if (fd >= 3 && fd != keep && fd != dirfd(d)) close(fd);
    }
    closedir(d);
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
        const char *spare_fd = getenv(DDP_SPARE_FD_ENV);
        close_from_3(spare_fd && *spare_fd ? atoi(spare_fd) : -1);
        execvp(argv[4], argv + 4);
        fprintf(stderr, "ddprun: cannot run %s: %s\n", argv[4], strerror(errno));
        _exit(DDP_EXIT_EXEC_FAILED);
    }
    program = child;
    /* a spare's handoff socket is the program's alone: held here too, a program that died after
     * saying it was ready would still take a round (the agent's send succeeds while the shim
     * lives), and its end would count as the round's failure */
    const char *spare_fd = getenv(DDP_SPARE_FD_ENV);
    if (spare_fd && *spare_fd && atoi(spare_fd) > LIFELINE_FD) close(atoi(spare_fd));
    write_pid_file(child);
    struct sigaction sa = {.sa_handler = forward};
    sigemptyset(&sa.sa_mask);
    int handled[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT};
    for (size_t i = 0; i < sizeof handled / sizeof handled[0]; i++)
        sigaction(handled[i], &sa, NULL);
    int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
    for (;;) {
        struct pollfd fds[2] = {{.fd = LIFELINE_FD, .events = POLLIN},
                                {.fd = pidfd, .events = POLLIN}};
        int n = poll(fds, pidfd >= 0 ? 2 : 1, pidfd >= 0 ? -1 : 100);
        if (n > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            /* the agent is gone: the program first (its escaped children become ours), those,
             * then the whole group, ourselves too */
            kill(child, SIGKILL);
            /* a second at most: a program stuck in the kernel must not keep the group alive */
            for (int i = 0; i < 100 && waitpid(child, NULL, WNOHANG) == 0; i++)
                usleep(10 * 1000);
            kill_descendants();
            kill(0, SIGKILL);
            _exit(DDP_EXIT_PEER_FAILURE);
        }
        int status;
        pid_t done = waitpid(child, &status, WNOHANG);
        if (done == child) {
            program = 0;
            kill_descendants();
            if (WIFSIGNALED(status)) {
                signal(WTERMSIG(status), SIG_DFL);
                raise(WTERMSIG(status));
            }
            return WIFEXITED(status) ? WEXITSTATUS(status) : DDP_EXIT_BUG;
        }
        if (done < 0 && errno != EINTR) return DDP_EXIT_BUG;
    }
}
