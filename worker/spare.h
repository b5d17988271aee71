/* spare: ddpworker as ddprun's warm spare (--warm-spares). ddprun starts the spare before any round
 * needs it, with DDPRUN_SPARE_FD in its environment; the spare initializes what does not depend on
 * the round, then blocks here until the agent hands it a round (proto/spare_handoff.h): the
 * round's environment replaces its own and its stdout/stderr become that round's. Main thread,
 * while no other thread reads the environment or writes to stdout/stderr. */
#ifndef DDP_WORKER_SPARE_H
#define DDP_WORKER_SPARE_H

/* The handoff socket ddprun gave this process, or -1 when it is not a spare. A malformed
 * DDPRUN_SPARE_FD is a launcher bug: exits with DDP_EXIT_USAGE. */
int spare_fd_from_env(void);
/* Tell the agent this spare is ready, block until it hands the spare a round, then take it:
 * environment replaced, stdout and stderr redirected. Exits 0 quietly when the agent retires the
 * spare (end of file), and with
 * DDP_EXIT_BUG naming what was wrong when the message is not a valid handoff. */
void spare_wait_for_round(int fd);

#endif
