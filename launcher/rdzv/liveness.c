/* liveness: see liveness.h. */
#include "rdzv/liveness.h"

#include <assert.h>
#include <stdbool.h>

#define UNKNOWN INT64_MIN /* before the first reading */

void liveness_reset(liveness_t *l, int n, uint64_t limit_ms, uint64_t now_ms) {
    assert(n >= 0 && n <= RDZV_MAX_NODES);
    l->n = n;
    l->limit_ms = limit_ms;
    for (int i = 0; i < n; i++) {
        l->seen[i] = UNKNOWN;
        l->changed_ms[i] = now_ms;
    }
}

int liveness_judge(liveness_t *l, const int64_t *marks, int self, uint64_t now_ms) {
    int stale = -1;
    for (int i = 0; i < l->n; i++) {
        if (i == self) continue;
        /* GONE never counts as a change: a member whose key vanished stays gone */
        bool is_change =
            marks[i] == LIVENESS_ALIVE || (marks[i] != l->seen[i] && marks[i] != LIVENESS_GONE);
        if (is_change) l->changed_ms[i] = now_ms;
        l->seen[i] = marks[i];
        if (!is_change && now_ms - l->changed_ms[i] > l->limit_ms && stale < 0) stale = i;
    }
    return stale;
}
