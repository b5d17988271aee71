/* status_report: see status_report.h. */
#include "status_report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_lines.h"
#include "store_client.h"

#define STATUS_TIMEOUT_MS 1000

struct status_report {
    store_client_t *store;
    char key[512];
    char resume_key[512];
};

status_report_t *status_report_open(int rank) {
    const char *host = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    const char *run_id = getenv("TORCHELASTIC_RUN_ID");
    long p = port ? strtol(port, NULL, 10) : 0;
    if (!host || !*host || p <= 0 || p > 65535 || !run_id || !*run_id) return NULL;
    status_report_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    store_secret_t secret; /* the store's, when it has one; a bad one ends the worker elsewhere */
    char err[256];
    if (store_secret_from_env(&secret, err, sizeof err) < 0) secret.is_set = false;
    store_client_opts_t so = {.host = host,
                              .port = (uint16_t)p,
                              .connect_timeout_ms = STATUS_TIMEOUT_MS,
                              .op_timeout_ms = STATUS_TIMEOUT_MS,
                              .secret = &secret};
    if (store_client_connect(&so, &s->store) < 0) {
        store_client_destroy(s->store);
        free(s);
        return NULL;
    }
    snprintf(s->key, sizeof s->key, "/ddprun/%s/progress/%d", run_id, rank);
    snprintf(s->resume_key, sizeof s->resume_key, "/ddprun/%s/progress/resume", run_id);
    return s;
}

void status_report_publish(status_report_t *s, int64_t step, int64_t epoch, double loss,
                           double img_per_s, int64_t snapshot_step) {
    if (!s || !s->store) return;
    cJSON *o = json_line_new("progress");
    json_line_int(o, "step", step);
    json_line_int(o, "epoch", epoch);
    json_line_num(o, "loss", loss);
    json_line_num(o, "img_per_s", img_per_s);
    if (snapshot_step >= 0) json_line_int(o, "snapshot_step", snapshot_step);
    char *text = json_line_text(o);
    cJSON_Delete(o);
    if (text && store_client_set(s->store, s->key, text, strlen(text)) < 0) {
        fprintf(stderr, "ddpworker: warning: progress for `ddprun status` stops: %s\n",
                store_client_error(s->store));
        store_client_destroy(s->store);
        s->store = NULL;
    }
    cJSON_free(text);
}

void status_report_resume(status_report_t *s, int64_t step, const char *source, int rank,
                          int64_t steps_lost) {
    if (!s || !s->store) return;
    cJSON *o = json_line_new("resume");
    json_line_int(o, "step", step);
    json_line_str(o, "source", source);
    json_line_int(o, "rank", rank);
    json_line_int(o, "steps_lost", steps_lost);
    char *text = json_line_text(o);
    cJSON_Delete(o);
    if (text && store_client_set(s->store, s->resume_key, text, strlen(text)) < 0) {
        fprintf(stderr, "ddpworker: warning: progress for `ddprun status` stops: %s\n",
                store_client_error(s->store));
        store_client_destroy(s->store);
        s->store = NULL;
    }
    cJSON_free(text);
}

void status_report_close(status_report_t *s) {
    if (!s) return;
    store_client_destroy(s->store);
    free(s);
}
