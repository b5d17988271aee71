/* cuda_memory: device memory, the workspace, host<->device copies (fp32 on the host side
 * always; narrow activations converted on the device) and the model's arenas. */
#include "cuda_common.cuh"

#include "startup_trace.h"

#include <cuda_profiler_api.h>

/* ---- memory ---- */

/* cudaMalloc; out of memory, the memory snapshots' staging buffers (copy_stage) are given back
 * first, for good (their copies then read the parameters directly), and it is tried once more:
 * training's own memory comes before a snapshot's speed. */
static cudaError_t device_malloc(gpu_t *g, void **p, size_t n_bytes) {
    cudaError_t rc = cudaMalloc(p, n_bytes);
    /* never while ops are being recorded: a synchronization would end the capture */
    if (rc != cudaErrorMemoryAllocation || g->is_recording) return rc;
    bool has_staging = false;
    for (int i = 0; i < COPY_STAGES; i++)
        has_staging |= g->copy_stage[i] != NULL;
    if (!has_staging) return rc;
    cudaGetLastError();
    g->is_copy_staging_off = true;
    if (g->copy_stream) CHECK_CUDA(cudaStreamSynchronize(g->copy_stream));
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
    for (int i = 0; i < COPY_STAGES; i++) {
        if (g->copy_stage[i]) CHECK_CUDA(cudaFree(g->copy_stage[i]));
        g->copy_stage[i] = NULL;
        g->copy_stage_bytes[i] = 0;
    }
    return cudaMalloc(p, n_bytes);
}

void *gpu_alloc(backend_t *b, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    void *p = NULL;
    if (device_malloc(g, &p, n_bytes ? n_bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    CHECK_CUDA(cudaMemsetAsync(p, 0, n_bytes, g->stream));
    return p;
}

void gpu_release(backend_t *b, void *p) {
    CHECK_CUDA(cudaStreamSynchronize(gpu_of(b)->stream));
    CHECK_CUDA(cudaFree(p));
}

bool gpu_is_device(backend_t *b, const void *p) {
    (void)b;
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError(); /* not a pointer CUDA knows: host memory */
        return false;
    }
    return attr.type == cudaMemoryTypeDevice;
}

int gpu_reserve_workspace(backend_t *b, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (n_bytes <= g->workspace_bytes) return 0;
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
    if (g->workspace) CHECK_CUDA(cudaFree(g->workspace));
    g->workspace = NULL;
    g->workspace_bytes = 0;
    if (device_malloc(g, &g->workspace, n_bytes) != cudaSuccess) {
        cudaGetLastError();
        return -12; /* -ENOMEM */
    }
    g->workspace_bytes = n_bytes;
    g->scratch_generation++;
    return 0;
}

/* ---- copies: fp32 on the host side always; narrow activations are converted on the device ---- */

float *gpu_grown(gpu_t *g, float **buf, size_t *have, size_t n_bytes) {
    if (n_bytes > *have) {
        CHECK_CUDA(cudaStreamSynchronize(g->stream));
        if (*buf) CHECK_CUDA(cudaFree(*buf));
        *buf = NULL;
        *have = 0;
        CHECK_CUDA(device_malloc(g, (void **)buf, n_bytes));
        *have = n_bytes;
        g->scratch_generation++;
    }
    return *buf;
}

/* fp32 staging for converting copies. */
static float *stage(gpu_t *g, size_t n_bytes) {
    return gpu_grown(g, &g->stage, &g->stage_bytes, n_bytes);
}

void gpu_bind_thread(gpu_t *g) {
    static __thread int bound = -1;
    if (bound == g->device) return;
    CHECK_CUDA(cudaSetDevice(g->device));
    bound = g->device;
}

void gpu_to_device(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    gpu_bind_thread(g);
    if (!n_bytes) return;
    /* from pageable memory the copy has read src before it returns, so src may be reused */
    if (!in_low_arena(g, dst)) {
        CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, g->stream));
        return;
    }
    float *s = stage(g, n_bytes);
    CHECK_CUDA(cudaMemcpyAsync(s, src, n_bytes, cudaMemcpyHostToDevice, g->stream));
    size_t n = n_bytes / sizeof(float);
    WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), n, s, LOW(dst), n));
}

void gpu_to_host(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    gpu_bind_thread(g);
    if (n_bytes && in_low_arena(g, src)) {
        float *s = stage(g, n_bytes);
        size_t n = n_bytes / sizeof(float);
        WITH_LOW(g, LAUNCH((convert_kernel<Low, float>), n, CLOW(src), s, n));
        src = s;
    }
    if (n_bytes) CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, g->stream));
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
}

/* ---- copies out on a side stream (memory snapshots): overlapped with the next step's forward ----
 */

int gpu_pin_host(backend_t *b, void *p, size_t n_bytes) {
    (void)b;
    if (cudaHostRegister(p, n_bytes, cudaHostRegisterDefault) != cudaSuccess) {
        cudaGetLastError(); /* pageable copies still work */
        return -1;
    }
    return 0;
}

void gpu_unpin_host(backend_t *b, void *p) {
    (void)b;
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

void gpu_copy_out_begin(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (!g->copy_stream) {
        CHECK_CUDA(cudaStreamCreateWithFlags(&g->copy_stream, cudaStreamNonBlocking));
        CHECK_CUDA(cudaEventCreateWithFlags(&g->copy_start, cudaEventDisableTiming));
        CHECK_CUDA(cudaEventCreateWithFlags(&g->copy_end, cudaEventDisableTiming));
    }
    /* the staging buffers are reused: the copies of the last generation must have left them (a
     * caller that skips a generation while one is in flight never waits here) */
    CHECK_CUDA(cudaStreamSynchronize(g->copy_stream));
    g->copy_stages_used = 0;
    g->is_copy_direct = false;
    CHECK_CUDA(cudaEventRecord(g->copy_start, g->stream));
    CHECK_CUDA(cudaStreamWaitEvent(g->copy_stream, g->copy_start, 0));
}

/* The staging buffer of the next copy of n_bytes (NULL: none could be had; the copy then reads
 * its source directly). One per copy of a generation, kept: every generation copies the same. */
static void *copy_stage(gpu_t *g, size_t n_bytes) {
    int i = g->copy_stages_used;
    if (i == COPY_STAGES || g->is_copy_staging_off) return NULL;
    if (g->copy_stage_bytes[i] < n_bytes) {
        if (g->copy_stage[i]) CHECK_CUDA(cudaFree(g->copy_stage[i]));
        g->copy_stage[i] = NULL;
        g->copy_stage_bytes[i] = 0;
        /* never the memory training may still grow into (cuDNN's workspace, a larger batch at
         * evaluation): a buffer only where a tenth of the GPU, and at least 1 GiB, stays free */
        size_t free_bytes = 0, total_bytes = 0;
        if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
            cudaGetLastError();
            return NULL;
        }
        size_t margin = total_bytes / 10 > ((size_t)1 << 30) ? total_bytes / 10 : (size_t)1 << 30;
        if (free_bytes < n_bytes || free_bytes - n_bytes < margin) return NULL;
        if (cudaMalloc(&g->copy_stage[i], n_bytes) != cudaSuccess) {
            cudaGetLastError(); /* out of memory: the direct copy, and a fence */
            g->copy_stage[i] = NULL;
            return NULL;
        }
        g->copy_stage_bytes[i] = n_bytes;
    }
    g->copy_stages_used = i + 1;
    return g->copy_stage[i];
}

/* Through a device buffer: the copy of the source on the main stream (at the device's bandwidth,
 * tens of microseconds for a ResNet's state), the slow copy over PCIe from the buffer on the side
 * stream. The ops after it may then change the source at once: copy_out_fence has nothing to wait
 * for. ResNet-18's 90 MB straight from the parameters held the optimizer 1 ms or more per
 * snapshot on the H200. */
void gpu_copy_out(backend_t *b, void *dst, const void *src, size_t n_bytes) {
    gpu_t *g = gpu_of(b);
    if (!n_bytes) return;
    void *staged = copy_stage(g, n_bytes);
    if (!staged) {
        g->is_copy_direct = true;
        CHECK_CUDA(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, g->copy_stream));
        return;
    }
    CHECK_CUDA(cudaMemcpyAsync(staged, src, n_bytes, cudaMemcpyDeviceToDevice, g->stream));
    CHECK_CUDA(cudaEventRecord(g->copy_start, g->stream));
    CHECK_CUDA(cudaStreamWaitEvent(g->copy_stream, g->copy_start, 0));
    CHECK_CUDA(cudaMemcpyAsync(dst, staged, n_bytes, cudaMemcpyDeviceToHost, g->copy_stream));
}

void gpu_copy_out_fence(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (!g->copy_stream || !g->is_copy_direct) return;
    CHECK_CUDA(cudaEventRecord(g->copy_end, g->copy_stream));
    CHECK_CUDA(cudaStreamWaitEvent(g->stream, g->copy_end, 0));
}

void gpu_copy_out_wait(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (!g->copy_stream) return;
    gpu_bind_thread(g); /* another thread than the trainer's may wait */
    CHECK_CUDA(cudaStreamSynchronize(g->copy_stream));
}

/* ---- the model's arenas (bf16 and fp16 modes) ---- */

int gpu_mark_arenas(backend_t *b, float *params, size_t n_params, float *acts, float *dacts,
                    size_t n_acts) {
    gpu_t *g = gpu_of(b);
    g->params = params;
    g->n_params = n_params;
    g->acts = (const char *)acts;
    g->dacts = (const char *)dacts;
    g->act_bytes = n_acts * sizeof(float);
    if (g->low == LOW_NONE) return 0;
    size_t bytes = (n_params ? n_params : 1) * LOW_BYTES;
    if (cudaMalloc(&g->shadow, bytes) != cudaSuccess ||
        cudaMalloc(&g->dw_scratch, bytes) != cudaSuccess) {
        cudaGetLastError();
        return -12; /* -ENOMEM */
    }
    return 0;
}

/* The startup trace's first step ends where the second begins (its forward, or the recording of
 * it): the first has been queued whole, wait for it. Never while recording: a capturing stream
 * cannot be waited for (the capture would fail, and the worker with it). */
static void trace_first_step_end(gpu_t *g) {
    g->trace_forwards = 2;
    CHECK_CUDA(cudaStreamSynchronize(g->stream));
    char what[160];
    snprintf(what, sizeof what,
             "first step (of which cuDNN's algorithm search: %.3f s for %d shapes)",
             g->search_seconds, g->searched_shapes);
    startup_trace_end(what, g->trace_first_forward);
}

/* The parameters may have changed (an optimizer step, a broadcast, a resume): refresh their copy.
 */
void gpu_prepare_forward(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (g->trace_forwards < 2 && startup_trace_is_on()) {
        if (g->trace_forwards == 0) {
            g->trace_forwards = 1;
            g->trace_first_forward = startup_trace_now();
        } else if (!g->is_recording) { /* recordings end it in gpu_graph_begin */
            trace_first_step_end(g);
        }
    }
    if (g->profile_first > 0) { /* the capture range: whole steps, each from its forward on */
        g->forwards++;
        if (g->forwards == g->profile_first) {
            CHECK_CUDA(cudaStreamSynchronize(g->stream));
            CHECK_CUDA(cudaProfilerStart());
        } else if (g->forwards == g->profile_first + g->profile_count) {
            CHECK_CUDA(cudaStreamSynchronize(g->stream));
            CHECK_CUDA(cudaProfilerStop());
        }
    }
    if (g->low != LOW_NONE && g->n_params)
        WITH_LOW(g, LAUNCH((convert_kernel<float, Low>), g->n_params, g->params, LOW(g->shadow),
                           g->n_params));
}

/* ---- recordings (CUDA graphs of the backend's stream; backend.h's graph_*) ---- */

typedef struct {
    cudaGraphExec_t exec;
    uint64_t generation; /* g->scratch_generation when recorded */
} recording_t;

int gpu_graph_begin(backend_t *b) {
    gpu_t *g = gpu_of(b);
    if (!g->is_graphs || g->profile_first > 0 || g->is_recording) return -1;
    if (g->trace_forwards == 1 && startup_trace_is_on()) trace_first_step_end(g);
    /* thread-local: the collective's thread may use CUDA meanwhile without spoiling this */
    CHECK_CUDA(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
    g->is_recording = true;
    return 0;
}

void *gpu_graph_end(backend_t *b) {
    gpu_t *g = gpu_of(b);
    g->is_recording = false;
    cudaGraph_t graph = NULL;
    cudaError_t rc = cudaStreamEndCapture(g->stream, &graph);
    recording_t *r = (recording_t *)calloc(1, sizeof *r);
    if (rc == cudaSuccess && r) rc = cudaGraphInstantiate(&r->exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (rc != cudaSuccess || !r) {
        fprintf(stderr, "ddpworker: %s:%d: recording a CUDA graph: %s; running without graphs\n",
                __FILE__, __LINE__, r ? cudaGetErrorString(rc) : "out of memory");
        cudaGetLastError();
        free(r);
        g->is_graphs = false;
        return NULL;
    }
    r->generation = g->scratch_generation;
    return r;
}

int gpu_graph_run(backend_t *b, void *graph) {
    gpu_t *g = gpu_of(b);
    recording_t *r = (recording_t *)graph;
    if (r->generation != g->scratch_generation) return -1;
    CHECK_CUDA(cudaGraphLaunch(r->exec, g->stream));
    return 0;
}

void gpu_graph_free(backend_t *b, void *graph) {
    recording_t *r = (recording_t *)graph;
    CHECK_CUDA(cudaStreamSynchronize(gpu_of(b)->stream));
    CHECK_CUDA(cudaGraphExecDestroy(r->exec));
    free(r);
}
