/* fs: see fs.h. */
#include "fs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
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

int fs_check_writable(const char *dir) {
    char probe[4200];
    if (snprintf(probe, sizeof probe, "%s/.ddprun-probe-%ld", dir, (long)getpid()) >= (int)sizeof probe)
        return -ENAMETOOLONG;
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    int rc = write(fd, "x", 1) == 1 ? 0 : -errno; /* a full disk fails here, not at open */
    close(fd);
    unlink(probe);
    return rc;
}
