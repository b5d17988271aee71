/* fs: small file-system helpers the launcher and the worker share. Blocking; any thread. */
#ifndef DDP_COMMON_FS_H
#define DDP_COMMON_FS_H

#include <stddef.h>

/* mkdir -p: create path and its missing parents (mode 0755). Returns 0 (also when it exists as a
 * directory), or -errno (-ENOTDIR when it or a parent is not a directory, -ENAMETOOLONG). */
int fs_mkdir_p(const char *path);
/* Whether this process can create files in dir: creates and removes a probe file. Returns 0 or
 * -errno (dir missing, read-only, full, permissions). */
int fs_check_writable(const char *dir);

#endif
