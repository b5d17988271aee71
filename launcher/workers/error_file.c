/* error_file: see error_file.h. */
#include "workers/error_file.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cJSON.h>

/* Printable text: control bytes other than newline and tab become '?'. */
static void copy_printable(char *out, size_t out_len, const char *in) {
    size_t n = 0;
    for (; *in && n + 1 < out_len; in++) {
        unsigned char c = (unsigned char)*in;
        out[n++] = (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f ? '?' : (char)c;
    }
    out[n] = '\0';
}

/* The last max_lines lines of text (a traceback ends with what matters). */
static const char *last_lines(const char *text, int max_lines) {
    const char *p = text + strlen(text);
    if (p > text && p[-1] == '\n') p--;
    int lines = 0;
    for (; p > text; p--)
        if (p[-1] == '\n' && ++lines >= max_lines) break;
    return p;
}

int error_file_read(const char *path, error_file_t *out) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return errno == ENOENT ? -ENOENT : -EINVAL;
    struct stat st;
    if (fstat(fileno(f), &st) < 0 || !S_ISREG(st.st_mode) ||
        (size_t)st.st_size > ERROR_FILE_MAX_BYTES) {
        fclose(f);
        return -EINVAL;
    }
    char *text = malloc((size_t)st.st_size + 1);
    size_t n = text ? fread(text, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!text) return -EINVAL;
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(root, "message");
    const cJSON *inner =
        cJSON_IsObject(msg) ? cJSON_GetObjectItemCaseSensitive(msg, "message") : msg;
    int rc = -EINVAL;
    if (cJSON_IsString(inner)) {
        copy_printable(out->message, sizeof out->message, inner->valuestring);
        const cJSON *extra =
            cJSON_IsObject(msg) ? cJSON_GetObjectItemCaseSensitive(msg, "extraInfo") : NULL;
        const cJSON *stack = cJSON_GetObjectItemCaseSensitive(extra, "py_callstack");
        if (cJSON_IsString(stack))
            copy_printable(out->traceback, sizeof out->traceback,
                           last_lines(stack->valuestring, 40));
        const cJSON *ts = cJSON_GetObjectItemCaseSensitive(extra, "timestamp");
        if (cJSON_IsString(ts))
            out->timestamp = strtoll(ts->valuestring, NULL, 10);
        else if (cJSON_IsNumber(ts))
            out->timestamp = (long long)ts->valuedouble;
        rc = 0;
    }
    cJSON_Delete(root);
    return rc;
}

void error_file_print(const error_file_t *e, FILE *f) {
    fprintf(f, "ddprun: its error: %s\n", e->message);
    if (!e->traceback[0]) return;
    const char *line = e->traceback;
    while (*line) {
        const char *end = strchr(line, '\n');
        int len = end ? (int)(end - line) : (int)strlen(line);
        fprintf(f, "  %.*s\n", len, line);
        line += len + (end != NULL);
    }
}
