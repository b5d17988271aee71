/* ini_file: the INI dialect of train.conf, read whole and checked line by line: `[section]`,
 * `key = value` (or `key: value`), full-line comments starting with ';' or '#', inline comments
 * starting with ' ;' or ' #', blank lines, an optional UTF-8 byte-order mark. Stricter than inih
 * where inih is silent: only regular files, at most INI_FILE_MAX_BYTES, no control bytes (a binary
 * file is named as such, never echoed), an unclosed `[section` is an error of its own, and lines
 * have no length limit below the file's. Pure apart from reading the file; no allocation kept. */
#ifndef DDP_WORKER_INI_FILE_H
#define DDP_WORKER_INI_FILE_H

#include <stddef.h>

#define INI_FILE_MAX_BYTES ((size_t)1 << 20)

/* One key: section and key without surrounding blanks, value with inline comment and blanks
 * removed; line is 1-based. Return 0 to go on, or -1 with a message in err (the parse stops). */
typedef int (*ini_file_cb)(void *user, const char *section, const char *key, const char *value,
                           int line, char *err, size_t err_len);

/* Parse path, calling cb for every key in order. Returns 0, or -1 with "path:line: why" (or
 * "path: why") in err. */
int ini_file_parse(const char *path, ini_file_cb cb, void *user, char *err, size_t err_len);
/* The same over text already in memory (path only names it in messages); text is changed. */
int ini_file_parse_text(const char *path, char *text, size_t n_bytes, ini_file_cb cb, void *user,
                        char *err, size_t err_len);

#endif
