/* run_log: what a run tells while it trains, from values its caller passes: metrics lines (rank 0's
 * train.metrics_file, the same numbers as TensorBoard scalars), the progress line on stdout (one
 * line that updates on a terminal, a line per log interval when piped), the closing summary, and
 * the beats ddprun's hang detector reads (DDPRUN_PROGRESS_FILE). Knows nothing of the trainer. The
 * trainer's thread, but for run_log_beat (any thread). */
#ifndef DDP_WORKER_RUN_LOG_H
#define DDP_WORKER_RUN_LOG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "json_lines.h"
#include "status_report.h"
#include "tb_events.h"
#include "train_state.h"

/* Rank 0's sinks of metrics; both NULL elsewhere. */
typedef struct {
    FILE *metrics;   /* train.metrics_file, or NULL */
    tb_events_t *tb; /* train.tensorboard_dir's event file, or NULL */
} run_log_t;

/* Open DDPRUN_PROGRESS_FILE, when ddprun set it, for run_log_beat. */
void run_log_open_beats(void);
/* One unit of progress (a training step, an evaluation batch, bytes of a snapshot reaching the
 * disk) for ddprun --hang-timeout. Any thread. */
void run_log_beat(void);
/* A metrics line into the metrics file and as TensorBoard scalars; frees o. */
void run_log_write(run_log_t *l, cJSON *o);
/* A metrics line into the metrics file only (events TensorBoard has no scalars for); frees o. */
void run_log_event(run_log_t *l, cJSON *o);
/* Before anything else goes to stdout: end the updating progress line a terminal shows. */
void run_log_end_line(void);

/* One progress line (rank 0): where the run is and how fast it goes. */
typedef struct {
    int64_t step, epoch;    /* epoch counted from 1 */
    int64_t total_steps;    /* 0: unknown (a time budget alone) */
    double hours, budget_h; /* train.hours: spent and allowed (budget 0: none) */
    double loss, lr, img_per_s;
    double eta_s;   /* until the run ends (whichever end comes first) */
    bool has_scale; /* loss scaling: its scale and skipped steps */
    double scale;
    uint32_t skipped_steps;
    const char *snapshot; /* "  snapshot ..." of the disk snapshots, or "" */
} run_log_progress_t;
/* Prints it (and ends it on a terminal only at the next line) and writes its "train" event. */
void run_log_progress(run_log_t *l, const run_log_progress_t *p);

/* What a start trains with (rank 0): its line on stdout and its "start" event. */
typedef struct {
    const char *model, *backend;
    size_t n_params;
    int world;
    int64_t step, epoch; /* where it starts (epoch counted from 1) */
    int64_t batch_size, steps_per_epoch;
    int64_t split_samples[SPLIT_COUNT];
    double lr; /* after optim.lr_scaling */
    bool was_spare;
} run_log_start_t;
void run_log_start(run_log_t *l, const run_log_start_t *v);

/* An evaluation's loss, top1 and top5 as fields of o, their names after prefix. */
void run_log_eval_fields(cJSON *o, const char *prefix, const eval_result_t *r);

/* One "epoch" event: wall time and images/s (all ranks) of the epoch, and its validation when one
 * ran (val, or NULL). */
void run_log_epoch(run_log_t *l, int64_t epoch, int64_t step, double wall_s, double img_per_s,
                   const eval_result_t *val);

/* Rank 0 after a resume: its source, the rank that sent it and steps lost as a "resume" event and
 * for `ddprun status`. */
void run_log_resume(run_log_t *l, status_report_t *status, int64_t step, const char *source,
                    int rank, int64_t steps_lost);

/* Rank 0's closing line: how long, how fast, how far, the best validation, restarts, snapshots. */
typedef struct {
    int64_t step, epoch;       /* reached (epoch counted from 1) */
    double total_s, attempt_s; /* training wall time of the run, and of this process */
    double img_per_s;          /* in this attempt, all ranks */
    const char *best_by;       /* the best's measure, or NULL: none kept */
    double best_value;
    int64_t best_step;
    int64_t n_snapshots; /* written in this attempt */
} run_log_summary_t;
void run_log_summary(const run_log_summary_t *v);

/* H:MM:SS, or M:SS under an hour. */
void run_log_duration(double s, char *buf, size_t len);

#endif
