/* die: see die.h. */
#include "die.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "ddp_error.h"
#include "exit_codes.h"

static int die_rank = -1;

void die_set_rank(int rank) {
    die_rank = rank;
}

_Noreturn void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (die_rank >= 0)
        fprintf(stderr, "ddpworker: rank %d: ", die_rank);
    else
        fputs("ddpworker: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

void die_comm(const comm_t *comm, int rc, const char *what) {
    if (rc >= 0) return;
    const char *why = comm->err[0] ? comm_error(comm) : "collective error";
    /* the stop came while the collective waited on a peer that is not answering: as a worker
     * that SIGTERM ended (128 + 15), not a failure of its own */
    if (rc == -ECANCELED) die(128 + SIGTERM, "%s; noticed at: %s", why, what);
    /* a closed connection or a silent peer is what a dead or stopped peer looks like: say that,
     * not that this rank's question (a stop signal, the loss) failed */
    if (rc == DDP_ECLOSED)
        die(DDP_EXIT_PEER_FAILURE,
            "a peer is gone (it exited, was killed, or its node failed): %s; noticed at: %s", why,
            what);
    if (rc == DDP_ETIMEOUT)
        die(DDP_EXIT_PEER_FAILURE,
            "a peer stopped answering (hung, stopped, or its node is unreachable): %s; noticed "
            "at: %s",
            why, what);
    die(DDP_EXIT_PEER_FAILURE, "%s failed: %s", what, why);
}

void *die_calloc(size_t n, size_t size, const char *what) {
    void *p = calloc(n ? n : 1, size);
    if (!p) die(DDP_EXIT_BUG, "out of memory for %s", what);
    return p;
}
