/* console: what the agent shows on its stdout and stderr (its workers' lines, its own messages),
 * written by a thread of its own: a console that stops reading (a pipe nobody drains, a terminal
 * on XOFF, a stalled container log) then stalls that thread only, never the agent's loop
 * (heartbeats, signals, timers, the shutdown timeout). Writes are queued whole and go out in the
 * order they came. Past CONSOLE_HIGH_BYTES queued, console_write says so and the caller stops
 * reading its workers' pipes (they then block on their own writes, as on a console of their own
 * under torchrun) until the room callback says the queue fell below CONSOLE_LOW_BYTES. Before
 * console_start and after console_stop, writes go straight to the descriptor. Any thread may
 * write; start, stop and the callback are the loop's. */
#ifndef DDP_LAUNCHER_CONSOLE_H
#define DDP_LAUNCHER_CONSOLE_H

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#define CONSOLE_HIGH_BYTES ((size_t)4 << 20)
#define CONSOLE_LOW_BYTES  ((size_t)1 << 20)

/* Start the writer; room(arg) runs on loop when the queue, once past the high mark, fell below
 * the low one. Returns 0 or a negative errno (then writes stay direct). */
int console_start(uv_loop_t *loop, void (*room)(void *arg), void *arg);
/* Queue n bytes for fd (1 or 2). Returns true while the queue is past its high mark. */
bool console_write(int fd, const void *p, size_t n);
/* console_write of a formatted message (at most 8 KiB). */
void console_printf(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Whether the queue passed its high mark and has not fallen below its low one since. */
bool console_is_full(void);
/* Wait until what is queued has been written, or timeout_ms (< 0: no bound), then stop the
 * writer: later writes are direct. A writer still blocked on a console that never reads is left
 * behind (it ends with the process). */
void console_stop(int timeout_ms);

#endif
