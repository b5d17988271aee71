/* eval: see eval.h. */
#include "eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "best.h"
#include "die.h"
#include "eval_score.h"

#define TOPK 5

void eval_init(eval_t *e, const train_parts_t *p, feed_t *feed, run_log_t *log) {
    memset(e, 0, sizeof *e);
    e->p = p;
    e->feed = feed;
    e->log = log;
    size_t batch = (size_t)p->conf->batch_size;
    e->indices = die_calloc(batch, sizeof(int64_t), "the evaluation's batch indices");
    e->next_indices = die_calloc(batch, sizeof(int64_t), "the evaluation's batch indices");
    e->host_logits =
        die_calloc(batch * (size_t)p->data->train.classes, sizeof(float), "the logits");
    e->split = p->data->val.n ? SPLIT_VAL : SPLIT_TEST;
}

void eval_free(eval_t *e) {
    free(e->indices);
    free(e->next_indices);
    free(e->host_logits);
    memset(e, 0, sizeof *e);
}

eval_result_t eval_run(eval_t *e, data_split_t split) {
    const train_parts_t *p = e->p;
    comm_t *comm = p->comm;
    model_t *m = p->model;
    backend_t *b = p->backend;
    /* the running statistics are rank 0's, as DDP's buffer broadcast makes them */
    train_state_bcast(comm, m, p->optim, TRAIN_STATE_BUFFERS, 0, "rank 0's");
    const dataset_t *d = data_split(p->data, split);
    int batch = (int)p->conf->batch_size, k = m->classes;
    /* the training criterion, as torchvision's evaluate: cross-entropy with label smoothing */
    double eps = p->conf->label_smoothing;
    double sums[4] = {0}; /* loss, top1, top5, samples */
    /* each evaluation numbers its batches afresh above the last one's, for the loader */
    uint64_t id = e->batches;
    for (int64_t pos = p->rank; pos < d->n; id++) {
        int n = 0;
        for (; n < batch && pos < d->n; pos += p->world)
            e->indices[n++] = pos;
        int next_n = 0;
        for (int64_t q = pos; next_n < batch && q < d->n; q += p->world)
            e->next_indices[next_n++] = q;
        feed_batch(e->feed, m, split, 0, id, e->indices, n, e->next_indices, next_n);
        model_forward(m, n, false);
        run_log_beat();
        b->mem->to_host(b, e->host_logits, model_logits(m), (size_t)n * k * sizeof(float));
        for (int i = 0; i < n; i++) {
            const float *z = e->host_logits + (size_t)i * k;
            int label = e->feed->host_labels[i];
            sums[0] += eval_score_loss(z, k, label, eps);
            int above = eval_score_rank(z, k, label);
            sums[1] += above == 0;
            sums[2] += above < TOPK;
        }
        sums[3] += n;
    }
    e->batches = id + 1; /* past the last one prefetched */
    die_comm(comm, comm->ops->allreduce_sum_f64(comm, sums, 4), "reducing the evaluation");
    double n = sums[3] > 0 ? sums[3] : 1;
    return (eval_result_t){.loss = sums[0] / n,
                           .top1 = sums[1] / n,
                           .top5 = sums[2] / n,
                           .n = (int64_t)sums[3],
                           .split = split};
}

/* Rank 0's "eval" (a validation during training: weights NULL) or "final" event (weights: "best"
 * or "last"), in the metrics and on stdout. */
static void report_eval(eval_t *e, const train_state_t *s, const eval_result_t *r,
                        const char *event, const char *weights, int64_t skipped_images) {
    if (e->p->rank != 0) return;
    cJSON *o = json_line_new(event);
    json_line_str(o, "split", data_split_name(r->split));
    run_log_eval_fields(o, "", r);
    json_line_int(o, "step", s->step);
    json_line_int(o, "epoch", s->epoch + 1);
    json_line_int(o, "samples", r->n);
    if (weights) {
        json_line_str(o, "weights", weights);
        if (skipped_images) json_line_int(o, "skipped_images", skipped_images);
        bool is_best = strcmp(weights, "best") == 0;
        if (is_best) {
            json_line_int(o, "best_step", s->best_step);
            json_line_num(o, "best_value", s->best_value);
            /* weights chosen on the split they are then reported on look better than they are */
            json_line_str(o, "chosen_on", data_split_name(e->split));
            json_line_bool(o, "split_chose_weights", r->split == e->split);
        }
        char *line = json_line_text(o); /* the same line on stdout as in the metrics file */
        run_log_end_line();
        if (line) printf("%s\n", line);
        cJSON_free(line);
        if (is_best && r->split == e->split)
            printf(
                "ddpworker: note: the final evaluation is on %s, the split that also chose these "
                "weights (train.best_by), so it flatters them; a test split of its own (an image "
                "folder's test/, or the dataset's test set with data.val_split) measures them "
                "fairly\n",
                data_split_name(r->split));
    } else {
        run_log_end_line();
        printf("eval  step %lld  %s loss %.4f  top1 %.2f%%  top5 %.2f%%\n", (long long)s->step,
               data_split_name(r->split), r->loss, 100 * r->top1, 100 * r->top5);
    }
    fflush(stdout);
    run_log_write(e->log, o);
}

eval_result_t eval_validate(eval_t *e, train_state_t *s) {
    const train_conf_t *c = e->p->conf;
    eval_result_t r = eval_run(e, e->split);
    report_eval(e, s, &r, "eval", NULL, 0);
    if (c->best_by == BEST_BY_NONE || !best_is_better(c, s, &r)) return r;
    /* every rank holds the same reduced result, so every rank agrees; rank 0 keeps the weights */
    s->best_value = c->best_by == BEST_BY_VAL_LOSS ? r.loss : r.top1;
    s->best_step = s->step;
    if (e->p->rank != 0) return r;
    best_write(c, e->p->model, s);
    cJSON *o = json_line_new("best");
    json_line_str(o, "by", best_by_name(c->best_by));
    json_line_num(o, "value", s->best_value);
    json_line_int(o, "step", s->step);
    json_line_str(o, "file", c->best_file);
    run_log_write(e->log, o);
    return r;
}

static bool uses_best(const eval_t *e, const train_state_t *s) {
    return e->p->conf->best_by != BEST_BY_NONE && s->best_step >= 0;
}

eval_result_t eval_final(eval_t *e, const train_state_t *s, const eval_result_t *last_validation) {
    data_split_t split = e->p->data->test.n ? SPLIT_TEST : e->split;
    bool use_best = uses_best(e, s);
    if (use_best) best_load(e->p, s->best_step);
    return use_best || split != last_validation->split ? eval_run(e, split) : *last_validation;
}

void eval_report_final(eval_t *e, const train_state_t *s, const eval_result_t *r,
                       int64_t skipped_images) {
    report_eval(e, s, r, "final", uses_best(e, s) ? "best" : "last", skipped_images);
}
