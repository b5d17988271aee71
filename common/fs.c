/* fs: see fs.h. */
#include "fs.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int fs_mkdir_p(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -ENAMETOOLONG;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -errno;
        *p = '/';
    }
    if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -errno;
    struct stat st; /* EEXIST says nothing about what exists */
    if (stat(buf, &st) < 0) return -errno;
    return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st, (void)type, (void)ftw;
    remove(path);
    return 0; /* best effort: the rest still goes */
}

static const char *file_kind(mode_t mode) {
    return S_ISDIR(mode)    ? "a directory"
           : S_ISFIFO(mode) ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
           : S_ISCHR(mode)  ? "a character device"
           : S_ISBLK(mode)  ? "a block device"
                            : "of an unknown kind";
}

int fs_open_regular(const char *path, struct stat *st, char *why, size_t why_len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        snprintf(why, why_len, "cannot open: %s", strerror(errno));
        return -1;
    }
    if (fstat(fd, st) < 0) {
        snprintf(why, why_len, "cannot stat: %s", strerror(errno));
    } else if (!S_ISREG(st->st_mode)) {
        snprintf(why, why_len, "not a regular file (%s)", file_kind(st->st_mode));
    } else {
        return fd;
    }
    close(fd);
    return -1;
}

int fs_write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -errno;
        if (w == 0) return -EIO;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

void fs_remove_tree(const char *path) {
    if (path && path[0]) nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int fs_check_writable(const char *dir) {
    char probe[4200];
    if (snprintf(probe, sizeof probe, "%s/.ddprun-probe-%ld", dir, (long)getpid()) >=
        (int)sizeof probe)
        return -ENAMETOOLONG;
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    int rc = write(fd, "x", 1) == 1 ? 0 : -errno; /* a full disk fails here, not at open */
    close(fd);
    unlink(probe);
    return rc;
}

void fs_self_dir(char *out, size_t out_len) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        snprintf(out, out_len, ".");
    else
        snprintf(out, out_len, "%.*s", slash == exe ? 1 : (int)(slash - exe), exe);
}

/* path with its longest existing prefix replaced by realpath's answer; unchanged when that does
 * not fit in len */
static void resolve_existing_prefix(char *path, size_t len) {
    char head[PATH_MAX], real[PATH_MAX];
    snprintf(head, sizeof head, "%s", path);
    for (;;) {
        if (realpath(head, real)) {
            const char *tail = path + strlen(head);
            size_t real_len = strlen(real), tail_len = strlen(tail);
            if (real_len + tail_len >= len) return;
            memmove(path + real_len, tail, tail_len + 1);
            memcpy(path, real, real_len);
            return;
        }
        char *slash = strrchr(head, '/');
        if (!slash || slash == head) return;
        *slash = '\0';
    }
}

int fs_find_beside_self(const char *const *paths, int n, int mode, char *out, size_t out_len) {
    char dir[PATH_MAX];
    fs_self_dir(dir, sizeof dir);
    for (int i = 0; i < n; i++) {
        int k = paths[i][0] == '/' ? snprintf(out, out_len, "%s", paths[i])
                                   : snprintf(out, out_len, "%s/%s", dir, paths[i]);
        if (k > 0 && (size_t)k < out_len && access(out, mode) == 0) {
            resolve_existing_prefix(out, out_len);
            return 0;
        }
    }
    if (out_len) resolve_existing_prefix(out, out_len);
    return -ENOENT;
}
