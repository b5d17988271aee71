/* commands: the subcommands of the ddprun executable. Each returns the process exit code
 * (0 success, 1 failure, 2 usage error) and prints its own messages. */
#ifndef DDP_LAUNCHER_COMMANDS_H
#define DDP_LAUNCHER_COMMANDS_H

/* `ddprun store ...`: the standalone store server (store/store_cmd.c). */
int store_cmd_main(int argc, char **argv);
/* `ddprun store-client ...`: one store operation from the shell (cmd/store_client_cmd.c). */
int store_client_cmd_main(int argc, char **argv);
/* `ddprun status ...`: a running job's state from its store (cmd/status_cmd.c). */
int status_cmd_main(int argc, char **argv);
/* `ddprun-shim __shim AGENT_PID -- PROGRAM ARGS` (or `ddprun __shim ...`): the first process of
 * each worker (workers/worker_shim.c; ddprun-shim is its own executable, workers/shim_main.c). */
int worker_shim_main(int argc, char **argv);
/* `ddprun plot RUN.jsonl... -o curves.png`: execs the plotting script (cmd/plot_cmd.c); returns
 * only when it cannot (1). */
int plot_cmd_main(int argc, char **argv);

#endif
