/* tensor_close: element-by-element comparison of a computed tensor against a reference, for the
 * unit tests (header-only, no Criterion dependency: the caller asserts on the result).
 * Element i passes when |got - want| <= atol + rtol * |want|, and only then: a NaN or an infinity
 * in `got` where `want` is finite fails (so does a finite value where `want` is not, unless both
 * are the same infinity or both NaN). Comparisons are written so that NaN never passes by
 * accident (fmax(x, NaN) is x; `err > tol` is false for a NaN err). */
#ifndef DDP_TESTS_TENSOR_CLOSE_H
#define DDP_TESTS_TENSOR_CLOSE_H

#include <math.h>
#include <stddef.h>
#include <stdio.h>

/* A tolerance: absolute part plus a part relative to the reference element. */
typedef struct {
    double rtol, atol;
} tensor_tol_t;

/* The outcome of one comparison. `worst` is the element furthest outside (or, when all pass,
 * closest to) its tolerance; ratio = |got - want| / tolerance there (INFINITY for a non-finite
 * mismatch). max_abs is the largest finite |got - want|. */
typedef struct {
    size_t n_bad, n_nonfinite, worst;
    double ratio, max_abs;
    float want, got;
} tensor_close_t;

/* Whether one element is within tol of want (see the file comment for the non-finite cases). */
static inline double tensor_close_ratio(float want, float got, tensor_tol_t tol) {
    if (isnan(want)) return isnan(got) ? 0.0 : INFINITY;
    if (isinf(want)) return got == want ? 0.0 : INFINITY;
    if (!isfinite(got)) return INFINITY;
    double err = fabs((double)got - (double)want), bound = tol.atol + tol.rtol * fabs((double)want);
    if (err == 0.0) return 0.0;
    return bound > 0.0 ? err / bound : INFINITY;
}

/* Compares n elements; returns the number that fail (0: all close). *out (may be NULL) gets the
 * details. Never allocates; n == 0 compares nothing and passes. */
static inline size_t tensor_close(const float *want, const float *got, size_t n, tensor_tol_t tol,
                                  tensor_close_t *out) {
    tensor_close_t r = {0};
    r.ratio = -1.0;
    for (size_t i = 0; i < n; i++) {
        double q = tensor_close_ratio(want[i], got[i], tol);
        if (!(q <= 1.0)) {
            r.n_bad++;
            if (!isfinite(got[i]) && isfinite(want[i])) r.n_nonfinite++;
        }
        if (isfinite(want[i]) && isfinite(got[i])) {
            double e = fabs((double)got[i] - (double)want[i]);
            if (e > r.max_abs) r.max_abs = e;
        }
        if (q > r.ratio) { /* first worst element wins; INFINITY beats everything finite */
            r.ratio = q;
            r.worst = i;
            r.want = want[i];
            r.got = got[i];
        }
    }
    if (r.ratio < 0) r.ratio = 0;
    if (out) *out = r;
    return r.n_bad;
}

/* One line describing r for an assertion message or a log: "3 of 1000 outside rtol 1e-05 atol
 * 1e-06 (2 non-finite); worst [17]: want 0.5 got nan (x inf of tolerance); max |d| 1e-3". */
static inline void tensor_close_describe(const tensor_close_t *r, size_t n, tensor_tol_t tol,
                                         char *buf, size_t size) {
    snprintf(buf, size,
             "%zu of %zu outside rtol %g atol %g (%zu non-finite); worst [%zu]: want %.9g got %.9g "
             "(%.3g of its tolerance); max |got - want| %g",
             r->n_bad, n, tol.rtol, tol.atol, r->n_nonfinite, r->worst, (double)r->want,
             (double)r->got, r->ratio, r->max_abs);
}

#endif
