/* snapshot: ddpworker's snapshots on disk (format: proto/snapshot_format.h, docs/snapshot.md).
 * Writing is crash-safe: a temp file in the same directory, fsync, rename, fsync of the directory,
 * then the `latest` manifest the same way; older snapshots are pruned only after the new one is in
 * place, so a failed write (full disk, read-only directory) never damages what was there. Reading
 * verifies every checksum before anything is used; snapshot_find_latest skips (and reports) torn or
 * corrupt files, moves them aside (NAME.corrupt, out of retention's sight) and falls back to older
 * ones; a non-regular file named like a snapshot (a FIFO) is skipped without blocking.
 *
 * snapshot_writer_t does the writing on its own thread from host copies, so a training step only
 * pays for the copy. One writer per run, driven from the trainer's thread. */
#ifndef DDP_WORKER_SNAPSHOT_H
#define DDP_WORKER_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "snapshot_format.h"

typedef struct {
    snapshot_header_t header;
    float *params, *momentum, *buffers; /* host memory, sizes from the header */
    float *second_moment;               /* adam/adamw (header.optimizer): as params; NULL for sgd */
} snapshot_data_t;

typedef struct {
    int64_t keep;       /* newest snapshots kept */
    int64_t keep_every; /* also keep steps that are multiples of this forever (0: none) */
} snapshot_retention_t;

/* Called after every chunk (4 MiB) a snapshot write puts on disk, from the writing thread. */
typedef struct {
    void (*cb)(void *arg);
    void *arg;
} snapshot_progress_t;

/* Write one snapshot into dir (which must exist) as snapshot-<step>.ddps; fills in the header's
 * magic, version, sections and checksums (the second moment's when header.optimizer is adam or
 * adamw: d->second_moment must then be set); then rewrites the manifest and prunes: only the
 * snapshots a resume could use count toward keep (this one, and older regular files whose header
 * verifies); a file a resume skips and leaves (a FIFO, an unreadable file, one of a later step) is
 * left in place and reported on stderr. Returns 0, or -1 with "what failed, the path, and the
 * system's reason" in err (nothing existing is damaged). */
int snapshot_write(const char *dir, const snapshot_data_t *d, const snapshot_retention_t *keep,
                   const snapshot_progress_t *progress, char *err, size_t err_len);
/* Fill in h's magic, version, section table (sections laid out back to back after the header, as
 * in a file) and every checksum from d's arrays (d->header is not read; d->second_moment is needed
 * when h->optimizer is adam or adamw). Returns the snapshot's size in bytes. */
uint64_t snapshot_seal(snapshot_header_t *h, const snapshot_data_t *d);
/* snapshot_seal in parts, for a writer that hashes the sections as it fills them: the layout fills
 * h's magic, version and section table (no checksums; sections back to back after the header, in
 * the order params, momentum, buffers, second moment) and returns the size in bytes; once every
 * section's checksum is in, snapshot_seal_header sets the header's own. */
uint64_t snapshot_layout(snapshot_header_t *h);
void snapshot_seal_header(snapshot_header_t *h);
/* The step of the newest file in dir named like a snapshot, unverified (-1: none or no dir): what
 * a faster source must reach for the disk to be skipped. */
int64_t snapshot_newest_step(const char *dir);
/* snapshot_read's and snapshot_find_latest's return for a file of a version newer than this
 * ddpworker's: not damage (nothing is skipped or moved aside for it), but nothing here can use it.
 */
#define SNAPSHOT_E_NEWER (-2)
/* snapshot_read's return when the file could not be read (open, memory, the file system's I/O
 * error): not damage either, so snapshot_find_latest skips it without moving it aside. */
#define SNAPSHOT_E_UNREADABLE (-3)

/* Read and verify path; versions older than SNAPSHOT_VERSION read too, with what they did not
 * record zeroed (best_value NaN). On success d's arrays are malloc'd (snapshot_data_free). Returns
 * 0, SNAPSHOT_E_NEWER, SNAPSHOT_E_UNREADABLE, or -1 with the first problem found (bad magic,
 * truncated, a checksum that does not match, ...); err names the file either way. */
int snapshot_read(const char *path, snapshot_data_t *d, char *err, size_t err_len);
void snapshot_data_free(snapshot_data_t *d);
/* The newest snapshot in dir that verifies, into d and its path into path_out. Every file skipped
 * on the way is reported on `report` (may be NULL) with its path and reason, and a regular one that
 * is damaged is renamed to NAME.corrupt (reported too; one that could not be read stays). Returns 1
 * when one was found, 0 when there is none (or no dir), -1 with err when dir cannot be read,
 * SNAPSHOT_E_NEWER with err when the newest file that is not damaged belongs to a newer ddpworker
 * (left as it is). */
int snapshot_find_latest(const char *dir, FILE *report, snapshot_data_t *d, char *path_out,
                         size_t path_len, char *err, size_t err_len);
/* XXH3-64 over params, momentum and buffers, then (adam/adamw) the second moment and the step
 * count: one number to compare two runs' final state. */
uint64_t snapshot_state_hash(const snapshot_data_t *d);
/* data.kind's name for a header's data_kind ("fashion-mnist", ...; "not recorded" for 0, as in
 * files written before the field was; "unknown" for a number this ddpworker does not know). */
const char *snapshot_data_kind_name(uint32_t data_kind);
/* `ddpworker inspect`: header, per-section verification, state hash. Returns 0 if it verifies. */
int snapshot_inspect(const char *path, FILE *out);

typedef struct snapshot_writer snapshot_writer_t;

/* A writer for dir with host buffers for n_params / n_buffers floats (and a second moment of
 * n_params when has_second_moment). Creates dir if missing.
 * Returns 0 or -1 with err (cannot create or write into dir, out of memory). */
int snapshot_writer_create(const char *dir, size_t n_params, size_t n_buffers,
                           bool has_second_moment, const snapshot_retention_t *keep,
                           snapshot_writer_t **out, char *err, size_t err_len);
/* Wait until the previous snapshot is written; then its buffers are free to fill. Returns 0, or
 * -1 with the previous write's failure in err (reported once). */
int snapshot_writer_acquire(snapshot_writer_t *w, snapshot_data_t **buffers, char *err,
                            size_t err_len);
/* Hand the filled buffers (and header) to the writer thread; returns at once. */
void snapshot_writer_submit(snapshot_writer_t *w);
/* Wait for the write in flight (if any); 0 or -1 with its failure in err. */
int snapshot_writer_flush(snapshot_writer_t *w, char *err, size_t err_len);
/* The path of the last snapshot written successfully ("" if none yet). */
const char *snapshot_writer_last_path(const snapshot_writer_t *w);
/* Report the writer thread's progress through progress (before the first submit). */
void snapshot_writer_set_progress(snapshot_writer_t *w, const snapshot_progress_t *progress);
/* When the last snapshot landed (CLOCK_MONOTONIC seconds; 0: none yet) and its step in *step;
 * failure gets the error of the writes that failed since ("" when the last one landed). */
double snapshot_writer_landed(snapshot_writer_t *w, uint64_t *step, char *failure,
                              size_t failure_len);
/* A wait for the write in flight (acquire, flush) that lasts after_s seconds is said on out, with
 * the step and the directory, and again every minute (default: 10 s, stderr). Before the first
 * submit. */
void snapshot_writer_set_notice(snapshot_writer_t *w, double after_s, FILE *out);
void snapshot_writer_destroy(snapshot_writer_t *w);

#endif
