/* main: the ddprun executable's entry point: a subcommand (store, store-client, plot, the worker
 * shim), --version, or the launcher itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "build_info.h"
#include "commands.h"
#include "log.h"
#include "options.h"
#include "slurm.h"

int main(int argc, char **argv) {
    const char *level = getenv("DDPRUN_LOG_LEVEL");
    int lvl = level ? log_level_parse(level) : -1;
    log_init("ddprun", lvl < 0 ? LOG_LEVEL_INFO : (log_level_t)lvl);
    if (argc >= 2) {
        const char *cmd = argv[1];
        if (strcmp(cmd, "store") == 0) return store_cmd_main(argc - 1, argv + 1);
        if (strcmp(cmd, "store-client") == 0) return store_client_cmd_main(argc - 1, argv + 1);
        if (strcmp(cmd, "status") == 0) return status_cmd_main(argc - 1, argv + 1);
        if (strcmp(cmd, "plot") == 0) return plot_cmd_main(argc - 1, argv + 1);
        if (strcmp(cmd, "__shim") == 0) return worker_shim_main(argc, argv);
        if (strcmp(cmd, "--version") == 0) {
            build_info_print("ddprun", stdout);
            return 0;
        }
    }
    static ddprun_opts_t opts;
    int rc = options_parse(argc, argv, &opts, slurm_apply_defaults, stderr);
    if (rc != 0) return rc == 1 ? 0 : rc;
    if (opts.is_dry_run) {
        options_print(&opts, stdout);
        return 0;
    }
    return agent_main(&opts);
}
