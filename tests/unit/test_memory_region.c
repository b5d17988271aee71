/* Unit tests of launcher/memory/memory_region: a new agent's memory directory takes over the files
 * of a dead agent's directory of the same job, removes a dead agent's directory of another job, and
 * leaves a live agent's alone. The base directory is a temporary one ($DDPRUN_SHM_DIR). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "memory/memory_region.h"
#include "temp_dir.h"

static char base[256];

static void setup(void) {
    temp_dir_make(base, sizeof base, "memory_region");
    setenv(MEMORY_REGION_BASE_ENV, base, 1);
}

static void teardown(void) {
    temp_dir_remove(base);
}

TestSuite(memory_region, .init = setup, .fini = teardown, .timeout = 30);

/* A pid that no process has now: a child's, once it exited and was reaped. */
static long dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    cr_assert_gt(pid, 0);
    waitpid(pid, NULL, 0);
    return (long)pid;
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

/* base/ddprun-mem-<pid>-<tag> holding a job file of identity and the given slot file. */
static void left_behind(char *dir, size_t len, long pid, const char *tag, const char *identity) {
    snprintf(dir, len, "%s/ddprun-mem-%ld-%s", base, pid, tag);
    cr_assert_eq(mkdir(dir, 0700), 0, "%s", dir);
    write_file(dir, "job", identity);
    write_file(dir, "own-0.ddps", tag);
}

static bool exists(const char *dir, const char *name) {
    char path[1400];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0;
}

Test(memory_region, a_dead_agent_of_the_same_job_leaves_its_files_to_the_next) {
    const char *job = "run chaos\nrendezvous etcd h:1\nnodes 2:2\nnproc 2\n";
    char dead[512], other[512], live[512], dir[1200], err[256];
    left_behind(dead, sizeof dead, dead_pid(), "same", job);
    write_file(dead, "peer-1-0.ddps", "copy");
    left_behind(other, sizeof other, dead_pid(), "other", "run another\n");
    left_behind(live, sizeof live, (long)getppid(), "live", job); /* its agent still runs */
    int adopted = -1;
    cr_assert_eq(memory_region_create(dir, sizeof dir, job, &adopted, err, sizeof err), 0, "%s",
                 err);
    cr_assert_eq(adopted, 2, "own-0 and the peer copy");
    cr_assert(exists(dir, "own-0.ddps") && exists(dir, "peer-1-0.ddps"));
    cr_assert(exists(dir, "job"), "the new directory names its job");
    cr_assert_not(exists(dead, ""), "the dead agent's directory is gone");
    cr_assert_not(exists(other, ""), "another job's is removed, not taken over");
    cr_assert(exists(live, "own-0.ddps"), "a live agent's directory is left alone");
    memory_region_remove(dir);
}

Test(memory_region, another_jobs_directory_gives_nothing) {
    char other[512], dir[1200], err[256];
    left_behind(other, sizeof other, dead_pid(), "other", "run a\n");
    int adopted = -1;
    cr_assert_eq(memory_region_create(dir, sizeof dir, "run b\n", &adopted, err, sizeof err), 0);
    cr_assert_eq(adopted, 0);
    cr_assert_not(exists(dir, "own-0.ddps"));
    cr_assert_not(exists(other, ""));
    memory_region_remove(dir);
}
