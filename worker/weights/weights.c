/* weights: see weights.h. The model's layers name the tensors; this file owns their shapes and
 * the layout permutations between ddpworker's NHWC arenas and PyTorch's NCHW state_dict. */
#include "weights.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "safetensors.h"
#include "ddp_error.h"

/* What a state_dict tensor is in the model. */
typedef enum { PART_WEIGHT, PART_BIAS, PART_RUNNING_MEAN, PART_RUNNING_VAR, PART_STEPS } part_t;

static const char *const part_suffix[] = {"weight", "bias", "running_mean", "running_var",
                                          "num_batches_tracked"};

typedef struct {
    char name[MODEL_LAYER_NAME_MAX + 24];
    int layer;
    part_t part;
    safetensors_tensor_t t; /* t.name points at name */
} tensor_ref_t;

static void add_ref(tensor_ref_t *refs, int *n, int layer, const char *prefix, part_t part,
                    safetensors_dtype_t dtype, int ndim, const uint64_t *shape) {
    tensor_ref_t *r = &refs[(*n)++];
    snprintf(r->name, sizeof r->name, "%s.%s", prefix, part_suffix[part]);
    r->layer = layer;
    r->part = part;
    r->t = (safetensors_tensor_t){.name = r->name, .dtype = dtype, .ndim = ndim};
    if (ndim) memcpy(r->t.shape, shape, sizeof(uint64_t) * (size_t)ndim);
}

/* The model's state_dict in torchvision's order (the layers'). *refs: malloc'ed; at most 5 per
 * layer. Returns the count, or -1 when out of memory. */
static int list_tensors(const model_t *m, tensor_ref_t **refs) {
    tensor_ref_t *r = malloc(sizeof *r * (size_t)(5 * m->n_layers + 1));
    if (!r) return -1;
    int n = 0;
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = &m->layers[i];
        if (!l->n_params) continue;
        uint64_t out = (uint64_t)m->tensors[l->out].c;
        const tensor_t *x = &m->tensors[l->in];
        if (l->kind == LAYER_CONV) {
            uint64_t w[4] = {out, (uint64_t)l->conv.c, (uint64_t)l->conv.r, (uint64_t)l->conv.s};
            add_ref(r, &n, i, l->name, PART_WEIGHT, SAFETENSORS_F32, 4, w);
            if (l->has_bias) add_ref(r, &n, i, l->name, PART_BIAS, SAFETENSORS_F32, 1, &out);
        } else if (l->kind == LAYER_LINEAR) {
            uint64_t w[2] = {out, (uint64_t)x->h * x->w * x->c};
            add_ref(r, &n, i, l->name, PART_WEIGHT, SAFETENSORS_F32, 2, w);
            add_ref(r, &n, i, l->name, PART_BIAS, SAFETENSORS_F32, 1, &out);
        } else if (l->kind == LAYER_BATCHNORM) {
            for (part_t p = PART_WEIGHT; p <= PART_RUNNING_VAR; p++)
                add_ref(r, &n, i, l->name, p, SAFETENSORS_F32, 1, &out);
            add_ref(r, &n, i, l->name, PART_STEPS, SAFETENSORS_I64, 0, NULL);
        }
    }
    *refs = r;
    return n;
}

/* Where a tensor's values live: `host` holds the parameter arena then the buffer arena. */
static float *values_of(const model_t *m, float *host, const tensor_ref_t *r) {
    const layer_t *l = &m->layers[r->layer];
    size_t n_w = (size_t)(r->part == PART_WEIGHT ? 0 : safetensors_elems(r->t.ndim, r->t.shape));
    switch (r->part) {
    case PART_WEIGHT:
        return host + l->param_offset;
    case PART_BIAS: /* after the weights: a conv's or linear's, or batch norm's gamma */
        return host + l->param_offset + l->n_params - n_w;
    case PART_RUNNING_MEAN:
        return host + m->n_params + l->buffer_offset;
    case PART_RUNNING_VAR:
        return host + m->n_params + l->buffer_offset + n_w;
    case PART_STEPS:
        break;
    }
    return NULL;
}

/* The index in ddpworker's layout of element i of the PyTorch tensor, for weights that differ. */
static size_t ours_of(const model_t *m, const tensor_ref_t *r, size_t i) {
    const layer_t *l = &m->layers[r->layer];
    if (r->part != PART_WEIGHT) return i;
    if (l->kind == LAYER_CONV) { /* torch (K, C, R, S) -> ours (K, R, S, C) */
        size_t c = (size_t)l->conv.c, rr = (size_t)l->conv.r, s = (size_t)l->conv.s;
        size_t x = i % s, y = i / s % rr, ch = i / (s * rr) % c, k = i / (s * rr * c);
        return ((k * rr + y) * s + x) * c + ch;
    }
    if (l->kind == LAYER_LINEAR) { /* columns: torch (C, H, W) -> ours (H, W, C) */
        const tensor_t *t = &m->tensors[l->in];
        size_t h = (size_t)t->h, w = (size_t)t->w, c = (size_t)t->c, in = h * w * c;
        size_t o = i / in, col = i % in, x = col % w, y = col / w % h, ch = col / (w * h);
        return o * in + (y * w + x) * c + ch;
    }
    return i;
}

typedef struct {
    model_t *m;
    float *host;
    const tensor_ref_t *refs;
    int64_t steps;
} save_ctx_t;

static int fill_tensor(void *arg, int i, void *buf, char *err, size_t err_len) {
    (void)err, (void)err_len;
    save_ctx_t *ctx = arg;
    const tensor_ref_t *r = &ctx->refs[i];
    if (r->part == PART_STEPS) {
        memcpy(buf, &ctx->steps, sizeof ctx->steps);
        return 0;
    }
    const float *src = values_of(ctx->m, ctx->host, r);
    float *dst = buf;
    size_t n = (size_t)safetensors_elems(r->t.ndim, r->t.shape);
    for (size_t j = 0; j < n; j++)
        dst[j] = src[ours_of(ctx->m, r, j)];
    return 0;
}

/* The model's parameters then buffers, read back from the backend. */
static float *host_copy(model_t *m) {
    float *host = malloc(sizeof(float) * (m->n_params + m->n_buffers + 1));
    if (!host) return NULL;
    backend_t *b = m->backend;
    b->mem->to_host(b, host, m->params, m->n_params * sizeof(float));
    b->mem->to_host(b, host + m->n_params, m->buffers, m->n_buffers * sizeof(float));
    return host;
}

int weights_save(model_t *m, const char *path, int64_t steps, char *err, size_t err_len) {
    return weights_save_tagged(m, path, steps, NULL, err, err_len);
}

int weights_save_tagged(model_t *m, const char *path, int64_t steps, const char *const *tags,
                        char *err, size_t err_len) {
    const char *meta[8 + 2 * WEIGHTS_MAX_TAGS] = {"format",    "pt",    "producer",
                                                  "ddpworker", "model", m->name};
    for (int i = 0; tags && tags[i] && tags[i + 1]; i += 2) {
        if (i >= 2 * WEIGHTS_MAX_TAGS)
            return ddp_errf(err, err_len, "%s: more than %d tags", path, WEIGHTS_MAX_TAGS);
        meta[6 + i] = tags[i];
        meta[7 + i] = tags[i + 1];
    }
    tensor_ref_t *refs = NULL;
    int n = list_tensors(m, &refs);
    float *host = n >= 0 ? host_copy(m) : NULL;
    if (!host) {
        free(refs);
        return ddp_errf(err, err_len, "%s: out of memory for a host copy of %zu parameters", path,
                        m->n_params);
    }
    safetensors_tensor_t *t = malloc(sizeof *t * (size_t)(n + 1));
    int rc = -1;
    if (!t) {
        ddp_errf(err, err_len, "%s: out of memory", path);
    } else {
        for (int i = 0; i < n; i++)
            t[i] = refs[i].t;
        save_ctx_t ctx = {.m = m, .host = host, .refs = refs, .steps = steps};
        rc = safetensors_write(path, t, n, meta, fill_tensor, &ctx, err, err_len);
    }
    free(t);
    free(host);
    free(refs);
    return rc;
}

int weights_read_tag(const char *path, const char *key, char *out, size_t out_len, char *err,
                     size_t err_len) {
    safetensors_index_t ix;
    int fd = safetensors_open(path, &ix, err, err_len);
    if (fd < 0) return -1;
    close(fd);
    const char *value = safetensors_meta(&ix, key);
    if (value) snprintf(out, out_len, "%s", value);
    safetensors_index_free(&ix);
    return value != NULL;
}

/* ---- loading ---- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Element i of raw data of dtype t, exactly (floating types only): F64 stays a double so that a
 * value beyond float's range is seen before it is converted. */
static double element(const void *raw, safetensors_dtype_t t, size_t i) {
    switch (t) {
    case SAFETENSORS_F32: {
        float f;
        memcpy(&f, (const uint8_t *)raw + 4 * i, 4);
        return f;
    }
    case SAFETENSORS_F64: {
        double d;
        memcpy(&d, (const uint8_t *)raw + 8 * i, 8);
        return d;
    }
    case SAFETENSORS_F16: {
        uint16_t h;
        memcpy(&h, (const uint8_t *)raw + 2 * i, 2);
        return half_to_float(h);
    }
    case SAFETENSORS_BF16: {
        uint16_t h;
        memcpy(&h, (const uint8_t *)raw + 2 * i, 2);
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    default:
        return 0.0;
    }
}

/* Whether v is a float that a parameter may hold: not NaN, not infinite, within float's range. */
static bool is_finite_float(double v) {
    return fabs(v) <= FLT_MAX; /* false for NaN too */
}

static bool is_float_type(safetensors_dtype_t t) {
    return t == SAFETENSORS_F32 || t == SAFETENSORS_F16 || t == SAFETENSORS_BF16 ||
           t == SAFETENSORS_F64;
}

static void format_shape(char *buf, size_t len, int ndim, const uint64_t *shape) {
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%llu", i ? ", " : "",
                               (unsigned long long)shape[i]);
    if (at < len) snprintf(buf + at, len - at, "]");
}

/* Whether entry e can fill reference r: the dtype's kind and the shape (num_batches_tracked: any
 * integer scalar). Sets why when not. */
static bool fits(const tensor_ref_t *r, const safetensors_entry_t *e, char *why, size_t len) {
    if (r->part == PART_STEPS) {
        bool is_int = e->dtype == SAFETENSORS_I64 || e->dtype == SAFETENSORS_I32;
        bool is_scalar = e->ndim == 0 || (e->ndim == 1 && e->shape[0] == 1);
        if (is_int && is_scalar) return true;
        snprintf(why, len, "a %s tensor of %d dimensions, not an integer scalar",
                 safetensors_dtype_name(e->dtype), e->ndim);
        return false;
    }
    if (!is_float_type(e->dtype)) {
        snprintf(why, len, "dtype %s, not a floating-point type (F32, F16, BF16, F64)",
                 safetensors_dtype_name(e->dtype));
        return false;
    }
    bool is_same = e->ndim == r->t.ndim;
    for (int d = 0; is_same && d < e->ndim; d++)
        is_same = e->shape[d] == r->t.shape[d];
    if (is_same) return true;
    char a[128], b[128];
    format_shape(a, sizeof a, e->ndim, e->shape);
    format_shape(b, sizeof b, r->t.ndim, r->t.shape);
    snprintf(why, len, "shape %s in the file, %s in the model", a, b);
    return false;
}

/* Whether name is on the comma-separated list (entries trimmed; "prefix*" matches a prefix). */
static bool is_listed(const char *list, const char *name) {
    for (const char *p = list; p && *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        while (n && p[n - 1] == ' ')
            n--;
        bool is_prefix = n && p[n - 1] == '*';
        size_t k = n - is_prefix;
        if (n &&
            (is_prefix ? strncmp(name, p, k) == 0 : strlen(name) == k && strncmp(name, p, k) == 0))
            return true;
        p = end ? end + 1 : p + n;
    }
    return false;
}

/* A tensor that does not load: a model tensor the file lacks or has in another shape or type, or a
 * file tensor the model lacks; is_head: the model's final layer's (a classifier head). */
typedef struct {
    const char *name;
    char why[320];
    bool is_head;
} problem_t;

#define NAMED_MAX 8 /* tensors named one by one; more are counted */

/* "tensor 'A': why; tensor 'B': why; ... and N more" of problems[0..n) into buf. */
static void describe_problems(char *buf, size_t len, const problem_t *p, int n) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && i < 3 && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%stensor '%s': %s", i ? "; " : "", p[i].name,
                               p[i].why);
    if (n > 3 && at < len) snprintf(buf + at, len - at, "; and %d more", n - 3);
}

/* Names of the n tensors into buf, "a, b, c", the first NAMED_MAX of them then "and N more". */
static void list_names(char *buf, size_t len, const char *const *names, int n) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && i < NAMED_MAX && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "", names[i]);
    if (n > NAMED_MAX && at < len) snprintf(buf + at, len - at, " and %d more", n - NAMED_MAX);
}

/* Every list entry must name a tensor of the model or of the file: a typo would skip nothing. */
static int check_list(const char *list, const tensor_ref_t *refs, int n,
                      const safetensors_index_t *ix, const char *path, char *err, size_t err_len) {
    for (const char *p = list; p && *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *end = strchr(p, ',');
        size_t k = end ? (size_t)(end - p) : strlen(p);
        while (k && p[k - 1] == ' ')
            k--;
        char entry[256];
        snprintf(entry, sizeof entry, "%.*s", (int)(k < sizeof entry ? k : sizeof entry - 1), p);
        bool is_used = !k;
        for (int i = 0; i < n && !is_used; i++)
            is_used = is_listed(entry, refs[i].name);
        for (int i = 0; i < ix->n && !is_used; i++)
            is_used = is_listed(entry, ix->entries[i].name);
        if (!is_used)
            return ddp_errf(err, err_len,
                            "model.init_skip: '%s' names no tensor of the model nor of %s "
                            "(names are torchvision's state_dict keys, e.g. classifier.6.weight; "
                            "'classifier.*' names a prefix)",
                            entry, path);
        p = end ? end + 1 : p + k;
    }
    return 0;
}

int weights_load(model_t *m, const char *path, bool is_skip_mismatched, FILE *log, char *err,
                 size_t err_len) {
    weights_skip_t skip = {.is_skip_head = is_skip_mismatched};
    return weights_load_init(m, path, &skip, log, err, err_len);
}

int weights_load_init(model_t *m, const char *path, const weights_skip_t *skip, FILE *log,
                      char *err, size_t err_len) {
    weights_skip_t none = {0};
    if (!skip) skip = &none;
    safetensors_index_t ix;
    int fd = safetensors_open(path, &ix, err, err_len);
    if (fd < 0) return -1;
    tensor_ref_t *refs = NULL;
    int n = list_tensors(m, &refs);
    float *host = n >= 0 ? host_copy(m) : NULL;
    bool *is_used = calloc((size_t)ix.n + 1, sizeof *is_used);
    bool *is_loading = calloc((size_t)(n > 0 ? n : 0) + 1, sizeof *is_loading);
    problem_t *problems = calloc((size_t)(n > 0 ? n : 0) + (size_t)ix.n + 1, sizeof *problems);
    const char **skipped = calloc((size_t)(n > 0 ? n : 0) + (size_t)ix.n + 1, sizeof *skipped);
    int rc = host && is_used && is_loading && problems && skipped
                 ? 0
                 : ddp_errf(err, err_len, "%s: out of memory", path);
    if (rc == 0) rc = check_list(skip->skip, refs, n, &ix, path, err, err_len);
    /* the final layer: the last one with parameters (torchvision's fc, classifier.6) */
    int head = -1;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].n_params) head = i;
    int n_problems = 0, n_refused = 0, n_skipped = 0, n_listed = 0, n_loaded = 0, n_absent = 0;
    char why[320];
    /* which tensors load, which are skipped (listed, or the head's that do not fit), which refuse
     */
    for (int i = 0; i < n && rc == 0; i++) {
        const tensor_ref_t *r = &refs[i];
        const safetensors_entry_t *e = safetensors_find(&ix, r->name);
        if (e) is_used[e - ix.entries] = true;
        if (is_listed(skip->skip, r->name)) {
            skipped[n_skipped++] = r->name;
            n_listed++;
            continue;
        }
        if (!e && r->part == PART_STEPS) { /* PyTorch accepts its absence too */
            n_absent++;
            continue;
        }
        bool is_fit = e && fits(r, e, why, sizeof why);
        if (is_fit) {
            is_loading[i] = true;
            continue;
        }
        problem_t *p = &problems[n_problems++];
        p->name = r->name;
        p->is_head = r->layer == head;
        snprintf(p->why, sizeof p->why, "%s", e ? why : "not in the file");
        if (p->is_head && skip->is_skip_head)
            skipped[n_skipped++] = r->name;
        else
            n_refused++;
    }
    int n_ignored = 0; /* the file's tensors that the model lacks, listed */
    for (int i = 0; i < ix.n && rc == 0; i++) {
        if (is_used[i]) continue;
        if (is_listed(skip->skip, ix.entries[i].name)) {
            n_ignored++;
            continue;
        }
        problem_t *p = &problems[n_problems++];
        p->name = ix.entries[i].name;
        snprintf(p->why, sizeof p->why, "not in the model");
        n_refused++;
    }
    int n_values = 0; /* tensors that will load and carry values (not just a num_batches_tracked) */
    for (int i = 0; i < n; i++)
        n_values += is_loading[i] && refs[i].part != PART_STEPS;
    if (rc == 0 && n_values == 0 && n > 0)
        rc = ddp_errf(err, err_len,
                      "%s: no tensor of the file fits model %s (another architecture?)", path,
                      m->name);
    if (rc == 0 && n_refused) {
        /* the refused ones first: they are what the user must look at */
        problem_t *sorted = calloc((size_t)n_problems + 1, sizeof *sorted);
        int k = 0;
        for (int pass = 0; sorted && pass < 2; pass++)
            for (int i = 0; i < n_problems; i++) {
                bool is_refused = !(problems[i].is_head && skip->is_skip_head);
                if (is_refused == (pass == 0)) sorted[k++] = problems[i];
            }
        char list[1024];
        describe_problems(list, sizeof list, sorted ? sorted : problems, n_refused);
        free(sorted);
        bool is_head_only = true;
        for (int i = 0; i < n_problems; i++)
            is_head_only &= problems[i].is_head;
        const char *hint =
            is_head_only ? "model.init_skip_mismatched = true keeps the final layer's drawn values "
                           "instead (a new classifier head)"
            : skip->is_skip_head
                ? "model.init_skip_mismatched skips only the final layer (a new classifier head): "
                  "check model.name, model.width and model.fc_width against the file, or list the "
                  "tensors to skip in model.init_skip"
                : "check model.name, model.width and model.fc_width against the file, or list the "
                  "tensors to skip in model.init_skip";
        rc = ddp_errf(err, err_len,
                      "%s: %s (%d of the model's %d tensors and the file's %d do not fit "
                      "model %s%s%s): %s",
                      path, list, n_refused, n, ix.n, m->name, head >= 0 ? ", final layer " : "",
                      head >= 0 ? m->layers[head].name : "", hint);
    }
    for (int i = 0; i < n && rc == 0; i++) {
        const tensor_ref_t *r = &refs[i];
        if (!is_loading[i]) continue;
        n_loaded++;
        if (r->part == PART_STEPS) continue; /* ddpworker keeps no such count */
        const safetensors_entry_t *e = safetensors_find(&ix, r->name);
        void *raw = malloc((size_t)(e->end - e->begin) + 1);
        if (!raw) {
            rc = ddp_errf(err, err_len, "%s: out of memory for tensor '%s'", path, r->name);
        } else if (safetensors_read(fd, &ix, e, raw, why, sizeof why) < 0) {
            rc = ddp_errf(err, err_len, "%s: %s", path, why);
        } else {
            float *dst = values_of(m, host, r);
            size_t count = (size_t)safetensors_elems(r->t.ndim, r->t.shape), n_bad = 0, first = 0;
            for (size_t j = 0; j < count; j++) {
                double v = element(raw, e->dtype, j);
                if (!is_finite_float(v)) {
                    if (n_bad++ == 0) first = j;
                    continue;
                }
                dst[ours_of(m, r, j)] = (float)v;
            }
            /* a diverged run's weights: training from them only spreads the NaN */
            if (n_bad)
                rc = ddp_errf(err, err_len,
                              "%s: tensor '%s': %zu of its %zu values are NaN, infinite or beyond "
                              "float's range (the first is element %zu): not weights to start "
                              "from",
                              path, r->name, n_bad, count, first);
        }
        free(raw);
    }
    if (rc == 0 && log) {
        char names[1024];
        list_names(names, sizeof names, skipped, n_skipped);
        fprintf(log, "ddpworker: model.init: %s: loaded %d of the model's %d tensors", path,
                n_loaded, n - n_absent);
        if (n_skipped)
            fprintf(log, "; skipped %d, which keep their drawn initial values (%s): %s", n_skipped,
                    !n_listed              ? "model.init_skip_mismatched"
                    : n_skipped > n_listed ? "model.init_skip, model.init_skip_mismatched"
                                           : "model.init_skip",
                    names);
        if (n_ignored)
            fprintf(log, "; ignored %d of the file's tensors (model.init_skip)", n_ignored);
        fputc('\n', log);
        for (int i = 0, shown = 0; i < n_problems && shown < NAMED_MAX; i++)
            if (problems[i].is_head && skip->is_skip_head) {
                fprintf(log, "ddpworker: model.init: %s: skipping tensor '%s': %s\n", path,
                        problems[i].name, problems[i].why);
                shown++;
            }
    }
    if (rc == 0) {
        backend_t *b = m->backend;
        b->mem->to_device(b, m->params, host, m->n_params * sizeof(float));
        b->mem->to_device(b, m->buffers, host + m->n_params, m->n_buffers * sizeof(float));
    }
    close(fd);
    free(skipped);
    free(problems);
    free(is_loading);
    free(is_used);
    free(host);
    free(refs);
    safetensors_index_free(&ix);
    return rc;
}
