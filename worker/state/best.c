/* best: see best.h. */
#include "best.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "die.h"
#include "exit_codes.h"
#include "weights.h"

/* What train.best_file says of itself in its metadata: which measure, its value (exact), the step,
 * and the run (seed; the model is weights' own "model" tag). */
#define TAG_BY    "ddpworker.best_by"
#define TAG_VALUE "ddpworker.best_value"
#define TAG_STEP  "ddpworker.best_step"
#define TAG_SEED  "ddpworker.seed"

const char *best_by_name(best_by_t by) {
    return by == BEST_BY_VAL_LOSS ? "val_loss" : by == BEST_BY_VAL_TOP1 ? "val_top1" : "none";
}

void best_write(const train_conf_t *c, model_t *m, const train_state_t *s) {
    char value[40], step[24], seed[24];
    snprintf(value, sizeof value, "%.17g", s->best_value);
    snprintf(step, sizeof step, "%lld", (long long)s->best_step);
    snprintf(seed, sizeof seed, "%lld", (long long)c->seed);
    const char *tags[] = {
        TAG_BY, best_by_name(c->best_by), TAG_VALUE, value, TAG_STEP, step, TAG_SEED, seed, NULL};
    train_state_save_weights(m, s->step, c->best_file, "train.best_file", tags);
}

/* The best file's own record, if it has one and it is this run's (measure, seed, model): 0, or -1
 * (absent, another run's, unreadable: err says which when it matters). */
static int read_best_tags(const train_conf_t *c, const char *model_name, double *value,
                          int64_t *step, char *err, size_t err_len) {
    const char *path = c->best_file;
    char by[32], v[64], s[32], seed[32], model[64];
    const char *keys[] = {TAG_BY, TAG_VALUE, TAG_STEP, TAG_SEED, "model"};
    char *outs[] = {by, v, s, seed, model};
    size_t lens[] = {sizeof by, sizeof v, sizeof s, sizeof seed, sizeof model};
    for (int i = 0; i < 5; i++) {
        int rc = weights_read_tag(path, keys[i], outs[i], lens[i], err, err_len);
        if (rc <= 0) {
            if (rc == 0) snprintf(err, err_len, "%s: no '%s' in its metadata", path, keys[i]);
            return -1;
        }
    }
    char *end_v, *end_s;
    *value = strtod(v, &end_v);
    *step = strtoll(s, &end_s, 10);
    if (strcmp(by, best_by_name(c->best_by)) != 0 || strtoll(seed, NULL, 10) != c->seed ||
        strcmp(model, model_name) != 0 || *end_v || *end_s || !isfinite(*value) || *step < 0) {
        snprintf(err, err_len,
                 "%s: the best %s of another run (%s %s at step %s, seed %s, model %s)", path, by,
                 by, v, s, seed, model);
        return -1;
    }
    return 0;
}

void best_recall(const train_conf_t *c, const char *model_name, double *value, int64_t *step) {
    if (c->best_by == BEST_BY_NONE) return;
    double file_value;
    int64_t file_step;
    char err[2048];
    bool is_there = access(c->best_file, F_OK) == 0;
    if (is_there && read_best_tags(c, model_name, &file_value, &file_step, err, sizeof err) == 0) {
        if (file_step > *step) {
            printf("ddpworker: train.best_file holds the best %s of step %lld (%.6g), later than "
                   "this snapshot's (step %lld): it stays the best so far\n",
                   best_by_name(c->best_by), (long long)file_step, file_value, (long long)*step);
            fflush(stdout);
            *value = file_value;
            *step = file_step;
        }
        return;
    }
    if (*step < 0) return; /* nothing kept yet: whatever is there gets replaced */
    if (!is_there) {
        fprintf(stderr,
                "ddpworker: warning: train.best_file %s is gone: the best weights (step %lld) "
                "are lost; the best so far starts afresh\n",
                c->best_file, (long long)*step);
        *value = NAN;
        *step = -1;
    } else {
        fprintf(stderr, "ddpworker: warning: %s; keeping the snapshot's best (step %lld)\n", err,
                (long long)*step);
    }
}

bool best_is_better(const train_conf_t *c, const train_state_t *s, const eval_result_t *r) {
    double value = c->best_by == BEST_BY_VAL_LOSS ? r->loss : r->top1;
    if (!isfinite(value)) return false;
    if (isnan(s->best_value)) return true;
    return c->best_by == BEST_BY_VAL_LOSS ? value < s->best_value : value > s->best_value;
}

void best_load(const train_parts_t *p, int64_t best_step) {
    model_t *m = p->model;
    const train_conf_t *c = p->conf;
    char err[2048];
    if (p->rank == 0 && weights_load(m, c->best_file, false, stderr, err, sizeof err) < 0)
        die(DDP_EXIT_DATA, "train.best_file (the best weights, of step %lld): %s",
            (long long)best_step, err);
    double value;
    int64_t step;
    if (p->rank == 0 &&
        (read_best_tags(c, m->name, &value, &step, err, sizeof err) < 0 || step != best_step))
        fprintf(stderr,
                "ddpworker: warning: train.best_file %s does not say it holds the best "
                "weights of step %lld (replaced since?): testing it anyway\n",
                c->best_file, (long long)best_step);
    train_state_bcast(p->comm, m, p->optim, TRAIN_STATE_PARAMS | TRAIN_STATE_BUFFERS, 0,
                      "the best weights'");
}
