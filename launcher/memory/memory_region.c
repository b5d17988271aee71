/* memory_region: see memory_region.h. */
#include "memory/memory_region.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ddp_error.h"

#define PREFIX "ddprun-mem-"

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void memory_region_remove(const char *dir) {
    if (dir && dir[0]) nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static const char *base_dir(void) {
    const char *env = getenv(MEMORY_REGION_BASE_ENV);
    if (env && *env) return env;
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

/* ddprun-mem-<pid>-XXXXXX of an agent that is gone: tmpfs memory nobody will free otherwise. */
static void remove_stale(const char *base) {
    DIR *d = opendir(base);
    if (!d) return;
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
        memory_region_remove(path);
    }
    closedir(d);
}

int memory_region_create(char *dir, size_t dir_len, char *err, size_t err_len) {
    const char *base = base_dir();
    remove_stale(base);
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
    return 0;
}
