/* startup_trace: where a worker's start-up goes. With DDP_STARTUP_TRACE=1 in its environment,
 * ddpworker and its cuda library write one line per start-up phase on stderr as the phase ends:
 *   ddpworker: startup: <phase> <seconds> s
 * (the phase's own duration, monotonic clock), so that a script reading the launcher's output
 * (tests/bench/bench_gpu_startup.py) lays them on its launch-to-first-step timeline. Header-only:
 * the cuda library uses it without linking ddp_common. Off: one getenv per phase. */
#ifndef DDP_COMMON_STARTUP_TRACE_H
#define DDP_COMMON_STARTUP_TRACE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline bool startup_trace_is_on(void) {
    const char *v = getenv("DDP_STARTUP_TRACE");
    return v && strcmp(v, "1") == 0;
}

/* The start of a phase: monotonic seconds. */
static inline double startup_trace_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The phase that began at `since` (startup_trace_now) ends now; returns now, the next phase's
 * start. */
static inline double startup_trace_end(const char *phase, double since) {
    double now = startup_trace_now();
    if (startup_trace_is_on())
        fprintf(stderr, "ddpworker: startup: %s %.3f s\n", phase, now - since);
    return now;
}

#endif
