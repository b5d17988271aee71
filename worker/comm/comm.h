/* comm: the collectives data-parallel training needs, behind one small interface (comm_i) so the
 * trainer does not care which transport runs them: `null` for a world of one, `ring` (TCP between
 * the workers, addresses exchanged through the job's store) and, with the CUDA backend, `nccl`.
 *
 * Every call blocks until the collective is complete on this rank or has failed. A failure (a peer
 * closed its socket, a deadline passed, a malformed frame) returns a negative code and leaves a
 * message naming the peer (rank, address) and what happened in comm_error(); the communicator is
 * then unusable and the worker exits with DDP_EXIT_PEER_FAILURE. No call ever waits forever.
 * A communicator is used by one thread at a time (the trainer's bucket thread or its main thread).
 */
#ifndef DDP_WORKER_COMM_H
#define DDP_WORKER_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store_client.h"

typedef struct comm comm_t;
typedef struct backend backend_t;

typedef struct {
    const char *name;
    /* In place: data[i] = sum over ranks of data[i]. Every rank ends with the same bits, and the
     * same inputs give the same bits on every run (fixed reduction order). */
    int (*allreduce_sum_f32)(comm_t *c, float *data, size_t n_elems);
    int (*allreduce_sum_f64)(comm_t *c, double *data, size_t n_elems);
    /* In place: every rank ends with root's bytes. */
    int (*broadcast)(comm_t *c, void *data, size_t n_bytes, int root);
    /* Returns when every rank has entered. */
    int (*barrier)(comm_t *c);
    void (*destroy)(comm_t *c);
} comm_i;

struct comm {
    const comm_i *ops;
    int rank, world;
    char err[512];
};

typedef struct {
    int rank, world;
    store_client_t *store;        /* address exchange, during create only; not kept */
    const char *key_prefix;       /* unique per job round, e.g. "/ddpworker/<run id>/<attempt>/" */
    const char *advertise_host;   /* address peers dial; NULL: this host's address on the route to
                                     store_host (127.0.0.1 when the store is on loopback) */
    const char *store_host;       /* the store's host, for the route lookup above */
    int64_t timeout_ms;           /* bound of connecting and of every socket wait in a collective */
    const store_secret_t *secret; /* the store's shared secret, which every rank proves to its
                                     neighbours; NULL or unset: none */
} comm_ring_opts_t;

/* A communicator for a world of one: every collective returns at once. */
int comm_null_create(comm_t **out);
/* Listen, publish "a.b.c.d:port" under key_prefix + "ring/<rank>", connect to rank + 1 and accept
 * rank - 1 (a handshake naming the job and rank, and proving the secret when there is one; see
 * comm_ring_join.c). Returns 0, or a negative code with the reason in err. Blocks at most
 * timeout_ms (plus the store's own bounds). */
int comm_ring_create(const comm_ring_opts_t *o, comm_t **out, char *err, size_t err_len);

/* Every rank publishes is_yes under key_prefix + question + "/<rank>", waits for all the others
 * (bounded by the store's op timeout) and gets whether all said yes: the same answer on every
 * rank. Returns 0, or a negative code with err (store failure, a value that is not 0 or 1). */
int comm_agree_all(store_client_t *store, const char *key_prefix, const char *question, int rank,
                   int world, bool is_yes, bool *all_yes, char *err, size_t err_len);

/* Collectives over a backend's device memory through `inner` (a host-memory transport), staged
 * chunk by chunk; host memory passes straight through. Takes ownership of inner. */
int comm_staged_create(comm_t *inner, backend_t *backend, comm_t **out);

static inline const char *comm_error(const comm_t *c) {
    return c->err;
}

#endif
