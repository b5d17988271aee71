/* run_dir: the agent's scratch run directory when no --log-dir is given:
 * $TMPDIR/ddprun-<rdzv_id>-XXXXXX, holding the workers' error files. The agent removes it when
 * the run succeeds and keeps it when the run fails (the error files say why). An agent killed
 * with SIGKILL does neither; its directory would stay forever (torchrun leaves its
 * torchelastic_* directories alike), so the next agent on the machine removes it.
 *
 * Telling a killed agent's directory from a failed run's kept one: a live agent holds an flock on
 * its directory's LOCK file (a lock the kernel drops with the process, across pid namespaces
 * that share the file system); an agent that exits on its own removes the file before it lets
 * the lock go, so a kept directory has none. A LOCK file that can be locked is a dead agent's.
 * Blocking (file system); the agent's thread, before its loop starts and after it ends. */
#ifndef DDP_LAUNCHER_RUN_DIR_H
#define DDP_LAUNCHER_RUN_DIR_H

#include <stdbool.h>
#include <stddef.h>

#define RUN_DIR_LOCK "agent.lock"

/* Create base/ddprun-<rdzv_id>-XXXXXX into dir (dir_len bytes) with its lock held (*lock_fd),
 * then remove every ddprun-* directory under base whose agent was killed (*swept: how many).
 * Returns 0, or a negative errno (dir unusable, nothing held). */
int run_dir_create(const char *base, const char *rdzv_id, char *dir, size_t dir_len, int *lock_fd,
                   int *swept);
/* At the agent's exit: remove dir (keep false), or keep it without its lock file; then let the
 * lock go. */
void run_dir_release(const char *dir, int lock_fd, bool keep);

#endif
