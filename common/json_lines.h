/* json_lines: JSON objects written one per line (ddpworker's metrics file and its final line,
 * reports), built with cJSON so that strings are escaped and numbers that are not finite (NaN,
 * inf) come out as null: every line is valid JSON. Each object opens with "event" and a UTC
 * "time" (ISO 8601 with milliseconds). Any thread, one object per caller. */
#ifndef DDP_COMMON_JSON_LINES_H
#define DDP_COMMON_JSON_LINES_H

#include <stdint.h>
#include <stdio.h>

#include <cJSON.h>

/* {"event": event, "time": "2026-11-25T03:04:05.678Z"}; NULL when out of memory (the json_line_*
 * calls then do nothing, so callers need not check). */
cJSON *json_line_new(const char *event);
/* A number; NaN and inf become null. */
void json_line_num(cJSON *o, const char *key, double value);
void json_line_int(cJSON *o, const char *key, int64_t value);
void json_line_str(cJSON *o, const char *key, const char *value);
void json_line_bool(cJSON *o, const char *key, int value);
/* The object as one line of text, malloc'd (free it), or NULL when out of memory. */
char *json_line_text(const cJSON *o);
/* Write o as one line to f (if f is not NULL) and flush; frees o. Returns 0 or -1 (write error,
 * out of memory). */
int json_line_write(FILE *f, cJSON *o);
/* The current UTC time as "YYYY-MM-DDTHH:MM:SS.mmmZ" (out: at least 32 bytes). */
void json_line_utc_now(char *out, size_t out_len);

#endif
