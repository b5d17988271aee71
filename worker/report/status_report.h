/* status_report: each rank's progress, published at log intervals in the job's store for
 * `ddprun status` under /ddprun/<run id>/progress/<rank> as a JSON object {"step", "epoch",
 * "loss", "img_per_s", "snapshot_step", "time"} (docs/protocol.md; a PyTorch script may publish
 * the same key). Best effort: a store that does not answer within a second turns it off with one
 * warning, and training goes on. The trainer's thread. */
#ifndef DDP_WORKER_STATUS_REPORT_H
#define DDP_WORKER_STATUS_REPORT_H

#include <stdint.h>

typedef struct status_report status_report_t;

/* Under ddprun (MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID set): a connection to the job's
 * store; otherwise, or when it cannot connect at once, NULL (then publishing does nothing). */
status_report_t *status_report_open(int rank);
void status_report_publish(status_report_t *s, int64_t step, int64_t epoch, double loss,
                           double img_per_s, int64_t snapshot_step);
/* Where the last resume came from, under /ddprun/<run id>/progress/resume as {"step", "source"
 * ("memory", "peer", "disk"), "rank" (that sent it), "steps_lost" (-1: unknown), "time"}. */
void status_report_resume(status_report_t *s, int64_t step, const char *source, int rank,
                          int64_t steps_lost);
void status_report_close(status_report_t *s);

#endif
