/* Unit tests of launcher/workers/error_file: PyTorch's @record error file read back, and anything
 * else a worker may leave there refused without harm. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "workers/error_file.h"

static char path[64];

static void write_file(const char *text) {
    strcpy(path, "/tmp/error_file_test_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
}

static void cleanup(void) {
    if (path[0]) unlink(path);
}

TestSuite(error_file, .fini = cleanup);

Test(error_file, torch_record_format) {
    write_file(
        "{\"message\": {\"message\": \"RuntimeError: boom\", \"extraInfo\": {\"py_callstack\": "
        "\"Traceback (most recent call last):\\n  File \\\"x.py\\\", line 3\\nRuntimeError: "
        "boom\\n\", \"timestamp\": \"1764040000\"}}}");
    error_file_t e;
    cr_assert_eq(error_file_read(path, &e), 0);
    cr_assert_str_eq(e.message, "RuntimeError: boom");
    cr_assert(strstr(e.traceback, "Traceback (most recent call last):\n"), "%s", e.traceback);
    cr_assert_eq(e.timestamp, 1764040000LL);
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    error_file_print(&e, f);
    fclose(f);
    cr_assert(strstr(out, "ddprun: its error: RuntimeError: boom\n  Traceback"), "%s", out);
    free(out);
}

Test(error_file, a_plain_message_and_control_bytes) {
    write_file("{\"message\": \"worker died\\u0007\\u001b[31m\"}");
    error_file_t e;
    cr_assert_eq(error_file_read(path, &e), 0);
    cr_assert_str_eq(e.message, "worker died??[31m");
    cr_assert_str_eq(e.traceback, "");
}

Test(error_file, other_files_are_refused) {
    error_file_t e;
    cr_assert_eq(error_file_read("/nonexistent/error.json", &e), -ENOENT);
    const char *bad[] = {"",   "not json",         "[]",
                         "{}", "{\"message\": 3}", "{\"message\": {\"x\": 1}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_file(bad[i]);
        cr_assert_eq(error_file_read(path, &e), -EINVAL, "%s", bad[i]);
        unlink(path);
    }
    cr_assert_eq(error_file_read("/tmp", &e), -EINVAL, "a directory");
}
