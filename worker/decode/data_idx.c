/* data_idx: see data_idx.h. zlib's gz* functions read gzipped and plain files alike. */
#include "data_idx.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "fs.h"

#define IDX_TYPE_UBYTE 0x08
#define IDX_MAX_ELEMS  ((int64_t)1 << 34) /* 16 GiB of bytes: far beyond any dataset here */
#define IDX_MAX_SIDE   65535              /* an image's height or width: they become ints */

/* Read the `claimed` bytes a header promises into a buffer that grows with what actually arrives,
 * so a lying header costs at most twice the real data, not its claim. *out is malloc'd on 0. */
static int read_claimed(gzFile f, size_t claimed, uint8_t **out) {
    size_t cap = claimed < (1u << 20) ? claimed : 1u << 20, have = 0;
    uint8_t *buf = malloc(cap ? cap : 1);
    while (buf && have < claimed) {
        if (have == cap) {
            size_t next = cap * 2 < claimed ? cap * 2 : claimed;
            uint8_t *grown = realloc(buf, next);
            if (!grown) break;
            buf = grown;
            cap = next;
        }
        int got =
            gzread(f, buf + have, (unsigned)(cap - have > (1u << 30) ? 1u << 30 : cap - have));
        if (got <= 0) break;
        have += (size_t)got;
    }
    if (!buf || have < claimed) {
        free(buf);
        return -1;
    }
    *out = buf;
    return 0;
}

/* Read exactly n bytes; 0, or -1 if the file ends (or fails) first. */
static int read_exact(gzFile f, void *p, size_t n) {
    uint8_t *b = p;
    while (n > 0) {
        unsigned chunk = n > (1u << 30) ? 1u << 30 : (unsigned)n;
        int got = gzread(f, b, chunk);
        if (got <= 0) return -1;
        b += got;
        n -= (size_t)got;
    }
    return 0;
}

/* A read of f that came short: "PATH: <short>" when the file ended first, else zlib's reason (a
 * gzip CRC or data error, a read error), which is not a truncation. Returns -1. */
static int read_failed(gzFile f, const char *path, const char *short_what, char *err, size_t el) {
    int code;
    const char *msg = gzerror(f, &code);
    if (code == Z_OK || code == Z_BUF_ERROR) /* Z_BUF_ERROR: "unexpected end of file" */
        return dataset_fail(err, el, "%s: %s", path, short_what);
    const char *sep = strstr(msg, ": "); /* zlib puts its name for the file first ("<fd:5>: ") */
    return dataset_fail(err, el, "%s: %s: %s", path,
                        code == Z_ERRNO ? "cannot read" : "corrupt gzip data", sep ? sep + 2 : msg);
}

/* Open an IDX file and check its header: ubyte data with `want_dims` dimensions. */
static gzFile open_idx(const char *path, int want_dims, int64_t dims[3], char *err, size_t el) {
    struct stat st;
    char why[256];
    int fd = fs_open_regular(path, &st, why, sizeof why); /* a FIFO: refused, not waited on */
    if (fd < 0) {
        dataset_fail(err, el, "%s: %s", path, why);
        return NULL;
    }
    gzFile f = gzdopen(fd, "rb");
    if (!f) {
        close(fd);
        dataset_fail(err, el, "%s: cannot open: out of memory", path);
        return NULL;
    }
    uint8_t magic[4];
    if (read_exact(f, magic, 4) < 0) {
        read_failed(f, path, "truncated: no IDX header", err, el);
    } else if (magic[0] || magic[1] || magic[2] != IDX_TYPE_UBYTE || magic[3] != want_dims) {
        dataset_fail(err, el,
                     "%s: not an IDX file of unsigned bytes with %d dimensions (header %02x %02x "
                     "%02x %02x)",
                     path, want_dims, magic[0], magic[1], magic[2], magic[3]);
    } else {
        int64_t total = 1;
        bool is_ok = true;
        for (int i = 0; i < want_dims && is_ok; i++) {
            uint8_t b[4];
            if (read_exact(f, b, 4) < 0) {
                read_failed(f, path, "truncated in the header", err, el);
                is_ok = false;
                break;
            }
            dims[i] = (int64_t)b[0] << 24 | b[1] << 16 | b[2] << 8 | b[3];
            if (dims[i] <= 0 || dims[i] > IDX_MAX_ELEMS / total ||
                (i > 0 && dims[i] > IDX_MAX_SIDE)) {
                if (dims[i] <= 0)
                    dataset_fail(err, el, "%s: dimension %d is %lld", path, i, (long long)dims[i]);
                else if (i > 0 && dims[i] > IDX_MAX_SIDE)
                    dataset_fail(err, el, "%s: images %lld pixels %s (at most %d)", path,
                                 (long long)dims[i], i == 1 ? "high" : "wide", IDX_MAX_SIDE);
                else
                    dataset_fail(err, el, "%s: its dimensions claim more than %lld bytes", path,
                                 (long long)IDX_MAX_ELEMS);
                is_ok = false;
                break;
            }
            total *= dims[i];
        }
        if (is_ok) return f;
    }
    gzclose(f);
    return NULL;
}

/* After the payload: the file must end here, or it is not what its header says. Reading on also
 * checks a gzip file's CRC: a mismatch is a gzread of -1, said as such. */
static int expect_end(gzFile f, const char *path, char *err, size_t el) {
    uint8_t extra;
    int got = gzread(f, &extra, 1);
    if (got < 0) return read_failed(f, path, "unreadable at its end", err, el);
    if (got != 0)
        return dataset_fail(err, el, "%s: longer than its header says (trailing bytes)", path);
    return 0;
}

int idx_load(const char *images_path, const char *labels_path, int64_t limit, int classes,
             dataset_t *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    int64_t idims[3], ldims[3];
    gzFile fi = open_idx(images_path, 3, idims, err, err_len);
    if (!fi) return -1;
    gzFile fl = open_idx(labels_path, 1, ldims, err, err_len);
    if (!fl) {
        gzclose(fi);
        return -1;
    }
    int rc = 0;
    if (idims[0] != ldims[0]) {
        rc = dataset_fail(err, err_len, "%s has %lld images but %s has %lld labels", images_path,
                          (long long)idims[0], labels_path, (long long)ldims[0]);
        goto done;
    }
    int64_t n = idims[0], keep = limit > 0 && limit < n ? limit : n;
    size_t per_image = (size_t)(idims[1] * idims[2]);
    char what[128];
    if (read_claimed(fi, (size_t)n * per_image, &out->images) < 0) {
        snprintf(what, sizeof what, "truncated: fewer than the %lld images its header promises",
                 (long long)n);
        rc = read_failed(fi, images_path, what, err, err_len);
        goto done;
    }
    uint8_t *raw_labels = NULL; /* IDX labels are bytes; ours are int32 end to end */
    if (read_claimed(fl, (size_t)n, &raw_labels) < 0) {
        snprintf(what, sizeof what, "truncated: fewer than the %lld labels its header promises",
                 (long long)n);
        rc = read_failed(fl, labels_path, what, err, err_len);
        goto done;
    }
    out->labels = malloc((size_t)(n ? n : 1) * sizeof *out->labels);
    if (!out->labels) {
        free(raw_labels);
        rc = dataset_fail(err, err_len, "%s: out of memory for %lld labels", labels_path,
                          (long long)n);
        goto done;
    }
    for (int64_t i = 0; i < n; i++)
        out->labels[i] = raw_labels[i];
    free(raw_labels);
    if ((rc = expect_end(fi, images_path, err, err_len)) < 0) goto done;
    if ((rc = expect_end(fl, labels_path, err, err_len)) < 0) goto done;
    for (int64_t i = 0; i < n; i++) {
        if (out->labels[i] >= classes) {
            rc = dataset_fail(err, err_len, "%s: label %d of sample %lld is not below %d classes",
                              labels_path, (int)out->labels[i], (long long)i, classes);
            goto done;
        }
    }
    out->n = keep;
    out->h = (int)idims[1];
    out->w = (int)idims[2];
    out->c = 1;
    out->classes = classes;
done:
    gzclose(fi);
    gzclose(fl);
    if (rc < 0) dataset_free(out);
    return rc;
}

/* dir/name or dir/name.gz, whichever exists. */
static void find_file(const char *dir, const char *name, char *out, size_t len) {
    struct stat st;
    snprintf(out, len, "%s/%s", dir, name);
    if (stat(out, &st) == 0) return;
    snprintf(out, len, "%s/%s.gz", dir, name);
}

void idx_images_path(const char *dir, bool is_train, char *out, size_t out_len) {
    find_file(dir, is_train ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte", out, out_len);
}

int idx_load_dir(const char *dir, bool is_train, int64_t limit, dataset_t *out, char *err,
                 size_t err_len) {
    char images[2048], labels[2048];
    idx_images_path(dir, is_train, images, sizeof images);
    find_file(dir, is_train ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte", labels,
              sizeof labels);
    return idx_load(images, labels, limit, 10, out, err, err_len);
}

void dataset_free(dataset_t *d) {
    free(d->images);
    free(d->labels);
    for (int64_t i = 0; d->paths && i < d->n; i++)
        free(d->paths[i]);
    free(d->paths);
    memset(d, 0, sizeof *d);
}
