/* loader: see loader.h. One mutex guards the slots; the pixels of a sample are written by the one
 * worker that claimed it, outside the lock. */
#include "loader.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs.h"
#include "image_decode.h"

#define MAX_FILE_BYTES ((size_t)256 << 20)
#define SKIP_ATTEMPTS  64 /* a skipped file is replaced by one of the next samples that decodes */

typedef enum { SLOT_FREE, SLOT_QUEUED, SLOT_DONE } slot_state_t;

typedef struct {
    slot_state_t state;
    uint64_t id, seq;
    const dataset_t *data;
    image_transform_kind_t kind;
    int64_t epoch;
    int64_t *indices;
    int n, next, done;
    float *pixels;
    int32_t *labels;
    char err[1200];
} slot_t;

typedef struct {
    loader_t *l;
    pthread_t thread;
    uint8_t *file;
    size_t file_cap;
    image_decoder_t decoder;
    image_scratch_t scratch;
} worker_t;

struct loader {
    loader_opts_t o;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    slot_t *slots;
    worker_t *workers;
    int n_started;
    uint64_t next_seq;
    int64_t skipped;
    bool is_stopping;
};

static size_t sample_floats(const loader_t *l) {
    return (size_t)l->o.size * l->o.size * 3;
}

/* The whole file into w->file. */
static int read_file(worker_t *w, const char *path, size_t *n, char *err, size_t err_len) {
    struct stat st;
    int fd = fs_open_regular(path, &st, err, err_len); /* a FIFO named like an image: refused */
    if (fd < 0) return -1;
    if ((size_t)st.st_size > MAX_FILE_BYTES) {
        close(fd);
        return snprintf(err, err_len, "%lld bytes; an image file has at most %zu",
                        (long long)st.st_size, MAX_FILE_BYTES),
               -1;
    }
    size_t size = (size_t)st.st_size;
    if (size > w->file_cap) {
        uint8_t *p = realloc(w->file, size);
        if (!p) {
            close(fd);
            return snprintf(err, err_len, "out of memory for %zu bytes", size), -1;
        }
        w->file = p;
        w->file_cap = size;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t k = read(fd, w->file + got, size - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    if (got != size)
        return snprintf(err, err_len, "cannot read: %s", got ? "short read" : strerror(errno)), -1;
    *n = size;
    return 0;
}

/* Sample index of d, decoded and transformed into dst. */
static int make_sample(worker_t *w, const slot_t *s, int64_t index, float *dst, char *err,
                       size_t err_len) {
    const loader_opts_t *o = &w->l->o;
    size_t n;
    if (read_file(w, s->data->paths[index], &n, err, err_len) < 0) return -1;
    image_info_t info;
    if (image_decode_info(&w->decoder, w->file, n, &info, err, err_len) < 0) return -1;
    if (image_plan_check(s->kind, info.width, info.height, o->size, err, err_len) < 0) return -1;
    image_plan_t plan =
        image_plan(s->kind, info.width, info.height, o->size, o->seed, s->epoch, index);
    int min_w, min_h, dw, dh;
    image_plan_min_decode(&plan, info.width, info.height, &min_w, &min_h);
    if (image_decode(&w->decoder, w->file, n, min_w, min_h, &dw, &dh, err, err_len) < 0) return -1;
    image_plan_t scaled = image_plan_scaled(&plan, info.width, info.height, dw, dh);
    if (image_apply(&scaled, w->decoder.pixels, dw, dh, o->size, o->mean, o->std, &w->scratch,
                    dst) < 0)
        return snprintf(err, err_len, "out of memory resampling a %dx%d image", dw, dh), -1;
    return 0;
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    loader_t *l = w->l;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        slot_t *s = NULL;
        for (int i = 0; i < l->o.slots; i++) {
            slot_t *c = &l->slots[i];
            if (c->state == SLOT_QUEUED && c->next < c->n && (!s || c->seq < s->seq)) s = c;
        }
        if (!s) {
            if (l->is_stopping) break;
            pthread_cond_wait(&l->work_cv, &l->mu);
            continue;
        }
        int k = s->next++;
        int64_t index = s->indices[k];
        pthread_mutex_unlock(&l->mu);
        char err[1024] = "";
        float *dst = s->pixels + (size_t)k * sample_floats(l);
        int rc = make_sample(w, s, index, dst, err, sizeof err);
        int64_t used = index, replaced = 0;
        for (int t = 1; rc < 0 && l->o.is_skip_bad && t <= SKIP_ATTEMPTS && t < s->data->n; t++) {
            used = (index + t) % s->data->n;
            replaced = 1;
            char again[1024];
            rc = make_sample(w, s, used, dst, again, sizeof again);
        }
        pthread_mutex_lock(&l->mu);
        if (rc < 0 && !s->err[0])
            snprintf(s->err, sizeof s->err, "%s: %s", s->data->paths[index], err);
        s->labels[k] = s->data->labels[used];
        l->skipped += replaced;
        if (++s->done == s->n) {
            s->state = SLOT_DONE;
            pthread_cond_broadcast(&l->done_cv);
        }
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

int loader_create(const loader_opts_t *o, loader_t **out, char *err, size_t err_len) {
    *out = NULL;
    loader_t *l = calloc(1, sizeof *l);
    if (!l) return snprintf(err, err_len, "out of memory for the loader"), -1;
    l->o = *o;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->work_cv, NULL);
    pthread_cond_init(&l->done_cv, NULL);
    l->slots = calloc((size_t)o->slots, sizeof *l->slots);
    l->workers = calloc((size_t)o->workers, sizeof *l->workers);
    bool is_ok = l->slots && l->workers;
    for (int i = 0; is_ok && i < o->slots; i++) {
        slot_t *s = &l->slots[i];
        s->indices = malloc(sizeof *s->indices * (size_t)o->batch_max);
        s->labels = malloc(sizeof *s->labels * (size_t)o->batch_max);
        s->pixels = malloc(sizeof *s->pixels * sample_floats(l) * (size_t)o->batch_max);
        is_ok = s->indices && s->labels && s->pixels;
    }
    for (int i = 0; is_ok && i < o->workers; i++) {
        worker_t *w = &l->workers[i];
        w->l = l;
        image_decoder_init(&w->decoder);
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) break;
        l->n_started++;
    }
    if (!is_ok || l->n_started < o->workers) {
        loader_destroy(l);
        return snprintf(err, err_len, "cannot start %d decode threads with %d batches of %d: %s",
                        o->workers, o->slots, o->batch_max, is_ok ? "threads" : "out of memory"),
               -1;
    }
    *out = l;
    return 0;
}

static slot_t *find(loader_t *l, uint64_t id) {
    for (int i = 0; i < l->o.slots; i++)
        if (l->slots[i].state != SLOT_FREE && l->slots[i].id == id) return &l->slots[i];
    return NULL;
}

void loader_submit(loader_t *l, uint64_t id, const dataset_t *d, image_transform_kind_t kind,
                   int64_t epoch, const int64_t *indices, int n) {
    pthread_mutex_lock(&l->mu);
    slot_t *s = NULL;
    for (;;) {
        for (int i = 0; i < l->o.slots && !s; i++)
            if (l->slots[i].state == SLOT_FREE) s = &l->slots[i];
        if (s) break;
        pthread_cond_wait(&l->done_cv, &l->mu);
    }
    s->state = SLOT_QUEUED;
    s->id = id;
    s->seq = l->next_seq++;
    s->data = d;
    s->kind = kind;
    s->epoch = epoch;
    s->n = n < l->o.batch_max ? n : l->o.batch_max;
    memcpy(s->indices, indices, sizeof *indices * (size_t)s->n);
    s->next = s->done = 0;
    s->err[0] = '\0';
    if (s->n == 0) s->state = SLOT_DONE;
    pthread_cond_broadcast(&l->work_cv);
    pthread_mutex_unlock(&l->mu);
}

bool loader_has(loader_t *l, uint64_t id) {
    pthread_mutex_lock(&l->mu);
    bool has = find(l, id) != NULL;
    pthread_mutex_unlock(&l->mu);
    return has;
}

int loader_take(loader_t *l, uint64_t id, loader_batch_t *out, char *err, size_t err_len) {
    pthread_mutex_lock(&l->mu);
    slot_t *s = find(l, id);
    while (s && s->state != SLOT_DONE)
        pthread_cond_wait(&l->done_cv, &l->mu);
    int rc = -1;
    if (!s)
        snprintf(err, err_len, "batch %llu was never submitted", (unsigned long long)id);
    else if (s->err[0])
        snprintf(err, err_len, "%s", s->err);
    else
        rc = 0;
    if (rc == 0) *out = (loader_batch_t){.pixels = s->pixels, .labels = s->labels, .n = s->n};
    pthread_mutex_unlock(&l->mu);
    return rc;
}

void loader_release(loader_t *l, uint64_t id) {
    pthread_mutex_lock(&l->mu);
    slot_t *s = find(l, id);
    if (s && s->state == SLOT_DONE) s->state = SLOT_FREE;
    pthread_cond_broadcast(&l->done_cv);
    pthread_mutex_unlock(&l->mu);
}

int64_t loader_skipped(loader_t *l) {
    pthread_mutex_lock(&l->mu);
    int64_t n = l->skipped;
    pthread_mutex_unlock(&l->mu);
    return n;
}

void loader_destroy(loader_t *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->is_stopping = true;
    /* unclaimed samples are abandoned; claimed ones finish */
    for (int i = 0; l->slots && i < l->o.slots; i++)
        l->slots[i].n = l->slots[i].next;
    pthread_cond_broadcast(&l->work_cv);
    pthread_mutex_unlock(&l->mu);
    for (int i = 0; i < l->n_started; i++)
        pthread_join(l->workers[i].thread, NULL);
    for (int i = 0; l->workers && i < l->o.workers; i++) {
        image_decoder_free(&l->workers[i].decoder);
        image_scratch_free(&l->workers[i].scratch);
        free(l->workers[i].file);
    }
    for (int i = 0; l->slots && i < l->o.slots; i++) {
        free(l->slots[i].indices);
        free(l->slots[i].labels);
        free(l->slots[i].pixels);
    }
    free(l->slots);
    free(l->workers);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->work_cv);
    pthread_cond_destroy(&l->done_cv);
    free(l);
}
