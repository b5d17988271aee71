/* clock: see clock.h. */
#include "clock.h"

#include <time.h>

uint64_t clock_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t clock_deadline_ms(int64_t timeout_ms) {
    return timeout_ms < 0 ? CLOCK_NEVER : clock_now_ms() + (uint64_t)timeout_ms;
}

int clock_remaining_ms(uint64_t deadline_ms) {
    if (deadline_ms == CLOCK_NEVER) return -1;
    uint64_t now = clock_now_ms();
    if (now >= deadline_ms) return 0;
    uint64_t left = deadline_ms - now;
    return left > INT32_MAX ? INT32_MAX : (int)left;
}
