/* cpu_dnnl: see cpu_dnnl.h. Convolutions: the activations in place (nhwc); the weights reordered
 * to and from the blocked layouts oneDNN's kernels pick (small; done each call). The backward
 * primitives have no "add to the destination" (post-ops are forward only), so their results land in
 * scratch buffers that are then added to dx and dw, as the backend's contract asks. */
#include "cpu_dnnl.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
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
int cpu_dnnl_linear_forward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                            const float *bias, float *y) {
    (void)d, (void)n, (void)in, (void)out, (void)x, (void)w, (void)bias, (void)y;
    return -1;
}
int cpu_dnnl_linear_backward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                             const float *dy, float *dx, float *dw) {
    (void)d, (void)n, (void)in, (void)out, (void)x, (void)w, (void)dy, (void)dx, (void)dw;
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
    /* the weights in the layouts oneDNN's kernels want (blocked; with the backend's plain OHWI
     * its only kernel is the slow reference one), converted each call: the weights are small */
    dnnl_primitive_t to_fwd_w, to_bwd_w, from_dw;
    dnnl_memory_t x, y, w_user, dw_user;    /* the backend's tensors: handles swapped per call */
    dnnl_memory_t w_fwd, w_bwd, dw_blocked; /* owned */
    float *dx_tmp, *dw_tmp;                 /* backward results before they are added */
} entry_t;

/* A linear layer's three matmuls for one (n, in, out); the backward ones add to their output
 * (a sum post-op), as the backend's contract asks. */
typedef struct {
    int n, in, out;
    bool is_failed;
    dnnl_primitive_t fwd, bwd_w, bwd_x;
    dnnl_memory_t x, w_t, bias, y, dy_t, x_w, dw, dy, w, dx; /* handles per call */
} mm_entry_t;

struct cpu_dnnl {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    entry_t entries[MAX_SHAPES];
    int n_entries;
    mm_entry_t mm[MAX_SHAPES / 4];
    int n_mm;
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
    dnnl_primitive_t prims[] = {e->fwd,      e->bwd_data, e->bwd_weights,
                                e->to_fwd_w, e->to_bwd_w, e->from_dw};
    for (size_t i = 0; i < sizeof prims / sizeof prims[0]; i++)
        if (prims[i]) dnnl_primitive_destroy(prims[i]);
    dnnl_memory_t mems[] = {e->x, e->y, e->w_user, e->dw_user, e->w_fwd, e->w_bwd, e->dw_blocked};
    for (size_t i = 0; i < sizeof mems / sizeof mems[0]; i++)
        if (mems[i]) dnnl_memory_destroy(mems[i]);
    free(e->dx_tmp);
    free(e->dw_tmp);
}

static void destroy_all(dnnl_primitive_t *prims, size_t n_prims, dnnl_memory_t *mems,
                        size_t n_mems) {
    for (size_t i = 0; i < n_prims; i++)
        if (prims[i]) dnnl_primitive_destroy(prims[i]);
    for (size_t i = 0; i < n_mems; i++)
        if (mems[i]) dnnl_memory_destroy(mems[i]);
}

static void mm_entry_free(mm_entry_t *e) {
    dnnl_primitive_t prims[] = {e->fwd, e->bwd_w, e->bwd_x};
    dnnl_memory_t mems[] = {e->x,   e->w_t, e->bias, e->y, e->dy_t,
                            e->x_w, e->dw,  e->dy,   e->w, e->dx};
    destroy_all(prims, 3, mems, sizeof mems / sizeof mems[0]);
}

void cpu_dnnl_destroy(cpu_dnnl_t *d) {
    if (!d) return;
    for (int i = 0; i < d->n_entries; i++)
        entry_free(&d->entries[i]);
    for (int i = 0; i < d->n_mm; i++)
        mm_entry_free(&d->mm[i]);
    dnnl_stream_destroy(d->stream);
    dnnl_engine_destroy(d->engine);
    free(d);
}

typedef struct {
    dnnl_memory_desc_t x, w, w_any, y;
    dnnl_dims_t strides, pad_l, pad_r;
} descs_t;

static bool make_descs(const conv_shape_t *s, descs_t *m) {
    dnnl_dims_t xd = {s->n, s->c, s->h, s->w}, wd = {s->k, s->c, s->r, s->s},
                yd = {s->n, s->k, s->oh, s->ow};
    m->strides[0] = m->strides[1] = s->stride;
    m->pad_l[0] = m->pad_l[1] = m->pad_r[0] = m->pad_r[1] = s->pad;
    return dnnl_memory_desc_init_by_tag(&m->x, 4, xd, dnnl_f32, dnnl_nhwc) == dnnl_success &&
           dnnl_memory_desc_init_by_tag(&m->w, 4, wd, dnnl_f32, dnnl_ohwi) == dnnl_success &&
           dnnl_memory_desc_init_by_tag(&m->w_any, 4, wd, dnnl_f32, dnnl_format_tag_any) ==
               dnnl_success &&
           dnnl_memory_desc_init_by_tag(&m->y, 4, yd, dnnl_f32, dnnl_nhwc) == dnnl_success;
}

/* A primitive descriptor for op_desc (hint: the forward one, for backward ones), or NULL. */
static dnnl_primitive_desc_t make_pd(cpu_dnnl_t *d, const void *op_desc,
                                     const_dnnl_primitive_desc_t hint) {
    dnnl_primitive_desc_t pd;
    return dnnl_primitive_desc_create(&pd, op_desc, NULL, d->engine, hint) == dnnl_success ? pd
                                                                                           : NULL;
}

/* The primitive of pd and an owned memory of the layout pd picked for what (NULL: none). */
static bool make_from_pd(cpu_dnnl_t *d, const_dnnl_primitive_desc_t pd, dnnl_primitive_t *prim,
                         dnnl_query_t what, dnnl_memory_t *owned) {
    if (dnnl_primitive_create(prim, pd) != dnnl_success) return false;
    if (!owned) return true;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(pd, what, 0);
    return md && dnnl_memory_create(owned, md, d->engine, DNNL_MEMORY_ALLOCATE) == dnnl_success;
}

static bool make_reorder(cpu_dnnl_t *d, dnnl_memory_t from, dnnl_memory_t to,
                         dnnl_primitive_t *out) {
    const dnnl_memory_desc_t *src, *dst;
    if (dnnl_memory_get_memory_desc(from, &src) != dnnl_success ||
        dnnl_memory_get_memory_desc(to, &dst) != dnnl_success)
        return false;
    dnnl_primitive_desc_t pd;
    if (dnnl_reorder_primitive_desc_create(&pd, src, d->engine, dst, d->engine, NULL) !=
        dnnl_success)
        return false;
    bool ok = dnnl_primitive_create(out, pd) == dnnl_success;
    dnnl_primitive_desc_destroy(pd);
    return ok;
}

/* The primitives of shape s, made together: the backward ones need the forward one's descriptor
 * as their hint. */
static bool entry_init(cpu_dnnl_t *d, entry_t *e, const conv_shape_t *s) {
    memset(e, 0, sizeof *e);
    e->shape = *s;
    descs_t m;
    if (!make_descs(s, &m)) return false;
    dnnl_convolution_desc_t fwd, bwd_data, bwd_weights;
    if (dnnl_convolution_forward_desc_init(&fwd, dnnl_forward_training, dnnl_convolution_direct,
                                           &m.x, &m.w_any, NULL, &m.y, m.strides, m.pad_l,
                                           m.pad_r) != dnnl_success ||
        dnnl_convolution_backward_data_desc_init(&bwd_data, dnnl_convolution_direct, &m.x, &m.w_any,
                                                 &m.y, m.strides, m.pad_l,
                                                 m.pad_r) != dnnl_success ||
        dnnl_convolution_backward_weights_desc_init(&bwd_weights, dnnl_convolution_direct, &m.x,
                                                    &m.w_any, NULL, &m.y, m.strides, m.pad_l,
                                                    m.pad_r) != dnnl_success)
        return false;
    dnnl_primitive_desc_t fwd_pd = make_pd(d, &fwd, NULL), bwd_data_pd = NULL, bwd_w_pd = NULL;
    if (fwd_pd) {
        bwd_data_pd = make_pd(d, &bwd_data, fwd_pd);
        bwd_w_pd = make_pd(d, &bwd_weights, fwd_pd);
    }
    bool ok =
        fwd_pd && bwd_data_pd && bwd_w_pd &&
        make_from_pd(d, fwd_pd, &e->fwd, dnnl_query_weights_md, &e->w_fwd) &&
        make_from_pd(d, bwd_data_pd, &e->bwd_data, dnnl_query_weights_md, &e->w_bwd) &&
        make_from_pd(d, bwd_w_pd, &e->bwd_weights, dnnl_query_diff_weights_md, &e->dw_blocked) &&
        dnnl_memory_create(&e->x, &m.x, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
        dnnl_memory_create(&e->y, &m.y, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
        dnnl_memory_create(&e->w_user, &m.w, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
        dnnl_memory_create(&e->dw_user, &m.w, d->engine, DNNL_MEMORY_NONE) == dnnl_success &&
        make_reorder(d, e->w_user, e->w_fwd, &e->to_fwd_w) &&
        make_reorder(d, e->w_user, e->w_bwd, &e->to_bwd_w) &&
        make_reorder(d, e->dw_blocked, e->dw_user, &e->from_dw);
    dnnl_primitive_desc_t pds[] = {fwd_pd, bwd_data_pd, bwd_w_pd};
    for (int i = 0; i < 3; i++)
        if (pds[i]) dnnl_primitive_desc_destroy(pds[i]);
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

/* Execute prim with args; false on failure. */
static bool run(cpu_dnnl_t *d, dnnl_primitive_t prim, const dnnl_exec_arg_t *args, int n) {
    return dnnl_primitive_execute(prim, d->stream, n, args) == dnnl_success;
}

static bool reorder(cpu_dnnl_t *d, dnnl_primitive_t prim, dnnl_memory_t from, dnnl_memory_t to) {
    dnnl_exec_arg_t args[] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    return run(d, prim, args, 2);
}

/* The backend's const tensors are only read through these handles. */
static bool set(dnnl_memory_t m, const float *p) {
    return dnnl_memory_set_data_handle(m, (void *)(uintptr_t)p) == dnnl_success;
}

int cpu_dnnl_conv_forward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                          float *y) {
    entry_t *e = entry_for(d, s);
    if (!e || !set(e->x, x) || !set(e->w_user, w) || !set(e->y, y)) return -1;
    dnnl_exec_arg_t args[] = {
        {DNNL_ARG_SRC, e->x}, {DNNL_ARG_WEIGHTS, e->w_fwd}, {DNNL_ARG_DST, e->y}};
    bool ok = reorder(d, e->to_fwd_w, e->w_user, e->w_fwd) && run(d, e->fwd, args, 3);
    return ok && dnnl_stream_wait(d->stream) == dnnl_success ? 0 : -1;
}

static void add_into(float *dst, const float *src, size_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (size_t i = 0; i < n; i++)
        dst[i] += src[i];
}

int cpu_dnnl_conv_backward(cpu_dnnl_t *d, const conv_shape_t *s, const float *x, const float *w,
                           const float *dy, float *dx, float *dw) {
    entry_t *e = entry_for(d, s);
    if (!e) return -1;
    size_t x_elems = (size_t)s->n * s->h * s->w * s->c, w_elems = (size_t)s->k * s->r * s->s * s->c;
    /* weights: diff_weights in oneDNN's layout, then into dw_tmp as OHWI */
    if (!set(e->x, x) || !set(e->y, dy) || !set(e->dw_user, e->dw_tmp)) return -1;
    dnnl_exec_arg_t wargs[] = {
        {DNNL_ARG_SRC, e->x}, {DNNL_ARG_DIFF_DST, e->y}, {DNNL_ARG_DIFF_WEIGHTS, e->dw_blocked}};
    if (!run(d, e->bwd_weights, wargs, 3) || !reorder(d, e->from_dw, e->dw_blocked, e->dw_user))
        return -1;
    if (dx) { /* data: diff_src into dx_tmp (e->x's handle now) */
        if (!set(e->w_user, w) || !set(e->x, e->dx_tmp)) return -1;
        dnnl_exec_arg_t dargs[] = {
            {DNNL_ARG_DIFF_DST, e->y}, {DNNL_ARG_WEIGHTS, e->w_bwd}, {DNNL_ARG_DIFF_SRC, e->x}};
        if (!reorder(d, e->to_bwd_w, e->w_user, e->w_bwd) || !run(d, e->bwd_data, dargs, 3))
            return -1;
    }
    if (dnnl_stream_wait(d->stream) != dnnl_success) return -1;
    /* only now, when nothing can fail any more: the caller's fallback must find dx, dw untouched */
    if (dx && s->is_dx_written) /* the model's first producer of dx (backend.h): written */
        memcpy(dx, e->dx_tmp, sizeof(float) * x_elems);
    else if (dx)
        add_into(dx, e->dx_tmp, x_elems);
    add_into(dw, e->dw_tmp, w_elems);
    return 0;
}

/* ---- linear layers: matmuls ---- */

static bool mem(cpu_dnnl_t *d, const dnnl_memory_desc_t *md, dnnl_memory_t *out) {
    return dnnl_memory_create(out, md, d->engine, DNNL_MEMORY_NONE) == dnnl_success;
}

static bool prim_of(const void *op_desc, const_dnnl_primitive_attr_t attr, cpu_dnnl_t *d,
                    const_dnnl_primitive_desc_t hint, dnnl_primitive_t *out) {
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, op_desc, attr, d->engine, hint) != dnnl_success)
        return false;
    bool ok = dnnl_primitive_create(out, pd) == dnnl_success;
    dnnl_primitive_desc_destroy(pd);
    return ok;
}

static bool run_wait(cpu_dnnl_t *d, dnnl_primitive_t prim, const dnnl_exec_arg_t *args, int n) {
    return dnnl_primitive_execute(prim, d->stream, n, args) == dnnl_success &&
           dnnl_stream_wait(d->stream) == dnnl_success;
}

static bool md_strided(dnnl_memory_desc_t *md, dnnl_dim_t rows, dnnl_dim_t cols,
                       dnnl_dim_t row_stride, dnnl_dim_t col_stride) {
    dnnl_dims_t dims = {rows, cols}, strides = {row_stride, col_stride};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_f32, strides) == dnnl_success;
}

static bool mm_prim(cpu_dnnl_t *d, const dnnl_memory_desc_t *src, const dnnl_memory_desc_t *wei,
                    const dnnl_memory_desc_t *bias, const dnnl_memory_desc_t *dst, bool is_sum,
                    dnnl_primitive_t *out) {
    dnnl_matmul_desc_t desc;
    if (dnnl_matmul_desc_init(&desc, src, wei, bias, dst) != dnnl_success) return false;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    bool ok = true;
    if (is_sum) { /* dst += src x wei */
        ok = dnnl_primitive_attr_create(&attr) == dnnl_success &&
             dnnl_post_ops_create(&po) == dnnl_success &&
             dnnl_post_ops_append_sum(po, 1.0f) == dnnl_success &&
             dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
    }
    ok = ok && prim_of(&desc, attr, d, NULL, out);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return ok;
}

static bool mm_entry_init(cpu_dnnl_t *d, mm_entry_t *e) {
    dnnl_dim_t n = e->n, in = e->in, out = e->out;
    dnnl_memory_desc_t x, w_t, bias, y, dy_t, x_w, dw, dy, w, dx;
    /* y (n, out) = x (n, in) . w^T (in, out: w's bytes read column-wise) + bias (1, out) */
    bool ok = md_strided(&x, n, in, in, 1) && md_strided(&w_t, in, out, 1, in) &&
              md_strided(&bias, 1, out, out, 1) && md_strided(&y, n, out, out, 1) &&
              /* dw (out, in) += dy^T (out, n) . x (n, in) */
              md_strided(&dy_t, out, n, 1, out) && md_strided(&x_w, n, in, in, 1) &&
              md_strided(&dw, out, in, in, 1) &&
              /* dx (n, in) += dy (n, out) . w (out, in) */
              md_strided(&dy, n, out, out, 1) && md_strided(&w, out, in, in, 1) &&
              md_strided(&dx, n, in, in, 1);
    return ok && mm_prim(d, &x, &w_t, &bias, &y, false, &e->fwd) &&
           mm_prim(d, &dy_t, &x_w, NULL, &dw, true, &e->bwd_w) &&
           mm_prim(d, &dy, &w, NULL, &dx, true, &e->bwd_x) && mem(d, &x, &e->x) &&
           mem(d, &w_t, &e->w_t) && mem(d, &bias, &e->bias) && mem(d, &y, &e->y) &&
           mem(d, &dy_t, &e->dy_t) && mem(d, &x_w, &e->x_w) && mem(d, &dw, &e->dw) &&
           mem(d, &dy, &e->dy) && mem(d, &w, &e->w) && mem(d, &dx, &e->dx);
}

static mm_entry_t *mm_entry_for(cpu_dnnl_t *d, int n, int in, int out) {
    for (int i = 0; i < d->n_mm; i++) {
        mm_entry_t *e = &d->mm[i];
        if (e->n == n && e->in == in && e->out == out) return e->is_failed ? NULL : e;
    }
    if (d->n_mm == (int)(sizeof d->mm / sizeof d->mm[0])) return NULL;
    mm_entry_t *e = &d->mm[d->n_mm++];
    *e = (mm_entry_t){.n = n, .in = in, .out = out};
    if (!mm_entry_init(d, e)) {
        mm_entry_free(e);
        *e = (mm_entry_t){.n = n, .in = in, .out = out, .is_failed = true};
        return NULL;
    }
    return e;
}

int cpu_dnnl_linear_forward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                            const float *bias, float *y) {
    mm_entry_t *e = mm_entry_for(d, n, in, out);
    if (!e || !set(e->x, x) || !set(e->w_t, w) || !set(e->bias, bias) || !set(e->y, y)) return -1;
    dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e->x},
                              {DNNL_ARG_WEIGHTS, e->w_t},
                              {DNNL_ARG_BIAS, e->bias},
                              {DNNL_ARG_DST, e->y}};
    return run_wait(d, e->fwd, args, 4) ? 0 : -1;
}

int cpu_dnnl_linear_backward(cpu_dnnl_t *d, int n, int in, int out, const float *x, const float *w,
                             const float *dy, float *dx, float *dw) {
    mm_entry_t *e = mm_entry_for(d, n, in, out);
    if (!e || !set(e->dy_t, dy) || !set(e->x_w, x) || !set(e->dw, dw)) return -1;
    dnnl_exec_arg_t wargs[] = {
        {DNNL_ARG_SRC, e->dy_t}, {DNNL_ARG_WEIGHTS, e->x_w}, {DNNL_ARG_DST, e->dw}};
    if (dx && (!set(e->dy, dy) || !set(e->w, w) || !set(e->dx, dx))) return -1;
    if (!run_wait(d, e->bwd_w, wargs, 3)) return -1;
    if (!dx) return 0;
    dnnl_exec_arg_t xargs[] = {
        {DNNL_ARG_SRC, e->dy}, {DNNL_ARG_WEIGHTS, e->w}, {DNNL_ARG_DST, e->dx}};
    if (run_wait(d, e->bwd_x, xargs, 3)) return 0;
    /* dw has its share already: the caller's fallback would add it twice. A primitive that ran
     * once and fails now is oneDNN's bug, not an input's. */
    fprintf(stderr, "ddpworker: %s:%d: oneDNN's matmul (%d x %d -> %d) failed after running\n",
            __FILE__, __LINE__, n, in, out);
    abort();
}

#endif /* DDP_HAVE_ONEDNN */
