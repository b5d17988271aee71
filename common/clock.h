/* clock: monotonic milliseconds and deadlines. A deadline is an absolute clock_now_ms() value;
 * CLOCK_NEVER means no deadline. */
#ifndef DDP_COMMON_CLOCK_H
#define DDP_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

#define CLOCK_NEVER UINT64_MAX

/* Monotonic seconds, for durations and rates (inline: the CUDA library uses it without linking
 * this module). */
static inline double clock_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

uint64_t clock_now_ms(void);
/* now + timeout_ms; a negative timeout means CLOCK_NEVER. */
uint64_t clock_deadline_ms(int64_t timeout_ms);
/* Milliseconds left until deadline (0 if passed); INT32_MAX-capped for poll(2); -1 for never. */
int clock_remaining_ms(uint64_t deadline_ms);

#endif
