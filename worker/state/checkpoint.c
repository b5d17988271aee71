/* checkpoint: see checkpoint.h. */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "best.h"
#include "clock.h"
#include "die.h"
#include "exit_codes.h"
#include "json_lines.h"
#include "memory_snapshot.h"
#include "stop_signal.h"

_Static_assert((int)OPTIM_SGD == (int)SNAPSHOT_OPTIM_SGD &&
                   (int)OPTIM_ADAM == (int)SNAPSHOT_OPTIM_ADAM &&
                   (int)OPTIM_ADAMW == (int)SNAPSHOT_OPTIM_ADAMW,
               "train.conf's optimizer numbers are the snapshot header's");

/* data.kind as the snapshot header records it (the format's numbers, not train.conf's order) */
static uint32_t data_kind_code(data_kind_t kind) {
    switch (kind) {
    case DATA_FASHION_MNIST:
        return SNAPSHOT_DATA_FASHION_MNIST;
    case DATA_MNIST:
        return SNAPSHOT_DATA_MNIST;
    case DATA_CIFAR10:
        return SNAPSHOT_DATA_CIFAR10;
    case DATA_CIFAR100:
        return SNAPSHOT_DATA_CIFAR100;
    case DATA_SYNTHETIC:
        return SNAPSHOT_DATA_SYNTHETIC;
    case DATA_IMAGEFOLDER:
        return SNAPSHOT_DATA_IMAGEFOLDER;
    }
    return SNAPSHOT_DATA_UNRECORDED;
}

/* Bytes reaching the disk are progress: a slow but moving snapshot write is no hang. */
static void beat(void *arg) {
    (void)arg;
    run_log_beat();
}

void checkpoint_init(checkpoint_t *ck, const train_parts_t *p) {
    const train_conf_t *c = p->conf;
    if (!c->snapshot_dir[0]) return;
    stop_signal_catch();
    if (p->rank != 0) return;
    snapshot_retention_t keep = {.keep = c->snapshot_keep, .keep_every = c->snapshot_keep_every};
    char err[1024];
    if (snapshot_writer_create(c->snapshot_dir, p->model->n_params, p->model->n_buffers,
                               optimizer_has_second_moment(p->optim), &keep, &ck->writer, err,
                               sizeof err) < 0)
        die(DDP_EXIT_IO, "%s", err);
    snapshot_writer_set_progress(ck->writer, &(snapshot_progress_t){.cb = beat});
}

void checkpoint_free(checkpoint_t *ck) {
    snapshot_writer_destroy(ck->writer);
    ck->writer = NULL;
}

void checkpoint_describe(const train_parts_t *p, const train_state_t *s, snapshot_header_t *h) {
    const train_conf_t *c = p->conf;
    const model_t *m = p->model;
    h->step = (uint64_t)s->step;
    h->epoch = (uint64_t)s->epoch;
    h->cursor = (uint64_t)s->cursor;
    h->seed = (uint64_t)c->seed;
    h->world_size = (uint32_t)p->world;
    h->train_samples = (uint64_t)p->data->train.n;
    snprintf(h->model, sizeof h->model, "%s", m->name);
    h->width = (uint32_t)c->width;
    h->height = (uint32_t)m->h;
    h->img_width = (uint32_t)m->w;
    h->channels = (uint32_t)m->c;
    h->classes = (uint32_t)m->classes;
    h->data_kind = data_kind_code(c->data_kind);
    h->n_params = m->n_params;
    h->n_buffers = m->n_buffers;
    h->lr = c->lr;
    h->momentum = c->momentum;
    h->weight_decay = c->weight_decay;
    h->is_nesterov = c->is_nesterov;
    h->precision = (uint32_t)c->precision;
    h->best_value = s->best_value;
    h->best_step = s->best_step < 0 ? 0 : (uint64_t)s->best_step;
    h->best_by = (uint32_t)c->best_by;
    h->elapsed_s = train_state_elapsed_s(s);
    h->is_finished = s->is_finished;
    h->optimizer = (uint32_t)p->optim->kind;
}

double checkpoint_take(checkpoint_t *ck, const train_parts_t *p, const train_state_t *s) {
    ck->last_step = s->step;
    if (ck->writer) ck->n_taken++;
    if (!ck->writer) return 0;
    double start = clock_now_s();
    snapshot_data_t *d;
    char err[1024];
    /* a failed earlier write is reported, not fatal: training goes on with the older snapshots */
    if (snapshot_writer_acquire(ck->writer, &d, err, sizeof err) < 0)
        fprintf(stderr, "ddpworker: warning: snapshot failed: %s\n", err);
    memset(&d->header, 0, sizeof d->header);
    checkpoint_describe(p, s, &d->header);
    loss_scale_t ls =
        train_state_loss_scale(s, p->backend); /* zeros without loss scaling: the format's "none" */
    d->header.loss_scale = ls.scale;
    d->header.loss_scale_good_steps = ls.good_steps;
    d->header.optim_steps = optimizer_steps(p->optim);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    d->header.unix_time_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
    const model_t *m = p->model;
    const backend_memory_i *mem = p->backend->mem;
    mem->to_host(p->backend, d->params, m->params, m->n_params * sizeof(float));
    mem->to_host(p->backend, d->momentum, m->momentum, m->n_params * sizeof(float));
    mem->to_host(p->backend, d->buffers, m->buffers, m->n_buffers * sizeof(float));
    if (optimizer_has_second_moment(p->optim))
        mem->to_host(p->backend, d->second_moment, p->optim->exp_avg_sq,
                     m->n_params * sizeof(float));
    return clock_now_s() - start;
}

void checkpoint_commit(checkpoint_t *ck, const train_parts_t *p, const train_state_t *s,
                       run_log_t *log, bool is_blocking, double stall, bool has_written_params) {
    if (!ck->writer) return;
    double start = clock_now_s() - stall;
    char err[1024];
    snapshot_writer_submit(ck->writer);
    if (is_blocking && snapshot_writer_flush(ck->writer, err, sizeof err) < 0)
        die(DDP_EXIT_IO, "the snapshot of step %lld failed: %s; %s", (long long)s->step, err,
            has_written_params        ? "the final weights are in train.params_file"
            : p->conf->params_file[0] ? "the weights of this step are NOT saved"
                                      : "the weights of this step are NOT saved (no "
                                        "train.params_file)");
    if (log->metrics) {
        cJSON *event = json_line_new("snapshot");
        json_line_int(event, "step", s->step);
        json_line_num(event, "stall_ms", stall * 1e3);
        if (is_blocking) json_line_num(event, "written_ms", (clock_now_s() - start) * 1e3);
        json_line_write(log->metrics, event);
    }
}

int checkpoint_agree_step(const train_parts_t *p, const train_state_t *s, bool *is_out_of_time) {
    *is_out_of_time = false;
    bool has_budget = p->conf->hours > 0, has_signals = p->conf->snapshot_dir[0] != '\0';
    if (!has_budget && !has_signals) return 0;
    /* ranks that received each signal, and rank 0's clock: every rank must stop at the same step,
     * and one reduction answers both questions */
    double got[3] = {stop_signal_is_stop_requested(), stop_signal_is_snapshot_requested(),
                     has_budget && p->rank == 0 &&
                         train_state_elapsed_s(s) >= p->conf->hours * 3600.0};
    die_comm(p->comm, p->comm->ops->allreduce_sum_f64(p->comm, got, 3),
             has_signals ? "agreeing on stop signals and the time budget after a step"
                         : "agreeing on the time budget after a step");
    *is_out_of_time = got[2] > 0;
    if (!has_signals) return 0;
    return got[0] > 0 ? SIGTERM : got[1] > 0 ? SIGUSR1 : 0; /* termination wins over a checkpoint */
}

/* Why a snapshot from another configuration cannot continue this run, into why (which key
 * differs, and what to do): false when it can. */
static bool is_incompatible(const train_parts_t *p, const snapshot_header_t *h, char *why,
                            size_t why_len) {
    const model_t *m = p->model;
    if (strncmp(h->model, m->name, sizeof h->model) != 0 || h->width != (uint32_t)p->conf->width ||
        h->n_params != m->n_params || h->n_buffers != m->n_buffers) {
        snprintf(why, why_len,
                 "holds model %.32s width %u (%" PRIu64
                 " parameters); train.conf asks for %s width %lld (%zu): use another snapshot.dir",
                 h->model, h->width, h->n_params, m->name, (long long)p->conf->width, m->n_params);
        return true;
    }
    /* a resnet's parameters do not depend on the input's size: the counts alone let a snapshot
     * taken at 8x8 continue at 16x16 */
    if (h->height != (uint32_t)m->h || h->img_width != (uint32_t)m->w ||
        h->channels != (uint32_t)m->c || h->classes != (uint32_t)m->classes) {
        snprintf(why, why_len,
                 "holds model %.32s for %ux%ux%u inputs and %u classes; train.conf gives "
                 "%dx%dx%d and %d (data.height, data.width, data.channels, data.image_size, "
                 "model.classes or the dataset's): use another snapshot.dir",
                 h->model, h->height, h->img_width, h->channels, h->classes, m->h, m->w, m->c,
                 m->classes);
        return true;
    }
    /* 0: a file written before the kind was recorded, resumed as before */
    uint32_t kind = data_kind_code(p->conf->data_kind);
    if (h->data_kind != SNAPSHOT_DATA_UNRECORDED && h->data_kind != kind) {
        snprintf(why, why_len,
                 "was taken on data.kind=%s; train.conf asks for data.kind=%s, where its position "
                 "in the data and its weights mean nothing: use another snapshot.dir",
                 snapshot_data_kind_name(h->data_kind), snapshot_data_kind_name(kind));
        return true;
    }
    if (h->train_samples != (uint64_t)p->data->train.n || h->seed != (uint64_t)p->conf->seed) {
        snprintf(why, why_len,
                 "was taken with %" PRIu64 " training samples and seed %" PRIu64
                 "; this run has %lld and %lld (data.train_limit, train.seed), so its position in "
                 "the data would be meaningless",
                 h->train_samples, h->seed, (long long)p->data->train.n, (long long)p->conf->seed);
        return true;
    }
    /* SGD's momentum is not Adam's first moment, and SGD has no second moment: no carrying over.
     * Adam and AdamW keep the same state (as torch's state_dicts), so either resumes the other. */
    bool was_adam = h->optimizer != SNAPSHOT_OPTIM_SGD, is_adam = p->optim->kind != OPTIM_SGD;
    if (was_adam != is_adam) {
        snprintf(why, why_len,
                 "was taken with optim.name=%s; train.conf asks for optim.name=%s, which cannot "
                 "continue %s's state: keep optim.name=%s, or start afresh in another "
                 "snapshot.dir",
                 optimizer_name(h->optimizer), optimizer_name(p->optim->kind),
                 optimizer_name(h->optimizer), optimizer_name(h->optimizer));
        return true;
    }
    return false;
}

static void check_compatible(const train_parts_t *p, const snapshot_header_t *h, const char *path) {
    char why[1024];
    if (is_incompatible(p, h, why, sizeof why)) die(DDP_EXIT_CONFIG, "snapshot %s %s", path, why);
    if (h->optimizer != (uint32_t)p->optim->kind)
        printf("ddpworker: note: snapshot %s was taken with optim.name=%s; continuing its moments "
               "and step count with %s\n",
               path, optimizer_name(h->optimizer), optimizer_name(p->optim->kind));
}

/* Whether train.conf leaves something to train after the state resumed (step, epoch, cursor,
 * elapsed time): none of its ends is reached. An epoch counts as done when its cursor covers the
 * training set, whatever the world size that padded it. */
static bool asks_for_more(const train_parts_t *p, const train_state_t *s) {
    const train_conf_t *c = p->conf;
    bool is_epoch_done = s->cursor >= p->data->train.n;
    if (c->max_steps >= 0 && s->step >= c->max_steps) return false;
    if (c->epochs && (s->epoch + 1 > c->epochs || (s->epoch + 1 == c->epochs && is_epoch_done)))
        return false;
    if (c->hours > 0 && s->elapsed_before_s >= c->hours * 3600.0) return false;
    return true;
}

/* Where a resume may come from, fastest first at the same step (checkpoint_resume's agreement). */
enum { SOURCE_NONE = 0, SOURCE_DISK = 1, SOURCE_PEER = 2, SOURCE_MEMORY = 3 };

static const char *source_name(int source) {
    return source == SOURCE_MEMORY ? "memory" : source == SOURCE_PEER ? "peer" : "disk";
}

/* This rank's best candidate: the node's memory snapshots (local rank 0, under ddprun), the disk
 * (rank 0; read only when its newest file is newer than memory's). Returns its source. */
static int find_candidate(const train_parts_t *p, snapshot_data_t *d, char *path, size_t path_len,
                          int64_t *reached) {
    *reached = -1;
    int source = SOURCE_NONE;
    const char *mem_dir = getenv(MEMORY_SNAPSHOT_DIR_ENV);
    const char *local_rank = getenv("LOCAL_RANK");
    if (mem_dir && *mem_dir && (!local_rank || strcmp(local_rank, "0") == 0)) {
        memory_snapshot_source_t m =
            memory_snapshot_find_latest(mem_dir, stderr, d, path, path_len, reached);
        char why[1024];
        if (m != MEMORY_SNAPSHOT_NONE && is_incompatible(p, &d->header, why, sizeof why)) {
            /* the node's region outlived a run of another train.conf under the same run id (an
             * agent restarted with it): not this run's state, and not the user's snapshot.dir */
            printf("ddpworker: memory snapshot %s %s; not resumed from it\n", path, why);
            fflush(stdout);
            snapshot_data_free(d);
            *d = (snapshot_data_t){0};
            *reached = -1;
            path[0] = '\0';
        } else if (m != MEMORY_SNAPSHOT_NONE) {
            source = m == MEMORY_SNAPSHOT_OWN ? SOURCE_MEMORY : SOURCE_PEER;
        }
    }
    if (p->rank != 0 || !p->conf->snapshot_dir[0]) return source;
    if (source != SOURCE_NONE &&
        snapshot_newest_step(p->conf->snapshot_dir) <= (int64_t)d->header.step)
        return source;
    snapshot_data_t disk = {0};
    char disk_path[4096], err[1024];
    int found = snapshot_find_latest(p->conf->snapshot_dir, stderr, &disk, disk_path,
                                     sizeof disk_path, err, sizeof err);
    if (found == SNAPSHOT_E_NEWER) die(DDP_EXIT_DATA, "snapshot.dir: %s", err);
    if (found < 0) die(DDP_EXIT_IO, "%s", err);
    if (found && (source == SOURCE_NONE || disk.header.step > d->header.step)) {
        snapshot_data_free(d);
        *d = disk;
        snprintf(path, path_len, "%s", disk_path);
        return SOURCE_DISK;
    }
    snapshot_data_free(&disk);
    return source;
}

bool checkpoint_resume(checkpoint_t *ck, const train_parts_t *p, train_state_t *s) {
    bool has_memory = getenv(MEMORY_SNAPSHOT_DIR_ENV) && *getenv(MEMORY_SNAPSHOT_DIR_ENV);
    /* the memory region is each node's (an agent that could not make one runs without): several
     * ranks always agree, or some would enter the agreement and others the next collective */
    if (p->world == 1 && !p->conf->snapshot_dir[0] && !has_memory) return false;
    int64_t where[6] = {0};       /* found, step, epoch, cursor, optimizer steps, is finished */
    double run[3] = {NAN, -1, 0}; /* best value, its step, elapsed seconds */
    loss_scale_t ls = {0};
    snapshot_data_t d = {0};
    char path[4096] = "";
    int64_t reached;
    int source = find_candidate(p, &d, path, sizeof path, &reached);
    if (source != SOURCE_NONE) check_compatible(p, &d.header, path);
    /* every rank's candidate (step + 1, source, reached + 1; zeros: none): the newest step wins,
     * then the fastest source, then the lowest rank, which sends it to everyone */
    double *all = calloc((size_t)p->world * 3, sizeof *all);
    if (!all) die(DDP_EXIT_BUG, "out of memory agreeing on a snapshot");
    if (source != SOURCE_NONE) {
        all[3 * p->rank] = (double)d.header.step + 1;
        all[3 * p->rank + 1] = source;
    }
    all[3 * p->rank + 2] = (double)(reached + 1);
    die_comm(p->comm, p->comm->ops->allreduce_sum_f64(p->comm, all, (size_t)p->world * 3),
             "agreeing on the snapshot to resume from");
    int root = -1;
    double max_reached = 0;
    for (int r = 0; r < p->world; r++) {
        if (all[3 * r + 2] > max_reached) max_reached = all[3 * r + 2];
        if (all[3 * r] == 0) continue;
        if (root < 0 || all[3 * r] > all[3 * root] ||
            (all[3 * r] == all[3 * root] && all[3 * r + 1] > all[3 * root + 1]))
            root = r;
    }
    int chosen = root < 0 ? SOURCE_NONE : (int)all[3 * root + 1];
    free(all);
    if (root < 0) {
        /* nothing to resume, yet training had reached a step here: all of it is lost, and said */
        if (max_reached > 1) {
            ck->resume_source = "none";
            ck->resume_rank = -1;
            ck->steps_lost = (int64_t)max_reached - 1;
            if (p->rank == 0) {
                printf(
                    "ddpworker: no snapshot to resume from (memory, peers, disk): starting again "
                    "from step 0; source none, %lld steps lost\n",
                    (long long)ck->steps_lost);
                fflush(stdout);
            }
        }
        return false;
    }
    snapshot_header_t h = d.header;
    die_comm(p->comm, p->comm->ops->broadcast(p->comm, &h, sizeof h, root),
             "broadcasting the snapshot's header");
    where[0] = 1;
    where[1] = (int64_t)h.step;
    where[2] = (int64_t)h.epoch;
    where[3] = (int64_t)h.cursor;
    where[4] = (int64_t)h.optim_steps;
    where[5] = h.is_finished != 0;
    run[2] = h.elapsed_s;
    ls.scale = (float)h.loss_scale;
    ls.good_steps = (uint32_t)h.loss_scale_good_steps;
    if (p->rank == 0) { /* train.best_file is rank 0's */
        /* a best value judged by another measure would mislead: start that afresh */
        double best_value = NAN;
        int64_t best_step = -1;
        if (h.best_by == (uint32_t)p->conf->best_by && !isnan(h.best_value)) {
            best_value = h.best_value;
            best_step = (int64_t)h.best_step;
        }
        best_recall(p->conf, p->model->name, &best_value, &best_step);
        run[0] = best_value;
        run[1] = (double)best_step;
    }
    die_comm(p->comm, p->comm->ops->broadcast(p->comm, run, sizeof run, 0),
             "broadcasting the run's state");
    s->step = ck->last_step = where[1];
    s->epoch = where[2];
    s->cursor = where[3];
    s->elapsed_before_s = run[2];
    ck->was_finished = where[5] != 0;
    ck->resume_source = source_name(chosen);
    ck->resume_rank = root;
    ck->steps_lost = max_reached > 0 ? (int64_t)max_reached - 1 - where[1] : -1;
    if (ck->steps_lost < 0 && max_reached > 0) ck->steps_lost = 0;
    /* a finished run is not trained again by the same command (every rank decides alike: the same
     * train.conf, the state broadcast) */
    if (ck->was_finished && !asks_for_more(p, s)) {
        ck->is_already_finished = true;
        snapshot_data_free(&d);
        if (p->rank == 0) {
            printf(
                "ddpworker: already finished at step %lld, epoch %lld (snapshot.dir %s): nothing "
                "to train; a larger train.max_steps, train.epochs or train.hours continues it, "
                "another snapshot.dir starts a new run\n",
                (long long)s->step, (long long)s->epoch + 1, p->conf->snapshot_dir);
            fflush(stdout);
        }
        return true;
    }
    model_t *m = p->model;
    const backend_memory_i *mem = p->backend->mem;
    if (p->rank == root) {
        mem->to_device(p->backend, m->params, d.params, m->n_params * sizeof(float));
        mem->to_device(p->backend, m->momentum, d.momentum, m->n_params * sizeof(float));
        mem->to_device(p->backend, m->buffers, d.buffers, m->n_buffers * sizeof(float));
        if (optimizer_has_second_moment(p->optim))
            mem->to_device(p->backend, p->optim->exp_avg_sq, d.second_moment,
                           m->n_params * sizeof(float));
        char lost[64] = "";
        if (ck->steps_lost >= 0)
            snprintf(lost, sizeof lost, ", %lld steps lost", (long long)ck->steps_lost);
        printf("ddpworker: resuming from %s: step %lld, epoch %lld, %lld samples into it (saved by "
               "%u ranks, now %d)%s; source %s (rank %d)%s\n",
               path, (long long)where[1], (long long)where[2] + 1, (long long)where[3],
               d.header.world_size, p->world,
               ck->was_finished ? "; that run had finished, train.conf now asks for more" : "",
               ck->resume_source, root, lost);
        fflush(stdout);
    }
    snapshot_data_free(&d);
    train_state_bcast(p->comm, m, p->optim,
                      TRAIN_STATE_PARAMS | TRAIN_STATE_MOMENTUM | TRAIN_STATE_BUFFERS |
                          TRAIN_STATE_SECOND_MOMENT,
                      root, "the snapshot's");
    if (optimizer_has_second_moment(p->optim)) optimizer_set_steps(p->optim, (uint64_t)where[4]);
    /* a snapshot without a scaler's state (0) leaves this run's initial scale */
    die_comm(p->comm, p->comm->ops->broadcast(p->comm, &ls, sizeof ls, root),
             "broadcasting the loss scale");
    if (s->loss_scale && ls.scale > 0) mem->to_device(p->backend, s->loss_scale, &ls, sizeof ls);
    s->best_value = run[0];
    s->best_step = (int64_t)run[1];
    return true;
}
