/* fs: small file-system helpers the launcher and the worker share. Blocking; any thread. */
#ifndef DDP_COMMON_FS_H
#define DDP_COMMON_FS_H

#include <stddef.h>
#include <sys/stat.h>

/* mkdir -p: create path and its missing parents (mode 0755). Returns 0 (also when it exists as a
 * directory), or -errno (-ENOTDIR when it or a parent is not a directory, -ENAMETOOLONG). */
int fs_mkdir_p(const char *path);
/* rm -rf path without following links, best effort (what cannot be removed stays); "" or NULL:
 * nothing. */
void fs_remove_tree(const char *path);
/* Open path read-only (O_CLOEXEC) as a reader of outside bytes must: with O_NONBLOCK, so that a
 * FIFO or a device named where a file is expected cannot block the open, then refused unless it is
 * a regular file (O_NONBLOCK changes nothing for a regular file's reads). Returns the descriptor
 * with *st filled, or -1 with why ("cannot open: No such file or directory", "not a regular file
 * (a FIFO)") in why, without the path: the caller says which file. Blocking (open, fstat). */
int fs_open_regular(const char *path, struct stat *st, char *why, size_t why_len);
/* write(2) all n bytes, again after EINTR and short writes. Returns 0 or -errno (EPIPE: a reader
 * gone; 0 bytes written: -EIO). */
int fs_write_all(int fd, const void *p, size_t n);
/* Whether this process can create files in dir: creates and removes a probe file. Returns 0 or
 * -errno (dir missing, read-only, full, permissions). */
int fs_check_writable(const char *dir);
/* The folder of this process's executable (/proc/self/exe, "." when unreadable) into out. */
void fs_self_dir(char *out, size_t out_len);
/* Find a file beside this executable: the first of paths[0..n) (each relative to the executable's
 * folder, or absolute) that passes access(mode) (F_OK, R_OK, X_OK), into out. Returns 0, or
 * -ENOENT with out holding the last candidate. Either way the part of out that exists is
 * resolved through realpath (/usr/lib/..., not /usr/bin/../lib/...: messages and --version name
 * the real place).
 * ddprun's shim, trainer and plot script, ddpworker's CUDA library. Blocking (stat); any thread. */
int fs_find_beside_self(const char *const *paths, int n, int mode, char *out, size_t out_len);

#endif
