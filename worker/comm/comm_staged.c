/* comm_staged: collectives over GPU memory through a host-memory transport (the ring), for ranks
 * that share a GPU, where NCCL refuses to run. Each call on device memory copies a chunk to the
 * host, runs the inner collective on it and copies the result back, chunk after chunk; host
 * memory passes straight through. Broadcasts are copies, so chunking changes no bit; a sum's order
 * for an element follows the ring's chunk of it, so a staged sum may differ in its last bits from
 * an unstaged one (each is the same on every rank and in every run).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"

#define STAGE_BYTES ((size_t)8 << 20)

typedef struct {
    comm_t base;
    comm_t *inner;
    backend_t *backend;
    unsigned char *host; /* STAGE_BYTES */
} staged_t;

static staged_t *staged_of(comm_t *c) {
    return (staged_t *)c;
}

/* The inner error, so that comm_error names the peer that failed. */
static int fail(staged_t *s, int rc) {
    memcpy(s->base.err, s->inner->err, sizeof s->base.err);
    return rc;
}

typedef int (*chunk_fn)(comm_t *inner, void *host, size_t n_bytes, int root);

static int through_host(staged_t *s, void *data, size_t n_bytes, size_t unit, int root,
                        chunk_fn fn) {
    const backend_memory_i *mem = s->backend->mem;
    size_t chunk = STAGE_BYTES / unit * unit;
    for (size_t at = 0; at < n_bytes; at += chunk) {
        size_t n = n_bytes - at < chunk ? n_bytes - at : chunk;
        mem->to_host(s->backend, s->host, (unsigned char *)data + at, n);
        int rc = fn(s->inner, s->host, n, root);
        if (rc < 0) return fail(s, rc);
        mem->to_device(s->backend, (unsigned char *)data + at, s->host, n);
    }
    return 0;
}

static int sum_f32_chunk(comm_t *inner, void *host, size_t n_bytes, int root) {
    (void)root;
    return inner->ops->allreduce_sum_f32(inner, host, n_bytes / sizeof(float));
}

static int sum_f64_chunk(comm_t *inner, void *host, size_t n_bytes, int root) {
    (void)root;
    return inner->ops->allreduce_sum_f64(inner, host, n_bytes / sizeof(double));
}

static int broadcast_chunk(comm_t *inner, void *host, size_t n_bytes, int root) {
    return inner->ops->broadcast(inner, host, n_bytes, root);
}

static bool is_device(staged_t *s, const void *p) {
    return s->backend->mem->is_device(s->backend, p);
}

static int staged_allreduce_f32(comm_t *c, float *data, size_t n) {
    staged_t *s = staged_of(c);
    if (!is_device(s, data)) {
        int rc = s->inner->ops->allreduce_sum_f32(s->inner, data, n);
        return rc < 0 ? fail(s, rc) : rc;
    }
    return through_host(s, data, n * sizeof(float), sizeof(float), 0, sum_f32_chunk);
}

static int staged_allreduce_f64(comm_t *c, double *data, size_t n) {
    staged_t *s = staged_of(c);
    if (!is_device(s, data)) {
        int rc = s->inner->ops->allreduce_sum_f64(s->inner, data, n);
        return rc < 0 ? fail(s, rc) : rc;
    }
    return through_host(s, data, n * sizeof(double), sizeof(double), 0, sum_f64_chunk);
}

static int staged_broadcast(comm_t *c, void *data, size_t n_bytes, int root) {
    staged_t *s = staged_of(c);
    if (!is_device(s, data)) {
        int rc = s->inner->ops->broadcast(s->inner, data, n_bytes, root);
        return rc < 0 ? fail(s, rc) : rc;
    }
    return through_host(s, data, n_bytes, 1, root, broadcast_chunk);
}

static int staged_barrier(comm_t *c) {
    staged_t *s = staged_of(c);
    int rc = s->inner->ops->barrier(s->inner);
    return rc < 0 ? fail(s, rc) : rc;
}

static void staged_destroy(comm_t *c) {
    staged_t *s = staged_of(c);
    s->inner->ops->destroy(s->inner);
    free(s->host);
    free(s);
}

static const comm_i staged_ops = {
    .name = "ring (staged through host memory)",
    .allreduce_sum_f32 = staged_allreduce_f32,
    .allreduce_sum_f64 = staged_allreduce_f64,
    .broadcast = staged_broadcast,
    .barrier = staged_barrier,
    .destroy = staged_destroy,
};

int comm_staged_create(comm_t *inner, backend_t *backend, comm_t **out) {
    staged_t *s = calloc(1, sizeof *s);
    unsigned char *host = malloc(STAGE_BYTES);
    if (!s || !host) {
        free(s);
        free(host);
        return -ENOMEM;
    }
    s->base.ops = &staged_ops;
    s->base.rank = inner->rank;
    s->base.world = inner->world;
    s->inner = inner;
    s->backend = backend;
    s->host = host;
    *out = &s->base;
    return 0;
}
