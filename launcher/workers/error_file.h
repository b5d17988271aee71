/* error_file: the JSON error file a failed worker leaves at TORCHELASTIC_ERROR_FILE, as PyTorch's
 * torch.distributed.elastic.multiprocessing.errors.record writes it: {"message": {"message":
 * "RuntimeError: ...", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "..."}}} (or a
 * plain string message). Read with cJSON, bounded, every byte a worker wrote treated as untrusted
 * (control bytes are replaced before anything is printed). Blocking file I/O; any thread. */
#ifndef DDP_LAUNCHER_ERROR_FILE_H
#define DDP_LAUNCHER_ERROR_FILE_H

#include <stddef.h>
#include <stdio.h>

#define ERROR_FILE_MAX_BYTES ((size_t)1 << 20)

typedef struct {
    char message[1024];   /* "RuntimeError: boom" */
    char traceback[8192]; /* the last lines of the Python call stack, or "" */
    long long timestamp;  /* unix seconds, 0 when absent */
} error_file_t;

/* Returns 0; -ENOENT when there is no file; -EINVAL when it is not such a file (too large, not
 * JSON, no message). */
int error_file_read(const char *path, error_file_t *out);
/* "ddprun: its error: MESSAGE" and the traceback indented, to f. */
void error_file_print(const error_file_t *e, FILE *f);

#endif
