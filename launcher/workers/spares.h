/* spares: warm spares (--warm-spares 1): one ddpworker per local rank, started before any round
 * needs it, initialized up to what depends on the round (CUDA context and handles, the data, the
 * model) and waiting on a socket (proto/spare_handoff.h). A round's workers take them in place of
 * fresh processes, which is what makes a restart on a GPU fast; every spare taken, or dead before
 * any round took it, is replaced in the background. A spare runs under the shim like any worker
 * (own process group, dies with the agent). Loop thread only. */
#ifndef DDP_LAUNCHER_SPARES_H
#define DDP_LAUNCHER_SPARES_H

#include <stdint.h>
#include <uv.h>

#include "workers/worker_env.h"

typedef struct spare spare_t;

/* A taken spare ended: called once, from the loop, with its shim's status (the program's). */
typedef void (*spare_exit_cb)(void *owner, int64_t exit_status, int term_signal);

typedef struct {
    int group_pid;        /* the shim's pid: the spare's process group */
    const char *pid_path; /* where the shim wrote the program's pid (lives as long as the spare) */
} spare_taken_t;

/* Whether spares may start now: the agent says yes once the current round's workers train (a spare
 * started while they still allocate could take the GPU memory they need). */
typedef bool (*spares_may_start_cb)(void *arg);

/* Keep a spare for every local rank of opts (train.conf's worker), their files under
 * run_dir/spares. A spare starts once may_start(arg) says so, checked a few times a second, and
 * at least a second after the last take. Returns 0, or a negative errno with a message in err
 * (then no spares). */
int spares_create(uv_loop_t *loop, const ddprun_opts_t *opts, const char *shim_exe,
                  const char *run_dir, spares_may_start_cb may_start, void *arg, spares_t **out,
                  char *err, size_t err_len);
/* Hand local_rank's spare a round: env (NULL-terminated KEY=VALUE, what a fresh worker of the
 * round would get) and the write ends of its new stdout and stderr (the caller keeps and closes
 * its own copies). On success the spare is the caller's to supervise: on_exit(owner, ...) fires
 * once when it ends; returns 0 and fills *taken. Returns -1 when local_rank has no spare that
 * says it is ready (one still starting stays for a later round) or the handoff could not be
 * delivered: the caller starts a fresh worker. Blocks at most ~1 s, only when the spare does not
 * read its socket. */
int spares_take(spares_t *s, int local_rank, char *const *env, int out_fd, int err_fd,
                spare_exit_cb on_exit, void *owner, spare_taken_t *taken);
/* Kill the spares no round took and stop replacing them; taken ones live on with their owners.
 * The set frees itself once every spare's process handle has closed. */
void spares_destroy(spares_t *s);

#endif
