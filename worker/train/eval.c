/* trainer_eval: what the trainer reports and keeps from evaluations: "eval", "epoch" and "final"
 * events, the best weights by train.best_by (train.best_file, safetensors written atomically; the
 * value lives in snapshots), the test at the end with them, and the weights files (nn/weights).
 * Internal to the trainer (trainer.h's trainer__ functions); the worker's main thread, every rank
 * at the same step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "exit_codes.h"
#include "die.h"
#include "train_state.h"
#include "trainer.h"
#include "weights.h"

void trainer__write_metrics(trainer_t *t, cJSON *o) {
    tb_events_metrics(t->tb, o); /* the same numbers as TensorBoard scalars (rank 0) */
    if (t->metrics)
        json_line_write(t->metrics, o);
    else
        cJSON_Delete(o);
}

static void add_eval(cJSON *o, const char *prefix, const eval_result_t *r) {
    char key[32];
    const char *names[3] = {"loss", "top1", "top5"};
    const double values[3] = {r->loss, r->top1, r->top5};
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s%s", prefix, names[i]);
        json_line_num(o, key, values[i]);
    }
}

static void report_eval(trainer_t *t, const eval_result_t *r, const char *event,
                        const char *weights) {
    if (t->rank != 0) return;
    cJSON *o = json_line_new(event);
    json_line_str(o, "split", data_split_name(r->split));
    add_eval(o, "", r);
    json_line_int(o, "step", t->step);
    json_line_int(o, "epoch", t->epoch + 1);
    json_line_int(o, "samples", r->n);
    if (weights) {
        json_line_str(o, "weights", weights);
        if (t->skipped_images) json_line_int(o, "skipped_images", t->skipped_images);
        bool is_best = strcmp(weights, "best") == 0;
        if (is_best) {
            json_line_int(o, "best_step", t->best_step);
            json_line_num(o, "best_value", t->best_value);
            /* weights chosen on the split they are then reported on look better than they are */
            json_line_str(o, "chosen_on", data_split_name(t->eval_split));
            json_line_bool(o, "split_chose_weights", r->split == t->eval_split);
        }
        char *line = json_line_text(o); /* the same line on stdout as in the metrics file */
        trainer__end_progress_line();
        if (line) printf("%s\n", line);
        cJSON_free(line);
        if (is_best && r->split == t->eval_split)
            printf(
                "ddpworker: note: the final evaluation is on %s, the split that also chose these "
                "weights (train.best_by), so it flatters them; a test split of its own (an image "
                "folder's test/, or the dataset's test set with data.val_split) measures them "
                "fairly\n",
                data_split_name(r->split));
    } else {
        trainer__end_progress_line();
        printf("eval  step %lld  %s loss %.4f  top1 %.2f%%  top5 %.2f%%\n", (long long)t->step,
               data_split_name(r->split), r->loss, 100 * r->top1, 100 * r->top5);
    }
    fflush(stdout);
    trainer__write_metrics(t, o);
}

void trainer__write_weights(trainer_t *t, const char *path, const char *key,
                            const char *const *tags) {
    char err[2048];
    if (weights_save_tagged(&t->model, path, t->step, tags, err, sizeof err) < 0)
        die(DDP_EXIT_IO, "%s: %s", key, err);
}

/* What train.best_file says of itself in its metadata: which measure, its value (exact), the step,
 * and the run (seed; the model is weights' own "model" tag). */
#define TAG_BY    "ddpworker.best_by"
#define TAG_VALUE "ddpworker.best_value"
#define TAG_STEP  "ddpworker.best_step"
#define TAG_SEED  "ddpworker.seed"

static const char *best_by_name(best_by_t by) {
    return by == BEST_BY_VAL_LOSS ? "val_loss" : by == BEST_BY_VAL_TOP1 ? "val_top1" : "none";
}

static void write_best(trainer_t *t) {
    char value[40], step[24], seed[24];
    snprintf(value, sizeof value, "%.17g", t->best_value);
    snprintf(step, sizeof step, "%lld", (long long)t->best_step);
    snprintf(seed, sizeof seed, "%lld", (long long)t->conf->seed);
    const char *tags[] = {
        TAG_BY, best_by_name(t->conf->best_by), TAG_VALUE, value, TAG_STEP, step, TAG_SEED, seed,
        NULL};
    trainer__write_weights(t, t->conf->best_file, "train.best_file", tags);
}

/* The best file's own record, if it has one and it is this run's (measure, seed, model): 0, or -1
 * (absent, another run's, unreadable: err says which when it matters). */
static int read_best_tags(const trainer_t *t, double *value, int64_t *step, char *err,
                          size_t err_len) {
    const char *path = t->conf->best_file;
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
    if (strcmp(by, best_by_name(t->conf->best_by)) != 0 ||
        strtoll(seed, NULL, 10) != t->conf->seed || strcmp(model, t->model.name) != 0 || *end_v ||
        *end_s || !isfinite(*value) || *step < 0) {
        snprintf(err, err_len,
                 "%s: the best %s of another run (%s %s at step %s, seed %s, model %s)", path, by,
                 by, v, s, seed, model);
        return -1;
    }
    return 0;
}

void trainer__recall_best(const trainer_t *t, double *value, int64_t *step) {
    if (t->conf->best_by == BEST_BY_NONE) return;
    double file_value;
    int64_t file_step;
    char err[2048];
    bool is_there = access(t->conf->best_file, F_OK) == 0;
    if (is_there && read_best_tags(t, &file_value, &file_step, err, sizeof err) == 0) {
        if (file_step > *step) {
            printf("ddpworker: train.best_file holds the best %s of step %lld (%.6g), later than "
                   "this snapshot's (step %lld): it stays the best so far\n",
                   best_by_name(t->conf->best_by), (long long)file_step, file_value,
                   (long long)*step);
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
                t->conf->best_file, (long long)*step);
        *value = NAN;
        *step = -1;
    } else {
        fprintf(stderr, "ddpworker: warning: %s; keeping the snapshot's best (step %lld)\n", err,
                (long long)*step);
    }
}

static bool is_better(const trainer_t *t, const eval_result_t *r) {
    double value = t->conf->best_by == BEST_BY_VAL_LOSS ? r->loss : r->top1;
    if (!isfinite(value)) return false;
    if (isnan(t->best_value)) return true;
    return t->conf->best_by == BEST_BY_VAL_LOSS ? value < t->best_value : value > t->best_value;
}

eval_result_t trainer__validate(trainer_t *t) {
    eval_result_t r = trainer_evaluate(t, t->eval_split);
    report_eval(t, &r, "eval", NULL);
    if (t->conf->best_by == BEST_BY_NONE || !is_better(t, &r)) return r;
    /* every rank holds the same reduced result, so every rank agrees; rank 0 keeps the weights */
    t->best_value = t->conf->best_by == BEST_BY_VAL_LOSS ? r.loss : r.top1;
    t->best_step = t->step;
    if (t->rank != 0) return r;
    write_best(t);
    cJSON *o = json_line_new("best");
    json_line_str(o, "by", best_by_name(t->conf->best_by));
    json_line_num(o, "value", t->best_value);
    json_line_int(o, "step", t->step);
    json_line_str(o, "file", t->conf->best_file);
    trainer__write_metrics(t, o);
    return r;
}

/* The best weights into the model on every rank, from train.best_file (where they went when they
 * were best, possibly before a restart). */
static void load_best(trainer_t *t) {
    model_t *m = &t->model;
    char err[2048];
    if (t->rank == 0 && weights_load(m, t->conf->best_file, false, stderr, err, sizeof err) < 0)
        die(DDP_EXIT_DATA, "train.best_file (the best weights, of step %lld): %s",
            (long long)t->best_step, err);
    double value;
    int64_t step;
    if (t->rank == 0 &&
        (read_best_tags(t, &value, &step, err, sizeof err) < 0 || step != t->best_step))
        fprintf(stderr,
                "ddpworker: warning: train.best_file %s does not say it holds the best "
                "weights of step %lld (replaced since?): testing it anyway\n",
                t->conf->best_file, (long long)t->best_step);
    train_state_bcast(t->comm, m, &t->optim, TRAIN_STATE_PARAMS | TRAIN_STATE_BUFFERS, 0,
                      "the best weights'");
}

eval_result_t trainer__final(trainer_t *t, const eval_result_t *last_validation) {
    data_split_t split = t->data->test.n ? SPLIT_TEST : t->eval_split;
    bool use_best = t->conf->best_by != BEST_BY_NONE && t->best_step >= 0;
    if (use_best) load_best(t);
    return use_best || split != last_validation->split ? trainer_evaluate(t, split)
                                                       : *last_validation;
}

void trainer__report_final(trainer_t *t, const eval_result_t *r) {
    bool use_best = t->conf->best_by != BEST_BY_NONE && t->best_step >= 0;
    report_eval(t, r, "final", use_best ? "best" : "last");
}

void trainer__report_epoch(trainer_t *t, double wall_s, int64_t samples, const eval_result_t *val) {
    if (t->rank != 0) return;
    cJSON *o = json_line_new("epoch");
    json_line_int(o, "epoch", t->epoch + 1);
    json_line_int(o, "step", t->step);
    json_line_num(o, "wall_s", wall_s);
    json_line_num(o, "img_per_s", wall_s > 0 ? (double)samples * t->world / wall_s : 0);
    if (val) {
        json_line_str(o, "split", data_split_name(val->split));
        add_eval(o, "val_", val);
    }
    trainer__write_metrics(t, o);
}
