/* memory_peer: the agent's copies of memory snapshots to and from other agents, over their own TCP
 * connections (not the store). Nodes form a ring by group rank: each agent sends every sealed
 * generation its workers write into its memory region (own-*.ddps, worker/memory_snapshot.h) to
 * the next node's agent, which keeps the newest two it received complete (peer-<node>-<0|1>.ddps
 * in its own region; another node's copies go once they are older than one received) so a lost
 * node's state survives it. Frames carry a tag of the run id: another job's are refused. A
 * generation is read and verified (header and section checksums) before it is sent, written
 * header-last on the receiving side, so a transfer cut by a crash never replaces a good copy. The
 * sender holds at most one generation; a generation sealed while the previous one is on the wire is
 * skipped for the newest.
 *
 * With a shared secret in the agents' environment (DDPRUN_STORE_SECRET[_FILE]) a receiver takes
 * frames only after the sender's HMAC over a nonce it sent (docs/protocol.md).
 *
 * The next agent's address comes with the round: each agent's node record carries its listener
 * (--local-addr, else the host name, and the port bound), and the round's rank records hand each
 * member its successor's (rendezvous.h: rdzv_set_own_peer). No store request of its own. The
 * agent's loop thread. */
#ifndef DDP_LAUNCHER_MEMORY_PEER_H
#define DDP_LAUNCHER_MEMORY_PEER_H

#include <uv.h>

#include "options.h"

/* A bound of what a peer may claim a generation's size to be (the state of a 16-billion-parameter
 * model with Adam); the receiving tmpfs refuses what it cannot hold anyway. */
#define MEMORY_PEER_MAX_BYTES ((uint64_t)192 << 30)
#define MEMORY_PEER_MAGIC     "DDPMEMR1"

typedef struct memory_peer memory_peer_t;

/* Listen on this node's address for peers' generations into dir, and watch dir's own slots.
 * Returns 0 or a negative code with err (then no replication). */
int memory_peer_start(uv_loop_t *loop, const ddprun_opts_t *o, const char *dir, memory_peer_t **out,
                      char *err, size_t err_len);
/* Where this agent's listener is, for its node record (pointers into p). */
void memory_peer_address(const memory_peer_t *p, const char **host, uint16_t *port);
/* A round with this node at group_rank of n_nodes began: send the newest generations from now on
 * to the next node's listener at next_host:next_port (from the round's records; empty host: that
 * node takes none, nothing is sent; n_nodes 1: nothing to send). */
void memory_peer_round(memory_peer_t *p, int round, int group_rank, int n_nodes,
                       const char *next_host, uint16_t next_port);
/* Close everything (sends in flight are cut); p is freed once its handles closed. */
void memory_peer_stop(memory_peer_t *p);

#endif
