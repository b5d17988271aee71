/* console: see console.h. One queue of chunks under a mutex; the writer thread takes them in
 * order, writes each whole (blocking), and signals the loop (uv_async) when the queue drains
 * below the low mark after it passed the high one. */
#include "workers/console.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fs.h"
#include "log.h"

typedef struct chunk {
    struct chunk *next;
    int fd;
    size_t len;
    char data[];
} chunk_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t has_work, has_drained;
    chunk_t *head, *tail;
    size_t queued; /* bytes queued or being written */
    bool is_running, is_stopping, is_full;
    pthread_t thread;
    uv_async_t room;
    void (*room_cb)(void *arg);
    void *room_arg;
} con = {.mu = PTHREAD_MUTEX_INITIALIZER,
         .has_work = PTHREAD_COND_INITIALIZER,
         .has_drained = PTHREAD_COND_INITIALIZER};

static void *writer_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&con.mu);
    for (;;) {
        while (!con.head && !con.is_stopping)
            pthread_cond_wait(&con.has_work, &con.mu);
        chunk_t *c = con.head;
        if (!c) break;
        con.head = c->next;
        if (!con.head) con.tail = NULL;
        pthread_mutex_unlock(&con.mu);
        (void)fs_write_all(c->fd, c->data, c->len);
        pthread_mutex_lock(&con.mu);
        con.queued -= c->len;
        free(c);
        if (con.is_full && con.queued <= CONSOLE_LOW_BYTES) {
            con.is_full = false;
            uv_async_send(&con.room);
        }
        if (con.queued == 0) pthread_cond_broadcast(&con.has_drained);
    }
    pthread_mutex_unlock(&con.mu);
    return NULL;
}

static void on_room(uv_async_t *a) {
    (void)a;
    if (con.room_cb && !console_is_full()) con.room_cb(con.room_arg);
}

static void log_line(const char *line, size_t len) {
    console_write(2, line, len);
}

int console_start(uv_loop_t *loop, void (*room)(void *arg), void *arg) {
    if (con.is_running) return -EALREADY;
    int rc = uv_async_init(loop, &con.room, on_room);
    if (rc < 0) return rc;
    uv_unref((uv_handle_t *)&con.room); /* it never keeps the loop alive */
    con.room_cb = room;
    con.room_arg = arg;
    con.is_stopping = false;
    rc = -pthread_create(&con.thread, NULL, writer_main, NULL);
    if (rc < 0) {
        uv_close((uv_handle_t *)&con.room, NULL);
        return rc;
    }
    pthread_mutex_lock(&con.mu);
    con.is_running = true;
    pthread_mutex_unlock(&con.mu);
    log_set_writer(log_line);
    return 0;
}

bool console_write(int fd, const void *p, size_t n) {
    pthread_mutex_lock(&con.mu);
    chunk_t *c = con.is_running && n ? malloc(sizeof *c + n) : NULL;
    if (!c) { /* not running, or out of memory: straight out (in order, the queue drained) */
        pthread_mutex_unlock(&con.mu);
        (void)fs_write_all(fd, p, n);
        return false;
    }
    c->next = NULL;
    c->fd = fd;
    c->len = n;
    memcpy(c->data, p, n);
    if (con.tail)
        con.tail->next = c;
    else
        con.head = c;
    con.tail = c;
    con.queued += n;
    if (con.queued > CONSOLE_HIGH_BYTES) con.is_full = true;
    bool is_full = con.is_full;
    pthread_cond_signal(&con.has_work);
    pthread_mutex_unlock(&con.mu);
    return is_full;
}

void console_printf(int fd, const char *fmt, ...) {
    char text[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    console_write(fd, text, (size_t)n < sizeof text ? (size_t)n : sizeof text - 1);
}

bool console_is_full(void) {
    pthread_mutex_lock(&con.mu);
    bool is_full = con.is_full;
    pthread_mutex_unlock(&con.mu);
    return is_full;
}

void console_stop(int timeout_ms) {
    pthread_mutex_lock(&con.mu);
    if (!con.is_running) {
        pthread_mutex_unlock(&con.mu);
        return;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    while (con.queued > 0)
        if (timeout_ms < 0)
            pthread_cond_wait(&con.has_drained, &con.mu);
        else if (pthread_cond_timedwait(&con.has_drained, &con.mu, &until) == ETIMEDOUT)
            break;
    bool is_drained = con.queued == 0;
    con.is_running = false; /* later writes are direct; what is left is the writer's */
    con.is_stopping = true;
    con.is_full = false; /* no room signal to a loop that is done with it */
    pthread_cond_signal(&con.has_work);
    pthread_mutex_unlock(&con.mu);
    log_set_writer(NULL);
    if (is_drained)
        pthread_join(con.thread, NULL);
    else
        pthread_detach(con.thread);
    uv_close((uv_handle_t *)&con.room, NULL);
}
