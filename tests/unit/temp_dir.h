/* temp_dir: a fresh directory under /tmp for one test and its removal, for Criterion fixtures
 * (.init/.fini) of the tests that write files. Header-only: each test file is its own program. */
#ifndef DDP_TEST_TEMP_DIR_H
#define DDP_TEST_TEMP_DIR_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

/* dir (n_bytes) := /tmp/NAME.XXXXXX, made; fails the test when it cannot be. */
static inline void temp_dir_make(char *dir, size_t n_bytes, const char *name) {
    snprintf(dir, n_bytes, "/tmp/%s.XXXXXX", name);
    cr_assert_not_null(mkdtemp(dir), "mkdtemp %s", dir);
}

/* rm -rf dir; fails the test when it cannot be removed. */
static inline void temp_dir_remove(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

#endif
