/* weights: save then load gives back every parameter and running statistic bit for bit, on every
 * architecture; the file holds PyTorch's layouts (a conv filter's (K, C, R, S), a linear layer's
 * columns in (C, H, W) order after a conv); num_batches_tracked is the step count; a tensor of
 * another shape is an error naming it, or with skipping a line on the log and the model's value
 * kept; a NaN, infinite or out-of-float-range value is an error naming the file and the tensor. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "temp_dir.h"
#include "rng.h"
#include "safetensors.h"
#include "weights.h"

static backend_t *backend;
static char dir[64];

static void setup(void) {
    backend = backend_cpu_create(1);
    cr_assert_not_null(backend);
    temp_dir_make(dir, sizeof dir, "test_weights");
}

static void teardown(void) {
    backend->mem->destroy(backend);
    temp_dir_remove(dir);
}

TestSuite(weights, .init = setup, .fini = teardown, .timeout = 60);

static void make(model_t *m, const char *name, int width, int side, int classes, uint64_t seed) {
    char err[256];
    model_opts_t o = model_opts_default(name, width);
    o.fc_width = 24;
    cr_assert_eq(model_init_opts(m, backend, &o, side, side, 3, classes, 2, err, sizeof err), 0,
                 "%s", err);
    cr_assert_eq(model_init_params(m, seed), 0);
    uint64_t s = seed;
    for (size_t i = 0; i < m->n_buffers; i++) /* statistics off their initial 0 and 1 */
        m->buffers[i] = 0.5f + (float)(rng_next(&s) >> 40) / (float)(1 << 24);
}

static const char *path_of(const char *name) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

Test(weights, save_then_load_is_the_identity) {
    const char *names[] = {"mlp", "cnn", "resnet18", "resnet50", "vgg11_bn", "vgg13"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        model_t a, b;
        char err[1024];
        make(&a, names[k], 4, 32, 5, 1);
        make(&b, names[k], 4, 32, 5, 2);
        const char *path = path_of("roundtrip.safetensors");
        cr_assert_eq(weights_save(&a, path, 42, err, sizeof err), 0, "%s", err);
        cr_assert_eq(weights_load(&b, path, false, stderr, err, sizeof err), 0, "%s: %s", names[k],
                     err);
        cr_assert(memcmp(a.params, b.params, a.n_params * sizeof(float)) == 0, "%s: parameters",
                  names[k]);
        cr_assert(memcmp(a.buffers, b.buffers, a.n_buffers * sizeof(float)) == 0, "%s: statistics",
                  names[k]);
        model_free(&a);
        model_free(&b);
    }
}

/* Element [i] of tensor name of the file, as float or int64. */
static void read_tensor(const char *path, const char *name, void *out, safetensors_entry_t *shape) {
    safetensors_index_t ix;
    char err[512];
    int fd = safetensors_open(path, &ix, err, sizeof err);
    cr_assert_geq(fd, 0, "%s", err);
    const safetensors_entry_t *e = safetensors_find(&ix, name);
    cr_assert_not_null(e, "no tensor %s", name);
    *shape = *e;
    shape->name = NULL;
    cr_assert_eq(safetensors_read(fd, &ix, e, out, err, sizeof err), 0, "%s", err);
    close(fd);
    safetensors_index_free(&ix);
}

Test(weights, files_hold_pytorch_layouts) {
    model_t m;
    char err[1024];
    make(&m, "cnn", 3, 8, 4, 3); /* 0: conv 3x3x3 -> 3, 9: linear over (2, 2, 6) */
    const char *path = path_of("layout.safetensors");
    cr_assert_eq(weights_save(&m, path, 17, err, sizeof err), 0, "%s", err);
    float *w = malloc(4096 * sizeof *w);
    safetensors_entry_t e;
    read_tensor(path, "0.weight", w, &e);
    cr_assert_eq(e.ndim, 4);
    cr_assert(e.shape[0] == 3 && e.shape[1] == 3 && e.shape[2] == 3 && e.shape[3] == 3);
    const float *conv = m.params + m.layers[0].param_offset; /* (K, R, S, C) */
    for (int k = 0; k < 3; k++)
        for (int c = 0; c < 3; c++)
            for (int r = 0; r < 3; r++)
                for (int s = 0; s < 3; s++)
                    cr_assert_eq(w[((k * 3 + c) * 3 + r) * 3 + s],
                                 conv[((k * 3 + r) * 3 + s) * 3 + c]);
    const layer_t *fc = &m.layers[m.n_layers - 1];
    cr_assert_str_eq(fc->name, "9");
    read_tensor(path, "9.weight", w, &e);
    cr_assert(e.ndim == 2 && e.shape[0] == 4 && e.shape[1] == 24);
    const float *lin = m.params + fc->param_offset; /* columns (H, W, C) = (2, 2, 6) */
    for (int o = 0; o < 4; o++)
        for (int c = 0; c < 6; c++)
            for (int y = 0; y < 2; y++)
                for (int x = 0; x < 2; x++)
                    cr_assert_eq(w[o * 24 + (c * 2 + y) * 2 + x],
                                 lin[o * 24 + (y * 2 + x) * 6 + c]);
    int64_t steps = 0;
    read_tensor(path, "1.num_batches_tracked", &steps, &e);
    cr_assert_eq(e.dtype, SAFETENSORS_I64);
    cr_assert_eq(e.ndim, 0);
    cr_assert_eq(steps, 17);
    read_tensor(path, "5.running_var", w, &e);
    cr_assert_eq(w[2], m.buffers[m.layers[5].buffer_offset + 6 + 2]); /* after 6 means */
    free(w);
    model_free(&m);
}

Test(weights, another_shape_is_an_error_or_skipped_and_named) {
    model_t ten, five;
    char err[1024];
    make(&ten, "resnet18", 4, 32, 10, 1);
    make(&five, "resnet18", 4, 32, 5, 2);
    const char *path = path_of("ten.safetensors");
    cr_assert_eq(weights_save(&ten, path, 0, err, sizeof err), 0, "%s", err);
    cr_assert_eq(weights_load(&five, path, false, stderr, err, sizeof err), -1);
    cr_assert(
        strstr(err, path) &&
            strstr(err, "tensor 'fc.weight': shape [10, 32] in the file, [5, 32] in the model"),
        "%s", err);
    float *before = malloc(five.n_params * sizeof(float));
    memcpy(before, five.params, five.n_params * sizeof(float));
    FILE *log = tmpfile();
    cr_assert_eq(weights_load(&five, path, true, log, err, sizeof err), 0, "%s", err);
    char text[1024] = "";
    rewind(log);
    size_t got = fread(text, 1, sizeof text - 1, log);
    text[got] = '\0';
    fclose(log);
    cr_assert(strstr(text, "skipping tensor 'fc.weight'") &&
                  strstr(text, "skipping tensor 'fc.bias'"),
              "%s", text);
    const layer_t *fc = &five.layers[five.n_layers - 1];
    cr_assert(memcmp(five.params + fc->param_offset, before + fc->param_offset,
                     fc->n_params * sizeof(float)) == 0,
              "the skipped head keeps its values");
    cr_assert(memcmp(five.params, ten.params, fc->param_offset * sizeof(float)) == 0,
              "the rest is the file's");
    free(before);
    model_free(&ten);
    model_free(&five);
}

static char *read_log(FILE *log) {
    static char text[8192];
    rewind(log);
    size_t got = fread(text, 1, sizeof text - 1, log);
    text[got] = '\0';
    fclose(log);
    return text;
}

/* A file of another width fits nowhere but in a few counters: skipping is for the final layer
 * only, so model.init_skip_mismatched refuses, naming the first mismatches and counting them, and
 * the model keeps its values; listing the tensors (model.init_skip) skips them on purpose, and
 * every load says how many tensors loaded and which were skipped. */
Test(weights, skipping_beyond_the_final_layer_is_refused_unless_listed) {
    model_t wide, narrow;
    char err[2048];
    make(&wide, "vgg11_bn", 8, 32, 10, 1);
    make(&narrow, "vgg11_bn", 4, 32, 5, 2);
    const char *path = path_of("wide.safetensors");
    cr_assert_eq(weights_save(&wide, path, 0, err, sizeof err), 0, "%s", err);
    float *before = malloc(narrow.n_params * sizeof(float));
    memcpy(before, narrow.params, narrow.n_params * sizeof(float));
    weights_skip_t head = {.is_skip_head = true};
    FILE *log = tmpfile();
    cr_assert_eq(weights_load_init(&narrow, path, &head, log, err, sizeof err), -1);
    cr_assert_str_eq(read_log(log), "", "nothing loaded, nothing reported as loaded");
    cr_assert(strstr(err, "tensor 'features.0.weight': shape [8, 3, 3, 3] in the file, [4, 3, 3, "
                          "3] in the model; "
                          "tensor 'features.0.bias'"),
              "%s", err);
    /* 8 convs (weight, bias) and 8 batch norms (weight, bias, mean, var), and the classifier's
     * first weight (its input is 8 channels wide); the final layer (5 classes) may be skipped */
    cr_assert(strstr(err, "and 46 more (49 of the model's 62 tensors and the file's 62 do not fit "
                          "model vgg11_bn, "
                          "final layer classifier.6)"),
              "%s", err);
    cr_assert(strstr(err, "model.init_skip_mismatched skips only the final layer") &&
                  strstr(err, "model.init_skip"),
              "%s", err);
    cr_assert(memcmp(narrow.params, before, narrow.n_params * sizeof(float)) == 0,
              "a refused load changes nothing");
    /* listed, they are skipped on purpose; the new head of 5 classes is skipped as such */
    weights_skip_t listed = {.is_skip_head = true, .skip = "features.*, classifier.0.weight"};
    log = tmpfile();
    cr_assert_eq(weights_load_init(&narrow, path, &listed, log, err, sizeof err), 0, "%s", err);
    char *text = read_log(log);
    cr_assert(
        strstr(
            text,
            "loaded 3 of the model's 62 tensors; skipped 59, which keep their drawn initial values "
            "(model.init_skip, model.init_skip_mismatched): features.0.weight, features.0.bias,"),
        "%s", text);
    cr_assert(strstr(text, "and 51 more\n"), "%s", text);
    cr_assert(strstr(text, "skipping tensor 'classifier.6.weight': shape [10, 24] in the file, [5, "
                           "24] in the model"),
              "%s", text);
    const layer_t *fc = &narrow.layers[narrow.n_layers - 1];
    cr_assert(memcmp(narrow.params + fc->param_offset, before + fc->param_offset,
                     fc->n_params * sizeof(float)) == 0,
              "the skipped head: as drawn");
    size_t features = 0; /* the parameters before the classifier's */
    for (int i = 0; i < narrow.n_layers; i++)
        if (strncmp(narrow.layers[i].name, "classifier.", 11) == 0 && !features)
            features = narrow.layers[i].param_offset;
    cr_assert(features > 0 && memcmp(narrow.params, before, features * sizeof(float)) == 0,
              "skipped: as drawn");
    /* a name that matches nothing is a typo, not a skip */
    weights_skip_t typo = {.skip = "clasifier.6.*"};
    cr_assert_eq(weights_load_init(&narrow, path, &typo, NULL, err, sizeof err), -1);
    cr_assert(strstr(err, "model.init_skip: 'clasifier.6.*' names no tensor of the model nor of"),
              "%s", err);
    /* a strict load of a file that fits says so */
    log = tmpfile();
    cr_assert_eq(weights_load_init(&wide, path, NULL, log, err, sizeof err), 0, "%s", err);
    text = read_log(log);
    cr_assert(strstr(text, "loaded 62 of the model's 62 tensors\n"), "%s", text);
    free(before);
    model_free(&wide);
    model_free(&narrow);
}

/* Tags go to __metadata__ (where PyTorch ignores them) and read back by key; the weights load as
 * if untagged. */
Test(weights, tags_are_kept_in_the_metadata) {
    model_t a, b;
    char err[1024], value[64];
    make(&a, "cnn", 4, 16, 3, 1);
    make(&b, "cnn", 4, 16, 3, 2);
    const char *path = path_of("tagged.safetensors");
    const char *tags[] = {"ddpworker.best_value", "0.25", "ddpworker.best_step", "12", NULL};
    cr_assert_eq(weights_save_tagged(&a, path, 12, tags, err, sizeof err), 0, "%s", err);
    cr_assert_eq(
        weights_read_tag(path, "ddpworker.best_value", value, sizeof value, err, sizeof err), 1);
    cr_assert_str_eq(value, "0.25");
    cr_assert_eq(weights_read_tag(path, "model", value, sizeof value, err, sizeof err), 1);
    cr_assert_str_eq(value, "cnn");
    cr_assert_eq(weights_read_tag(path, "ddpworker.nothing", value, sizeof value, err, sizeof err),
                 0);
    cr_assert_eq(weights_load(&b, path, false, stderr, err, sizeof err), 0, "%s", err);
    cr_assert(memcmp(a.params, b.params, a.n_params * sizeof(float)) == 0);
    cr_assert_eq(weights_read_tag(path_of("none.safetensors"), "model", value, sizeof value, err,
                                  sizeof err),
                 -1);
    cr_assert(strstr(err, "none.safetensors"), "%s", err);
    const char *too_many[2 * WEIGHTS_MAX_TAGS + 3] = {0};
    for (int i = 0; i < 2 * WEIGHTS_MAX_TAGS + 2; i++)
        too_many[i] = "x";
    cr_assert_eq(weights_save_tagged(&a, path, 12, too_many, err, sizeof err), -1);
    cr_assert(strstr(err, "more than 8 tags"), "%s", err);
    model_free(&a);
    model_free(&b);
}

/* A diverged run's weights (NaN, inf) were accepted as model.init and trained from. */
Test(weights, a_non_finite_value_is_refused_naming_the_file_and_the_tensor) {
    model_t a, b;
    char err[1024];
    make(&a, "cnn", 4, 16, 3, 1);
    make(&b, "cnn", 4, 16, 3, 2);
    const layer_t *fc = &a.layers[a.n_layers - 1];
    a.params[fc->param_offset + 1] = NAN;
    a.params[fc->param_offset + 5] = INFINITY;
    a.params[fc->param_offset + 6] = -INFINITY;
    const char *path = path_of("nan.safetensors");
    cr_assert_eq(weights_save(&a, path, 0, err, sizeof err), 0, "%s", err);
    float *before = malloc(b.n_params * sizeof(float));
    memcpy(before, b.params, b.n_params * sizeof(float));
    cr_assert_eq(weights_load(&b, path, false, NULL, err, sizeof err), -1, "NaN weights loaded");
    char want[512];
    snprintf(want, sizeof want, "%s: tensor '%s.weight': 3 of its %zu values are NaN, infinite",
             path, fc->name, (size_t)(fc->n_params - 3));
    cr_assert(strstr(err, want), "'%s' lacks '%s'", err, want);
    cr_assert(strstr(err, "(the first is element"), "%s", err);
    cr_assert(memcmp(b.params, before, b.n_params * sizeof(float)) == 0,
              "a refused load changes nothing");
    free(before);
    model_free(&a);
    model_free(&b);
}

typedef struct {
    const safetensors_index_t *ix;
    int fd;
    double huge;
} f64_copy_t;

/* Tensor i of the F32 file as F64, its first element replaced by huge when it is a weight. */
static int fill_f64(void *arg, int i, void *buf, char *err, size_t err_len) {
    f64_copy_t *c = arg;
    const safetensors_entry_t *e = &c->ix->entries[i];
    size_t n = (size_t)safetensors_elems(e->ndim, e->shape);
    if (e->dtype != SAFETENSORS_F32) return safetensors_read(c->fd, c->ix, e, buf, err, err_len);
    float *f = malloc(n * sizeof *f + 1);
    cr_assert_eq(safetensors_read(c->fd, c->ix, e, f, err, err_len), 0, "%s", err);
    double *d = buf;
    for (size_t j = 0; j < n; j++)
        d[j] = f[j];
    if (n && strstr(e->name, ".weight")) d[0] = c->huge;
    free(f);
    return 0;
}

/* An F64 value beyond float's range became inf (undefined, strictly) on conversion. */
Test(weights, an_f64_value_beyond_floats_range_is_refused) {
    model_t a, b;
    char err[1024];
    make(&a, "mlp", 4, 8, 3, 1);
    make(&b, "mlp", 4, 8, 3, 2);
    const char *path32 = path_of("f32.safetensors");
    cr_assert_eq(weights_save(&a, path32, 0, err, sizeof err), 0, "%s", err);
    safetensors_index_t ix;
    int fd = safetensors_open(path32, &ix, err, sizeof err);
    cr_assert_geq(fd, 0, "%s", err);
    safetensors_tensor_t *t = calloc((size_t)ix.n, sizeof *t);
    for (int i = 0; i < ix.n; i++) {
        const safetensors_entry_t *e = &ix.entries[i];
        t[i] = (safetensors_tensor_t){.name = e->name, .dtype = e->dtype, .ndim = e->ndim};
        if (e->dtype == SAFETENSORS_F32) t[i].dtype = SAFETENSORS_F64;
        memcpy(t[i].shape, e->shape, sizeof e->shape);
    }
    f64_copy_t copy = {.ix = &ix, .fd = fd, .huge = 1e300};
    const char *path64 = path_of("f64.safetensors");
    cr_assert_eq(safetensors_write(path64, t, ix.n, NULL, fill_f64, &copy, err, sizeof err), 0,
                 "%s", err);
    cr_assert_eq(weights_load(&b, path64, false, NULL, err, sizeof err), -1, "1e300 loaded");
    cr_assert(strstr(err, "f64.safetensors: tensor '") && strstr(err, ".weight': 1 of its ") &&
                  strstr(err, "beyond float's range"),
              "%s", err);
    copy.huge = 0.25; /* within range: the F64 file loads */
    cr_assert_eq(safetensors_write(path64, t, ix.n, NULL, fill_f64, &copy, err, sizeof err), 0,
                 "%s", err);
    cr_assert_eq(weights_load(&b, path64, false, NULL, err, sizeof err), 0, "%s", err);
    free(t);
    close(fd);
    safetensors_index_free(&ix);
    model_free(&a);
    model_free(&b);
}
