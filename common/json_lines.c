/* json_lines: see json_lines.h. */
#include "json_lines.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void json_line_utc_now(char *out, size_t out_len) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, out_len, "%s.%03dZ", date, (int)(ts.tv_nsec / 1000000 % 1000));
}

cJSON *json_line_new(const char *event) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    char now[40];
    json_line_utc_now(now, sizeof now);
    cJSON_AddStringToObject(o, "event", event);
    cJSON_AddStringToObject(o, "time", now);
    return o;
}

void json_line_num(cJSON *o, const char *key, double value) {
    if (!o) return;
    if (!isfinite(value)) {
        cJSON_AddNullToObject(o, key);
        return;
    }
    /* the shortest text that reads back as exactly this double (cJSON's own printing settles for
     * "nearly equal", which loses the last digits) */
    char text[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, value);
        if (strtod(text, NULL) == value) break;
    }
    cJSON_AddRawToObject(o, key, text);
}

void json_line_int(cJSON *o, const char *key, int64_t value) {
    if (!o) return;
    /* as text: cJSON prints numbers past INT_MAX with 15 significant digits */
    char text[24];
    snprintf(text, sizeof text, "%lld", (long long)value);
    cJSON_AddRawToObject(o, key, text);
}

void json_line_str(cJSON *o, const char *key, const char *value) {
    if (o) cJSON_AddStringToObject(o, key, value);
}

void json_line_bool(cJSON *o, const char *key, int value) {
    if (o) cJSON_AddBoolToObject(o, key, value);
}

char *json_line_text(const cJSON *o) {
    return o ? cJSON_PrintUnformatted(o) : NULL;
}

int json_line_write(FILE *f, cJSON *o) {
    char *text = json_line_text(o);
    cJSON_Delete(o);
    if (!text) return -1;
    int rc = 0;
    if (f) {
        if (fprintf(f, "%s\n", text) < 0 || fflush(f) != 0) rc = -1;
    }
    cJSON_free(text);
    return rc;
}
