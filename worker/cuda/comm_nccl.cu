/* comm_nccl: comm_i over NCCL, one GPU per rank. Collectives run on a stream of their own that
 * first waits for everything the backend has queued so far (an event), so a gradient bucket is
 * reduced as soon as backward has produced it while backward goes on. Each call then waits for
 * completion by polling, bounded by the collective timeout: a peer that died or hangs shows as
 * ncclCommGetAsyncError or as the deadline passing, the communicator is aborted and the call fails
 * (the worker exits "peer failure"), never a hang. Host memory (evaluation sums, agreement bytes)
 * goes through a small device buffer. */
#include <errno.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend_cuda_internal.h"
#include "clock.h"
#include "comm.h"
#include "comm_nccl.h"
#include "startup_trace.h"

#define SCRATCH_BYTES ((size_t)1 << 20)

typedef struct {
    comm_t base;
    ncclComm_t nccl;
    backend_t *backend;
    cudaStream_t stream;
    cudaEvent_t ready, done;
    void *scratch; /* SCRATCH_BYTES of device memory */
    int64_t timeout_ms;
    bool is_broken;
} nccl_t;

static nccl_t *nccl_of(comm_t *c) {
    return (nccl_t *)c;
}

static int fail(nccl_t *n, const char *fmt, const char *what, const char *detail) {
    snprintf(n->base.err, sizeof n->base.err, fmt, what, detail);
    if (!n->is_broken) ncclCommAbort(n->nccl); /* frees peers blocked on us too */
    n->is_broken = true;
    return -EPIPE;
}

/* Wait until `done` has passed or the communicator reports an error, within the timeout. */
static int wait_done(nccl_t *n, const char *what) {
    if (cudaEventRecord(n->done, n->stream) != cudaSuccess)
        return fail(n, "%s: %s", what, cudaGetErrorString(cudaGetLastError()));
    double deadline = (clock_now_s() * 1e3) + (double)n->timeout_ms;
    for (;;) {
        cudaError_t rc = cudaEventQuery(n->done);
        if (rc == cudaSuccess) return 0;
        if (rc != cudaErrorNotReady) return fail(n, "%s: %s", what, cudaGetErrorString(rc));
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(n->nccl, &async);
        if (async != ncclSuccess && async != ncclInProgress)
            return fail(n, "%s failed: %s (a peer died or left)", what, ncclGetErrorString(async));
        if ((clock_now_s() * 1e3) > deadline) {
            char ms[32];
            snprintf(ms, sizeof ms, "%lld", (long long)n->timeout_ms);
            return fail(n, "%s did not complete within %s ms (a peer died or hangs)", what, ms);
        }
        usleep(20);
    }
}

/* A non-blocking communicator's call may return ncclInProgress: wait until it is queued. */
static int settle(nccl_t *n, ncclResult_t rc, const char *what) {
    double deadline = (clock_now_s() * 1e3) + (double)n->timeout_ms;
    while (rc == ncclInProgress && (clock_now_s() * 1e3) < deadline) {
        usleep(20);
        ncclCommGetAsyncError(n->nccl, &rc);
    }
    if (rc != ncclSuccess) return fail(n, "%s: %s", what, ncclGetErrorString(rc));
    return 0;
}

static bool is_device(const void *p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return attr.type == cudaMemoryTypeDevice;
}

typedef enum { OP_SUM, OP_BROADCAST } op_t;

static int run_on_device(nccl_t *n, op_t op, void *data, size_t count, ncclDataType_t type,
                         int root) {
    const char *what = op == OP_SUM ? "NCCL all-reduce" : "NCCL broadcast";
    if (n->is_broken) return -EPIPE;
    if (cudaEventRecord(n->ready, backend_cuda_stream(n->backend)) != cudaSuccess ||
        cudaStreamWaitEvent(n->stream, n->ready, 0) != cudaSuccess)
        return fail(n, "%s: %s", what, cudaGetErrorString(cudaGetLastError()));
    ncclResult_t rc = op == OP_SUM
                          ? ncclAllReduce(data, data, count, type, ncclSum, n->nccl, n->stream)
                          : ncclBroadcast(data, data, count, type, root, n->nccl, n->stream);
    if (settle(n, rc, what) < 0) return -EPIPE;
    return wait_done(n, what);
}

static int run(nccl_t *n, op_t op, void *data, size_t count, size_t elem, ncclDataType_t type,
               int root) {
    if (is_device(data)) return run_on_device(n, op, data, count, type, root);
    size_t chunk = SCRATCH_BYTES / elem;
    for (size_t at = 0; at < count; at += chunk) {
        size_t k = count - at < chunk ? count - at : chunk;
        char *host = (char *)data + at * elem;
        if (cudaMemcpyAsync(n->scratch, host, k * elem, cudaMemcpyHostToDevice, n->stream) !=
            cudaSuccess)
            return fail(n, "%s: %s", "staging for NCCL", cudaGetErrorString(cudaGetLastError()));
        int rc = run_on_device(n, op, n->scratch, k, type, root);
        if (rc < 0) return rc;
        if (cudaMemcpyAsync(host, n->scratch, k * elem, cudaMemcpyDeviceToHost, n->stream) !=
                cudaSuccess ||
            cudaStreamSynchronize(n->stream) != cudaSuccess)
            return fail(n, "%s: %s", "staging for NCCL", cudaGetErrorString(cudaGetLastError()));
    }
    return 0;
}

static int nccl_allreduce_f32(comm_t *c, float *data, size_t n) {
    return run(nccl_of(c), OP_SUM, data, n, sizeof(float), ncclFloat32, 0);
}

static int nccl_allreduce_f64(comm_t *c, double *data, size_t n) {
    return run(nccl_of(c), OP_SUM, data, n, sizeof(double), ncclFloat64, 0);
}

static int nccl_broadcast(comm_t *c, void *data, size_t n_bytes, int root) {
    return run(nccl_of(c), OP_BROADCAST, data, n_bytes, 1, ncclUint8, root);
}

static int nccl_barrier(comm_t *c) {
    float one = 1.0f;
    return nccl_allreduce_f32(c, &one, 1);
}

static void nccl_destroy(comm_t *c) {
    nccl_t *n = nccl_of(c);
    if (n->nccl) {
        if (n->is_broken) {
            /* aborted already */
        } else {
            cudaStreamSynchronize(n->stream);
            ncclCommDestroy(n->nccl);
        }
    }
    if (n->scratch) cudaFree(n->scratch);
    if (n->ready) cudaEventDestroy(n->ready);
    if (n->done) cudaEventDestroy(n->done);
    if (n->stream) cudaStreamDestroy(n->stream);
    free(n);
}

static comm_i make_ops(void) {
    comm_i o;
    memset(&o, 0, sizeof o);
    o.name = "nccl";
    o.allreduce_sum_f32 = nccl_allreduce_f32;
    o.allreduce_sum_f64 = nccl_allreduce_f64;
    o.broadcast = nccl_broadcast;
    o.barrier = nccl_barrier;
    o.destroy = nccl_destroy;
    return o;
}

static const comm_i nccl_ops = make_ops();

extern "C" size_t comm_nccl_id_bytes(void) {
    return sizeof(ncclUniqueId);
}

extern "C" int comm_nccl_unique_id(void *out, char *err, size_t err_len) {
    ncclResult_t rc = ncclGetUniqueId((ncclUniqueId *)out);
    if (rc != ncclSuccess) {
        snprintf(err, err_len, "ncclGetUniqueId: %s", ncclGetErrorString(rc));
        return -EIO;
    }
    return 0;
}

extern "C" int comm_nccl_create(backend_t *backend, const void *id, int rank, int world,
                                int64_t timeout_ms, comm_t **out, char *err, size_t err_len) {
    nccl_t *n = (nccl_t *)calloc(1, sizeof *n);
    if (!n) return -ENOMEM;
    n->base.ops = &nccl_ops;
    n->base.rank = rank;
    n->base.world = world;
    n->backend = backend;
    n->timeout_ms = timeout_ms;
    if (cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&n->done, cudaEventDisableTiming) != cudaSuccess ||
        cudaMalloc(&n->scratch, SCRATCH_BYTES) != cudaSuccess) {
        snprintf(err, err_len, "CUDA: %s", cudaGetErrorString(cudaGetLastError()));
        nccl_destroy(&n->base);
        return -ENOMEM;
    }
    double t = startup_trace_now();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* so that joining is bounded by the timeout too */
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    ncclResult_t rc = ncclCommInitRankConfig(&n->nccl, world, uid, rank, &config);
    double deadline = (clock_now_s() * 1e3) + (double)timeout_ms;
    while (rc == ncclInProgress && (clock_now_s() * 1e3) < deadline) {
        usleep(100);
        ncclCommGetAsyncError(n->nccl, &rc);
    }
    if (rc != ncclSuccess) {
        snprintf(err, err_len, "rank %d of %d: %s", rank, world,
                 rc == ncclInProgress ? "the other ranks did not join in time"
                                      : ncclGetErrorString(rc));
        if (n->nccl) ncclCommAbort(n->nccl);
        n->nccl = NULL;
        nccl_destroy(&n->base);
        return -EIO;
    }
    startup_trace_end("nccl communicator", t);
    *out = &n->base;
    return 0;
}
