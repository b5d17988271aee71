/* liveness: judges from a round's members' marks whether one of them is gone. A mark is what a
 * member leaves while it lives: on the TCP store its heartbeat counter (it changes while the
 * member beats), on etcd whether its lease-bound key is there (LIVENESS_ALIVE or LIVENESS_GONE).
 * A member whose mark has not changed, or who has been GONE, for longer than the limit is stale.
 * Counters, not clocks: each agent judges on its own monotonic clock, passed in as now_ms.
 * Pure: no I/O, no clock, no allocation; the caller's storage. Members beside each other judge
 * each other this way, and so does an agent that arrived after the round closed (a spare):
 * a closed round whose members all died is ended by whoever waits for it. */
#ifndef DDP_LAUNCHER_LIVENESS_H
#define DDP_LAUNCHER_LIVENESS_H

#include <stdint.h>

#include "rdzv/rdzv_record.h"

#define LIVENESS_ALIVE INT64_MAX /* seen alive right now (etcd: its key is there) */
#define LIVENESS_GONE  (-1)      /* its key is gone; stays stale */

typedef struct {
    int n;             /* members */
    uint64_t limit_ms; /* how long a mark may stand still */
    int64_t seen[RDZV_MAX_NODES];
    uint64_t changed_ms[RDZV_MAX_NODES];
} liveness_t;

/* Start judging n members (n <= RDZV_MAX_NODES): every member counts as alive at now_ms. */
void liveness_reset(liveness_t *l, int n, uint64_t limit_ms, uint64_t now_ms);
/* One reading of every member's mark (marks[0..n-1]) at now_ms. Returns the first member other
 * than `self` (-1: judge them all) whose mark stood still or was GONE for longer than limit_ms,
 * else -1. */
int liveness_judge(liveness_t *l, const int64_t *marks, int self, uint64_t now_ms);

#endif
