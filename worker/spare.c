/* spare: see spare.h. Reads exactly one handoff message; every length is bounded by the limits in
 * proto/spare_handoff.h before anything is allocated. */
#include "spare.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "exit_codes.h"
#include "spare_handoff.h"
#include "die.h"

int spare_fd_from_env(void) {
    const char *v = getenv(DDP_SPARE_FD_ENV);
    if (!v || !*v) return -1;
    char *end;
    errno = 0;
    long fd = strtol(v, &end, 10);
    if (*end || errno || fd < 3 || fd > 1 << 20)
        die(DDP_EXIT_USAGE, "environment: %s='%s' is not a descriptor", DDP_SPARE_FD_ENV, v);
    return (int)fd;
}

/* The header and the descriptors that ride on its first byte. Returns the number of header bytes
 * read (0: the agent closed the socket first). */
static size_t read_header(int fd, uint8_t header[DDP_SPARE_HEADER_BYTES], int fds[DDP_SPARE_N_FDS],
                          int *n_fds) {
    size_t got = 0;
    *n_fds = 0;
    while (got < DDP_SPARE_HEADER_BYTES) {
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int) * DDP_SPARE_N_FDS)];
        } control;
        struct iovec iov = {.iov_base = header + got, .iov_len = DDP_SPARE_HEADER_BYTES - got};
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die(DDP_EXIT_BUG, "warm spare: reading the handoff: %s", strerror(errno));
        if (msg.msg_flags & MSG_CTRUNC)
            die(DDP_EXIT_BUG, "warm spare: the handoff carried more descriptors than %d",
                DDP_SPARE_N_FDS);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int received;
                memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
                if (*n_fds < DDP_SPARE_N_FDS)
                    fds[(*n_fds)++] = received;
                else
                    close(received);
            }
        }
        if (n == 0) return got;
        got += (size_t)n;
    }
    return got;
}

static void read_exactly(int fd, char *p, size_t len) {
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            die(DDP_EXIT_BUG, "warm spare: the handoff's environment ended early (%s)",
                n < 0 ? strerror(errno) : "end of file");
        p += n;
        len -= (size_t)n;
    }
}

void spare_wait_for_round(int fd) {
    char ready = DDP_SPARE_READY;
    ssize_t w;
    while ((w = send(fd, &ready, 1, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    if (w != 1) exit(0); /* the agent has gone, or retired the spare already */
    /* still the spare's own output file: the round's replaces it only below */
    fprintf(stderr, "ddpworker: warm spare ready (pid %d, local rank %s)\n", (int)getpid(),
            getenv("LOCAL_RANK") ? getenv("LOCAL_RANK") : "0");
    uint8_t header[DDP_SPARE_HEADER_BYTES];
    int fds[DDP_SPARE_N_FDS], n_fds;
    size_t got = read_header(fd, header, fds, &n_fds);
    if (got == 0) exit(0); /* retired before any round needed it */
    if (got < DDP_SPARE_HEADER_BYTES)
        die(DDP_EXIT_BUG, "warm spare: a handoff header of %zu bytes, not %d", got,
            DDP_SPARE_HEADER_BYTES);
    char err[256];
    uint32_t env_bytes;
    if (spare_handoff_header_decode(header, &env_bytes, err, sizeof err) < 0)
        die(DDP_EXIT_BUG, "warm spare: %s", err);
    if (n_fds != DDP_SPARE_N_FDS)
        die(DDP_EXIT_BUG, "warm spare: the handoff carried %d descriptors, not %d", n_fds,
            DDP_SPARE_N_FDS);
    char *block = malloc(env_bytes ? env_bytes : 1);
    if (!block) die(DDP_EXIT_BUG, "out of memory for the round's environment");
    read_exactly(fd, block, env_bytes);
    close(fd);
    if (spare_handoff_env_check(block, env_bytes, err, sizeof err) < 0)
        die(DDP_EXIT_BUG, "warm spare: %s", err);
    /* the block stays allocated: putenv keeps pointers into it */
    clearenv();
    for (size_t at = 0; at < env_bytes; at += strlen(block + at) + 1)
        if (putenv(block + at) != 0) die(DDP_EXIT_BUG, "out of memory for the environment");
    fflush(stdout);
    fflush(stderr);
    if (dup2(fds[0], STDOUT_FILENO) < 0 || dup2(fds[1], STDERR_FILENO) < 0)
        die(DDP_EXIT_BUG, "warm spare: taking the round's output: %s", strerror(errno));
    close(fds[0]);
    close(fds[1]);
}
