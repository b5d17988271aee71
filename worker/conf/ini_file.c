/* ini_file: see ini_file.h. */
#include "ini_file.h"
#include "ddp_error.h"
#include "fs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static bool is_blank(char c) {
    return c == ' ' || c == '\t' || c == '\r';
}

static char *trim(char *s) {
    while (is_blank(*s))
        s++;
    size_t n = strlen(s);
    while (n && is_blank(s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* A ';' or '#' after a blank starts an inline comment (a value may contain either otherwise). */
static void cut_inline_comment(char *s) {
    for (char *p = s + 1; *p; p++)
        if ((*p == ';' || *p == '#') && is_blank(p[-1])) {
            *p = '\0';
            return;
        }
}

/* Control bytes say "not a text file": name the first one, never print the line. */
static int check_text(const char *path, const char *text, size_t n, char *err, size_t err_len) {
    int line = 1, column = 1;
    for (size_t i = 0; i < n; i++, column++) {
        unsigned char c = (unsigned char)text[i];
        if (c == '\n') {
            line++;
            column = 0;
        } else if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) {
            return ddp_errf(err, err_len, "%s:%d: byte 0x%02x at column %d: not a text file", path,
                            line, c, column);
        }
    }
    return 0;
}

int ini_file_parse_text(const char *path, char *text, size_t n_bytes, ini_file_cb cb, void *user,
                        char *err, size_t err_len) {
    if (check_text(path, text, n_bytes, err, err_len) < 0) return -1;
    text[n_bytes] = '\0';
    if (n_bytes >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) text += 3;
    char section[128] = "";
    int line = 0;
    for (char *next = text; next;) {
        char *raw = next;
        char *nl = strchr(raw, '\n');
        next = nl ? nl + 1 : NULL;
        if (nl) *nl = '\0';
        line++;
        char *s = trim(raw);
        if (*s == '\0' || *s == ';' || *s == '#') continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (!close)
                return ddp_errf(err, err_len,
                                "%s:%d: section header '%.60s' is not closed with ']'", path, line,
                                s);
            *close = '\0';
            char *rest = trim(close + 1);
            if (*rest && *rest != ';' && *rest != '#')
                return ddp_errf(err, err_len, "%s:%d: text after the section header [%.60s]", path,
                                line, s + 1);
            char *name = trim(s + 1);
            if (!*name) return ddp_errf(err, err_len, "%s:%d: empty section name '[]'", path, line);
            if (strlen(name) >= sizeof section)
                return ddp_errf(err, err_len, "%s:%d: section name longer than %zu bytes", path,
                                line, sizeof section - 1);
            strcpy(section, name);
            continue;
        }
        char *eq = s + strcspn(s, "=:");
        if (!*eq)
            return ddp_errf(err, err_len,
                            "%s:%d: '%.60s' is not 'key = value', '[section]' or a "
                            "comment",
                            path, line, s);
        *eq = '\0';
        char *key = trim(s), *value = eq + 1;
        cut_inline_comment(value - 1);
        value = trim(value);
        if (!*key) return ddp_errf(err, err_len, "%s:%d: a value without a key", path, line);
        if (!*section)
            return ddp_errf(err, err_len, "%s:%d: key '%.60s' comes before any [section]", path,
                            line, key);
        char msg[768];
        if (cb(user, section, key, value, line, msg, sizeof msg) < 0)
            return ddp_errf(err, err_len, "%s:%d: %s", path, line, msg);
    }
    return 0;
}

int ini_file_parse(const char *path, ini_file_cb cb, void *user, char *err, size_t err_len) {
    struct stat st;
    char why[128];
    int fd = fs_open_regular(path, &st, why, sizeof why); /* a FIFO does not block it */
    if (fd < 0) return ddp_errf(err, err_len, "%s: %s", path, why);
    if ((size_t)st.st_size > INI_FILE_MAX_BYTES) {
        close(fd);
        return ddp_errf(err, err_len, "%s: %lld bytes; a train.conf has at most %zu", path,
                        (long long)st.st_size, INI_FILE_MAX_BYTES);
    }
    char *text = malloc((size_t)st.st_size + 1);
    if (!text) {
        close(fd);
        return ddp_errf(err, err_len, "%s: out of memory", path);
    }
    size_t n = 0;
    int read_errno = 0;
    while (n < (size_t)st.st_size) {
        ssize_t got = read(fd, text + n, (size_t)st.st_size - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) read_errno = errno;
        if (got <= 0) break; /* an error, or the file shrank while we read: what is there */
        n += (size_t)got;
    }
    close(fd);
    if (read_errno) {
        free(text);
        return ddp_errf(err, err_len, "%s: cannot read: %s", path, strerror(read_errno));
    }
    int rc = ini_file_parse_text(path, text, n, cb, user, err, err_len);
    free(text);
    return rc;
}
