/* run_dir: see run_dir.h. */
#include "agent/run_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs.h"

#define PREFIX "ddprun-"

/* The lock is taken on a file of another name and renamed into place, so that another agent's
 * sweep never finds an unlocked LOCK file in a directory being made. */
static int hold_lock(const char *dir, int *lock_fd) {
    char fresh[4200], lock[4200];
    snprintf(fresh, sizeof fresh, "%s/" RUN_DIR_LOCK ".new", dir);
    snprintf(lock, sizeof lock, "%s/" RUN_DIR_LOCK, dir);
    int fd = open(fresh, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    if (flock(fd, LOCK_EX | LOCK_NB) < 0 || rename(fresh, lock) < 0) {
        int e = errno;
        close(fd);
        unlink(fresh);
        return -e;
    }
    *lock_fd = fd;
    return 0;
}

/* Whether base/name is a directory of ours whose agent is gone: it has a LOCK file and no process
 * holds its lock. Removed then, while this process holds that lock. */
static bool sweep_one(const char *base, const char *name, uid_t me) {
    char path[4200], lock[4400];
    snprintf(path, sizeof path, "%s/%s", base, name);
    struct stat st;
    if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != me) return false;
    snprintf(lock, sizeof lock, "%s/" RUN_DIR_LOCK, path);
    int fd = open(lock, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return false; /* a failed run's kept directory, or not an agent's */
    bool is_dead = flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (is_dead) fs_remove_tree(path);
    close(fd);
    return is_dead;
}

static int sweep(const char *base, const char *own) {
    DIR *d = opendir(base);
    if (!d) return 0;
    const char *own_name = strrchr(own, '/') ? strrchr(own, '/') + 1 : own;
    uid_t me = getuid();
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strncmp(e->d_name, PREFIX, strlen(PREFIX)) == 0 && strcmp(e->d_name, own_name) != 0 &&
            sweep_one(base, e->d_name, me))
            n++;
    closedir(d);
    return n;
}

int run_dir_create(const char *base, const char *rdzv_id, char *dir, size_t dir_len, int *lock_fd,
                   int *swept) {
    *lock_fd = -1;
    *swept = 0;
    int n = snprintf(dir, dir_len, "%s/" PREFIX "%s-XXXXXX", base, rdzv_id);
    if (n < 0 || (size_t)n >= dir_len) return -ENAMETOOLONG;
    for (char *c = dir + strlen(base) + 1; *c; c++)
        if (*c == '/') *c = '_'; /* a run id may hold any character; one name under base */
    if (!mkdtemp(dir)) return -errno;
    int rc = hold_lock(dir, lock_fd);
    if (rc < 0) {
        fs_remove_tree(dir);
        return rc;
    }
    *swept = sweep(base, dir);
    return 0;
}

void run_dir_release(const char *dir, int lock_fd, bool keep) {
    if (keep) {
        char lock[4200];
        snprintf(lock, sizeof lock, "%s/" RUN_DIR_LOCK, dir);
        unlink(lock);
    } else {
        fs_remove_tree(dir);
    }
    if (lock_fd >= 0) close(lock_fd);
}
