/* trainer: see trainer.h. The loop is llm.c-style: everything allocated in trainer_prepare and
 * trainer_start, a step is assemble batch -> forward -> loss -> backward (buckets all-reduced as
 * they complete) -> the optimizer (optim.name). */
#include "trainer.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include "clock.h"
#include "die.h"
#include "train_state.h"
#include "exit_codes.h"
#include "json_lines.h"
#include "weights.h"

#define BUCKET_BYTES (4u << 20)
#define TOPK         5

static int progress_fd = -1; /* DDPRUN_PROGRESS_FILE: the agent's hang detector reads it */
/* atomic: the snapshot writer's thread beats too, while it writes */
static _Atomic uint64_t progress_beats;
static atomic_bool is_progress_broken;

/* One more unit of progress (a training step, an evaluation batch) for ddprun --hang-timeout. */
static void progress_beat(void) {
    if (progress_fd < 0 || atomic_load(&is_progress_broken)) return;
    uint64_t beats = atomic_fetch_add(&progress_beats, 1) + 1;
    /* the agent's run directory went away: stop reporting (the fd stays open for the other
     * thread, which may be in pwrite) */
    if (pwrite(progress_fd, &beats, sizeof beats, 0) < 0) atomic_store(&is_progress_broken, true);
}

void trainer__progress_beat(void) {
    progress_beat();
}

static int is_tty = -1;   /* stdout is a terminal (-1: not asked yet) */
static bool is_line_open; /* a progress line waits for its newline (terminals only) */

void trainer__end_progress_line(void) {
    if (!is_line_open) return;
    putchar('\n');
    is_line_open = false;
}

/* A resumed run appends: its metrics continue the interrupted run's. */
static void open_metrics(trainer_t *t, bool is_resumed) {
    if (t->rank != 0 || !t->conf->metrics_file[0]) return;
    t->metrics = fopen(t->conf->metrics_file, is_resumed ? "a" : "w");
    if (!t->metrics)
        die(DDP_EXIT_CONFIG, "train.metrics_file: cannot open %s: %s", t->conf->metrics_file,
            strerror(errno));
}

static void init_loss_scale(trainer_t *t) {
    const train_conf_t *c = t->conf;
    if (c->loss_scaling == LOSS_SCALING_OFF ||
        (c->loss_scaling == LOSS_SCALING_AUTO && c->precision != PRECISION_FP16))
        return;
    t->loss_scale = t->backend->mem->alloc(t->backend, sizeof *t->loss_scale);
    if (!t->loss_scale) die(DDP_EXIT_BUG, "out of memory for the loss scale");
    loss_scale_t start = {.scale = (float)c->loss_scale_init};
    t->backend->mem->to_device(t->backend, t->loss_scale, &start, sizeof start);
}

loss_scale_t trainer__loss_scale(trainer_t *t) {
    loss_scale_t s = {0};
    if (t->loss_scale) t->backend->mem->to_host(t->backend, &s, t->loss_scale, sizeof s);
    return s;
}

void trainer_prepare(trainer_t *t, const train_conf_t *conf, const data_splits_t *data,
                     backend_t *backend) {
    memset(t, 0, sizeof *t);
    t->conf = conf;
    t->data = data;
    t->backend = backend;
    const dataset_t *tr = &data->train;
    if (conf->model_classes && conf->model_classes != tr->classes)
        die(DDP_EXIT_CONFIG, "model.classes = %lld, but the dataset has %d classes",
            (long long)conf->model_classes, tr->classes);
    if (conf->best_by != BEST_BY_NONE && !conf->best_file[0])
        die(DDP_EXIT_CONFIG, "train.best_by: set train.best_file, where the best weights go");
    t->eval_split = data->val.n ? SPLIT_VAL : SPLIT_TEST;
    t->best_value = NAN;
    t->best_step = -1;
    char err[512];
    model_opts_t mo = {.name = conf->model,
                       .width = (int)conf->width,
                       .stem = (model_stem_t)conf->model_stem,
                       .fc_width = (int)conf->fc_width,
                       .dropout = (float)conf->dropout,
                       .is_zero_init_residual = conf->is_zero_init_residual};
    if (model_init_opts(&t->model, backend, &mo, tr->h, tr->w, tr->c, tr->classes,
                        (int)conf->batch_size, err, sizeof err) < 0)
        die(DDP_EXIT_CONFIG, "model.name: %s", err);
    if (optimizer_init(&t->optim, conf, backend, t->model.n_params) < 0)
        die(DDP_EXIT_BUG, "out of memory for %s's state (%zu parameters)",
            optimizer_name(conf->optimizer), t->model.n_params);
    t->indices = die_calloc((size_t)conf->batch_size, sizeof(int64_t), "the batch indices");
    t->next_indices = die_calloc((size_t)conf->batch_size, sizeof(int64_t), "the batch indices");
    feed_init(&t->feed, conf, data, &t->model, backend);
    t->host_logits =
        die_calloc((size_t)conf->batch_size * tr->classes, sizeof(float), "the logits");
    init_loss_scale(t);
}

void trainer_warm_up(trainer_t *t) {
    model_t *m = &t->model;
    int n = (int)t->conf->batch_size;
    model_set_step(m, (uint64_t)t->conf->seed, 0, 0);
    model_forward(m, n, true);
    model_loss(m, n, 0.0f, 1.0f, NULL);
    model_backward(m, n, NULL, NULL);
    model_take_loss(m); /* waits for the device, and leaves no loss behind */
}

void trainer_start(trainer_t *t, comm_t *comm) {
    const train_conf_t *conf = t->conf;
    const dataset_t *tr = &t->data->train;
    char err[512];
    t->comm = comm;
    t->rank = comm->rank;
    t->world = comm->world;
    die_set_rank(t->rank);
    const char *progress = getenv("DDPRUN_PROGRESS_FILE");
    if (progress && *progress) progress_fd = open(progress, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (sampler_init(&t->sampler, tr->n, t->world, t->rank, (uint64_t)conf->seed, true) < 0)
        die(DDP_EXIT_DATA, "the training set is empty");
    int64_t per_rank = sampler_rank_count(&t->sampler, 0);
    t->steps_per_epoch = (per_rank + conf->batch_size - 1) / conf->batch_size;
    int64_t by_epochs = conf->epochs * t->steps_per_epoch;
    bool has_max_steps = conf->max_steps >= 0;
    if (conf->epochs == 0 && !has_max_steps && conf->hours == 0)
        die(DDP_EXIT_CONFIG, "train.epochs and train.hours are 0 and train.max_steps is "
                             "unlimited: nothing says when to stop");
    if (conf->epochs == 0 && !has_max_steps &&
        (conf->schedule == SCHEDULE_COSINE || conf->schedule == SCHEDULE_ONE_CYCLE))
        die(DDP_EXIT_CONFIG, "optim.schedule: a cosine or one-cycle schedule needs the run's "
                             "length: set train.epochs or train.max_steps besides train.hours");
    t->total_steps =
        has_max_steps && (!by_epochs || conf->max_steps < by_epochs) ? conf->max_steps : by_epochs;
    lr_schedule_init(&t->lr, conf, t->world, t->steps_per_epoch, t->total_steps);

    if (t->world > 1) {
        int rc = grad_sync_init(&t->sync, comm, t->model.grads, t->model.n_params, BUCKET_BYTES);
        if (rc < 0) die(DDP_EXIT_BUG, "cannot start the gradient thread: %s", strerror(-rc));
        t->has_sync = true;
    }
    trainer__snapshot_init(t);
    bool is_resumed = trainer__resume(t);
    trainer__memory_init(t);
    if (t->is_already_finished) return; /* trainer_run does nothing: the metrics stay as they are */
    if (!is_resumed) {
        /* DDP's construction: every rank starts from rank 0's parameters and buffers, so only
         * rank 0 draws them (a resumed run has the snapshot's) */
        if (t->rank == 0 && model_init_params(&t->model, (uint64_t)conf->seed) < 0)
            die(DDP_EXIT_BUG, "out of memory for the initial parameters");
        weights_skip_t skip = {.is_skip_head = conf->is_init_skip_mismatched,
                               .skip = conf->model_init_skip};
        if (t->rank == 0 && conf->model_init[0] &&
            weights_load_init(&t->model, conf->model_init, &skip, stderr, err, sizeof err) < 0)
            die(DDP_EXIT_CONFIG, "model.init: %s", err);
        train_state_bcast(comm, &t->model, &t->optim, TRAIN_STATE_PARAMS | TRAIN_STATE_BUFFERS, 0,
                          "the initial");
    }
    open_metrics(t, is_resumed);
    if (t->rank == 0 && conf->tensorboard_dir[0] &&
        tb_events_open(conf->tensorboard_dir, t->step, conf->source_path, conf->overrides, &t->tb,
                       err, sizeof err) < 0)
        die(DDP_EXIT_CONFIG, "%s", err);
    t->status = status_report_open(t->rank);
    trainer__report_resume(t);
}

void trainer_free(trainer_t *t) {
    trainer__memory_free(t);
    trainer__snapshot_free(t);
    if (t->has_sync) grad_sync_free(&t->sync);
    if (t->loss_scale) t->backend->mem->release(t->backend, t->loss_scale);
    optimizer_free(&t->optim);
    model_free(&t->model);
    sampler_free(&t->sampler);
    feed_free(&t->feed);
    free(t->indices);
    free(t->host_logits);
    free(t->next_indices);
    if (t->metrics) fclose(t->metrics);
    tb_events_close(t->tb);
    status_report_close(t->status);
    memset(t, 0, sizeof *t);
}

/* The indices of this rank's next batch of the epoch from cursor; returns its size (0: the epoch
 * is over). */
static int batch_at(const trainer_t *t, int64_t cursor, int64_t *indices) {
    int64_t left = sampler_rank_count(&t->sampler, cursor);
    int n = (int)(left < t->conf->batch_size ? left : t->conf->batch_size);
    for (int i = 0; i < n; i++)
        indices[i] = sampler_index(&t->sampler, cursor, i);
    return n;
}

int trainer_step(trainer_t *t) {
    const train_conf_t *c = t->conf;
    int n = batch_at(t, t->cursor, t->indices);
    /* the batch after it: an image folder decodes it while this one trains */
    int next_n = batch_at(t, t->cursor + (int64_t)n * t->world, t->next_indices);
    feed_batch(&t->feed, &t->model, SPLIT_TRAIN, t->epoch, (uint64_t)t->step, t->indices, n,
               t->next_indices, next_n);

    model_t *m = &t->model;
    model_set_step(m, (uint64_t)c->seed, t->step, t->rank);
    model_forward(m, n, true);
    const backend_i *o = t->backend->ops;
    model_loss(m, n, (float)c->label_smoothing, 1.0f, t->loss_scale);
    if (t->has_sync) {
        grad_sync_begin(&t->sync);
        model_backward(m, n, grad_sync_ready, &t->sync);
        die_comm(t->comm, grad_sync_finish(&t->sync), "the gradient all-reduce");
    } else {
        model_backward(m, n, NULL, NULL);
    }
    trainer__memory_fence(t); /* the last memory snapshot's copies, before the state changes */
    /* the summed gradients: every rank finds the same inf or NaN */
    if (t->loss_scale) o->loss_scale_check(t->backend, m->grads, m->n_params, t->loss_scale);
    /* DDP averages: the all-reduce summed, the optimizer divides by the world size */
    optimizer_step(&t->optim, m->params, m->grads, m->momentum, lr_at(&t->lr, t->step),
                   1.0f / (float)t->world, t->loss_scale);
    if (t->loss_scale)
        o->loss_scale_update(t->backend, t->loss_scale, (uint32_t)c->loss_scale_growth_interval);
    t->step++;
    progress_beat();
    t->cursor +=
        (int64_t)n * t->world; /* every rank took n: the same count, by the sampler's padding */
    return n;
}

static void count_hits(const float *logits, int classes, int label, double *top1, double *top5) {
    int above = 0; /* classes scoring higher than the label (ties count for the label) */
    for (int j = 0; j < classes; j++) {
        if (isnan(logits[j])) return; /* NaN compares false: it would look like a hit */
        if (logits[j] > logits[label]) above++;
    }
    if (above == 0) *top1 += 1;
    if (above < TOPK) *top5 += 1;
}

eval_result_t trainer_evaluate(trainer_t *t, data_split_t split) {
    comm_t *comm = t->comm;
    model_t *m = &t->model;
    /* the running statistics are rank 0's, as DDP's buffer broadcast makes them */
    train_state_bcast(comm, m, &t->optim, TRAIN_STATE_BUFFERS, 0, "rank 0's");
    const dataset_t *d = data_split(t->data, split);
    int batch = (int)t->conf->batch_size, k = m->classes;
    double sums[4] = {0}; /* loss, top1, top5, samples */
    int64_t *indices = t->indices;
    /* each evaluation numbers its batches afresh above the last one's, for the loader */
    uint64_t id = t->eval_batches;
    for (int64_t pos = t->rank; pos < d->n; id++) {
        int n = 0;
        for (; n < batch && pos < d->n; pos += t->world)
            indices[n++] = pos;
        int next_n = 0;
        for (int64_t q = pos; next_n < batch && q < d->n; q += t->world)
            t->next_indices[next_n++] = q;
        feed_batch(&t->feed, m, split, 0, id, indices, n, t->next_indices, next_n);
        model_forward(m, n, false);
        progress_beat();
        t->backend->mem->to_host(t->backend, t->host_logits, model_logits(m),
                                 (size_t)n * k * sizeof(float));
        for (int i = 0; i < n; i++) {
            const float *z = t->host_logits + (size_t)i * k;
            int label = t->feed.host_labels[i];
            double zmax = z[0], sum_exp = 0;
            for (int j = 1; j < k; j++)
                zmax = z[j] > zmax ? z[j] : zmax;
            for (int j = 0; j < k; j++)
                sum_exp += exp(z[j] - zmax);
            sums[0] += log(sum_exp) + zmax - z[label];
            count_hits(z, k, label, &sums[1], &sums[2]);
        }
        sums[3] += n;
    }
    t->eval_batches = id + 1; /* past the last one prefetched */
    die_comm(t->comm, comm->ops->allreduce_sum_f64(comm, sums, 4), "reducing the evaluation");
    double n = sums[3] > 0 ? sums[3] : 1;
    return (eval_result_t){.loss = sums[0] / n,
                           .top1 = sums[1] / n,
                           .top5 = sums[2] / n,
                           .n = (int64_t)sums[3],
                           .split = split};
}

static void format_duration(double s, char *buf, size_t len) {
    long total = s > 0 && s < 1e9 ? (long)(s + 0.5) : 0;
    if (total >= 3600)
        snprintf(buf, len, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
    else
        snprintf(buf, len, "%ld:%02ld", total / 60, total % 60);
}

double trainer__elapsed_s(const trainer_t *t) {
    return t->elapsed_before_s + (t->start_s > 0 ? clock_now_s() - t->start_s : 0);
}

/* Every rank must stop at the same step: rank 0's clock decides, shared by a broadcast. The budget
 * counts the whole run's wall time, restarts included (the elapsed time is in snapshots). At the
 * start only: after each step trainer__agree_step asks it with the stop signals. */
static bool is_out_of_time(trainer_t *t) {
    if (t->conf->hours <= 0) return false;
    uint8_t is_over = trainer__elapsed_s(t) > t->conf->hours * 3600.0;
    die_comm(t->comm, t->comm->ops->broadcast(t->comm, &is_over, 1, 0),
             "agreeing on the time budget");
    return is_over;
}

static bool is_epoch_over(trainer_t *t) {
    return sampler_rank_count(&t->sampler, t->cursor) == 0;
}

/* Whether the run has nothing left: max_steps reached, or the last epoch's samples all used. */
static bool is_run_over(trainer_t *t) {
    const train_conf_t *c = t->conf;
    return (c->max_steps >= 0 && t->step >= c->max_steps) ||
           (c->epochs &&
            (t->epoch >= c->epochs || (t->epoch + 1 == c->epochs && is_epoch_over(t))));
}

/* The age of the last snapshot that actually landed, and the failure while writes fail. */
static void describe_snapshots(trainer_t *t, char *out, size_t len) {
    uint64_t step;
    char failure[1024];
    double landed_s = snapshot_writer_landed(t->snapshots, &step, failure, sizeof failure);
    char landed[64] = "none yet";
    if (landed_s > 0)
        snprintf(landed, sizeof landed, "%.0fs ago (step %llu)", clock_now_s() - landed_s,
                 (unsigned long long)step);
    /* the system's reason ends the message ("cannot write PATH: No space left on device") */
    const char *reason = strrchr(failure, ':');
    reason = reason ? reason + 1 + (reason[1] == ' ') : failure;
    if (failure[0])
        snprintf(out, len, "  snapshot FAILING: %.80s; last landed %s", reason, landed);
    else if (landed_s > 0)
        snprintf(out, len, "  snapshot %s", landed);
}

/* Without loss scaling nothing skips a bad step: a training loss that is NaN or inf on any rank
 * ends the run on every rank, before it reports or snapshots garbage (a snapshot of NaN weights
 * would be what a rerun with a lower lr resumes from). loss: this rank's, summed or averaged over
 * the steps since the last log, so one bad step anywhere in them shows. A collective: every rank
 * calls it at the same step. */
static void check_diverged(trainer_t *t, double loss) {
    if (t->loss_scale) return;
    double is_bad = !isfinite(loss);
    die_comm(t->comm, t->comm->ops->allreduce_sum_f64(t->comm, &is_bad, 1), "agreeing on the loss");
    if (is_bad > 0)
        die(DDP_EXIT_DIVERGED,
            "the training loss is %s by step %lld (on %.0f of %d "
            "ranks): the run diverged; lower optim.lr, or use precision.loss_scaling",
            isnan(loss)      ? "NaN"
            : isfinite(loss) ? "NaN or inf on another rank"
                             : "inf",
            (long long)t->step, is_bad, t->world);
}

/* check_diverged before a snapshot between log steps: the loss so far in the window, read back
 * without taking it (one float, at a snapshot, which reads the arenas back anyway). */
static void check_diverged_now(trainer_t *t) {
    if (t->loss_scale) return;
    float loss_sum = 0.0f;
    t->backend->mem->to_host(t->backend, &loss_sum, t->model.loss_sum, sizeof loss_sum);
    check_diverged(t, loss_sum);
}

static void log_window(trainer_t *t, int64_t samples, int64_t steps, double seconds) {
    double loss = model_take_loss(&t->model) / (double)samples;
    double rate = seconds > 0 ? (double)samples * t->world / seconds : 0;
    double steps_left = t->total_steps > t->step ? (double)(t->total_steps - t->step) : 0;
    check_diverged(t, loss);
    char eta[32], snap[256] = "", scaling[64] = "";
    double eta_s = t->total_steps ? steps_left * seconds / (double)steps : INFINITY;
    if (t->conf->hours > 0) { /* whichever ends the run first */
        double budget_left_s = t->conf->hours * 3600 - trainer__elapsed_s(t);
        eta_s = fmin(eta_s, budget_left_s > 0 ? budget_left_s : 0);
    }
    format_duration(isfinite(eta_s) ? eta_s : 0, eta, sizeof eta);
    if (t->snapshots) describe_snapshots(t, snap, sizeof snap);
    status_report_publish(t->status, t->step, t->epoch + 1, loss, rate,
                          t->last_snapshot_step > 0 ? t->last_snapshot_step : -1);
    if (t->rank != 0) return;
    loss_scale_t ls = {0};
    if (t->loss_scale) {
        ls = trainer__loss_scale(t);
        snprintf(scaling, sizeof scaling, "  scale %g (%u skipped)", (double)ls.scale,
                 ls.skipped_steps);
    }
    double lr = lr_at(&t->lr, t->step - 1);
    /* "step 10/0" says nothing: a run without a step count shows none, and a time budget shows
     * the whole run's hours against it */
    char where[96], total[32] = "", hours[48] = "";
    if (t->total_steps) snprintf(total, sizeof total, "/%lld", (long long)t->total_steps);
    if (t->conf->hours > 0)
        snprintf(hours, sizeof hours, "  hours %.2f/%.2f", trainer__elapsed_s(t) / 3600,
                 t->conf->hours);
    snprintf(where, sizeof where, "step %lld%s%s", (long long)t->step, total, hours);
    /* on a terminal, one line that updates; piped (ddprun, a file), a line per log interval */
    if (is_tty < 0) is_tty = isatty(STDOUT_FILENO);
    printf("%sepoch %lld  %s  loss %.4f  lr %.5f  %.0f img/s  ETA %s%s%s%s",
           is_tty ? "\r\033[K" : "", (long long)t->epoch + 1, where, loss, lr, rate, eta, scaling,
           snap, is_tty ? "" : "\n");
    is_line_open = is_tty;
    fflush(stdout);
    if (t->metrics || t->tb) {
        cJSON *o = json_line_new("train");
        json_line_int(o, "step", t->step);
        json_line_int(o, "epoch", t->epoch + 1);
        json_line_num(o, "loss", loss);
        json_line_num(o, "lr", lr);
        json_line_num(o, "img_per_s", rate);
        if (t->loss_scale) {
            json_line_num(o, "loss_scale", ls.scale);
            json_line_int(o, "skipped_steps", ls.skipped_steps);
        }
        trainer__write_metrics(t, o);
    }
}

/* Rank 0's closing lines: how long, how fast, how far, the best validation, restarts, snapshots. */
static void report_summary(trainer_t *t, double this_attempt_s) {
    if (t->rank != 0) return;
    double total_s = trainer__elapsed_s(t),
           rate = this_attempt_s > 0 ? t->samples_trained * t->world / this_attempt_s : 0;
    char total[32], attempt[32], best[128] = "";
    format_duration(total_s, total, sizeof total);
    format_duration(this_attempt_s, attempt, sizeof attempt);
    const char *restarts = getenv("TORCHELASTIC_RESTART_COUNT");
    long n_restarts = restarts ? strtol(restarts, NULL, 10) : 0;
    if (t->best_step >= 0 && t->conf->best_by != BEST_BY_NONE)
        snprintf(best, sizeof best, "; best %s %.4f at step %lld",
                 t->conf->best_by == BEST_BY_VAL_LOSS ? "val_loss" : "val_top1", t->best_value,
                 (long long)t->best_step);
    trainer__end_progress_line();
    printf(
        "ddpworker: done: %lld steps, %lld epochs, %s of training (%s in this attempt, %.0f img/s)"
        "%s; %ld restart%s; %lld snapshot%s written in this attempt\n",
        (long long)t->step, (long long)t->epoch + 1, total, attempt, rate, best, n_restarts,
        n_restarts == 1 ? "" : "s", (long long)t->n_snapshots, t->n_snapshots == 1 ? "" : "s");
    fflush(stdout);
}

eval_result_t trainer_run(trainer_t *t) {
    const train_conf_t *c = t->conf;
    if (t->is_already_finished) return (eval_result_t){.loss = NAN, .top1 = NAN, .top5 = NAN};
    t->start_s = clock_now_s();
    double window_s = t->start_s, epoch_s = t->start_s;
    int64_t window_samples = 0, window_steps = 0, epoch_samples = 0;
    eval_result_t last = {0};
    int64_t last_eval_step = -1;
    bool is_done = is_run_over(t);
    if (t->rank == 0) {
        printf("ddpworker: %s (%zu parameters) on %s, world %d, %lld samples, %lld steps/epoch, "
               "batch %lld per rank, lr %g%s%s\n",
               t->model.name, t->model.n_params, t->backend->mem->name, t->world,
               (long long)t->data->train.n, (long long)t->steps_per_epoch, (long long)c->batch_size,
               t->lr.base_lr, t->step ? ", resumed" : "", t->was_spare ? ", warm spare" : "");
        fflush(stdout);
        /* what this start trains with: lr after optim.lr_scaling, the splits' sizes */
        cJSON *o = json_line_new("start");
        json_line_int(o, "step", t->step);
        json_line_int(o, "pid", getpid());
        json_line_int(o, "world", t->world);
        json_line_int(o, "global_batch", c->batch_size * t->world);
        json_line_int(o, "steps_per_epoch", t->steps_per_epoch);
        json_line_num(o, "lr", t->lr.base_lr);
        for (int s = 0; s < SPLIT_COUNT; s++) {
            char key[24];
            snprintf(key, sizeof key, "%s_samples", data_split_name((data_split_t)s));
            json_line_int(o, key, data_split(t->data, (data_split_t)s)->n);
        }
        json_line_bool(o, "resumed", t->step > 0);
        if (t->was_spare) json_line_bool(o, "warm_spare", true);
        json_line_int(o, "epoch", t->epoch + 1);
        const char *restarts = getenv("TORCHELASTIC_RESTART_COUNT"); /* `ddprun plot` marks these */
        if (restarts) json_line_int(o, "restart_count", strtoll(restarts, NULL, 10));
        trainer__write_metrics(t, o);
    }
    sampler_set_epoch(&t->sampler, t->epoch);
    if (!is_done && is_out_of_time(t)) is_done = true; /* resumed with the budget spent */
    while (!is_done) {
        if (is_epoch_over(t)) {
            t->epoch++;
            t->cursor = 0;
            sampler_set_epoch(&t->sampler, t->epoch);
            epoch_s = clock_now_s();
            epoch_samples = 0;
        }
        int n = trainer_step(t);
        t->samples_trained += n;
        window_samples += n;
        epoch_samples += n;
        window_steps++;
        bool is_out_of_time_now;
        int signum =
            trainer__agree_step(t, &is_out_of_time_now); /* acted on after the evaluation */
        is_done = is_run_over(t) || is_out_of_time_now;
        if (t->step % c->log_interval == 0 || is_done) {
            log_window(t, window_samples, window_steps, clock_now_s() - window_s);
            window_s = clock_now_s();
            window_samples = window_steps = 0;
        }
        bool is_epoch_end = is_epoch_over(t);
        bool is_eval_due = c->eval_interval ? t->step % c->eval_interval == 0 : is_epoch_end;
        if (is_eval_due || is_done) {
            last = trainer__validate(t);
            last_eval_step = t->step;
        }
        if (is_epoch_end)
            trainer__report_epoch(t, clock_now_s() - epoch_s, epoch_samples,
                                  last_eval_step == t->step ? &last : NULL);
        bool is_log_step = t->step % c->log_interval == 0 || is_done; /* the loss was checked */
        if (signum) {
            if (!is_log_step) check_diverged_now(t);
            trainer__snapshot(t, true);
            trainer__end_progress_line();
            if (t->rank == 0)
                printf("ddpworker: signal %d: snapshot at step %lld taken, exiting\n", signum,
                       (long long)t->step);
            fflush(stdout);
            exit(128 + signum);
        }
        if (c->snapshot_every && t->step % c->snapshot_every == 0 && !is_done) {
            if (!is_log_step) check_diverged_now(t);
            trainer__snapshot(t, false);
        }
        if (!is_done) trainer__memory_snapshot(t);
    }
    /* max_steps 0, or a run resumed at its end: the weights as they are */
    if (last_eval_step != t->step) last = trainer__validate(t);
    if (!isfinite(last.loss))
        die(DDP_EXIT_DIVERGED,
            "the validation loss is %s at step %lld: the weights "
            "diverged",
            isnan(last.loss) ? "NaN" : "inf", (long long)t->step);
    /* the weights first: a final snapshot that fails (a full disk) must not take them along */
    if (t->rank == 0 && c->params_file[0]) {
        trainer__write_weights(t, c->params_file, "train.params_file", NULL);
        t->has_written_params = true;
    }
    /* the run's last snapshot says it finished, so the same command does not train it again. Its
     * state is taken now (the final evaluation may load the best weights into the model) but it
     * lands only once the final evaluation is done: a crash during that evaluation resumes the
     * snapshot before, and the final result is not lost to a run that says it finished */
    t->is_finished = true;
    double stall = trainer__snapshot_take(t); /* rank 0 with snapshot.dir */
    if (feed_is_files(
            &t->feed)) { /* the files data.on_bad_image = skip went without, on every rank */
        double skipped = (double)feed_skipped(&t->feed);
        die_comm(t->comm, t->comm->ops->allreduce_sum_f64(t->comm, &skipped, 1),
                 "counting the skipped images");
        t->skipped_images = (int64_t)skipped;
        trainer__end_progress_line();
        if (t->rank == 0 && skipped > 0)
            printf("ddpworker: %lld image files could not be decoded and were replaced by the next "
                   "that could (data.on_bad_image = skip)\n",
                   (long long)t->skipped_images);
    }
    eval_result_t final = trainer__final(t, &last);
    trainer__snapshot_commit(t, true, stall);
    trainer__report_memory(t);
    trainer__report_final(t, &final);
    report_summary(t, clock_now_s() - t->start_s);
    if (!isfinite(final.loss))
        die(DDP_EXIT_DIVERGED, "the final evaluation's loss is %s: the weights diverged",
            isnan(final.loss) ? "NaN" : "inf");
    return final;
}
