/* exit_codes: how a worker's exit status tells the agent whether restarting can help.
 * Numbers follow sysexits(3) where one fits. Used by ddpworker (fail fast with these) and by the
 * agent (restart policy, root-cause summary). Any other non-zero status is restartable. */
#ifndef DDP_PROTO_EXIT_CODES_H
#define DDP_PROTO_EXIT_CODES_H

#include <stdbool.h>

enum {
    DDP_EXIT_OK = 0,
    DDP_EXIT_USAGE = 2,         /* bad command line: not restartable */
    DDP_EXIT_DATA = 65,         /* EX_DATAERR: a dataset or snapshot is unusable: not restartable */
    DDP_EXIT_BUG = 70,          /* EX_SOFTWARE: an internal invariant broke: restartable */
    DDP_EXIT_CANT_CREATE = 73,  /* EX_CANTCREAT: ddprun's --log-dir cannot be created or written */
    DDP_EXIT_IO = 74,           /* EX_IOERR: snapshots cannot be written: not restartable */
    DDP_EXIT_PEER_FAILURE = 75, /* EX_TEMPFAIL: a peer died or hung: restart */
    DDP_EXIT_CONFIG = 78,       /* EX_CONFIG: train.conf is wrong: not restartable */
    DDP_EXIT_DIVERGED = 80,     /* the training loss became NaN or inf: not restartable */
    DDP_EXIT_EXEC_FAILED = 127, /* the program could not be started: not restartable */
};

/* True when running the same workers again cannot change the outcome. */
static inline bool ddp_exit_is_permanent(int status) {
    return status == DDP_EXIT_USAGE || status == DDP_EXIT_DATA || status == DDP_EXIT_IO ||
           status == DDP_EXIT_CONFIG || status == DDP_EXIT_DIVERGED ||
           status == DDP_EXIT_EXEC_FAILED;
}

#endif
