/* trainer: see trainer.h. The loop is llm.c-style: everything allocated in trainer_prepare and
 * trainer_start, a step is assemble batch -> forward -> loss -> backward (buckets all-reduced as
 * they complete) -> the optimizer (optim.name); trainer_run is the steps of a run, each part of a
 * step a call that takes the state and the parts it needs. */
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "best.h"
#include "clock.h"
#include "die.h"
#include "exit_codes.h"
#include "weights.h"

#define BUCKET_BYTES (4u << 20)

/* A resumed run appends: its metrics continue the interrupted run's. */
static void open_metrics(trainer_t *t, bool is_resumed) {
    const train_conf_t *c = t->p.conf;
    if (t->p.rank != 0 || !c->metrics_file[0]) return;
    t->log.metrics = fopen(c->metrics_file, is_resumed ? "a" : "w");
    if (!t->log.metrics)
        die(DDP_EXIT_CONFIG, "train.metrics_file: cannot open %s: %s", c->metrics_file,
            strerror(errno));
}

static void init_loss_scale(trainer_t *t) {
    const train_conf_t *c = t->p.conf;
    backend_t *b = t->p.backend;
    if (c->loss_scaling == LOSS_SCALING_OFF ||
        (c->loss_scaling == LOSS_SCALING_AUTO && c->precision != PRECISION_FP16))
        return;
    t->state.loss_scale = b->mem->alloc(b, sizeof *t->state.loss_scale);
    if (!t->state.loss_scale) die(DDP_EXIT_BUG, "out of memory for the loss scale");
    loss_scale_t start = {.scale = (float)c->loss_scale_init};
    b->mem->to_device(b, t->state.loss_scale, &start, sizeof start);
}

void trainer_prepare(trainer_t *t, const train_conf_t *conf, const data_splits_t *data,
                     backend_t *backend) {
    memset(t, 0, sizeof *t);
    t->p = (train_parts_t){
        .conf = conf, .data = data, .backend = backend, .model = &t->model, .optim = &t->optim};
    const dataset_t *tr = &data->train;
    if (conf->model_classes && conf->model_classes != tr->classes)
        die(DDP_EXIT_CONFIG, "model.classes = %lld, but the dataset has %d classes",
            (long long)conf->model_classes, tr->classes);
    if (conf->best_by != BEST_BY_NONE && !conf->best_file[0])
        die(DDP_EXIT_CONFIG, "train.best_by: set train.best_file, where the best weights go");
    t->state.best_value = NAN;
    t->state.best_step = -1;
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
    eval_init(&t->eval, &t->p, &t->feed, &t->log);
    init_loss_scale(t);
}

void trainer_warm_up(trainer_t *t) {
    model_t *m = &t->model;
    int n = (int)t->p.conf->batch_size;
    model_set_step(m, (uint64_t)t->p.conf->seed, 0, 0);
    model_forward(m, n, true);
    model_loss(m, n, 0.0f, 1.0f, NULL);
    model_backward(m, n, NULL, NULL);
    model_take_loss(m); /* waits for the device, and leaves no loss behind */
}

/* The sampler, the run's length and the learning-rate schedule for this world. */
static void plan_run(trainer_t *t) {
    const train_conf_t *conf = t->p.conf;
    const dataset_t *tr = &t->p.data->train;
    if (sampler_init(&t->sampler, tr->n, t->p.world, t->p.rank, (uint64_t)conf->seed, true) < 0)
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
    lr_schedule_init(&t->lr, conf, t->p.world, t->steps_per_epoch, t->total_steps);
}

/* DDP's construction: every rank starts from rank 0's parameters and buffers, so only rank 0
 * draws them (or loads model.init). */
static void init_params(trainer_t *t) {
    const train_conf_t *conf = t->p.conf;
    char err[512];
    if (t->p.rank == 0 && model_init_params(&t->model, (uint64_t)conf->seed) < 0)
        die(DDP_EXIT_BUG, "out of memory for the initial parameters");
    weights_skip_t skip = {.is_skip_head = conf->is_init_skip_mismatched,
                           .skip = conf->model_init_skip};
    if (t->p.rank == 0 && conf->model_init[0] &&
        weights_load_init(&t->model, conf->model_init, &skip, stderr, err, sizeof err) < 0)
        die(DDP_EXIT_CONFIG, "model.init: %s", err);
    train_state_bcast(t->p.comm, &t->model, &t->optim, TRAIN_STATE_PARAMS | TRAIN_STATE_BUFFERS, 0,
                      "the initial");
}

/* The schedule counts this world's steps. A run resumed at another world size took another
 * number of steps to reach the same samples: the schedule takes the step this world would be at
 * (the same epoch, as many samples into it), so that the warm-up, the decays and the cosine go on
 * from where the run is, not from where its step count says (a world of 4 resumed at 2 halfway
 * through jumped back up the cosine). At the world the run began with the offset is 0. A run
 * bounded by train.max_steps counts steps, whatever the world. */
static void align_schedule(trainer_t *t) {
    t->lr_step_offset = 0;
    if (t->total_steps != t->p.conf->epochs * t->steps_per_epoch) return;
    int64_t global_batch = (int64_t)t->p.conf->batch_size * t->p.world;
    int64_t into_epoch = (t->state.cursor + global_batch - 1) / global_batch;
    t->lr_step_offset = t->state.epoch * t->steps_per_epoch + into_epoch - t->state.step;
}

void trainer_start(trainer_t *t, comm_t *comm) {
    const train_conf_t *conf = t->p.conf;
    char err[512];
    t->p.comm = comm;
    t->p.rank = comm->rank;
    t->p.world = comm->world;
    die_set_rank(t->p.rank);
    run_log_open_beats();
    plan_run(t);
    if (t->p.world > 1) {
        int rc = grad_sync_init(&t->sync, comm, t->model.grads, t->model.n_params, BUCKET_BYTES);
        if (rc < 0) die(DDP_EXIT_BUG, "cannot start the gradient thread: %s", strerror(-rc));
        t->has_sync = true;
    }
    checkpoint_init(&t->ckpt, &t->p);
    bool is_resumed = checkpoint_resume(&t->ckpt, &t->p, &t->state);
    align_schedule(t);
    /* trainer_run does nothing: the metrics stay as they are */
    if (t->ckpt.is_already_finished) return;
    checkpoint_memory_init(&t->memory, &t->p);
    if (!is_resumed) init_params(t); /* a resumed run has the snapshot's */
    open_metrics(t, is_resumed);
    if (t->p.rank == 0 && conf->tensorboard_dir[0] &&
        tb_events_open(conf->tensorboard_dir, t->state.step, conf->source_path, conf->overrides,
                       &t->log.tb, err, sizeof err) < 0)
        die(DDP_EXIT_CONFIG, "%s", err);
    t->status = status_report_open(t->p.rank);
    if (t->p.rank == 0 && t->ckpt.resume_source)
        run_log_resume(&t->log, t->status, t->state.step, t->ckpt.resume_source,
                       t->ckpt.resume_rank, t->ckpt.steps_lost);
}

void trainer_free(trainer_t *t) {
    checkpoint_memory_free(&t->memory, &t->p);
    checkpoint_free(&t->ckpt);
    if (t->has_sync) grad_sync_free(&t->sync);
    if (t->state.loss_scale) t->p.backend->mem->release(t->p.backend, t->state.loss_scale);
    optimizer_free(&t->optim);
    model_free(&t->model);
    sampler_free(&t->sampler);
    feed_free(&t->feed);
    eval_free(&t->eval);
    free(t->indices);
    free(t->next_indices);
    if (t->log.metrics) fclose(t->log.metrics);
    tb_events_close(t->log.tb);
    status_report_close(t->status);
    memset(t, 0, sizeof *t);
}

/* The indices of this rank's next batch of the epoch from cursor; returns its size (0: the epoch
 * is over). */
static int batch_at(const trainer_t *t, int64_t cursor, int64_t *indices) {
    int64_t left = sampler_rank_count(&t->sampler, cursor);
    int n = (int)(left < t->p.conf->batch_size ? left : t->p.conf->batch_size);
    for (int i = 0; i < n; i++)
        indices[i] = sampler_index(&t->sampler, cursor, i);
    return n;
}

int trainer_step(trainer_t *t) {
    const train_conf_t *c = t->p.conf;
    train_state_t *s = &t->state;
    int world = t->p.world;
    int n = batch_at(t, s->cursor, t->indices);
    /* the batch after it: an image folder decodes it while this one trains */
    int next_n = batch_at(t, s->cursor + (int64_t)n * world, t->next_indices);
    feed_batch(&t->feed, &t->model, SPLIT_TRAIN, s->epoch, (uint64_t)s->step, t->indices, n,
               t->next_indices, next_n);

    model_t *m = &t->model;
    model_set_step(m, (uint64_t)c->seed, s->step, t->p.rank);
    model_forward(m, n, true);
    backend_t *b = t->p.backend;
    model_loss(m, n, (float)c->label_smoothing, 1.0f, s->loss_scale);
    if (t->has_sync) {
        grad_sync_begin(&t->sync);
        model_backward(m, n, grad_sync_ready, &t->sync);
        die_comm(t->p.comm, grad_sync_finish(&t->sync), "the gradient all-reduce");
    } else {
        model_backward(m, n, NULL, NULL);
    }
    /* the last memory snapshot's copies, before the state changes */
    checkpoint_memory_fence(&t->memory, &t->p);
    /* the summed gradients: every rank finds the same inf or NaN */
    if (s->loss_scale) b->ops->loss_scale_check(b, m->grads, m->n_params, s->loss_scale);
    /* DDP averages: the all-reduce summed, the optimizer divides by the world size */
    optimizer_step(&t->optim, m->params, m->grads, m->momentum,
                   lr_at(&t->lr, s->step + t->lr_step_offset), 1.0f / (float)world, s->loss_scale);
    if (s->loss_scale)
        b->ops->loss_scale_update(b, s->loss_scale, (uint32_t)c->loss_scale_growth_interval);
    s->step++;
    run_log_beat();
    s->cursor +=
        (int64_t)n * world; /* every rank took n: the same count, by the sampler's padding */
    return n;
}

/* Every rank must stop at the same step: rank 0's clock decides, shared by a broadcast. The budget
 * counts the whole run's wall time, restarts included (the elapsed time is in snapshots). At the
 * start only: after each step checkpoint_agree_step asks it with the stop signals. */
static bool is_out_of_time(trainer_t *t) {
    if (t->p.conf->hours <= 0) return false;
    uint8_t is_over = train_state_elapsed_s(&t->state) > t->p.conf->hours * 3600.0;
    die_comm(t->p.comm, t->p.comm->ops->broadcast(t->p.comm, &is_over, 1, 0),
             "agreeing on the time budget");
    return is_over;
}

static bool is_epoch_over(const trainer_t *t) {
    return sampler_rank_count(&t->sampler, t->state.cursor) == 0;
}

/* Whether the run has nothing left: max_steps reached, or the last epoch's samples all used. */
static bool is_run_over(const trainer_t *t) {
    const train_conf_t *c = t->p.conf;
    const train_state_t *s = &t->state;
    return (c->max_steps >= 0 && s->step >= c->max_steps) ||
           (c->epochs &&
            (s->epoch >= c->epochs || (s->epoch + 1 == c->epochs && is_epoch_over(t))));
}

/* The age of the last snapshot that actually landed, and the failure while writes fail. */
static void describe_snapshots(snapshot_writer_t *writer, char *out, size_t len) {
    uint64_t step;
    char failure[1024];
    double landed_s = snapshot_writer_landed(writer, &step, failure, sizeof failure);
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
    if (t->state.loss_scale) return;
    double is_bad = !isfinite(loss);
    die_comm(t->p.comm, t->p.comm->ops->allreduce_sum_f64(t->p.comm, &is_bad, 1),
             "agreeing on the loss");
    if (is_bad > 0)
        die(DDP_EXIT_DIVERGED,
            "the training loss is %s by step %lld (on %.0f of %d ranks): the run diverged; lower "
            "optim.lr, or use precision.loss_scaling",
            isnan(loss)      ? "NaN"
            : isfinite(loss) ? "NaN or inf on another rank"
                             : "inf",
            (long long)t->state.step, is_bad, t->p.world);
}

/* check_diverged before a snapshot between log steps: the loss so far in the window, read back
 * without taking it (one float, at a snapshot, which reads the arenas back anyway). */
static void check_diverged_now(trainer_t *t) {
    if (t->state.loss_scale) return;
    float loss_sum = 0.0f;
    t->p.backend->mem->to_host(t->p.backend, &loss_sum, t->model.loss_sum, sizeof loss_sum);
    check_diverged(t, loss_sum);
}

/* Samples and steps since a mark (a log interval's, an epoch's start). */
typedef struct {
    double start_s;
    int64_t samples, steps;
} window_t;

static void window_reset(window_t *w) {
    *w = (window_t){.start_s = clock_now_s()};
}

/* Seconds until the run ends, at the pace of the last window: by its steps, or train.hours'
 * budget, whichever ends it first (INFINITY: unknown). */
static double eta_s(const trainer_t *t, double seconds, int64_t steps) {
    int64_t step = t->state.step;
    double steps_left = t->total_steps > step ? (double)(t->total_steps - step) : 0;
    double eta = t->total_steps ? steps_left * seconds / (double)steps : INFINITY;
    if (t->p.conf->hours > 0) {
        double budget_left_s = t->p.conf->hours * 3600 - train_state_elapsed_s(&t->state);
        eta = fmin(eta, budget_left_s > 0 ? budget_left_s : 0);
    }
    return eta;
}

/* Rank 0's progress line and "train" event of the window. */
static void report_progress(trainer_t *t, double loss, double rate, double eta) {
    const train_state_t *s = &t->state;
    char snap[256] = "";
    if (t->ckpt.writer) describe_snapshots(t->ckpt.writer, snap, sizeof snap);
    run_log_progress_t p = {.step = s->step,
                            .epoch = s->epoch + 1,
                            .total_steps = t->total_steps,
                            .budget_h = t->p.conf->hours,
                            .loss = loss,
                            .lr = lr_at(&t->lr, s->step - 1 + t->lr_step_offset),
                            .img_per_s = rate,
                            .eta_s = eta,
                            .snapshot = snap};
    if (s->loss_scale) {
        loss_scale_t ls = train_state_loss_scale(s, t->p.backend);
        p.has_scale = true;
        p.scale = ls.scale;
        p.skipped_steps = ls.skipped_steps;
    }
    if (p.budget_h > 0) p.hours = train_state_elapsed_s(s) / 3600;
    run_log_progress(&t->log, &p);
}

/* The end of a log interval: the window's loss checked on every rank (it ends a diverged run), its
 * pace for `ddprun status`, and rank 0's progress line. */
static void log_window(trainer_t *t, const window_t *w) {
    /* the clock is read after the loss: its read-back waits for the window's last step, which a
     * GPU may still be running when the host has queued it (read before, a window of one step
     * measured only its launch: 0.09 ms for a ResNet-18 step on the H200) */
    double loss = model_take_loss(&t->model) / (double)w->samples;
    double seconds = clock_now_s() - w->start_s;
    double rate = seconds > 0 ? (double)w->samples * t->p.world / seconds : 0;
    check_diverged(t, loss);
    double eta = eta_s(t, seconds, w->steps);
    status_report_publish(t->status, t->state.step, t->state.epoch + 1, loss, rate,
                          t->ckpt.last_step > 0 ? t->ckpt.last_step : -1);
    if (t->p.rank == 0) report_progress(t, loss, rate, eta);
}

/* Rank 0: what this start trains with. */
static void report_start(trainer_t *t) {
    if (t->p.rank != 0) return;
    run_log_start_t v = {.model = t->model.name,
                         .backend = t->p.backend->mem->name,
                         .n_params = t->model.n_params,
                         .world = t->p.world,
                         .step = t->state.step,
                         .epoch = t->state.epoch + 1,
                         .batch_size = t->p.conf->batch_size,
                         .steps_per_epoch = t->steps_per_epoch,
                         .lr = t->lr.base_lr,
                         .was_spare = t->was_spare};
    for (int s = 0; s < SPLIT_COUNT; s++)
        v.split_samples[s] = data_split(t->p.data, (data_split_t)s)->n;
    run_log_start(&t->log, &v);
}

/* A snapshot of the state after the last step, whole (asynchronous unless is_blocking). */
static void snapshot(trainer_t *t, bool is_blocking) {
    double stall = checkpoint_take(&t->ckpt, &t->p, &t->state);
    checkpoint_commit(&t->ckpt, &t->p, &t->state, &t->log, is_blocking, stall,
                      t->has_written_params);
}

/* SIGTERM or SIGUSR1, agreed on by every rank: a blocking snapshot, then exit 128 + signum. */
static _Noreturn void stop_on_signal(trainer_t *t, int signum, bool is_log_step) {
    if (!is_log_step) check_diverged_now(t); /* a log step checked the loss already */
    snapshot(t, true);
    run_log_end_line();
    if (t->p.rank == 0)
        printf("ddpworker: signal %d: snapshot at step %lld taken, exiting\n", signum,
               (long long)t->state.step);
    fflush(stdout);
    exit(128 + signum);
}

/* The epoch's end: one "epoch" event with its pace, and its validation when one ran (val). */
static void report_epoch(trainer_t *t, const window_t *epoch, const eval_result_t *val) {
    if (t->p.rank != 0) return;
    double wall_s = clock_now_s() - epoch->start_s;
    double rate = wall_s > 0 ? (double)epoch->samples * t->p.world / wall_s : 0;
    run_log_epoch(&t->log, t->state.epoch + 1, t->state.step, wall_s, rate, val);
}

/* The files data.on_bad_image = skip went without, on every rank (image folders; else 0). */
static int64_t count_skipped_images(trainer_t *t) {
    if (!feed_is_files(&t->feed)) return 0;
    double skipped = (double)feed_skipped(&t->feed);
    die_comm(t->p.comm, t->p.comm->ops->allreduce_sum_f64(t->p.comm, &skipped, 1),
             "counting the skipped images");
    run_log_end_line();
    if (t->p.rank == 0 && skipped > 0)
        printf("ddpworker: %lld image files could not be decoded and were replaced by the next "
               "that could (data.on_bad_image = skip)\n",
               (long long)skipped);
    return (int64_t)skipped;
}

static void die_if_diverged(const eval_result_t *r, const char *what, int64_t step) {
    if (isfinite(r->loss)) return;
    die(DDP_EXIT_DIVERGED, "the %s loss is %s at step %lld: the weights diverged", what,
        isnan(r->loss) ? "NaN" : "inf", (long long)step);
}

/* Rank 0's closing line. */
static void report_summary(trainer_t *t, double attempt_s) {
    if (t->p.rank != 0) return;
    const train_state_t *s = &t->state;
    const train_conf_t *c = t->p.conf;
    bool has_best = s->best_step >= 0 && c->best_by != BEST_BY_NONE;
    run_log_summary(&(run_log_summary_t){
        .step = s->step,
        .epoch = s->epoch + 1,
        .total_s = train_state_elapsed_s(s),
        .attempt_s = attempt_s,
        .img_per_s = attempt_s > 0 ? t->samples_trained * t->p.world / attempt_s : 0,
        .best_by = has_best ? best_by_name(c->best_by) : NULL,
        .best_value = s->best_value,
        .best_step = s->best_step,
        .n_snapshots = t->ckpt.n_taken});
}

/* The run's end: the weights as they are validated (unless the last step was), written, the last
 * snapshot taken, the final test (with the best weights when train.best_by kept any), reported. */
static eval_result_t finish(trainer_t *t, eval_result_t last, int64_t last_eval_step) {
    const train_conf_t *c = t->p.conf;
    train_state_t *s = &t->state;
    /* a stop that came after the last step's agreement (in its validation): the rest can take
     * longer than the agent waits (--shutdown-timeout, then SIGKILL). As at a step boundary:
     * the last step's snapshot (not marked finished), then exit; the next run resumes at the end
     * and does only the evaluations */
    bool is_out_of_time;
    int signum = checkpoint_agree_step(&t->p, s, &is_out_of_time);
    if (signum) stop_on_signal(t, signum, true);
    /* max_steps 0, or a run resumed at its end: the weights as they are */
    if (last_eval_step != s->step) last = eval_validate(&t->eval, s);
    die_if_diverged(&last, "validation", s->step);
    /* the weights first: a final snapshot that fails (a full disk) must not take them along */
    if (t->p.rank == 0 && c->params_file[0]) {
        train_state_save_weights(&t->model, s->step, c->params_file, "train.params_file", NULL);
        t->has_written_params = true;
    }
    /* the run's last snapshot says it finished, so the same command does not train it again. Its
     * state is taken now (the final evaluation may load the best weights into the model) but it
     * lands only once the final evaluation is done: a crash during that evaluation resumes the
     * snapshot before, and the final result is not lost to a run that says it finished */
    s->is_finished = true;
    double stall = checkpoint_take(&t->ckpt, &t->p, s); /* rank 0 with snapshot.dir */
    int64_t skipped_images = count_skipped_images(t);
    eval_result_t final = eval_final(&t->eval, s, &last);
    checkpoint_commit(&t->ckpt, &t->p, s, &t->log, true, stall, t->has_written_params);
    checkpoint_memory_report(&t->memory, &t->log);
    eval_report_final(&t->eval, s, &final, skipped_images);
    report_summary(t, clock_now_s() - s->start_s);
    if (!isfinite(final.loss))
        die(DDP_EXIT_DIVERGED, "the final evaluation's loss is %s: the weights diverged",
            isnan(final.loss) ? "NaN" : "inf");
    return final;
}

eval_result_t trainer_run(trainer_t *t) {
    const train_conf_t *c = t->p.conf;
    train_state_t *s = &t->state;
    if (t->ckpt.is_already_finished) return (eval_result_t){.loss = NAN, .top1 = NAN, .top5 = NAN};
    s->start_s = clock_now_s();
    window_t window, epoch;
    window_reset(&window);
    epoch = window;
    eval_result_t last = {0};
    int64_t last_eval_step = -1;
    bool is_done = is_run_over(t);
    report_start(t);
    sampler_set_epoch(&t->sampler, s->epoch);
    if (!is_done && is_out_of_time(t)) is_done = true; /* resumed with the budget spent */
    while (!is_done) {
        if (is_epoch_over(t)) {
            s->epoch++;
            s->cursor = 0;
            sampler_set_epoch(&t->sampler, s->epoch);
            window_reset(&epoch);
        }
        int n = trainer_step(t);
        t->samples_trained += n;
        window.samples += n;
        window.steps++;
        epoch.samples += n;
        bool is_out_of_time_now; /* the signal is acted on after the evaluation */
        int signum = checkpoint_agree_step(&t->p, s, &is_out_of_time_now);
        is_done = is_run_over(t) || is_out_of_time_now;
        bool is_log_step = s->step % c->log_interval == 0 || is_done; /* checks the loss */
        if (is_log_step) {
            log_window(t, &window);
            window_reset(&window);
        }
        bool is_epoch_end = is_epoch_over(t);
        if ((c->eval_interval ? s->step % c->eval_interval == 0 : is_epoch_end) || is_done) {
            last = eval_validate(&t->eval, s);
            last_eval_step = s->step;
        }
        if (is_epoch_end) report_epoch(t, &epoch, last_eval_step == s->step ? &last : NULL);
        if (signum) stop_on_signal(t, signum, is_log_step);
        if (c->snapshot_every && s->step % c->snapshot_every == 0 && !is_done) {
            if (!is_log_step) check_diverged_now(t);
            snapshot(t, false);
        }
        if (!is_done) checkpoint_memory_take(&t->memory, &t->p, s);
    }
    return finish(t, last, last_eval_step);
}
