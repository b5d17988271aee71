/* comm_ring_internal: what the ring's two files share: the ring itself (ring_t), its failure
 * (comm_ring__fail) and its operations table. comm_ring.c runs the collectives on a joined ring;
 * comm_ring_join.c joins it (addresses through the store, the handshake with both neighbours). */
#ifndef DDP_WORKER_COMM_RING_INTERNAL_H
#define DDP_WORKER_COMM_RING_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"

#define RING_PIECE_BYTES (1u << 18)

typedef struct {
    comm_t base;
    int next_fd, prev_fd;
    char next_addr[80], prev_addr[80];
    int64_t timeout_ms;
    uint8_t *scratch;            /* RING_PIECE_BYTES */
    const char *doing;           /* the collective in progress, for messages */
    uint64_t seq;                /* collectives begun so far */
    int64_t bound_ms;            /* the collective in progress ends by then (clock_now_ms) */
    bool has_sent, has_received; /* bytes went to next / came from prev in that collective */
    int64_t longest_quiet_ms;    /* the longest wait for a peer that then moved its data */
    int failed_rc;               /* 0, or the code of the failure that made this ring unusable */
} ring_t;

/* The ring's collectives (comm_ring.c); destroy closes both sockets and frees the ring. */
extern const comm_i comm_ring__ops;

/* Marks the ring failed with rc and "ring: <message>" in its err; returns rc. */
int comm_ring__fail(ring_t *r, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static inline int prev_rank(const ring_t *r) {
    return (r->base.rank + r->base.world - 1) % r->base.world;
}
static inline int next_rank(const ring_t *r) {
    return (r->base.rank + 1) % r->base.world;
}

#endif
