/* trainer_eval: what the trainer reports and keeps from evaluations: "eval", "epoch" and "final"
 * events, the best weights by train.best_by (train.best_file, safetensors written atomically; the
 * value lives in snapshots), the test at the end with them, and the weights files (nn/weights). Internal to the trainer
 * (trainer.h's trainer__ functions); the worker's main thread, every rank at the same step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exit_codes.h"
#include "trainer.h"
#include "weights.h"

void trainer__write_metrics(trainer_t *t, cJSON *o) {
    if (t->metrics) json_line_write(t->metrics, o);
    else cJSON_Delete(o);
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

static void report_eval(trainer_t *t, const eval_result_t *r, const char *event, const char *weights) {
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
        if (t->best_step >= 0 && t->conf->best_by != BEST_BY_NONE) {
            json_line_int(o, "best_step", t->best_step);
            json_line_num(o, "best_value", t->best_value);
        }
        char *line = json_line_text(o); /* the same line on stdout as in the metrics file */
        if (line) printf("%s\n", line);
        cJSON_free(line);
    } else {
        printf("eval  step %lld  %s loss %.4f  top1 %.2f%%  top5 %.2f%%\n", (long long)t->step,
               data_split_name(r->split), r->loss, 100 * r->top1, 100 * r->top5);
    }
    fflush(stdout);
    trainer__write_metrics(t, o);
}

void trainer__write_weights(trainer_t *t, const char *path, const char *key) {
    char err[1024];
    if (weights_save(&t->model, path, t->step, err, sizeof err) < 0)
        trainer_die(DDP_EXIT_IO, "%s: %s", key, err);
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
    trainer__write_weights(t, t->conf->best_file, "train.best_file");
    cJSON *o = json_line_new("best");
    json_line_str(o, "by", t->conf->best_by == BEST_BY_VAL_LOSS ? "val_loss" : "val_top1");
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
    char err[1024];
    if (t->rank == 0 && weights_load(m, t->conf->best_file, false, stderr, err, sizeof err) < 0)
        trainer_die(DDP_EXIT_DATA, "train.best_file (the best weights, of step %lld): %s",
                    (long long)t->best_step, err);
    trainer__check_comm(t, t->comm->ops->broadcast(t->comm, m->params, m->n_params * sizeof(float), 0),
                        "broadcasting the best weights");
    trainer__check_comm(t, t->comm->ops->broadcast(t->comm, m->buffers, m->n_buffers * sizeof(float), 0),
                        "broadcasting the best weights' statistics");
}

eval_result_t trainer__final(trainer_t *t, const eval_result_t *last_validation) {
    data_split_t split = t->data->test.n ? SPLIT_TEST : t->eval_split;
    bool use_best = t->conf->best_by != BEST_BY_NONE && t->best_step >= 0;
    if (use_best) load_best(t);
    eval_result_t r = use_best || split != last_validation->split ? trainer_evaluate(t, split)
                                                                  : *last_validation;
    report_eval(t, &r, "final", use_best ? "best" : "last");
    return r;
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
