/* Unit tests of launcher/agent/run_dir: an agent's run directory, removed after a success, kept
 * (without its lock file) after a failure, and swept by the next agent when its agent was killed;
 * a live agent's directory and a failed run's kept one are never swept. The base directory is a
 * temporary one (the agent's $TMPDIR). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent/run_dir.h"
#include "temp_dir.h"

static char base[256];

static void setup(void) {
    temp_dir_make(base, sizeof base, "run_dir");
}

static void teardown(void) {
    temp_dir_remove(base);
}

TestSuite(run_dir, .init = setup, .fini = teardown, .timeout = 30);

static bool exists(const char *dir, const char *name) {
    char path[1400];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name ? name : ".");
    return stat(path, &st) == 0;
}

/* base/name made, with a file in it, and a LOCK file when has_lock */
static void make_dir(char *dir, size_t len, const char *name, bool has_lock) {
    snprintf(dir, len, "%s/%s", base, name);
    cr_assert_eq(mkdir(dir, 0700), 0, "%s", dir);
    char path[1400];
    snprintf(path, sizeof path, "%s/error.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{}", f);
    fclose(f);
    if (!has_lock) return;
    snprintf(path, sizeof path, "%s/" RUN_DIR_LOCK, dir);
    int fd = open(path, O_CREAT | O_WRONLY, 0600);
    cr_assert_geq(fd, 0);
    close(fd);
}

Test(run_dir, is_removed_after_a_success_and_kept_without_its_lock_after_a_failure) {
    char dir[1200];
    int fd, swept;
    cr_assert_eq(run_dir_create(base, "job", dir, sizeof dir, &fd, &swept), 0);
    cr_assert_eq(strncmp(dir, base, strlen(base)), 0);
    cr_assert(strstr(dir, "/ddprun-job-"), "%s", dir);
    cr_assert(exists(dir, RUN_DIR_LOCK));
    cr_assert_not(exists(dir, RUN_DIR_LOCK ".new"));
    cr_assert_eq(swept, 0);
    run_dir_release(dir, fd, false);
    cr_assert_not(exists(dir, NULL));

    cr_assert_eq(run_dir_create(base, "job", dir, sizeof dir, &fd, &swept), 0);
    run_dir_release(dir, fd, true);
    cr_assert(exists(dir, NULL));
    cr_assert_not(exists(dir, RUN_DIR_LOCK));
    /* a kept directory stays through the next agent's sweep */
    char next[1200];
    cr_assert_eq(run_dir_create(base, "job", next, sizeof next, &fd, &swept), 0);
    cr_assert_eq(swept, 0);
    cr_assert(exists(dir, NULL));
    run_dir_release(next, fd, false);
}

/* An agent killed with SIGKILL: a child process that made its run directory and was then killed.
 * The next agent removes that directory, and only it. */
Test(run_dir, a_killed_agents_directory_is_swept_by_the_next_agent) {
    int pipefd[2];
    cr_assert_eq(pipe(pipefd), 0);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* gone with the test, whatever it asserts */
        char dir[1200];
        int fd, swept;
        if (run_dir_create(base, "job", dir, sizeof dir, &fd, &swept) < 0) _exit(1);
        if (write(pipefd[1], dir, sizeof dir) != (ssize_t)sizeof dir) _exit(1);
        pause();
        _exit(0);
    }
    cr_assert_gt(pid, 0);
    char dead[1200];
    cr_assert_eq(read(pipefd[0], dead, sizeof dead), (ssize_t)sizeof dead);
    close(pipefd[0]), close(pipefd[1]);

    /* alive: a second agent leaves it alone */
    char live[1200];
    int live_fd, swept;
    cr_assert_eq(run_dir_create(base, "other", live, sizeof live, &live_fd, &swept), 0);
    cr_assert_eq(swept, 0);
    cr_assert(exists(dead, RUN_DIR_LOCK));

    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    char kept[1200], foreign[1200], mem[1200];
    make_dir(kept, sizeof kept, "ddprun-job-failed", false);
    make_dir(foreign, sizeof foreign, "elsewhere-job", true); /* not named as an agent's */
    make_dir(mem, sizeof mem, "ddprun-mem-1-abcdef", false);  /* memory_region's */
    char next[1200];
    int next_fd;
    cr_assert_eq(run_dir_create(base, "job", next, sizeof next, &next_fd, &swept), 0);
    cr_assert_eq(swept, 1);
    cr_assert_not(exists(dead, NULL), "%s was not swept", dead);
    cr_assert(exists(live, RUN_DIR_LOCK), "a live agent's directory was swept");
    cr_assert(exists(kept, "error.json"), "a failed run's kept directory was swept");
    cr_assert(exists(foreign, "error.json"));
    cr_assert(exists(mem, "error.json"));
    run_dir_release(next, next_fd, false);
    run_dir_release(live, live_fd, false);
}

Test(run_dir, a_dead_agents_lock_file_is_one_nobody_holds) {
    char dead[1200], held[1200];
    make_dir(dead, sizeof dead, "ddprun-a-000001", true);
    make_dir(held, sizeof held, "ddprun-b-000002", true);
    char lock[1400];
    snprintf(lock, sizeof lock, "%s/" RUN_DIR_LOCK, held);
    int holder = open(lock, O_RDONLY); /* another open file: flock conflicts within a process too */
    cr_assert_geq(holder, 0);
    cr_assert_eq(flock(holder, LOCK_EX | LOCK_NB), 0);
    char dir[1200];
    int fd, swept;
    cr_assert_eq(run_dir_create(base, "c", dir, sizeof dir, &fd, &swept), 0);
    cr_assert_eq(swept, 1);
    cr_assert_not(exists(dead, NULL));
    cr_assert(exists(held, "error.json"));
    close(holder);
    run_dir_release(dir, fd, false);
}

Test(run_dir, a_run_id_with_slashes_is_one_name_under_base) {
    char dir[1200];
    int fd, swept;
    cr_assert_eq(run_dir_create(base, "team/job/1", dir, sizeof dir, &fd, &swept), 0);
    cr_assert(strstr(dir, "/ddprun-team_job_1-"), "%s", dir);
    cr_assert_null(strchr(dir + strlen(base) + 1, '/'), "%s", dir);
    run_dir_release(dir, fd, false);
    char long_id[1300];
    memset(long_id, 'x', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    cr_assert_lt(run_dir_create(base, long_id, dir, sizeof dir, &fd, &swept), 0);
    cr_assert_eq(fd, -1);
}
