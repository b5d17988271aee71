/* trainer_folder: batches of an image folder for the trainer: the loader (data/loader.h) decodes
 * them on its threads, one batch ahead of the step that uses it, and the finished fp32 batch goes
 * to the model's input and labels with to_device (a GPU backend converts it to its activations'
 * type there). Internal to the trainer; its thread. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "exit_codes.h"
#include "trainer.h"

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

void trainer__folder_init(trainer_t *t) {
    const dataset_t *tr = &t->data->train;
    if (!tr->paths) return;
    const train_conf_t *c = t->conf;
    loader_opts_t o = {.workers = c->workers ? (int)c->workers : default_workers(),
                       .slots = PREFETCH_SLOTS,
                       .batch_max = (int)c->batch_size,
                       .size = (int)c->image_size,
                       .is_skip_bad = c->on_bad_image == BAD_IMAGE_SKIP,
                       .seed = (uint64_t)c->seed};
    for (int i = 0; i < 3; i++) {
        o.mean[i] = t->data->mean[i];
        o.std[i] = t->data->std[i];
    }
    char err[512];
    if (loader_create(&o, &t->loader, err, sizeof err) < 0) trainer_die(DDP_EXIT_BUG, "%s", err);
}

void trainer__folder_free(trainer_t *t) {
    loader_destroy(t->loader);
    t->loader = NULL;
}

static image_transform_kind_t kind_of(const trainer_t *t, data_split_t split) {
    if (split == SPLIT_TRAIN)
        return t->conf->train_transform == TRAIN_TRANSFORM_RESIZE ? IMAGE_RESIZE
                                                                  : IMAGE_RANDOM_RESIZED_CROP;
    return t->conf->eval_transform == EVAL_TRANSFORM_RESIZE ? IMAGE_RESIZE
                                                            : IMAGE_RESIZE_CENTER_CROP;
}

void trainer__folder_batch(trainer_t *t, data_split_t split, int64_t epoch, uint64_t id,
                           const int64_t *indices, int n, const int64_t *next_indices, int next_n) {
    const dataset_t *d = data_split(t->data, split);
    image_transform_kind_t kind = kind_of(t, split);
    uint64_t base = split == SPLIT_TRAIN ? 0 : EVAL_IDS;
    if (!loader_has(t->loader, base + id))
        loader_submit(t->loader, base + id, d, kind, epoch, indices, n);
    /* the next batch decodes while this one trains */
    if (next_n > 0 && !loader_has(t->loader, base + id + 1))
        loader_submit(t->loader, base + id + 1, d, kind, epoch, next_indices, next_n);
    loader_batch_t b;
    char err[1300];
    if (loader_take(t->loader, base + id, &b, err, sizeof err) < 0)
        trainer_die(DDP_EXIT_DATA, "data: %s (data.on_bad_image = skip goes on without it)", err);
    size_t per = (size_t)d->h * d->w * d->c;
    t->backend->mem->to_device(t->backend, model_input(&t->model), b.pixels,
                               sizeof(float) * per * (size_t)b.n);
    t->backend->mem->to_device(t->backend, t->model.labels, b.labels,
                               sizeof(int32_t) * (size_t)b.n);
    memcpy(t->host_labels, b.labels, sizeof(int32_t) * (size_t)b.n);
    loader_release(t->loader, base + id);
}
