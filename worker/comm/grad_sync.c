/* grad_sync: see grad_sync.h. */
#include "grad_sync.h"

#include <errno.h>
#include <stdlib.h>

static void *bucket_thread(void *arg) {
    grad_sync_t *g = arg;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (!g->is_stopping && g->n_done == g->n_queued)
            pthread_cond_wait(&g->cv, &g->mu);
        if (g->is_stopping) break;
        int i = g->n_done;
        size_t start = g->bucket_start[i], end = i ? g->bucket_start[i - 1] : g->n_elems;
        int failed = g->rc;
        pthread_mutex_unlock(&g->mu);
        int rc = failed ? failed
                        : g->comm->ops->allreduce_sum_f32(g->comm, g->grads + start, end - start);
        pthread_mutex_lock(&g->mu);
        if (rc < 0 && g->rc == 0) g->rc = rc;
        g->n_done++;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

int grad_sync_init(grad_sync_t *g, comm_t *comm, float *grads, size_t n_elems,
                   size_t bucket_bytes) {
    *g = (grad_sync_t){.comm = comm, .grads = grads, .n_elems = n_elems};
    size_t per = bucket_bytes / sizeof(float);
    if (per == 0) per = 1;
    size_t n = (n_elems + per - 1) / per;
    g->bucket_start = calloc(n ? n : 1, sizeof *g->bucket_start);
    if (!g->bucket_start) return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        g->bucket_start[i] = n_elems > (i + 1) * per ? n_elems - (i + 1) * per : 0;
    g->n_buckets = (int)n;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    int rc = pthread_create(&g->thread, NULL, bucket_thread, g);
    if (rc != 0) {
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g->bucket_start);
        return -rc;
    }
    g->has_thread = true;
    return 0;
}

void grad_sync_free(grad_sync_t *g) {
    if (g->has_thread) {
        pthread_mutex_lock(&g->mu);
        g->is_stopping = true;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->thread, NULL);
        pthread_mutex_destroy(&g->mu);
        pthread_cond_destroy(&g->cv);
    }
    free(g->bucket_start);
    *g = (grad_sync_t){0};
}

void grad_sync_begin(grad_sync_t *g) {
    pthread_mutex_lock(&g->mu);
    g->n_queued = g->n_done = 0;
    pthread_mutex_unlock(&g->mu);
}

void grad_sync_ready(void *arg, size_t ready_from) {
    grad_sync_t *g = arg;
    pthread_mutex_lock(&g->mu);
    int before = g->n_queued;
    while (g->n_queued < g->n_buckets && g->bucket_start[g->n_queued] >= ready_from)
        g->n_queued++;
    if (g->n_queued != before) pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

int grad_sync_finish(grad_sync_t *g) {
    grad_sync_ready(g, 0);
    pthread_mutex_lock(&g->mu);
    while (g->n_done < g->n_buckets)
        pthread_cond_wait(&g->cv, &g->mu);
    int rc = g->rc;
    pthread_mutex_unlock(&g->mu);
    return rc;
}
