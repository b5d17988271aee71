/* safetensors: see safetensors.h. Every number in the header is checked before it sizes or
 * places anything: lengths against the file, offsets against the data section, byte counts against
 * shape x dtype with overflow checks. */
#include "safetensors.h"
#include "ddp_error.h"
#include "fs.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c reads and writes little-endian bytes as they are in memory"
#endif

/* Whole numbers a double holds exactly: bigger offsets or dimensions are refused. */
#define EXACT_MAX 9007199254740992.0 /* 2^53 */

static const struct {
    const char *name;
    size_t size;
} dtypes[] = {
    [SAFETENSORS_F32] = {"F32", 4},   [SAFETENSORS_F16] = {"F16", 2},
    [SAFETENSORS_BF16] = {"BF16", 2}, [SAFETENSORS_F64] = {"F64", 8},
    [SAFETENSORS_I64] = {"I64", 8},   [SAFETENSORS_I32] = {"I32", 4},
    [SAFETENSORS_I16] = {"I16", 2},   [SAFETENSORS_I8] = {"I8", 1},
    [SAFETENSORS_U8] = {"U8", 1},     [SAFETENSORS_BOOL] = {"BOOL", 1},
};
#define N_DTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

const char *safetensors_dtype_name(safetensors_dtype_t t) {
    return (int)t >= 0 && (int)t < N_DTYPES ? dtypes[t].name : "?";
}

size_t safetensors_dtype_size(safetensors_dtype_t t) {
    return (int)t >= 0 && (int)t < N_DTYPES ? dtypes[t].size : 0;
}

uint64_t safetensors_elems(int ndim, const uint64_t *shape) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

/* A whole number in [0, 2^53] or false. */
static bool whole(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0.0 && d <= EXACT_MAX) || d != floor(d)) return false;
    *out = (uint64_t)d;
    return true;
}

static int parse_entry(const cJSON *t, uint64_t data_len, safetensors_entry_t *e, char *err,
                       size_t err_len) {
    const char *name = t->string;
    if (!cJSON_IsObject(t)) return ddp_errf(err, err_len, "tensor '%s': not a JSON object", name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(t, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape");
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
    if (!cJSON_IsString(dtype))
        return ddp_errf(err, err_len, "tensor '%s': no \"dtype\" string", name);
    int kind = -1;
    for (int i = 0; i < N_DTYPES && kind < 0; i++)
        if (strcmp(dtype->valuestring, dtypes[i].name) == 0) kind = i;
    if (kind < 0)
        return ddp_errf(err, err_len, "tensor '%s': unknown dtype \"%.32s\"", name,
                        dtype->valuestring);
    e->dtype = (safetensors_dtype_t)kind;
    if (!cJSON_IsArray(shape))
        return ddp_errf(err, err_len, "tensor '%s': no \"shape\" array", name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > SAFETENSORS_MAX_DIMS)
        return ddp_errf(err, err_len, "tensor '%s': %d dimensions (at most %d)", name, ndim,
                        SAFETENSORS_MAX_DIMS);
    e->ndim = ndim;
    uint64_t elems = 1;
    bool is_overflow = false;
    for (int i = 0; i < ndim; i++) {
        if (!whole(cJSON_GetArrayItem(shape, i), &e->shape[i]))
            return ddp_errf(err, err_len, "tensor '%s': dimension %d is not a whole number", name,
                            i);
        if (e->shape[i] && elems > UINT64_MAX / e->shape[i]) is_overflow = true;
        elems *= e->shape[i];
    }
    uint64_t size = dtypes[kind].size;
    if (is_overflow || (elems && size > UINT64_MAX / elems))
        return ddp_errf(err, err_len, "tensor '%s': its shape overflows 64 bits", name);
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        !whole(cJSON_GetArrayItem(offsets, 0), &e->begin) ||
        !whole(cJSON_GetArrayItem(offsets, 1), &e->end))
        return ddp_errf(err, err_len, "tensor '%s': \"data_offsets\" is not [begin, end]", name);
    if (e->begin > e->end || e->end > data_len)
        return ddp_errf(err, err_len,
                        "tensor '%s': data_offsets [%llu, %llu] outside the %llu bytes of data",
                        name, (unsigned long long)e->begin, (unsigned long long)e->end,
                        (unsigned long long)data_len);
    if (e->end - e->begin != elems * size)
        return ddp_errf(err, err_len, "tensor '%s': %llu bytes for %llu elements of %s", name,
                        (unsigned long long)(e->end - e->begin), (unsigned long long)elems,
                        dtypes[kind].name);
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const safetensors_entry_t *)a)->name, ((const safetensors_entry_t *)b)->name);
}

static int by_begin(const void *a, const void *b) {
    const safetensors_entry_t *x = a, *y = b;
    return x->begin < y->begin   ? -1
           : x->begin > y->begin ? 1
           : x->end < y->end     ? -1
                                 : x->end > y->end;
}

/* No two names alike, no two tensors sharing a byte (checked on a sorted copy). */
static int check_unique(const safetensors_index_t *ix, char *err, size_t err_len) {
    if (ix->n < 2) return 0;
    safetensors_entry_t *s = malloc(sizeof *s * (size_t)ix->n);
    if (!s) return ddp_errf(err, err_len, "out of memory for %d tensors", ix->n);
    memcpy(s, ix->entries, sizeof *s * (size_t)ix->n);
    int rc = 0;
    qsort(s, (size_t)ix->n, sizeof *s, by_name);
    for (int i = 1; i < ix->n && rc == 0; i++)
        if (strcmp(s[i - 1].name, s[i].name) == 0)
            rc = ddp_errf(err, err_len, "tensor '%s' appears twice", s[i].name);
    qsort(s, (size_t)ix->n, sizeof *s, by_begin);
    for (int i = 1; i < ix->n && rc == 0; i++)
        if (s[i].begin < s[i - 1].end && s[i].begin < s[i].end) /* empty tensors overlap nothing */
            rc = ddp_errf(err, err_len, "tensors '%s' and '%s' overlap in the data", s[i - 1].name,
                          s[i].name);
    free(s);
    return rc;
}

/* __metadata__'s strings into ix->meta (of a key given twice, the last, as a JSON map reads). */
static int keep_meta(const cJSON *obj, safetensors_index_t *ix, char *err, size_t err_len) {
    for (int i = 0; ix->meta && ix->meta[i]; i++)
        free(ix->meta[i]);
    free(ix->meta);
    ix->meta = NULL;
    ix->n_meta = 0;
    int n = cJSON_GetArraySize(obj);
    ix->meta = calloc((size_t)(2 * n + 1), sizeof *ix->meta);
    if (!ix->meta) return ddp_errf(err, err_len, "out of memory for %d metadata entries", n);
    for (const cJSON *m = obj->child; m; m = m->next) {
        if (!m->string || !cJSON_IsString(m))
            return ddp_errf(err, err_len, "__metadata__ '%s' is not a string",
                            m->string ? m->string : "");
        char **kv = &ix->meta[2 * ix->n_meta];
        if (!(kv[0] = strdup(m->string)) || !(kv[1] = strdup(m->valuestring)))
            return ddp_errf(err, err_len, "out of memory");
        ix->n_meta++;
    }
    return 0;
}

int safetensors_parse_header(const char *header, size_t len, uint64_t data_len,
                             safetensors_index_t *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(header, len, &end, false);
    if (!root) return ddp_errf(err, err_len, "the header is not JSON");
    int rc = 0;
    for (const char *p = end; p && p < header + len && rc == 0; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            rc = ddp_errf(err, err_len, "the header has bytes after its JSON object (at byte %zu)",
                          (size_t)(p - header));
    if (rc == 0 && !cJSON_IsObject(root))
        rc = ddp_errf(err, err_len, "the header is not a JSON object");
    int n = 0;
    for (const cJSON *t = rc == 0 ? root->child : NULL; t; t = t->next) {
        if (!t->string) rc = ddp_errf(err, err_len, "the header has an unnamed member");
        n += t->string && strcmp(t->string, "__metadata__") != 0;
    }
    if (rc == 0 && n > 0 && !(out->entries = calloc((size_t)n, sizeof *out->entries)))
        rc = ddp_errf(err, err_len, "out of memory for %d tensors", n);
    for (const cJSON *t = rc == 0 ? root->child : NULL; t && rc == 0; t = t->next) {
        if (strcmp(t->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(t))
                rc = ddp_errf(err, err_len, "__metadata__ is not an object");
            else
                rc = keep_meta(t, out, err, err_len);
            continue;
        }
        size_t name_len = strlen(t->string);
        if (name_len == 0 || name_len > SAFETENSORS_NAME_MAX) {
            rc = ddp_errf(err, err_len, "a tensor name of %zu bytes (1 to %d)", name_len,
                          SAFETENSORS_NAME_MAX);
            break;
        }
        safetensors_entry_t *e = &out->entries[out->n];
        rc = parse_entry(t, data_len, e, err, err_len);
        if (rc == 0 && !(e->name = strdup(t->string))) rc = ddp_errf(err, err_len, "out of memory");
        if (rc == 0) out->n++;
    }
    cJSON_Delete(root);
    out->data_len = data_len;
    if (rc == 0) rc = check_unique(out, err, err_len);
    if (rc < 0) safetensors_index_free(out);
    return rc;
}

/* The little-endian header length at p, checked against what follows it. */
static int header_length(const uint8_t *p, uint64_t size, uint64_t *len, char *err,
                         size_t err_len) {
    if (size < 8)
        return ddp_errf(err, err_len, "%llu bytes: shorter than the 8-byte header length",
                        (unsigned long long)size);
    uint64_t n;
    memcpy(&n, p, sizeof n);
    if (n < 2 || n > SAFETENSORS_HEADER_MAX || n > size - 8)
        return ddp_errf(
            err, err_len,
            "a header length of %llu bytes does not fit (the file has %llu, the limit is %llu)",
            (unsigned long long)n, (unsigned long long)size,
            (unsigned long long)SAFETENSORS_HEADER_MAX);
    *len = n;
    return 0;
}

int safetensors_parse_buffer(const uint8_t *buf, size_t size, safetensors_index_t *out, char *err,
                             size_t err_len) {
    memset(out, 0, sizeof *out);
    uint64_t n = 0; /* set by header_length; GCC -O3 cannot see it (maybe-uninitialized) */
    if (header_length(buf, size, &n, err, err_len) < 0) return -1;
    if (safetensors_parse_header((const char *)buf + 8, (size_t)n, size - 8 - n, out, err,
                                 err_len) < 0)
        return -1;
    out->data_offset = 8 + n;
    return 0;
}

static int read_at(int fd, void *buf, size_t n, uint64_t offset) {
    uint8_t *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)offset);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? -errno : -EIO; /* EIO: the file ended early */
        p += k;
        n -= (size_t)k;
        offset += (uint64_t)k;
    }
    return 0;
}

int safetensors_open(const char *path, safetensors_index_t *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    struct stat st;
    char why[512];
    /* model.init or train.best_file naming a FIFO: refused, not a reader waited for forever */
    int fd = fs_open_regular(path, &st, why, sizeof why);
    if (fd < 0) return ddp_errf(err, err_len, "%s: %s", path, why);
    uint8_t prefix[8];
    uint64_t n = 0;
    if (read_at(fd, prefix, st.st_size < 8 ? (size_t)st.st_size : 8, 0) < 0 ||
        header_length(prefix, (uint64_t)st.st_size, &n, why, sizeof why) < 0) {
        ddp_errf(err, err_len, "%s: not a safetensors file: %s", path,
                 st.st_size < 8 ? "too short" : why);
    } else {
        char *header = malloc((size_t)n);
        int rc = header ? read_at(fd, header, (size_t)n, 8) : -ENOMEM;
        if (rc < 0) {
            ddp_errf(err, err_len, "%s: cannot read the %llu-byte header: %s", path,
                     (unsigned long long)n, strerror(-rc));
        } else if (safetensors_parse_header(header, (size_t)n, (uint64_t)st.st_size - 8 - n, out,
                                            why, sizeof why) < 0) {
            ddp_errf(err, err_len, "%s: %s", path, why);
        } else {
            out->data_offset = 8 + n;
            free(header);
            return fd;
        }
        free(header);
    }
    close(fd);
    return -1;
}

int safetensors_read(int fd, const safetensors_index_t *ix, const safetensors_entry_t *e, void *buf,
                     char *err, size_t err_len) {
    int rc = read_at(fd, buf, (size_t)(e->end - e->begin), ix->data_offset + e->begin);
    if (rc < 0)
        return ddp_errf(err, err_len, "tensor '%s': cannot read its bytes: %s", e->name,
                        strerror(-rc));
    return 0;
}

const safetensors_entry_t *safetensors_find(const safetensors_index_t *ix, const char *name) {
    for (int i = 0; i < ix->n; i++)
        if (strcmp(ix->entries[i].name, name) == 0) return &ix->entries[i];
    return NULL;
}

const char *safetensors_meta(const safetensors_index_t *ix, const char *key) {
    for (int i = ix->n_meta - 1; i >= 0; i--) /* a key given twice: the last, as JSON maps read */
        if (strcmp(ix->meta[2 * i], key) == 0) return ix->meta[2 * i + 1];
    return NULL;
}

void safetensors_index_free(safetensors_index_t *ix) {
    for (int i = 0; i < ix->n; i++)
        free(ix->entries[i].name);
    free(ix->entries);
    /* a failed keep_meta may leave a key without its value: the array is NULL-padded */
    for (int i = 0; ix->meta && ix->meta[i]; i++)
        free(ix->meta[i]);
    free(ix->meta);
    memset(ix, 0, sizeof *ix);
}

/* ---- writing ---- */

/* The header text, padded with spaces to end on an 8-byte boundary of the file. */
static char *build_header(const safetensors_tensor_t *t, int n, const char *const *metadata,
                          uint64_t *max_bytes, size_t *len) {
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = root ? cJSON_AddObjectToObject(root, "__metadata__") : NULL;
    bool is_ok = meta != NULL;
    for (int i = 0; is_ok && metadata && metadata[i] && metadata[i + 1]; i += 2)
        is_ok = cJSON_AddStringToObject(meta, metadata[i], metadata[i + 1]) != NULL;
    uint64_t at = 0;
    *max_bytes = 0;
    for (int i = 0; is_ok && i < n; i++) {
        uint64_t bytes =
            safetensors_elems(t[i].ndim, t[i].shape) * safetensors_dtype_size(t[i].dtype);
        cJSON *o = cJSON_AddObjectToObject(root, t[i].name), *shape = NULL, *offsets = NULL;
        is_ok = o && cJSON_AddStringToObject(o, "dtype", safetensors_dtype_name(t[i].dtype)) &&
                (shape = cJSON_AddArrayToObject(o, "shape")) &&
                (offsets = cJSON_AddArrayToObject(o, "data_offsets"));
        for (int d = 0; is_ok && d < t[i].ndim; d++)
            is_ok = cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t[i].shape[d]));
        /* cJSON prints whole numbers below 1e15 exactly ("%1.15g") */
        is_ok = is_ok && at + bytes < (uint64_t)1e15 &&
                cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)at)) &&
                cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)(at + bytes)));
        at += bytes;
        if (bytes > *max_bytes) *max_bytes = bytes;
    }
    char *text = is_ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!text) return NULL;
    size_t n_text = strlen(text), padded = n_text + (8 - (8 + n_text) % 8) % 8;
    char *out = realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n_text, ' ', padded - n_text);
    out[padded] = '\0';
    *len = padded;
    return out;
}

static int write_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t k = write(fd, b, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? -errno : -EIO;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

int safetensors_write(const char *path, const safetensors_tensor_t *tensors, int n,
                      const char *const *metadata, safetensors_fill_cb fill, void *arg, char *err,
                      size_t err_len) {
    uint64_t max_bytes;
    size_t header_len;
    char *header = build_header(tensors, n, metadata, &max_bytes, &header_len);
    if (!header)
        return ddp_errf(err, err_len, "%s: cannot build the header (out of memory?)", path);
    void *buf = malloc(max_bytes ? (size_t)max_bytes : 1);
    char tmp[4200], why[512] = "";
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    int fd = buf ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    int rc = 0;
    if (!buf) {
        rc = ddp_errf(err, err_len, "%s: out of memory for a %llu-byte tensor", path,
                      (unsigned long long)max_bytes);
    } else if (fd < 0) {
        rc = ddp_errf(err, err_len, "%s: cannot create %s: %s", path, tmp, strerror(errno));
    } else {
        uint64_t len = header_len;
        int io = write_all(fd, &len, sizeof len);
        if (io == 0) io = write_all(fd, header, header_len);
        for (int i = 0; i < n && io == 0 && rc == 0; i++) {
            if (fill(arg, i, buf, why, sizeof why) < 0)
                rc = ddp_errf(err, err_len, "%s: %s", path, why);
            else
                io = write_all(fd, buf,
                               safetensors_elems(tensors[i].ndim, tensors[i].shape) *
                                   safetensors_dtype_size(tensors[i].dtype));
        }
        if (io == 0 && rc == 0 && fsync(fd) < 0) io = -errno;
        if (close(fd) < 0 && io == 0 && rc == 0) io = -errno;
        if (io == 0 && rc == 0 && rename(tmp, path) < 0) io = -errno;
        if (io < 0) rc = ddp_errf(err, err_len, "%s: cannot write: %s", path, strerror(-io));
        if (rc < 0) {
            unlink(tmp);
        } else { /* the rename lasts once the directory is on disk */
            char dir[4200];
            snprintf(dir, sizeof dir, "%s", path);
            int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                fsync(dfd);
                close(dfd);
            }
        }
    }
    free(buf);
    free(header);
    return rc;
}
