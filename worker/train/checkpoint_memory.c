/* checkpoint_memory: the trainer's side of memory snapshots (memory_snapshot.h): rank 0 copies its
 * state after every snapshot.every_memory steps into the agent's shared memory. The copy overlaps
 * the next step's forward and backward: on the cpu backend the memory writer's thread makes it, on
 * a GPU it is queued on the backend's side stream into page-locked slots; either way the optimizer
 * waits for it (trainer__memory_fence), and the batch-norm statistics, which the next forward
 * changes, are copied first. The checksums are the writer thread's. The trainer's thread. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "trainer.h"

/* The writer's thread waits for the side stream before it hashes. */
static void wait_copies(void *arg) {
    backend_t *b = arg;
    b->mem->copy_out_wait(b);
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

static bool is_async(const trainer_t *t) {
    const backend_memory_i *mem = t->backend->mem;
    return mem->copy_out_begin && mem->copy_out && mem->copy_out_fence && mem->copy_out_wait;
}

void trainer__memory_init(trainer_t *t) {
    const char *dir = getenv(MEMORY_SNAPSHOT_DIR_ENV);
    if (!dir || !*dir || t->rank != 0) return;
    memory_snapshot_wait_t wait = {.cb = wait_copies, .arg = t->backend};
    char err[1024];
    if (t->conf->snapshot_every_memory == 0) { /* how far training got, for the steps lost */
        if (memory_snapshot_create_progress(dir, &t->memory, err, sizeof err) < 0) t->memory = NULL;
        return;
    }
    if (memory_snapshot_create(dir, t->model.n_params, t->model.n_buffers,
                               optimizer_has_second_moment(&t->optim), is_async(t) ? &wait : NULL,
                               &t->memory, err, sizeof err) < 0) {
        fprintf(stderr, "ddpworker: warning: no memory snapshots (restarts use snapshot.dir): %s\n",
                err);
        t->memory = NULL;
        return;
    }
    if (is_async(t) && t->backend->mem->pin_host)
        memory_snapshot_each_slot(t->memory, pin, t->backend);
}

/* The trainer's time in a memory snapshot since start (for the "memory_snapshots" event). */
static void account(trainer_t *t, double start) {
    double stall = clock_now_s() - start;
    t->memory_stall_s += stall;
    if (stall > t->memory_stall_max_s) t->memory_stall_max_s = stall;
    t->n_memory++;
}

void trainer__memory_snapshot(trainer_t *t) {
    if (!t->memory) return;
    int64_t every = t->conf->snapshot_every_memory;
    if (every == 0 || t->step % every != 0) {
        memory_snapshot_mark_reached(t->memory, t->step);
        return;
    }
    double start = clock_now_s();
    snapshot_data_t *d = memory_snapshot_begin(t->memory); /* the previous one is sealed */
    /* recorded only now: a kill from here on finds the previous step sealed (at most this one
     * lost), even when the writer's thread ran behind the training */
    memory_snapshot_mark_reached(t->memory, t->step);
    snapshot_header_t h;
    memset(&h, 0, sizeof h);
    trainer__describe(t, &h);
    h.optim_steps = optimizer_steps(&t->optim);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    h.unix_time_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
    const model_t *m = &t->model;
    const backend_memory_i *mem = t->backend->mem;
    size_t p_bytes = m->n_params * sizeof(float), b_bytes = m->n_buffers * sizeof(float);
    bool has_second = optimizer_has_second_moment(&t->optim);
    if (t->loss_scale) { /* a read-back (a synchronization): only fp16 runs scale */
        loss_scale_t ls = trainer__loss_scale(t);
        h.loss_scale = ls.scale;
        h.loss_scale_good_steps = ls.good_steps;
    }
    if (is_async(t)) {
        mem->copy_out_begin(t->backend);
        /* the running statistics change in the next forward: it waits for their (small) copy */
        mem->copy_out(t->backend, d->buffers, m->buffers, b_bytes);
        mem->copy_out_fence(t->backend);
        mem->copy_out(t->backend, d->params, m->params, p_bytes);
        mem->copy_out(t->backend, d->momentum, m->momentum, p_bytes);
        if (has_second) mem->copy_out(t->backend, d->second_moment, t->optim.exp_avg_sq, p_bytes);
        t->is_memory_copying = true;
    } else if (!mem->is_device(t->backend, m->params)) {
        /* host arenas (cpu): the writer's thread copies what the next forward does not change,
         * overlapped with it; the running statistics change in the forward: copied now */
        mem->to_host(t->backend, d->buffers, m->buffers, b_bytes);
        memory_snapshot_copy_t copies[3] = {{d->params, m->params, p_bytes},
                                            {d->momentum, m->momentum, p_bytes},
                                            {d->second_moment, t->optim.exp_avg_sq, p_bytes}};
        memory_snapshot_submit_copies(t->memory, &h, copies, has_second ? 3 : 2);
        t->is_memory_copying = true;
        account(t, start);
        return;
    } else {
        mem->to_host(t->backend, d->params, m->params, p_bytes);
        mem->to_host(t->backend, d->momentum, m->momentum, p_bytes);
        mem->to_host(t->backend, d->buffers, m->buffers, b_bytes);
        if (has_second) mem->to_host(t->backend, d->second_moment, t->optim.exp_avg_sq, p_bytes);
    }
    memory_snapshot_submit(t->memory, &h);
    account(t, start);
}

void trainer__memory_fence(trainer_t *t) {
    if (!t->is_memory_copying) return;
    double start = clock_now_s();
    if (is_async(t))
        t->backend->mem->copy_out_fence(t->backend);
    else
        memory_snapshot_wait_copied(t->memory);
    t->is_memory_copying = false;
    t->memory_stall_s += clock_now_s() - start; /* a copy the step outran is a stall too */
}

void trainer__report_memory(trainer_t *t) {
    if (!t->memory || !t->metrics || !t->n_memory) return;
    memory_snapshot_flush(t->memory); /* the sealed step of the last generation */
    cJSON *event = json_line_new("memory_snapshots");
    json_line_int(event, "count", t->n_memory);
    json_line_num(event, "stall_ms_mean", t->memory_stall_s * 1e3 / (double)t->n_memory);
    json_line_num(event, "stall_ms_max", t->memory_stall_max_s * 1e3);
    json_line_num(event, "seal_cpu_ms_mean",
                  memory_snapshot_seal_cpu_s(t->memory) * 1e3 / (double)t->n_memory);
    json_line_int(event, "sealed_step", memory_snapshot_sealed_step(t->memory));
    json_line_write(t->metrics, event);
}

void trainer__memory_free(trainer_t *t) {
    if (!t->memory) return;
    memory_snapshot_flush(t->memory);
    if (is_async(t) && t->backend->mem->unpin_host)
        memory_snapshot_each_slot(t->memory, unpin, t->backend);
    memory_snapshot_destroy(t->memory);
    t->memory = NULL;
}

void trainer__report_resume(trainer_t *t) {
    if (t->rank != 0 || !t->resume_source) return;
    status_report_resume(t->status, t->step, t->resume_source, t->resume_rank, t->steps_lost);
    if (!t->metrics) return;
    cJSON *event = json_line_new("resume");
    json_line_int(event, "step", t->step);
    json_line_str(event, "source", t->resume_source);
    json_line_int(event, "rank", t->resume_rank);
    json_line_int(event, "steps_lost", t->steps_lost);
    json_line_write(t->metrics, event);
}
