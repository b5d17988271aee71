/* safetensors: the file format of Hugging Face's safetensors, which PyTorch users exchange weights
 * in: an 8-byte little-endian header length N, N bytes of JSON header
 *   {"NAME": {"dtype": "F32", "shape": [64, 3, 7, 7], "data_offsets": [BEGIN, END]}, ...,
 *    "__metadata__": {"KEY": "VALUE", ...}}
 * then the tensors' raw little-endian bytes, offsets relative to the end of the header. This module
 * knows the format only (no model): a reader that validates every length, offset, dtype and shape
 * before anything is read from the data section, and an atomic writer. The header is read and
 * written with cJSON. Blocking file I/O; any thread; no state shared between calls. */
#ifndef DDP_WORKER_SAFETENSORS_H
#define DDP_WORKER_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define SAFETENSORS_MAX_DIMS 8
/* The reference implementation's limit on the header (100 MB): nothing larger is allocated. */
#define SAFETENSORS_HEADER_MAX ((uint64_t)100000000)
/* A tensor name's longest length accepted. */
#define SAFETENSORS_NAME_MAX 512

typedef enum {
    SAFETENSORS_F32,
    SAFETENSORS_F16,
    SAFETENSORS_BF16,
    SAFETENSORS_F64,
    SAFETENSORS_I64,
    SAFETENSORS_I32,
    SAFETENSORS_I16,
    SAFETENSORS_I8,
    SAFETENSORS_U8,
    SAFETENSORS_BOOL,
} safetensors_dtype_t;

typedef struct {
    char *name;
    safetensors_dtype_t dtype;
    int ndim; /* 0: a scalar */
    uint64_t shape[SAFETENSORS_MAX_DIMS];
    uint64_t begin, end; /* bytes, into the data section */
} safetensors_entry_t;

typedef struct {
    safetensors_entry_t *entries; /* in the header's order */
    int n;
    char **meta; /* __metadata__: key, value, key, value, ... (n_meta pairs) */
    int n_meta;
    uint64_t data_offset; /* of the data section in the file: 8 + header length */
    uint64_t data_len;
} safetensors_index_t;

/* A tensor to write: bytes come from fill (so large models stream through one buffer). */
typedef struct {
    const char *name;
    safetensors_dtype_t dtype;
    int ndim;
    uint64_t shape[SAFETENSORS_MAX_DIMS];
} safetensors_tensor_t;

/* Writes tensor i's bytes (safetensors_bytes of it) into buf. Returns 0, or -1 with err set. */
typedef int (*safetensors_fill_cb)(void *arg, int i, void *buf, char *err, size_t err_len);

/* "F32", ... (the header's spelling); bytes per element. */
const char *safetensors_dtype_name(safetensors_dtype_t t);
size_t safetensors_dtype_size(safetensors_dtype_t t);
/* Elements of a shape (1 for a scalar). */
uint64_t safetensors_elems(int ndim, const uint64_t *shape);

/* Parse a header of len bytes (not NUL-terminated; trailing spaces allowed) describing a data
 * section of data_len bytes. Every entry is validated: an object with a known dtype, a shape of at
 * most SAFETENSORS_MAX_DIMS non-negative whole numbers, data_offsets [begin, end] with begin <= end
 * <= data_len and end - begin = elements * dtype size (no overflow), no duplicate or empty names,
 * no two tensors overlapping; __metadata__, if present, an object of strings. Returns 0 with *out
 * filled (free it with safetensors_index_free), or -1 with the reason in err (naming the tensor).
 */
int safetensors_parse_header(const char *header, size_t len, uint64_t data_len,
                             safetensors_index_t *out, char *err, size_t err_len);
/* A whole file held in memory: the length prefix (at least 2 bytes of JSON, at most
 * SAFETENSORS_HEADER_MAX and within size), then safetensors_parse_header. */
int safetensors_parse_buffer(const uint8_t *buf, size_t size, safetensors_index_t *out, char *err,
                             size_t err_len);
/* Open path and parse its header (read with pread, nothing of the data section yet). Returns an
 * open descriptor (>= 0) with *out filled, or -1 with "PATH: why" in err. */
int safetensors_open(const char *path, safetensors_index_t *out, char *err, size_t err_len);
/* Read entry e's bytes (e->end - e->begin) from fd into buf. Returns 0, or -1 with err set. */
int safetensors_read(int fd, const safetensors_index_t *ix, const safetensors_entry_t *e, void *buf,
                     char *err, size_t err_len);
/* The entry called name, or NULL. */
const safetensors_entry_t *safetensors_find(const safetensors_index_t *ix, const char *name);
/* The __metadata__ value of key (owned by ix), or NULL. */
const char *safetensors_meta(const safetensors_index_t *ix, const char *key);
void safetensors_index_free(safetensors_index_t *ix);

/* Write n tensors to path atomically (a temporary file beside it, fsync, rename, fsync of the
 * directory): the header (cJSON, __metadata__ from the NULL-terminated key/value list `metadata`,
 * padded with spaces so the data starts 8-byte aligned), then each tensor's bytes from fill, in
 * order. Returns 0, or -1 with "PATH: why" in err; on failure path is untouched. */
int safetensors_write(const char *path, const safetensors_tensor_t *tensors, int n,
                      const char *const *metadata, safetensors_fill_cb fill, void *arg, char *err,
                      size_t err_len);

#endif
