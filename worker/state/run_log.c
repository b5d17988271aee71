/* run_log: see run_log.h. */
#include "run_log.h"

#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

static int progress_fd = -1; /* DDPRUN_PROGRESS_FILE: the agent's hang detector reads it */
/* atomic: the snapshot writer's thread beats too, while it writes */
static _Atomic uint64_t progress_beats;
static atomic_bool is_progress_broken;

static int is_tty = -1;   /* stdout is a terminal (-1: not asked yet) */
static bool is_line_open; /* a progress line waits for its newline (terminals only) */

void run_log_open_beats(void) {
    const char *progress = getenv("DDPRUN_PROGRESS_FILE");
    if (progress && *progress) progress_fd = open(progress, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
}

void run_log_beat(void) {
    if (progress_fd < 0 || atomic_load(&is_progress_broken)) return;
    uint64_t beats = atomic_fetch_add(&progress_beats, 1) + 1;
    /* the agent's run directory went away: stop reporting (the fd stays open for the other
     * thread, which may be in pwrite) */
    if (pwrite(progress_fd, &beats, sizeof beats, 0) < 0) atomic_store(&is_progress_broken, true);
}

void run_log_write(run_log_t *l, cJSON *o) {
    tb_events_metrics(l->tb, o); /* the same numbers as TensorBoard scalars (rank 0) */
    run_log_event(l, o);
}

void run_log_event(run_log_t *l, cJSON *o) {
    if (l->metrics)
        json_line_write(l->metrics, o);
    else
        cJSON_Delete(o);
}

void run_log_end_line(void) {
    if (!is_line_open) return;
    putchar('\n');
    is_line_open = false;
}

void run_log_duration(double s, char *buf, size_t len) {
    long total = s > 0 && s < 1e9 ? (long)(s + 0.5) : 0;
    if (total >= 3600)
        snprintf(buf, len, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
    else
        snprintf(buf, len, "%ld:%02ld", total / 60, total % 60);
}

void run_log_progress(run_log_t *l, const run_log_progress_t *p) {
    char eta[32], scaling[64] = "";
    run_log_duration(isfinite(p->eta_s) ? p->eta_s : 0, eta, sizeof eta);
    if (p->has_scale)
        snprintf(scaling, sizeof scaling, "  scale %g (%u skipped)", p->scale, p->skipped_steps);
    /* "step 10/0" says nothing: a run without a step count shows none, and a time budget shows
     * the whole run's hours against it */
    char where[96], total[32] = "", hours[48] = "";
    if (p->total_steps) snprintf(total, sizeof total, "/%lld", (long long)p->total_steps);
    if (p->budget_h > 0) snprintf(hours, sizeof hours, "  hours %.2f/%.2f", p->hours, p->budget_h);
    snprintf(where, sizeof where, "step %lld%s%s", (long long)p->step, total, hours);
    /* on a terminal, one line that updates; piped (ddprun, a file), a line per log interval */
    if (is_tty < 0) is_tty = isatty(STDOUT_FILENO);
    printf("%sepoch %lld  %s  loss %.4f  lr %.5f  %.0f img/s  ETA %s%s%s%s",
           is_tty ? "\r\033[K" : "", (long long)p->epoch, where, p->loss, p->lr, p->img_per_s, eta,
           scaling, p->snapshot, is_tty ? "" : "\n");
    is_line_open = is_tty;
    fflush(stdout);
    if (!l->metrics && !l->tb) return;
    cJSON *o = json_line_new("train");
    json_line_int(o, "step", p->step);
    json_line_int(o, "epoch", p->epoch);
    json_line_num(o, "loss", p->loss);
    json_line_num(o, "lr", p->lr);
    json_line_num(o, "img_per_s", p->img_per_s);
    if (p->has_scale) {
        json_line_num(o, "loss_scale", p->scale);
        json_line_int(o, "skipped_steps", p->skipped_steps);
    }
    run_log_write(l, o);
}

void run_log_start(run_log_t *l, const run_log_start_t *v) {
    const char *restarts = getenv("TORCHELASTIC_RESTART_COUNT"); /* `ddprun plot` marks these */
    printf("ddpworker: %s (%zu parameters) on %s, world %d, %lld samples, %lld steps/epoch, "
           "batch %lld per rank, lr %g%s%s\n",
           v->model, v->n_params, v->backend, v->world, (long long)v->split_samples[SPLIT_TRAIN],
           (long long)v->steps_per_epoch, (long long)v->batch_size, v->lr,
           v->step ? ", resumed" : "", v->was_spare ? ", warm spare" : "");
    fflush(stdout);
    /* what this start trains with: lr after optim.lr_scaling, the splits' sizes */
    cJSON *o = json_line_new("start");
    json_line_int(o, "step", v->step);
    json_line_int(o, "pid", getpid());
    json_line_int(o, "world", v->world);
    json_line_int(o, "global_batch", v->batch_size * v->world);
    json_line_int(o, "steps_per_epoch", v->steps_per_epoch);
    json_line_num(o, "lr", v->lr);
    for (int s = 0; s < SPLIT_COUNT; s++) {
        char key[24];
        snprintf(key, sizeof key, "%s_samples", data_split_name((data_split_t)s));
        json_line_int(o, key, v->split_samples[s]);
    }
    json_line_bool(o, "resumed", v->step > 0);
    if (v->was_spare) json_line_bool(o, "warm_spare", true);
    json_line_int(o, "epoch", v->epoch);
    if (restarts) json_line_int(o, "restart_count", strtoll(restarts, NULL, 10));
    run_log_write(l, o);
}

void run_log_eval_fields(cJSON *o, const char *prefix, const eval_result_t *r) {
    char key[32];
    const char *names[3] = {"loss", "top1", "top5"};
    const double values[3] = {r->loss, r->top1, r->top5};
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s%s", prefix, names[i]);
        json_line_num(o, key, values[i]);
    }
}

void run_log_epoch(run_log_t *l, int64_t epoch, int64_t step, double wall_s, double img_per_s,
                   const eval_result_t *val) {
    cJSON *o = json_line_new("epoch");
    json_line_int(o, "epoch", epoch);
    json_line_int(o, "step", step);
    json_line_num(o, "wall_s", wall_s);
    json_line_num(o, "img_per_s", img_per_s);
    if (val) {
        json_line_str(o, "split", data_split_name(val->split));
        run_log_eval_fields(o, "val_", val);
    }
    run_log_write(l, o);
}

void run_log_resume(run_log_t *l, status_report_t *status, int64_t step, const char *source,
                    int rank, int64_t steps_lost) {
    status_report_resume(status, step, source, rank, steps_lost);
    if (!l->metrics) return;
    cJSON *event = json_line_new("resume");
    json_line_int(event, "step", step);
    json_line_str(event, "source", source);
    json_line_int(event, "rank", rank);
    json_line_int(event, "steps_lost", steps_lost);
    json_line_write(l->metrics, event);
}

void run_log_summary(const run_log_summary_t *v) {
    char total[32], attempt[32], best[128] = "";
    run_log_duration(v->total_s, total, sizeof total);
    run_log_duration(v->attempt_s, attempt, sizeof attempt);
    const char *restarts = getenv("TORCHELASTIC_RESTART_COUNT");
    long n_restarts = restarts ? strtol(restarts, NULL, 10) : 0;
    if (v->best_by)
        snprintf(best, sizeof best, "; best %s %.4f at step %lld", v->best_by, v->best_value,
                 (long long)v->best_step);
    run_log_end_line();
    printf(
        "ddpworker: done: %lld steps, %lld epochs, %s of training (%s in this attempt, %.0f img/s)"
        "%s; %ld restart%s; %lld snapshot%s written in this attempt\n",
        (long long)v->step, (long long)v->epoch, total, attempt, v->img_per_s, best, n_restarts,
        n_restarts == 1 ? "" : "s", (long long)v->n_snapshots, v->n_snapshots == 1 ? "" : "s");
    fflush(stdout);
}
