/* memory_region: the node's shared-memory directory for memory snapshots, owned by the agent.
 * The agent creates it (on /dev/shm, or $DDPRUN_SHM_DIR), names it to its workers
 * (DDPRUN_MEMORY_SNAPSHOT_DIR: SNAPSHOT_MEMORY_DIR_ENV, proto/snapshot_format.h; set by
 * workers/worker_env.c), keeps it across worker restarts (a worker killed with -9 leaves its last
 * sealed generation there) and removes it when it exits. A directory left by an agent that was
 * killed (its pid in the name is gone) is removed by the next agent on the node; when it was the
 * same job's (its file "job" holds the same identity), its files move into the new directory
 * first, so that an agent's death alone costs the node none of its generations (one such
 * directory per agent: another of the job is left to the job's next agent here). What the workers
 * write into it: worker/snapshot/memory_snapshot.h. The agent's loop thread. */
#ifndef DDP_LAUNCHER_MEMORY_REGION_H
#define DDP_LAUNCHER_MEMORY_REGION_H

#include <stddef.h>

#define MEMORY_REGION_BASE_ENV "DDPRUN_SHM_DIR"

/* Create this agent's directory into dir (dir_len bytes), write identity (the job's: run id,
 * nodes, program and arguments) into it, adopt the files of a stale directory of the same
 * identity and remove the stale ones. *adopted: how many files it took over. Returns 0, or a
 * negative errno with err saying where (the job then runs without memory snapshots). */
int memory_region_create(char *dir, size_t dir_len, const char *identity, int *adopted, char *err,
                         size_t err_len);
/* Remove dir and everything in it (best effort). */
void memory_region_remove(const char *dir);

#endif
