/* checkpoint_memory: the trainer's side of memory snapshots (memory_snapshot.h): rank 0 copies its
 * state after every snapshot.every_memory steps into the agent's shared memory. The copy overlaps
 * the next step's forward and backward: on the cpu backend the memory writer's thread makes it and
 * the optimizer waits for it (checkpoint_memory_fence); on a GPU the state is copied on the device
 * into a buffer, and from there over PCIe into page-locked slots on the backend's side stream, so
 * nothing waits (a due snapshot is skipped while the last is on its way). The batch-norm
 * statistics, which the next forward changes, are copied first. The checksums are the writer
 * thread's. The trainer's thread. */
#include "checkpoint_memory.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checkpoint.h"
#include "clock.h"

/* The writer's thread waits for the side stream before it hashes, and puts the loss scale that
 * came with the copies into the header. */
static void wait_copies(void *arg, snapshot_header_t *h) {
    checkpoint_memory_t *cm = arg;
    backend_t *b = cm->parts->backend;
    b->mem->copy_out_wait(b);
    if (cm->has_scale_copy) {
        h->loss_scale = cm->scale_copy->scale;
        h->loss_scale_good_steps = cm->scale_copy->good_steps;
    }
}

/* A page of page-locked memory for the loss scale's copy (NULL: none; it is then read back). */
static loss_scale_t *pinned_scale(backend_t *b) {
    void *p = NULL;
    if (!b->mem->pin_host || posix_memalign(&p, 4096, 4096) != 0) return NULL;
    if (b->mem->pin_host(b, p, 4096) < 0) {
        free(p);
        return NULL;
    }
    return p;
}

static void pin(void *arg, void *p, size_t n_bytes) {
    backend_t *b = arg;
    if (b->mem->pin_host(b, p, n_bytes) < 0)
        fprintf(stderr,
                "ddpworker: warning: memory snapshot slot of %zu bytes not page-locked: its "
                "copies are slower\n",
                n_bytes);
}

static void unpin(void *arg, void *p, size_t n_bytes) {
    (void)n_bytes;
    backend_t *b = arg;
    b->mem->unpin_host(b, p);
}

static bool is_async(const train_parts_t *p) {
    const backend_memory_i *mem = p->backend->mem;
    return mem->copy_out_begin && mem->copy_out && mem->copy_out_fence && mem->copy_out_wait;
}

/* The slots opened (created or resized, pre-faulted, verified); no CUDA here: it runs on the
 * opener's thread, which an exit() may find still running. */
static void open_slots(checkpoint_memory_t *cm, const train_parts_t *p, const char *dir) {
    memory_snapshot_wait_t wait = {.cb = wait_copies, .arg = cm};
    char err[1024];
    if (p->conf->snapshot_every_memory == 0) { /* how far training got, for the steps lost */
        if (memory_snapshot_create_progress(dir, &cm->memory, err, sizeof err) < 0)
            cm->memory = NULL;
        return;
    }
    if (memory_snapshot_create(dir, p->model->n_params, p->model->n_buffers,
                               optimizer_has_second_moment(p->optim), is_async(p) ? &wait : NULL,
                               &cm->memory, err, sizeof err) < 0) {
        fprintf(stderr, "ddpworker: warning: no memory snapshots (restarts use snapshot.dir): %s\n",
                err);
        cm->memory = NULL;
        return;
    }
}

static void *open_in_background(void *arg) {
    checkpoint_memory_t *cm = arg;
    open_slots(cm, cm->parts, getenv(MEMORY_SNAPSHOT_DIR_ENV));
    return NULL;
}

void checkpoint_memory_init(checkpoint_memory_t *cm, const train_parts_t *p) {
    const char *dir = getenv(MEMORY_SNAPSHOT_DIR_ENV);
    if (!dir || !*dir || p->rank != 0) return;
    /* on a thread of its own while the first step runs: sizing, pre-faulting and verifying both
     * slots of ResNet-18's 90 MB state took 0.39-1.4 s of a worker's start on the 2-core VM (a
     * GPU then page-locks them, at the first take) */
    cm->parts = p;
    cm->has_opener = pthread_create(&cm->opener, NULL, open_in_background, cm) == 0;
    if (!cm->has_opener) open_slots(cm, p, dir);
    cm->is_opening = true; /* joined (if a thread) and pinned by wait_open */
}

/* Every use of the slots waits until they are open; then, on the trainer's thread, a GPU
 * page-locks them for its copies. */
static void wait_open(checkpoint_memory_t *cm) {
    if (!cm->is_opening) return;
    if (cm->has_opener) pthread_join(cm->opener, NULL);
    cm->is_opening = false;
    const train_parts_t *p = cm->parts;
    if (cm->memory && p->conf->snapshot_every_memory && is_async(p) && p->backend->mem->pin_host)
        memory_snapshot_each_slot(cm->memory, pin, p->backend);
}

/* The trainer's time in a memory snapshot since start (for the "memory_snapshots" event). */
static void account(checkpoint_memory_t *cm, double start) {
    double stall = clock_now_s() - start;
    cm->stall_s += stall;
    if (stall > cm->stall_max_s) cm->stall_max_s = stall;
    cm->n_taken++;
}

void checkpoint_memory_take(checkpoint_memory_t *cm, const train_parts_t *p,
                            const train_state_t *s) {
    wait_open(cm);
    if (!cm->memory) return;
    int64_t every = p->conf->snapshot_every_memory;
    if (every == 0 || s->step % every != 0) {
        memory_snapshot_mark_reached(cm->memory, s->step);
        return;
    }
    if (is_async(p) && memory_snapshot_is_sealing(cm->memory)) {
        memory_snapshot_mark_reached(cm->memory, s->step);
        cm->n_skipped++;
        return;
    }
    double start = clock_now_s();
    snapshot_data_t *d = memory_snapshot_begin(cm->memory); /* the previous one is sealed */
    /* recorded only now: a kill from here on finds the previous generation sealed (at most this
     * step lost; on a GPU, where due snapshots are skipped while one is on its way, the steps
     * since the last one taken), even when the writer's thread ran behind the training */
    memory_snapshot_mark_reached(cm->memory, s->step);
    snapshot_header_t h;
    memset(&h, 0, sizeof h);
    checkpoint_describe(p, s, &h);
    h.optim_steps = optimizer_steps(p->optim);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    h.unix_time_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
    const model_t *m = p->model;
    const backend_memory_i *mem = p->backend->mem;
    size_t p_bytes = m->n_params * sizeof(float), b_bytes = m->n_buffers * sizeof(float);
    bool has_second = optimizer_has_second_moment(p->optim);
    if (s->loss_scale && is_async(p) && !cm->scale_copy && !cm->is_scale_unpinned) {
        cm->scale_copy = pinned_scale(p->backend); /* once, at the first snapshot that scales */
        cm->is_scale_unpinned = !cm->scale_copy;
    }
    bool is_scale_copied = s->loss_scale && is_async(p) && cm->scale_copy;
    if (s->loss_scale && !is_scale_copied) { /* a read-back (waits for the GPU): fp16 scales */
        loss_scale_t ls = train_state_loss_scale(s, p->backend);
        h.loss_scale = ls.scale;
        h.loss_scale_good_steps = ls.good_steps;
    }
    cm->has_scale_copy = is_scale_copied;
    if (is_async(p)) {
        mem->copy_out_begin(p->backend);
        if (is_scale_copied) /* the writer's thread puts it into the header */
            mem->copy_out(p->backend, cm->scale_copy, s->loss_scale, sizeof *cm->scale_copy);
        /* the running statistics change in the next forward: it waits for their (small) copy */
        mem->copy_out(p->backend, d->buffers, m->buffers, b_bytes);
        mem->copy_out_fence(p->backend);
        mem->copy_out(p->backend, d->params, m->params, p_bytes);
        mem->copy_out(p->backend, d->momentum, m->momentum, p_bytes);
        if (has_second) mem->copy_out(p->backend, d->second_moment, p->optim->exp_avg_sq, p_bytes);
        cm->is_copying = true;
    } else if (!mem->is_device(p->backend, m->params)) {
        /* host arenas (cpu): the writer's thread copies what the next forward does not change,
         * overlapped with it; the running statistics change in the forward: copied now */
        mem->to_host(p->backend, d->buffers, m->buffers, b_bytes);
        memory_snapshot_copy_t copies[3] = {{d->params, m->params, p_bytes},
                                            {d->momentum, m->momentum, p_bytes},
                                            {d->second_moment, p->optim->exp_avg_sq, p_bytes}};
        memory_snapshot_submit_copies(cm->memory, &h, copies, has_second ? 3 : 2);
        cm->is_copying = true;
        account(cm, start);
        return;
    } else {
        mem->to_host(p->backend, d->params, m->params, p_bytes);
        mem->to_host(p->backend, d->momentum, m->momentum, p_bytes);
        mem->to_host(p->backend, d->buffers, m->buffers, b_bytes);
        if (has_second) mem->to_host(p->backend, d->second_moment, p->optim->exp_avg_sq, p_bytes);
    }
    memory_snapshot_submit(cm->memory, &h);
    account(cm, start);
}

void checkpoint_memory_fence(checkpoint_memory_t *cm, const train_parts_t *p) {
    if (!cm->is_copying) return;
    double start = clock_now_s();
    if (is_async(p))
        p->backend->mem->copy_out_fence(p->backend);
    else
        memory_snapshot_wait_copied(cm->memory);
    cm->is_copying = false;
    cm->stall_s += clock_now_s() - start; /* a copy the step outran is a stall too */
}

void checkpoint_memory_report(checkpoint_memory_t *cm, run_log_t *log) {
    wait_open(cm);
    if (!cm->memory || !log->metrics || !cm->n_taken) return;
    memory_snapshot_flush(cm->memory); /* the sealed step of the last generation */
    cJSON *event = json_line_new("memory_snapshots");
    json_line_int(event, "count", cm->n_taken);
    json_line_int(event, "skipped", cm->n_skipped);
    json_line_num(event, "stall_ms_mean", cm->stall_s * 1e3 / (double)cm->n_taken);
    json_line_num(event, "stall_ms_max", cm->stall_max_s * 1e3);
    json_line_num(event, "seal_cpu_ms_mean",
                  memory_snapshot_seal_cpu_s(cm->memory) * 1e3 / (double)cm->n_taken);
    json_line_int(event, "sealed_step", memory_snapshot_sealed_step(cm->memory));
    json_line_write(log->metrics, event);
}

void checkpoint_memory_free(checkpoint_memory_t *cm, const train_parts_t *p) {
    wait_open(cm);
    if (!cm->memory) return;
    memory_snapshot_flush(cm->memory);
    if (is_async(p) && p->backend->mem->unpin_host)
        memory_snapshot_each_slot(cm->memory, unpin, p->backend);
    memory_snapshot_destroy(cm->memory);
    cm->memory = NULL;
    if (cm->scale_copy) {
        if (p->backend->mem->unpin_host) p->backend->mem->unpin_host(p->backend, cm->scale_copy);
        free(cm->scale_copy);
        cm->scale_copy = NULL;
    }
}
