/* Unit tests of launcher/workers/console: writes go out whole and in order from the writer thread;
 * a console that does not read fills the queue past its high mark, which console_write says (the
 * caller then stops reading its workers) without ever blocking the caller; once the console reads
 * again the room callback comes on the loop; console_stop waits for what is queued, or gives up
 * after its bound when the console never reads. The console is a pipe put on fd 1. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "workers/console.h"

static uv_loop_t loop;
/* the console's handle does not keep a loop alive: the agent's other handles do */
static uv_timer_t alive;
static int console_pipe[2], saved_stdout = -1;
static int rooms;

static void on_alive(uv_timer_t *t) {
    (void)t;
}

static void on_room(void *arg) {
    (void)arg;
    rooms++;
}

static void setup(void) {
    /* as ddprun: a writer left behind on a console that went away gets EPIPE, not a signal */
    signal(SIGPIPE, SIG_IGN);
    cr_assert_eq(pipe2(console_pipe, O_CLOEXEC), 0);
    fcntl(console_pipe[0], F_SETFL, O_NONBLOCK);
    saved_stdout = dup(1);
    cr_assert_geq(dup2(console_pipe[1], 1), 0);
    cr_assert_eq(uv_loop_init(&loop), 0);
    uv_timer_init(&loop, &alive);
    uv_timer_start(&alive, on_alive, 1000, 1000);
    rooms = 0;
    cr_assert_eq(console_start(&loop, on_room, NULL), 0);
}

static void teardown(void) {
    /* a writer left behind (the stop test's) finds its console gone (EPIPE) and the rest of its
     * queue goes to /dev/null, not to this process's own stdout */
    close(console_pipe[0]);
    int null_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    dup2(null_fd, 1);
    close(null_fd);
    close(console_pipe[1]);
    close(saved_stdout);
}

TestSuite(console, .init = setup, .fini = teardown, .timeout = 60);

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

Test(console, a_console_that_does_not_read_fills_the_queue_without_blocking_the_caller) {
    char line[128];
    int n = 0;
    double start = now_s();
    bool is_full = false;
    while (!is_full && n < 1000000) {
        int len = snprintf(line, sizeof line, "line %07d %0100d\n", n++, 0);
        is_full = console_write(1, line, (size_t)len);
    }
    cr_assert(is_full && console_is_full(), "never full after %d lines", n);
    cr_assert_lt(now_s() - start, 5.0, "the caller was held");
    /* the console reads again: every line, in order, and the room callback on the loop */
    char buf[1 << 16], pending[256];
    size_t pending_len = 0;
    int seen = 0;
    double deadline = now_s() + 30;
    while ((seen < n || rooms == 0) && now_s() < deadline) {
        ssize_t got = read(console_pipe[0], buf, sizeof buf);
        for (ssize_t i = 0; i < got; i++) {
            pending[pending_len++] = buf[i];
            if (buf[i] != '\n') continue;
            int k = -1;
            sscanf(pending, "line %d", &k);
            cr_assert_eq(k, seen, "line %d came as line %d", k, seen);
            seen++;
            pending_len = 0;
        }
        uv_run(&loop, UV_RUN_NOWAIT);
        if (got <= 0) usleep(1000);
    }
    cr_assert_eq(seen, n);
    cr_assert_eq(rooms, 1, "the room callback came %d times", rooms);
    cr_assert_not(console_is_full());
    console_stop(-1);
}

Test(console, stop_gives_up_on_a_console_that_never_reads_after_its_bound) {
    char line[4096];
    memset(line, 'y', sizeof line);
    for (int i = 0; i < 64; i++) /* 256 KiB: more than the pipe holds */
        console_write(1, line, sizeof line);
    double start = now_s();
    console_stop(500);
    double took = now_s() - start;
    cr_assert(took >= 0.4 && took < 5.0, "stop took %.2f s", took);
    /* later writes are direct (a console that has room takes them at once) */
}
