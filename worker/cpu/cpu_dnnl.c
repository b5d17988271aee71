/* cpu_dnnl: see cpu_dnnl.h. Plain layouts in and out (nhwc activations, ohwi weights): the
 * backend's tensors are used in place, no reorders. The backward primitives have no "add to the
 * destination" (post-ops are forward only), so their results land in scratch buffers that are then
 * added to dx and dw, as the backend's contract asks. */
#include "cpu_dnnl.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef DDP_HAVE_ONEDNN
cpu_dnnl_t *cpu_dnnl_create(void) {
    return NULL;
}
void cpu_dnnl_destroy(cpu_dnnl_t *d) {
    (void)d;
}
int cpu_dnnl_conv_forward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                          float *y) {
    (void)d, (void)s, (void)x, (void)w, (void)y;
    return -1;
}
int cpu_dnnl_conv_backward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                           const float *dy, float *dx, float *dw) {
    (void)d, (void)s, (void)x, (void)w, (void)dy, (void)dx, (void)dw;
    return -1;
}
#else

#include <oneapi/dnnl/dnnl.h>

/* A ResNet-152 has under 40 distinct convolution shapes per batch size; evaluation batches add a
 * few. Shapes past this run on im2col. */
#define MAX_SHAPES 128

typedef struct {
    conv_shape_t shape;
    bool is_failed; /* oneDNN refused it: im2col from then on */
    dnnl_primitive_t fwd, bwd_data, bwd_weights;
    dnnl_memory_t x, w, y;   /* handles swapped per call */
    float *dx_tmp, *dw_tmp;  /* backward results before they are added */
} entry_t;

struct cpu_dnnl {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    entry_t entries[MAX_SHAPES];
    int n_entries;
};

cpu_dnnl_t *cpu_dnnl_create(void) {
    cpu_dnnl_t *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    if (dnnl_engine_create(&d->engine, dnnl_cpu, 0) != dnnl_success) {
        free(d);
        return NULL;
    }
    if (dnnl_stream_create(&d->stream, d->engine, dnnl_stream_default_flags) != dnnl_success) {
        dnnl_engine_destroy(d->engine);
        free(d);
        return NULL;
    }
    return d;
}

static void entry_free(entry_t *e) {
    dnnl_primitive_t prims[] = {e->fwd, e->bwd_data, e->bwd_weights};
    for (int i = 0; i < 3; i++)
        if (prims[i]) dnnl_primitive_destroy(prims[i]);
    dnnl_memory_t mems[] = {e->x, e->w, e->y};
    for (int i = 0; i < 3; i++)
        if (mems[i]) dnnl_memory_destroy(mems[i]);
    free(e->dx_tmp);
    free(e->dw_tmp);
}

void cpu_dnnl_destroy(cpu_dnnl_t *d) {
    if (!d) return;
    for (int i = 0; i < d->n_entries; i++) entry_free(&d->entries[i]);
    dnnl_stream_destroy(d->stream);
    dnnl_engine_destroy(d->engine);
    free(d);
}

typedef struct {
    dnnl_memory_desc_t x, w, y;
    dnnl_dims_t strides, pad_l, pad_r;
} descs_t;

static bool make_descs(const conv_shape_t *s, descs_t *m) {
    dnnl_dims_t xd = {s->n, s->c, s->h, s->w}, wd = {s->k, s->c, s->r, s->s},
                yd = {s->n, s->k, s->oh, s->ow};
    m->strides[0] = m->strides[1] = s->stride;
    m->pad_l[0] = m->pad_l[1] = m->pad_r[0] = m->pad_r[1] = s->pad;
    return dnnl_memory_desc_init_by_tag(&m->x, 4, xd, dnnl_f32, dnnl_nhwc) == dnnl_success &&
           dnnl_memory_desc_init_by_tag(&m->w, 4, wd, dnnl_f32, dnnl_ohwi) == dnnl_success &&
           dnnl_memory_desc_init_by_tag(&m->y, 4, yd, dnnl_f32, dnnl_nhwc) == dnnl_success;
}

/* A primitive from op_desc (hint: the forward primitive descriptor, for backward ones). */
static bool make_primitive(cpu_dnnl_t *d, const void *op_desc, const_dnnl_primitive_desc_t hint,
                           dnnl_primitive_t *out, dnnl_primitive_desc_t *pd_out) {
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, op_desc, NULL, d->engine, hint) != dnnl_success)
        return false;
    bool ok = dnnl_primitive_create(out, pd) == dnnl_success;
    if (pd_out && ok)
        *pd_out = pd;
    else
        dnnl_primitive_desc_destroy(pd);
    return ok;
}

/* The three primitives of shape s, made together: the backward ones need the forward one's
 * descriptor as their hint. */
static bool entry_init(cpu_dnnl_t *d, entry_t *e, const conv_shape_t *s) {
    memset(e, 0, sizeof *e);
    e->shape = *s;
    descs_t m;
    if (!make_descs(s, &m)) return false;
    dnnl_convolution_desc_t fwd, bwd_data, bwd_weights;
    if (dnnl_convolution_forward_desc_init(&fwd, dnnl_forward_training, dnnl_convolution_direct,
                                           &m.x, &m.w, NULL, &m.y, m.strides, m.pad_l,
                                           m.pad_r) != dnnl_success ||
        dnnl_convolution_backward_data_desc_init(&bwd_data, dnnl_convolution_direct, &m.x, &m.w,
                                                 &m.y, m.strides, m.pad_l, m.pad_r) != dnnl_success ||
        dnnl_convolution_backward_weights_desc_init(&bwd_weights, dnnl_convolution_direct, &m.x,
                                                    &m.w, NULL, &m.y, m.strides, m.pad_l,
                                                    m.pad_r) != dnnl_success)
        return false;
    dnnl_primitive_desc_t fwd_pd = NULL;
    bool ok = make_primitive(d, &fwd, NULL, &e->fwd, &fwd_pd) &&
              make_primitive(d, &bwd_data, fwd_pd, &e->bwd_data, NULL) &&
              make_primitive(d, &bwd_weights, fwd_pd, &e->bwd_weights, NULL) &&
              dnnl_memory_create(&e->x, &m.x, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
              dnnl_memory_create(&e->w, &m.w, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
              dnnl_memory_create(&e->y, &m.y, d->engine, DNNL_MEMORY_NONE) == dnnl_success;
    if (fwd_pd) dnnl_primitive_desc_destroy(fwd_pd);
    size_t x_elems = (size_t)s->n * s->h * s->w * s->c, w_elems = (size_t)s->k * s->r * s->s * s->c;
    if (ok) {
        e->dx_tmp = malloc(sizeof(float) * x_elems);
        e->dw_tmp = malloc(sizeof(float) * w_elems);
        ok = e->dx_tmp && e->dw_tmp;
    }
    return ok;
}

/* The cache's entry for s (made on first use), or NULL when oneDNN cannot take it. */
static entry_t *entry_for(cpu_dnnl_t *d, const conv_shape_t *s) {
    for (int i = 0; i < d->n_entries; i++)
        if (!memcmp(&d->entries[i].shape, s, sizeof *s))
            return d->entries[i].is_failed ? NULL : &d->entries[i];
    if (d->n_entries == MAX_SHAPES) return NULL;
    entry_t *e = &d->entries[d->n_entries++];
    if (!entry_init(d, e, s)) {
        entry_free(e);
        memset(e, 0, sizeof *e);
        e->shape = *s;
        e->is_failed = true;
        return NULL;
    }
    return e;
}

/* Run prim with args and wait; false on failure. The backend's const tensors are only read. */
static bool run(cpu_dnnl_t *d, dnnl_primitive_t prim, const dnnl_exec_arg_t *args, int n) {
    return dnnl_primitive_execute(prim, d->stream, n, args) == dnnl_success &&
           dnnl_stream_wait(d->stream) == dnnl_success;
}

static bool set(dnnl_memory_t m, const float *p) {
    return dnnl_memory_set_data_handle(m, (void *)(uintptr_t)p) == dnnl_success;
}

int cpu_dnnl_conv_forward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                          float *y) {
    entry_t *e = entry_for(d, s);
    if (!e || !set(e->x, x) || !set(e->w, w) || !set(e->y, y)) return -1;
    dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e->x}, {DNNL_ARG_WEIGHTS, e->w}, {DNNL_ARG_DST, e->y}};
    return run(d, e->fwd, args, 3) ? 0 : -1;
}

static void add_into(float *dst, const float *src, size_t n) {
    #pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

int cpu_dnnl_conv_backward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                           const float *dy, float *dx, float *dw) {
    entry_t *e = entry_for(d, s);
    if (!e) return -1;
    size_t x_elems = (size_t)s->n * s->h * s->w * s->c, w_elems = (size_t)s->k * s->r * s->s * s->c;
    /* weights: diff_weights into dw_tmp (e->w's handle), then dw += */
    if (!set(e->x, x) || !set(e->y, dy) || !set(e->w, e->dw_tmp)) return -1;
    dnnl_exec_arg_t wargs[] = {{DNNL_ARG_SRC, e->x}, {DNNL_ARG_DIFF_DST, e->y},
                               {DNNL_ARG_DIFF_WEIGHTS, e->w}};
    if (!run(d, e->bwd_weights, wargs, 3)) return -1;
    if (dx) { /* data: diff_src into dx_tmp (e->x's handle), before dw is touched */
        if (!set(e->w, w) || !set(e->x, e->dx_tmp)) return -1;
        dnnl_exec_arg_t dargs[] = {{DNNL_ARG_DIFF_DST, e->y}, {DNNL_ARG_WEIGHTS, e->w},
                                   {DNNL_ARG_DIFF_SRC, e->x}};
        if (!run(d, e->bwd_data, dargs, 3)) return -1;
        add_into(dx, e->dx_tmp, x_elems);
    }
    add_into(dw, e->dw_tmp, w_elems);
    return 0;
}

#endif /* DDP_HAVE_ONEDNN */
