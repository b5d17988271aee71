/* workers: one attempt's local worker processes on the agent's loop. Spawns each worker through
 * the shim (own process group, dies with the agent), gives it torchrun's environment, carries its
 * stdout/stderr to the console ("[node/rank]: " prefix, --redirects/--tee/--local-ranks-filter)
 * and to per-rank, per-attempt files under --log-dir, and stops them: the signal to every group,
 * SIGKILL after the shutdown timeout, and never waits forever on a worker stuck in the kernel.
 * With spec->spares, a local rank's warm spare takes the round in place of a fresh process.
 * Loop thread only. */
#ifndef DDP_LAUNCHER_WORKERS_H
#define DDP_LAUNCHER_WORKERS_H

#include <stdint.h>
#include <uv.h>

#include "workers/worker_env.h"

typedef struct workers workers_t;

typedef struct {
    int local_rank, rank;
    int pid;
    int exit_status; /* valid when term_signal == 0 */
    int term_signal;
    bool has_exited;
} worker_result_t;

/* A worker ended (before its output is drained). */
typedef void (*workers_exit_cb)(workers_t *w, const worker_result_t *r, void *arg);
/* Every worker ended and its output is drained (or it was given up as unkillable). */
typedef void (*workers_done_cb)(workers_t *w, void *arg);

/* Start every local worker. Returns 0, or a negative code with a message in err (nothing runs). */
int workers_start(uv_loop_t *loop, const workers_spec_t *spec, workers_exit_cb on_exit,
                  workers_done_cb on_done, void *arg, workers_t **out, char *err, size_t err_len);
/* Send signum to every live worker's process group. */
void workers_signal(workers_t *w, int signum);
/* signum to every group now, SIGKILL after timeout_s; on_done fires once all are gone. */
void workers_stop(workers_t *w, int signum, double timeout_s);
/* Whether every worker of the set has reported progress (DDPRUN_PROGRESS_FILE: ddpworker does from
 * its first step, after its start-up allocations) and none has exited. Reads the files. */
bool workers_are_training(workers_t *w);
/* The last lines a worker wrote to stderr (NUL-terminated, may be empty). */
const char *workers_tail(const workers_t *w, int local_rank);
/* The console has room again (console_start's callback): read the workers' output again. */
void workers_console_room(void *arg);
/* Free after on_done. */
void workers_destroy(workers_t *w);

#endif
