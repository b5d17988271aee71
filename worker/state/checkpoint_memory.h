/* checkpoint_memory: memory snapshots for the trainer (memory_snapshot.h), given its state and
 * parts: rank 0 copies its state after every snapshot.every_memory steps into the agent's shared
 * memory, overlapped with the next step's forward and backward. The trainer's thread. */
#ifndef DDP_WORKER_CHECKPOINT_MEMORY_H
#define DDP_WORKER_CHECKPOINT_MEMORY_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "memory_snapshot.h"
#include "run_log.h"
#include "train_state.h"

typedef struct {
    memory_snapshot_t *memory; /* rank 0 under ddprun (snapshot.every_memory 0: progress alone) */
    bool is_copying;           /* copies out to memory are in flight: fence before the optimizer */
    double stall_s, stall_max_s; /* the trainer's time in memory snapshots */
    int64_t n_taken;             /* memory snapshots taken by this process */
    int64_t n_skipped; /* due ones skipped while the one before was still on its way (a GPU) */
    /* a GPU's loss scale copied out with the state into page-locked memory (NULL: read back,
     * which waits for the GPU), for the writer's thread to put into the generation's header */
    loss_scale_t *scale_copy;
    bool has_scale_copy;        /* the generation in flight carries one */
    bool is_scale_unpinned;     /* no page could be page-locked for it: read back */
    const train_parts_t *parts; /* init's (the opener's and the writer's threads read it) */
    /* the slots are opened on this thread while the first step runs (has_opener: it was
     * started), then page-locked on the trainer's (is_opening until both are done) */
    pthread_t opener;
    bool has_opener, is_opening;
} checkpoint_memory_t;

/* Rank 0 under ddprun (DDPRUN_MEMORY_SNAPSHOT_DIR) with snapshot.every_memory: open the slots, on
 * a thread of their own (the first take waits for it; p must outlive it). A failure is a warning:
 * training goes on without them. */
void checkpoint_memory_init(checkpoint_memory_t *cm, const train_parts_t *p);
/* After every step: record the step reached; every snapshot.every_memory steps copy the state
 * into the next slot (a GPU: into a device buffer, then over PCIe on a side stream while the next
 * steps run) to be sealed by the writer's thread. On a GPU a due snapshot is skipped while the one
 * before is still being copied or sealed: training never waits for one (a step can outrun the
 * copy of its state: ResNet-18's 90 MB take longer over PCIe than its step on an H200). */
void checkpoint_memory_take(checkpoint_memory_t *cm, const train_parts_t *p,
                            const train_state_t *s);
/* Before anything overwrites the state (the optimizer, the loss scaler): wait for the copies. */
void checkpoint_memory_fence(checkpoint_memory_t *cm, const train_parts_t *p);
/* The "memory_snapshots" metrics event (count, the training thread's stall: tests/bench), written
 * before the "final" event, which stays the last line of a finished run. */
void checkpoint_memory_report(checkpoint_memory_t *cm, run_log_t *log);
void checkpoint_memory_free(checkpoint_memory_t *cm, const train_parts_t *p);

#endif
