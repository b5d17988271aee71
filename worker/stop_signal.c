/* stop_signal: see stop_signal.h. */
#include "stop_signal.h"

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>

/* lock-free atomics: safe in the handler, and read by other threads (the gradient thread's
 * collectives) */
static atomic_bool is_stop_requested, is_snapshot_requested;

static void on_signal(int signum) {
    if (signum == SIGTERM) atomic_store(&is_stop_requested, true);
    if (signum == SIGUSR1) atomic_store(&is_snapshot_requested, true);
}

void stop_signal_catch(void) {
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
}

bool stop_signal_is_stop_requested(void) {
    return atomic_load(&is_stop_requested);
}

bool stop_signal_is_snapshot_requested(void) {
    return atomic_load(&is_snapshot_requested);
}
