/* shim_main: the entry point of ddprun-shim, the small executable every worker starts under
 * (`ddprun-shim __shim AGENT_PID -- PROGRAM ARGS`, worker_shim.c). Linked with libc alone: a
 * worker's start pays for none of the libraries the agent needs (libuv, libsodium, cJSON, ...),
 * and a test holds it to that (tests/e2e/test_launch_cost.py). `ddprun __shim` runs the same code
 * where the small executable is missing. */
#include "commands.h"

int main(int argc, char **argv) {
    return worker_shim_main(argc, argv);
}
