/* memory_region: see memory_region.h. */
#include "memory/memory_region.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ddp_error.h"
#include "fs.h"

#define PREFIX   "ddprun-mem-"
#define JOB_FILE "job"

void memory_region_remove(const char *dir) {
    fs_remove_tree(dir);
}

static const char *base_dir(void) {
    const char *env = getenv(MEMORY_REGION_BASE_ENV);
    if (env && *env) return env;
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

/* Whether the directory at path was made for this identity (its job file holds exactly it). */
static bool is_same_job(const char *path, const char *identity) {
    char file[4200], text[4096];
    snprintf(file, sizeof file, "%s/" JOB_FILE, path);
    FILE *f = fopen(file, "r");
    if (!f) return false;
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    return n == strlen(identity) && memcmp(text, identity, n) == 0;
}

/* Every file of from but its job file, renamed into to (the same file system): returns how many. */
static int adopt_files(const char *from, const char *to) {
    DIR *d = opendir(from);
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, JOB_FILE) == 0) continue;
        char src[4400], dst[4400];
        snprintf(src, sizeof src, "%s/%s", from, e->d_name);
        snprintf(dst, sizeof dst, "%s/%s", to, e->d_name);
        if (rename(src, dst) == 0) n++;
    }
    closedir(d);
    return n;
}

/* ddprun-mem-<pid>-XXXXXX of an agent that is gone: tmpfs memory nobody will free otherwise; the
 * first of the same job gives its files to dir first. */
static int remove_stale(const char *base, const char *dir, const char *identity) {
    int adopted = 0;
    bool has_adopted = false;
    DIR *d = opendir(base);
    if (!d) return 0;
    uid_t me = getuid();
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, PREFIX, strlen(PREFIX)) != 0) continue;
        char *end;
        long pid = strtol(e->d_name + strlen(PREFIX), &end, 10);
        if (pid <= 0 || *end != '-') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", base, e->d_name);
        struct stat st;
        if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != me) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        if (identity[0] && is_same_job(path, identity)) {
            /* one per agent; another of the job (several nodes on one host, as in tests) is left
             * for the next agent of the job that starts here */
            if (has_adopted) continue;
            adopted = adopt_files(path, dir);
            has_adopted = true;
        }
        memory_region_remove(path);
    }
    closedir(d);
    return adopted;
}

int memory_region_create(char *dir, size_t dir_len, const char *identity, int *adopted, char *err,
                         size_t err_len) {
    const char *base = base_dir();
    *adopted = 0;
    int n = snprintf(dir, dir_len, "%s/" PREFIX "%ld-XXXXXX", base, (long)getpid());
    if (n < 0 || (size_t)n >= dir_len) {
        dir[0] = '\0';
        ddp_errf(err, err_len, "memory snapshots: the directory name under %s is too long", base);
        return -ENAMETOOLONG;
    }
    if (!mkdtemp(dir)) {
        int e = errno;
        ddp_errf(err, err_len, "memory snapshots: cannot create a directory in %s: %s", base,
                 strerror(e));
        dir[0] = '\0';
        return -e;
    }
    char job[4200];
    snprintf(job, sizeof job, "%s/" JOB_FILE, dir);
    FILE *f = fopen(job, "w");
    bool is_written = f && fputs(identity, f) >= 0;
    if (f && fclose(f) != 0) is_written = false;
    /* without its identity the directory is never adopted: the snapshots still work */
    *adopted = remove_stale(base, dir, is_written ? identity : "");
    return 0;
}
