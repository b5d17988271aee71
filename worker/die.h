/* die: how ddpworker ends when it cannot go on: "ddpworker: rank R: <message>" on stderr, then
 * exit with a code from proto/exit_codes.h that tells the agent what happened (config, data, peer
 * failure, bug) and so whether to restart. Any thread; the rank is set once, by the trainer's
 * start, before the threads that may die run. */
#ifndef DDP_WORKER_DIE_H
#define DDP_WORKER_DIE_H

#include <stddef.h>

#include "comm.h"

/* From now on messages name this rank (before: "ddpworker: " alone). */
void die_set_rank(int rank);
/* Print "ddpworker: rank R: <message>" to stderr and exit with code. */
_Noreturn void die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A collective's result rc: on failure exit with DDP_EXIT_PEER_FAILURE naming what was being
 * done and comm's reason (a peer gone, a peer silent, or the error itself); -ECANCELED (a SIGTERM
 * that found a peer silent) exits 128 + SIGTERM. */
void die_comm(const comm_t *comm, int rc, const char *what);
/* calloc(n, size) (at least one byte), or exit with DDP_EXIT_BUG naming what it was for. */
void *die_calloc(size_t n, size_t size, const char *what);

#endif
