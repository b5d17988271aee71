/* checkpoint: snapshots on disk for the trainer, given its state and parts: taking them (rank 0
 * copies the arenas into the writer's host buffers; the writer thread does the disk work),
 * resuming (the newest state among the node's memory snapshots, peers' copies and the disk, agreed
 * on by all ranks and broadcast by the rank that has it), and SIGTERM/SIGUSR1 (agreed on by all
 * ranks at a step boundary; the trainer then takes a blocking snapshot and exits). The trainer's
 * thread. */
#ifndef DDP_WORKER_CHECKPOINT_H
#define DDP_WORKER_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "run_log.h"
#include "snapshot.h"
#include "train_state.h"

typedef struct {
    snapshot_writer_t *writer; /* rank 0 with snapshot.dir set, else NULL */
    int64_t last_step;         /* the step of the last snapshot taken or resumed (0: none) */
    int64_t n_taken;           /* snapshots taken by this process (rank 0), for the summary */
    const char *resume_source; /* "memory", "peer", "disk", "none" (lost all); NULL: first start */
    int64_t steps_lost;        /* steps trained before the restart and lost (-1: unknown) */
    int resume_rank;           /* the rank that sent the state resumed from */
    bool was_finished;         /* the snapshot resumed from was a finished run's */
    bool is_already_finished;  /* ... and train.conf asks nothing more of it */
} checkpoint_t;

/* Rank 0: the snapshot writer; every rank: SIGTERM/SIGUSR1 handlers. No-op without snapshot.dir.
 * Exits (DDP_EXIT_IO) when snapshot.dir cannot be used. */
void checkpoint_init(checkpoint_t *c, const train_parts_t *p);
/* Find the newest state (memory, peers, disk), agree on it with every rank and load it into s
 * and p's arenas on every rank (s->loss_scale included); returns whether one was found (then
 * c->resume_* say where from; c->is_already_finished: nothing is left to train and the arenas
 * were not loaded). Collective. Exits on a snapshot of another configuration (DDP_EXIT_CONFIG),
 * an unreadable snapshot.dir, or a collective's failure. */
bool checkpoint_resume(checkpoint_t *c, const train_parts_t *p, train_state_t *s);
/* The header of the state s (after its last step): everything but checksums and times. */
void checkpoint_describe(const train_parts_t *p, const train_state_t *s, snapshot_header_t *h);
/* A snapshot in two halves, so the model may change between them (the final evaluation loads the
 * best weights) and the write land later: take copies the state into the writer's buffers (rank
 * 0; returns the stall in seconds), commit hands them to the writer thread (waits for the write
 * if is_blocking; a failure then exits DDP_EXIT_IO, saying whether has_written_params) and reports
 * the "snapshot" event. Every rank calls both (counting); only rank 0 writes. */
double checkpoint_take(checkpoint_t *c, const train_parts_t *p, const train_state_t *s);
void checkpoint_commit(checkpoint_t *c, const train_parts_t *p, const train_state_t *s,
                       run_log_t *log, bool is_blocking, double stall, bool has_written_params);
/* After every step, one collective (every rank calls it at the same step; none without
 * snapshot.dir and train.hours): the stop signal any rank received, SIGTERM over SIGUSR1 (0: none,
 * and always 0 without snapshot.dir), and in *is_out_of_time whether train.hours is spent by rank
 * 0's clock. */
int checkpoint_agree_step(const train_parts_t *p, const train_state_t *s, bool *is_out_of_time);
void checkpoint_free(checkpoint_t *c);

#endif
