/* tb_events: TensorBoard event files (train.tensorboard_dir), written by rank 0: the metrics lines
 * the trainer reports (train loss, learning rate, img/s, loss scale; the evaluations' loss, top-1,
 * top-5) as scalars, and the run's configuration as a text summary. Each process that opens the
 * directory starts a new file in it (names sort in the order they were opened), beginning with a
 * SessionLog START at the first step it will run: TensorBoard then drops whatever earlier files
 * hold from that step on, so a resumed run continues one curve with no step twice (TensorFlow's
 * own writer does the same on restore). Records are TFRecords (length, masked CRC-32C of the
 * length, the Event protobuf, its masked CRC-32C); protobuf-c encodes, ISA-L computes CRC-32C.
 * Does not read event files, nor talk to TensorBoard. The trainer's thread; not thread-safe. */
#ifndef DDP_WORKER_TB_EVENTS_H
#define DDP_WORKER_TB_EVENTS_H

#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

typedef struct tb_events tb_events_t;

/* A new event file in dir (made, with its parents, if missing), opened for a process that resumes
 * after step first_step (0: a run from the start): it holds the file version, a SessionLog START
 * at first_step + 1, and at that step the text summary "config": the text of conf_path (the
 * train.conf; NULL: no summary) and the overrides given on the command line (NULL or ""). Returns
 * 0 and *out, or -1 with what and where in err (nothing is left open). */
int tb_events_open(const char *dir, int64_t first_step, const char *conf_path,
                   const char *overrides, tb_events_t **out, char *err, size_t err_len);
/* One scalar at step. Returns 0, or -1 when the write fails: the first failure is reported on
 * stderr once, and the writer then does nothing (training goes on without its curves). */
int tb_events_scalar(tb_events_t *w, const char *tag, int64_t step, double value);
/* A text summary (Markdown) at step; as tb_events_scalar. */
int tb_events_text(tb_events_t *w, const char *tag, int64_t step, const char *text);
/* A metrics line (json_lines.h) as the scalars it holds, all at its "step", in one event:
 * "train" -> train/loss, train/lr, train/img_per_s, train/loss_scale; "eval" -> <split>/loss,
 * <split>/top1, <split>/top5 (split: val, else test); "final" -> final/loss, final/top1,
 * final/top5; "epoch" -> epoch/img_per_s, epoch/wall_s. Other events are left out; a null
 * (NaN, inf) value is written as NaN. w NULL: does nothing. Returns as tb_events_scalar. */
int tb_events_metrics(tb_events_t *w, const cJSON *line);
/* The file path being written (for messages). */
const char *tb_events_path(const tb_events_t *w);
/* Close the file (its records are on disk after each call already); NULL is fine. */
void tb_events_close(tb_events_t *w);

/* The TFRecord framing, for the tests. */
#define TB_RECORD_HEADER_BYTES 12 /* u64 length LE, u32 masked CRC-32C of those 8 bytes */
#define TB_RECORD_FOOTER_BYTES 4  /* u32 masked CRC-32C of the payload */
/* CRC-32C (Castagnoli) of data, masked as TFRecord does: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
 */
uint32_t tb_masked_crc32c(const void *data, size_t len);
/* The plain CRC-32C (iSCSI: reflected, init and final xor 0xffffffff). */
uint32_t tb_crc32c(const void *data, size_t len);
/* The header and footer that frame payload[0..len) as one record. */
void tb_record_frame(const void *payload, size_t len, uint8_t header[TB_RECORD_HEADER_BYTES],
                     uint8_t footer[TB_RECORD_FOOTER_BYTES]);

#endif
