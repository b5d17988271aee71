/* log: leveled, timestamped log lines on stderr, one write(2) per line so lines from several
 * processes never interleave mid-line. Thread-safe; no allocation. */
#ifndef DDP_COMMON_LOG_H
#define DDP_COMMON_LOG_H

#include <stddef.h>

typedef enum { LOG_LEVEL_DEBUG = 0, LOG_LEVEL_INFO, LOG_LEVEL_WARN, LOG_LEVEL_ERROR } log_level_t;

/* Set the threshold and the component name printed on each line (string is not copied). */
void log_init(const char *component, log_level_t level);
/* Parse "debug|info|warn|error" (e.g. from DDPRUN_LOG_LEVEL); returns -1 if unknown. */
int log_level_parse(const char *s);
void log_write(log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Where whole lines go instead of write(2) on stderr (NULL: there again); set before any thread
 * logs. The agent queues them behind its workers' output (launcher/workers/console.h). */
void log_set_writer(void (*writer)(const char *line, size_t len));

#define LOG_DEBUG(...) log_write(LOG_LEVEL_DEBUG, __VA_ARGS__)
#define LOG_INFO(...)  log_write(LOG_LEVEL_INFO, __VA_ARGS__)
#define LOG_WARN(...)  log_write(LOG_LEVEL_WARN, __VA_ARGS__)
#define LOG_ERROR(...) log_write(LOG_LEVEL_ERROR, __VA_ARGS__)

#endif
