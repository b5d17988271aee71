/* stop_signal: SIGTERM (stop) and SIGUSR1 (a snapshot now) as requests that the trainer answers at
 * a step boundary, once a run has somewhere to save its state, instead of their default action.
 * Each is remembered apart (a SIGUSR1 after a SIGTERM does not hide the stop). The flags are set
 * by the handler and read by any thread: the trainer between steps, a collective while it waits
 * (a stop must not wait out collective_timeout for a peer that froze). */
#ifndef DDP_WORKER_STOP_SIGNAL_H
#define DDP_WORKER_STOP_SIGNAL_H

#include <stdbool.h>

/* From now on SIGTERM and SIGUSR1 are requests. */
void stop_signal_catch(void);
bool stop_signal_is_stop_requested(void);     /* a SIGTERM came */
bool stop_signal_is_snapshot_requested(void); /* a SIGUSR1 came */

#endif
