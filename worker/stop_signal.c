/* stop_signal: see stop_signal.h. */
#include "stop_signal.h"

#include <signal.h>
#include <stddef.h>

static volatile sig_atomic_t is_stop_requested, is_snapshot_requested;

static void on_signal(int signum) {
    if (signum == SIGTERM) is_stop_requested = 1;
    if (signum == SIGUSR1) is_snapshot_requested = 1;
}

void stop_signal_catch(void) {
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
}

bool stop_signal_is_stop_requested(void) {
    return is_stop_requested;
}

bool stop_signal_is_snapshot_requested(void) {
    return is_snapshot_requested;
}
