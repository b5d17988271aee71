/* memory_snapshot: snapshots in a shared-memory directory that the node's agent owns
 * (DDPRUN_MEMORY_SNAPSHOT_DIR, on tmpfs), taken every snapshot.every_memory steps. It outlives
 * the worker (a kill -9 keeps it) and dies with the agent. Each slot file holds exactly what a
 * disk snapshot holds, in the disk format (proto/snapshot_format.h, `ddpworker inspect` reads it).
 *
 * Double-buffered: own-0.ddps and own-1.ddps; a generation is written into the slot that does not
 * hold the newest sealed one, its header first invalidated, then the sections, then the header
 * with every checksum: the header's checksum seals the generation, and a copy torn anywhere fails
 * verification, so it never replaces the good one. (The slots stay writable in the worker: making
 * a sealed one read-only costs a page fault per 4 KiB at its next reuse, 1% of a ResNet-18 step.)
 * The agent copies each sealed generation to a peer node (peer-<node>-<0|1>.ddps here on the
 * peer); progress holds the newest step trained, to count the steps a restart loses.
 *
 * The checksums and the header are written by the writer's own thread, after an optional wait
 * (a GPU's side-stream copies); the trainer's thread fills the sections, or hands the writer's
 * thread host copies to make, each hashed as it is copied (the cpu backend: the copy overlaps the
 * next step's forward and backward, and the trainer waits for it before the optimizer changes the
 * sources). A small state (memory_snapshot_set_inline_bytes) is copied and sealed in the call. */
#ifndef DDP_WORKER_MEMORY_SNAPSHOT_H
#define DDP_WORKER_MEMORY_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "snapshot.h"

#define MEMORY_SNAPSHOT_DIR_ENV SNAPSHOT_MEMORY_DIR_ENV /* proto/snapshot_format.h */

typedef struct memory_snapshot memory_snapshot_t;

/* Called on the writer's thread before the checksums of a generation: wait until its sections are
 * filled (a GPU's asynchronous copies), and complete its header h with what those copies brought
 * (a GPU's loss scale, read without stopping the trainer). NULL: they are filled when
 * memory_snapshot_submit is called. */
typedef struct {
    void (*cb)(void *arg, snapshot_header_t *h);
    void *arg;
} memory_snapshot_wait_t;

/* Open dir's two own slots for a state of n_params / n_buffers floats (and a second moment of
 * n_params): created or resized, mapped, pre-faulted; the newest sealed generation already there
 * is kept. Each slot is verified whole (its sections hashed: the only hashing outside a seal); one
 * that fails, or was sealed for another state, counts as empty and is written next. Returns 0 or
 * -1 with err (what, the path, the system's reason). */
int memory_snapshot_create(const char *dir, size_t n_params, size_t n_buffers,
                           bool has_second_moment, const memory_snapshot_wait_t *wait,
                           memory_snapshot_t **out, char *err, size_t err_len);
/* The progress record alone (memory_snapshot_mark_reached; no slots, no thread): with
 * snapshot.every_memory = 0 a restart still says how many steps it lost. */
int memory_snapshot_create_progress(const char *dir, memory_snapshot_t **out, char *err,
                                    size_t err_len);
/* The sections to fill for the next generation (params, momentum, buffers, second moment point
 * into the shared mapping; the header is ignored): waits for the previous generation's seal,
 * invalidates the slot that does not hold the newest sealed generation and makes it writable. */
snapshot_data_t *memory_snapshot_begin(memory_snapshot_t *m);
/* Seal the generation begun last with header h (its step, epoch, ...): on the writer's thread,
 * after the wait. Returns at once. A generation whose parameters or optimizer state hold an inf
 * or a NaN is not sealed (a warning on stderr, once): a diverged step never becomes the resume
 * point. */
void memory_snapshot_submit(memory_snapshot_t *m, const snapshot_header_t *h);
/* As memory_snapshot_submit, with up to MEMORY_SNAPSHOT_MAX_COPIES host copies into the sections
 * that the writer's thread makes first (the trainer's thread goes on with the next step): their
 * sources must not change until memory_snapshot_wait_copied returns. */
#define MEMORY_SNAPSHOT_MAX_COPIES 4
typedef struct {
    void *dst;
    const void *src;
    size_t n_bytes;
} memory_snapshot_copy_t;
void memory_snapshot_submit_copies(memory_snapshot_t *m, const snapshot_header_t *h,
                                   const memory_snapshot_copy_t *copies, int n_copies);
/* Slots of at most n_bytes (default 1 MiB) are filled and sealed by the submitting call itself,
 * on the caller's thread, unless a wait was given; larger ones by the writer's thread. */
void memory_snapshot_set_inline_bytes(memory_snapshot_t *m, size_t n_bytes);
/* Wait until the copies of the generation in flight are made. */
void memory_snapshot_wait_copied(memory_snapshot_t *m);
/* Whether a generation is in flight (submitted, not yet sealed): memory_snapshot_begin would wait
 * for it. A caller that must not wait skips a generation instead. */
bool memory_snapshot_is_sealing(memory_snapshot_t *m);
/* Wait for the generation in flight to be sealed. */
void memory_snapshot_flush(memory_snapshot_t *m);
/* The CPU seconds every generation's copies, checksums and checks took so far, on whichever thread
 * made them (the writer's or the caller's): what the snapshots cost, apart from any wait. */
double memory_snapshot_seal_cpu_s(memory_snapshot_t *m);
/* The newest step sealed (-1: none yet). */
int64_t memory_snapshot_sealed_step(memory_snapshot_t *m);
/* Record that training reached step (every step: one 8-byte store into the shared mapping). */
void memory_snapshot_mark_reached(memory_snapshot_t *m, int64_t step);
/* cb(arg, mapping, its bytes) for each slot (to page-lock them for a GPU's copies). */
void memory_snapshot_each_slot(memory_snapshot_t *m, void (*cb)(void *arg, void *p, size_t n_bytes),
                               void *arg);
void memory_snapshot_destroy(memory_snapshot_t *m);

typedef enum {
    MEMORY_SNAPSHOT_NONE = 0,
    MEMORY_SNAPSHOT_OWN = 1,  /* written on this node */
    MEMORY_SNAPSHOT_PEER = 2, /* a peer node's, copied here by its agent */
} memory_snapshot_source_t;

/* The newest generation in dir that verifies (own or a peer's), read into d (malloc'd:
 * snapshot_data_free) and its path into path. Slots that do not verify are reported on report
 * (may be NULL) with path and reason, and left as they are (the writer reuses them). *reached gets
 * the newest step the progress files record (this node's, and what a peer's agent said its node
 * had reached when it sent its last copy; -1: none). Returns the source, MEMORY_SNAPSHOT_NONE
 * when none verifies or there is no dir. Reads; never blocks on anyone. */
memory_snapshot_source_t memory_snapshot_find_latest(const char *dir, FILE *report,
                                                     snapshot_data_t *d, char *path,
                                                     size_t path_len, int64_t *reached);

#endif
