/* grad_sync: DDP's gradient averaging, overlapped with backward. The gradient arena is cut into
 * buckets from its end (backward finishes the last layers first); as model_backward reports
 * gradients final, complete buckets go to a background thread that all-reduces them in a fixed
 * order through comm_i while backward carries on. The trainer waits for every bucket before the
 * optimizer step. One bucket thread per trainer; the trainer's thread calls everything here. */
#ifndef DDP_WORKER_GRAD_SYNC_H
#define DDP_WORKER_GRAD_SYNC_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "comm.h"

typedef struct {
    comm_t *comm;
    float *grads;
    size_t n_elems;
    size_t *bucket_start; /* bucket i covers [bucket_start[i], i ? bucket_start[i-1] : n_elems) */
    int n_buckets;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_queued, n_done; /* this step's buckets handed over / reduced */
    int rc;               /* first failure, 0 if none */
    bool is_stopping, has_thread;
} grad_sync_t;

/* Buckets of about bucket_bytes over grads (n_elems floats, memory the comm can read). Starts the
 * bucket thread. Returns 0 or a negative errno. */
int grad_sync_init(grad_sync_t *g, comm_t *comm, float *grads, size_t n_elems, size_t bucket_bytes);
void grad_sync_free(grad_sync_t *g);
/* Before a step's backward. */
void grad_sync_begin(grad_sync_t *g);
/* model_grads_ready_cb: grads[ready_from, n_elems) are final. */
void grad_sync_ready(void *g, size_t ready_from);
/* Hands over what is left and waits until every bucket is summed across ranks. Returns 0, or the
 * comm's negative code (comm_error says why). */
int grad_sync_finish(grad_sync_t *g);

#endif
