/* feed: see feed.h. */
#include "feed.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "die.h"
#include "exit_codes.h"

#define PREFETCH_SLOTS 3
/* batch ids: training batches are their step; an evaluation's are numbered above this */
#define EVAL_IDS ((uint64_t)1 << 62)

static int default_workers(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const char *local = getenv("LOCAL_WORLD_SIZE");
    long ranks = local ? strtol(local, NULL, 10) : 1;
    long n = cores / (ranks > 0 ? ranks : 1);
    return n >= 1 ? (int)n : 1;
}

static void folder_init(feed_t *f) {
    const dataset_t *tr = &f->data->train;
    if (!tr->paths) return;
    const train_conf_t *c = f->conf;
    loader_opts_t o = {.workers = c->workers ? (int)c->workers : default_workers(),
                       .slots = PREFETCH_SLOTS,
                       .batch_max = (int)c->batch_size,
                       .size = (int)c->image_size,
                       .is_skip_bad = c->on_bad_image == BAD_IMAGE_SKIP,
                       .seed = (uint64_t)c->seed};
    for (int i = 0; i < 3; i++) {
        o.mean[i] = f->data->mean[i];
        o.std[i] = f->data->std[i];
    }
    char err[512];
    if (loader_create(&o, &f->loader, err, sizeof err) < 0) die(DDP_EXIT_BUG, "%s", err);
}

/* The datasets where augment_batch reads them: on a GPU, uploaded once (uint8, so even CIFAR's
 * 150 MB is cheap); the cpu backend reads the host's arrays. */
static void place_data(feed_t *f, const model_t *m) {
    backend_t *b = f->backend;
    f->is_uploaded = b->mem->is_device(b, m->params);
    for (int s = 0; s < SPLIT_COUNT; s++) {
        const dataset_t *d = data_split(f->data, (data_split_t)s);
        if (d->n == 0 || d->paths) continue; /* an image folder: the loader decodes its files */
        if (!f->is_uploaded) {
            f->images[s] = d->images;
            f->labels[s] = d->labels;
            continue;
        }
        size_t n_bytes = (size_t)d->n * d->h * d->w * d->c;
        size_t label_bytes = (size_t)d->n * sizeof *d->labels;
        uint8_t *images = b->mem->alloc(b, n_bytes);
        int32_t *labels = b->mem->alloc(b, label_bytes);
        if (!images || !labels)
            die(DDP_EXIT_BUG, "out of GPU memory for the %s set (%zu bytes)",
                data_split_name((data_split_t)s), n_bytes);
        b->mem->to_device(b, images, d->images, n_bytes);
        b->mem->to_device(b, labels, d->labels, label_bytes);
        f->images[s] = images;
        f->labels[s] = labels;
    }
}

void feed_init(feed_t *f, const train_conf_t *conf, const data_splits_t *data, const model_t *m,
               backend_t *backend) {
    memset(f, 0, sizeof *f);
    f->conf = conf;
    f->data = data;
    f->backend = backend;
    f->augment_train = (augment_t){.is_random = conf->is_augmented,
                                   .padding = (int)conf->crop_padding,
                                   .seed = (uint64_t)conf->seed};
    memcpy(f->augment_train.mean, data->mean, sizeof data->mean);
    memcpy(f->augment_train.std, data->std, sizeof data->std);
    f->augment_eval = f->augment_train;
    f->augment_eval.is_random = false;
    f->host_labels = die_calloc((size_t)conf->batch_size, sizeof(int32_t), "the batch labels");
    f->host_jobs = die_calloc((size_t)conf->batch_size, sizeof(augment_job_t), "the batch's jobs");
    f->jobs = backend->mem->alloc(backend, (size_t)conf->batch_size * sizeof(augment_job_t));
    if (!f->jobs) die(DDP_EXIT_BUG, "out of memory for the batch's jobs");
    place_data(f, m);
    folder_init(f);
}

void feed_free(feed_t *f) {
    backend_t *b = f->backend;
    for (int s = 0; s < SPLIT_COUNT && f->is_uploaded; s++) {
        if (f->images[s]) b->mem->release(b, f->images[s]);
        if (f->labels[s]) b->mem->release(b, f->labels[s]);
    }
    if (f->jobs) b->mem->release(b, f->jobs);
    free(f->host_jobs);
    free(f->host_labels);
    loader_destroy(f->loader);
    memset(f, 0, sizeof *f);
}

bool feed_is_files(const feed_t *f) {
    return f->loader != NULL;
}

int64_t feed_skipped(const feed_t *f) {
    return f->loader ? loader_skipped(f->loader) : 0;
}

/* An in-memory dataset's batch: the host only makes the choices; the backend moves the pixels
 * where they live. */
static void memory_batch(feed_t *f, model_t *m, data_split_t split, int64_t epoch,
                         const int64_t *indices, int n) {
    const dataset_t *d = data_split(f->data, split);
    const augment_t *aug = split == SPLIT_TRAIN ? &f->augment_train : &f->augment_eval;
    for (int i = 0; i < n; i++) {
        f->host_jobs[i] =
            (augment_job_t){.index = indices[i], .choice = augment_choose(aug, epoch, indices[i])};
        f->host_labels[i] = d->labels[indices[i]];
    }
    backend_t *b = f->backend;
    b->mem->to_device(b, f->jobs, f->host_jobs, (size_t)n * sizeof *f->jobs);
    b->ops->augment_batch(b, f->images[split], f->labels[split], d->h, d->w, d->c, f->jobs, n,
                          augment_norm(aug, d->c),
                          tensor_desc(model_input(m), m->act_dtype, n, d->h, d->w, d->c),
                          m->labels);
}

static image_transform_kind_t kind_of(const feed_t *f, data_split_t split) {
    if (split == SPLIT_TRAIN)
        return f->conf->train_transform == TRAIN_TRANSFORM_RESIZE ? IMAGE_RESIZE
                                                                  : IMAGE_RANDOM_RESIZED_CROP;
    return f->conf->eval_transform == EVAL_TRANSFORM_RESIZE ? IMAGE_RESIZE
                                                            : IMAGE_RESIZE_CENTER_CROP;
}

/* An image folder's batch through the loader, submitting it if it is not yet, and the next. */
static void folder_batch(feed_t *f, model_t *m, data_split_t split, int64_t epoch, uint64_t id,
                         const int64_t *indices, int n, const int64_t *next_indices, int next_n) {
    const dataset_t *d = data_split(f->data, split);
    image_transform_kind_t kind = kind_of(f, split);
    uint64_t base = split == SPLIT_TRAIN ? 0 : EVAL_IDS;
    if (!loader_has(f->loader, base + id))
        loader_submit(f->loader, base + id, d, kind, epoch, indices, n);
    /* the next batch decodes while this one trains */
    if (next_n > 0 && !loader_has(f->loader, base + id + 1))
        loader_submit(f->loader, base + id + 1, d, kind, epoch, next_indices, next_n);
    loader_batch_t b;
    char err[1300];
    if (loader_take(f->loader, base + id, &b, err, sizeof err) < 0)
        die(DDP_EXIT_DATA, "data: %s (data.on_bad_image = skip goes on without it)", err);
    size_t per = (size_t)d->h * d->w * d->c;
    f->backend->mem->to_device(f->backend, model_input(m), b.pixels,
                               sizeof(float) * per * (size_t)b.n);
    f->backend->mem->to_device(f->backend, m->labels, b.labels, sizeof(int32_t) * (size_t)b.n);
    memcpy(f->host_labels, b.labels, sizeof(int32_t) * (size_t)b.n);
    loader_release(f->loader, base + id);
}

void feed_batch(feed_t *f, model_t *m, data_split_t split, int64_t epoch, uint64_t id,
                const int64_t *indices, int n, const int64_t *next_indices, int next_n) {
    if (f->loader)
        folder_batch(f, m, split, epoch, id, indices, n, next_indices, next_n);
    else
        memory_batch(f, m, split, epoch, indices, n);
}
