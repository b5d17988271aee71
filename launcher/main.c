/* main: the ddprun executable's entry point; dispatches to a subcommand. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "log.h"

static const char main_usage[] =
    "usage: ddprun COMMAND [ARGS]\n"
    "\n"
    "commands:\n"
    "  store          run a TCPStore-protocol key/value store (ddprun store --help)\n"
    "  store-client   one operation against a store (ddprun store-client --help)\n"
    "\n"
    "  --version      print the version\n";

int main(int argc, char **argv) {
    const char *level = getenv("DDPRUN_LOG_LEVEL");
    int lvl = level ? log_level_parse(level) : -1;
    log_init("ddprun", lvl < 0 ? LOG_LEVEL_INFO : (log_level_t)lvl);
    if (argc < 2) {
        fputs(main_usage, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "store") == 0) return store_cmd_main(argc - 1, argv + 1);
    if (strcmp(cmd, "store-client") == 0) return store_cli_main(argc - 1, argv + 1);
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        fputs(main_usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        puts("ddprun " DDP_VERSION);
        return 0;
    }
    fprintf(stderr, "ddprun: unknown command '%s' (see ddprun --help)\n", cmd);
    return 2;
}
