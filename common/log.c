/* log: see log.h. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *log_component = "ddprun";
static log_level_t log_threshold = LOG_LEVEL_INFO;
static void (*log_writer)(const char *line, size_t len);

void log_set_writer(void (*writer)(const char *line, size_t len)) {
    log_writer = writer;
}

void log_init(const char *component, log_level_t level) {
    log_component = component;
    log_threshold = level;
}

int log_level_parse(const char *s) {
    static const char *const names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

void log_write(log_level_t level, const char *fmt, ...) {
    static const char *const tags[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    if (level < log_threshold) return;
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %s %s: ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, log_component, tags[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    if (log_writer) {
        log_writer(line, len);
        return;
    }
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
