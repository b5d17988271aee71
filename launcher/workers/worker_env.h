/* worker_env: what a worker process is started with: the round's description of its workers
 * (workers_spec_t), the shim's command line around the program (python3 -u for a script), and the
 * environment (the agent's own, then torchrun's variables over it). Shared by workers (a round's
 * processes) and spares (warm spares, which receive the round's environment when a round takes
 * them). Pure apart from reading the agent's environment; loop thread only. */
#ifndef DDP_LAUNCHER_WORKER_ENV_H
#define DDP_LAUNCHER_WORKER_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "options.h"

typedef struct spares spares_t;

typedef struct {
    const ddprun_opts_t *opts;
    const char *shim_exe; /* the shim to start workers under (ddprun-shim, or ddprun) */
    const char *run_id;
    int attempt;       /* the round: DDPRUN_ATTEMPT, the log directory */
    int restart_count; /* TORCHELASTIC_RESTART_COUNT: restarts used (membership changes
                          are not restarts, as in torchrun) */
    int group_rank, group_world_size;
    int rank_offset; /* global rank of local rank 0 */
    int world_size;
    const char *master_addr; /* the agent's store, for MASTER_ADDR/MASTER_PORT */
    uint16_t master_port;
    const char *attempt_dir; /* logs and error files of this attempt (always set) */
    spares_t *spares;        /* warm spares to take the workers' places, or NULL */
    const char *memory_dir;  /* the agent's memory snapshot directory ("" or NULL: none) */
} workers_spec_t;

/* A NULL-terminated KEY=VALUE array (execve's envp); a later set of a key replaces it. */
typedef struct {
    char **vars;
    size_t n, cap;
} worker_env_t;

/* 0 or -ENOMEM (e keeps what it had). The value is cut at 4 KiB. */
int worker_env_set(worker_env_t *e, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void worker_env_free(worker_env_t *e);
/* The agent's environment plus the defaults every worker gets (OMP_NUM_THREADS=1 when the node
 * runs several, unbuffered Python, NCCL errors that abort) unless the agent's environment sets
 * them. 0 or -ENOMEM. */
int worker_env_base(worker_env_t *e, int nproc_per_node);
/* worker_env_base plus torchrun's variables and DDPRUN_* for local_rank of the round. */
int worker_env_round(const workers_spec_t *sp, int local_rank, worker_env_t *e);
/* argv of the shim: SHIM __shim AGENT_PID (SHIM: ddprun-shim, or ddprun itself) -- [python3 -u
 * [-m]] PROGRAM ARGS (NULL-terminated, pointing into opts and pid_text; free() the array alone), or
 * NULL when out of memory. */
char **worker_env_argv(const ddprun_opts_t *o, const char *shim_exe, char *pid_text);
/* The program's pid that the shim wrote at path (DDPRUN_PID_FILE), or 0 when there is none yet. */
int worker_env_program_pid(const char *path);

#endif
