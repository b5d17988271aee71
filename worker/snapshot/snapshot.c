/* snapshot: see snapshot.h. Files are named by step (snapshot-000000001234.ddps) so the newest is
 * found by listing; the manifest is a convenience for people and tools, never trusted alone. */
#include "snapshot.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "fs.h"
#include "ddp_error.h"
#include "xxh3_simd.h"

#define HEADER_CHECKED_BYTES offsetof(snapshot_header_t, header_checksum)

/* Written in chunks, with progress reported after each: a large snapshot on a slow disk is work
 * going on, not a hang (ddprun --hang-timeout reads the worker's progress counter). */
#define WRITE_CHUNK_BYTES ((size_t)4 << 20)

static int write_all(int fd, const void *p, size_t n, const snapshot_progress_t *progress) {
    const uint8_t *b = p;
    while (n) {
        ssize_t k = write(fd, b, n < WRITE_CHUNK_BYTES ? n : WRITE_CHUNK_BYTES);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? -errno : -EIO;
        b += k;
        n -= (size_t)k;
        if (progress && progress->cb) progress->cb(progress->arg);
    }
    return 0;
}

static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = fsync(fd) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

/* Write bytes to dir/name atomically: dir/.name.tmp, fsync, rename, fsync dir. */
static int write_atomically(const char *dir, const char *name, const void *const *parts,
                            const size_t *sizes, int n_parts, const snapshot_progress_t *progress,
                            char *err, size_t err_len) {
    char tmp[4096], path[4096];
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp", dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ddp_errf(err, err_len, "cannot create %s: %s", tmp, strerror(errno));
    int rc = 0;
    for (int i = 0; i < n_parts && rc == 0; i++)
        rc = write_all(fd, parts[i], sizes[i], progress);
    const char *step = "write";
    if (rc == 0 && fsync(fd) < 0) {
        rc = -errno;
        step = "fsync";
    }
    if (close(fd) < 0 && rc == 0) {
        rc = -errno;
        step = "close";
    }
    if (rc == 0 && rename(tmp, path) < 0) {
        rc = -errno;
        step = "rename";
    }
    if (rc < 0) {
        unlink(tmp);
        return ddp_errf(err, err_len, "cannot %s %s: %s", step, strcmp(step, "rename") ? tmp : path,
                        strerror(-rc));
    }
    rc = fsync_dir(dir);
    if (rc < 0) return ddp_errf(err, err_len, "cannot fsync directory %s: %s", dir, strerror(-rc));
    return 0;
}

static bool parse_step(const char *name, int64_t *step) {
    size_t lp = strlen(SNAPSHOT_FILE_PREFIX), ls = strlen(SNAPSHOT_FILE_SUFFIX), n = strlen(name);
    if (n <= lp + ls || strncmp(name, SNAPSHOT_FILE_PREFIX, lp) != 0 ||
        strcmp(name + n - ls, SNAPSHOT_FILE_SUFFIX) != 0)
        return false;
    int64_t v = 0;
    for (size_t i = lp; i < n - ls; i++) {
        if (name[i] < '0' || name[i] > '9' || v > INT64_MAX / 10 - 10) return false;
        v = v * 10 + (name[i] - '0');
    }
    *step = v;
    return true;
}

typedef struct {
    int64_t step;
    char name[256];
} entry_t;

static int by_step_desc(const void *a, const void *b) {
    int64_t x = ((const entry_t *)a)->step, y = ((const entry_t *)b)->step;
    return (x < y) - (x > y);
}

/* Snapshot files of dir, newest first (malloc'd; *n of them). -1 when dir cannot be read. */
static int list_snapshots(const char *dir, entry_t **out, size_t *n) {
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return -errno;
    size_t cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        int64_t step;
        if (!parse_step(e->d_name, &step) || strlen(e->d_name) >= sizeof(*out)->name) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            entry_t *grown = realloc(*out, cap * sizeof **out);
            if (!grown) {
                closedir(d);
                free(*out);
                *out = NULL;
                return -ENOMEM;
            }
            *out = grown;
        }
        (*out)[*n].step = step;
        snprintf((*out)[*n].name, sizeof(*out)->name, "%s", e->d_name);
        (*n)++;
    }
    closedir(d);
    if (*n) qsort(*out, *n, sizeof **out, by_step_desc);
    return 0;
}

static size_t section_floats(const snapshot_header_t *h, uint32_t kind) {
    return kind == SNAPSHOT_SECTION_BUFFERS ? h->n_buffers : h->n_params;
}

static bool has_second_moment(const snapshot_header_t *h) {
    return h->optimizer == SNAPSHOT_OPTIM_ADAM || h->optimizer == SNAPSHOT_OPTIM_ADAMW;
}

uint64_t snapshot_layout(snapshot_header_t *h) {
    memcpy(h->magic, SNAPSHOT_MAGIC, sizeof h->magic);
    h->version = SNAPSHOT_VERSION;
    h->header_bytes = sizeof *h;
    static const uint32_t kinds[4] = {SNAPSHOT_SECTION_PARAMS, SNAPSHOT_SECTION_MOMENTUM,
                                      SNAPSHOT_SECTION_BUFFERS, SNAPSHOT_SECTION_SECOND_MOMENT};
    h->n_sections = has_second_moment(h) ? 4 : 3;
    uint64_t offset = sizeof *h;
    for (uint32_t i = 0; i < h->n_sections; i++) {
        uint64_t bytes = section_floats(h, kinds[i]) * sizeof(float);
        h->sections[i] = (snapshot_section_t){.kind = kinds[i], .offset = offset, .n_bytes = bytes};
        offset += bytes;
    }
    return offset;
}

void snapshot_seal_header(snapshot_header_t *h) {
    h->header_checksum = XXH3_64bits(h, HEADER_CHECKED_BYTES);
}

uint64_t snapshot_seal(snapshot_header_t *h, const snapshot_data_t *d) {
    uint64_t bytes = snapshot_layout(h);
    const float *arrays[4] = {d->params, d->momentum, d->buffers, d->second_moment};
    for (uint32_t i = 0; i < h->n_sections; i++)
        h->sections[i].checksum = XXH3_64bits(arrays[i], h->sections[i].n_bytes);
    snapshot_seal_header(h);
    return bytes;
}

static void prune(const char *dir, const snapshot_retention_t *keep, const char *written,
                  uint64_t written_step, uint64_t *reported);

/* snapshot_write; *reported is what prune last reported (snapshot_writer_t keeps it, so a stray
 * file is reported once, not at every snapshot). */
static int write_snapshot(const char *dir, const snapshot_data_t *d,
                          const snapshot_retention_t *keep, const snapshot_progress_t *progress,
                          uint64_t *reported, char *err, size_t err_len) {
    snapshot_header_t h = d->header;
    const float *arrays[4] = {d->params, d->momentum, d->buffers, d->second_moment};
    if (has_second_moment(&h) && !d->second_moment)
        return ddp_errf(err, err_len,
                        "snapshot of step %" PRIu64 ": an %s snapshot needs the second "
                        "moment",
                        h.step, h.optimizer == SNAPSHOT_OPTIM_ADAM ? "adam" : "adamw");
    snapshot_seal(&h, d);
    char name[128];
    snprintf(name, sizeof name, SNAPSHOT_FILE_PREFIX "%012" PRIu64 SNAPSHOT_FILE_SUFFIX, h.step);
    const void *parts[5] = {&h, arrays[0], arrays[1], arrays[2], arrays[3]};
    size_t sizes[5] = {sizeof h};
    for (uint32_t i = 0; i < h.n_sections; i++)
        sizes[i + 1] = h.sections[i].n_bytes;
    if (write_atomically(dir, name, parts, sizes, (int)h.n_sections + 1, progress, err, err_len) <
        0)
        return -1;
    char manifest[160];
    int len = snprintf(manifest, sizeof manifest, "%s\n", name);
    const void *mparts[1] = {manifest};
    size_t msizes[1] = {(size_t)len};
    if (write_atomically(dir, SNAPSHOT_MANIFEST, mparts, msizes, 1, NULL, err, err_len) < 0)
        return -1;
    prune(dir, keep, name, h.step, reported);
    return 0;
}

int snapshot_write(const char *dir, const snapshot_data_t *d, const snapshot_retention_t *keep,
                   const snapshot_progress_t *progress, char *err, size_t err_len) {
    uint64_t reported = 0;
    return write_snapshot(dir, d, keep, progress, &reported, err, err_len);
}

void snapshot_data_free(snapshot_data_t *d) {
    free(d->params);
    free(d->momentum);
    free(d->buffers);
    free(d->second_moment);
    d->params = d->momentum = d->buffers = d->second_moment = NULL;
}

/* 0, -ENODATA when the file ends first (shrunk since its size was read: torn), else -errno (the
 * file system's error: not the file's damage). */
static int read_at(int fd, void *buf, size_t n, uint64_t offset) {
    uint8_t *b = buf;
    while (n) {
        ssize_t k = pread(fd, b, n, (off_t)offset);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? -errno : -ENODATA;
        b += k;
        n -= (size_t)k;
        offset += (uint64_t)k;
    }
    return 0;
}

/* Versions 1 and 2 are this header with blocks missing that later versions inserted before the
 * loss scale: version 2 added the optimizer's (kind, Adam's step count), version 3 the run's (best
 * value and step, elapsed time). Everything else, sections included, is where it was. */
#define OPTIM_BLOCK_AT offsetof(snapshot_header_t, optimizer)
#define RUN_BLOCK_AT   offsetof(snapshot_header_t, best_value)
#define TAIL_AT        offsetof(snapshot_header_t, loss_scale)

static size_t header_bytes_of(uint32_t version) {
    size_t missing = version >= 3 ? 0
                                  : (TAIL_AT - RUN_BLOCK_AT) +
                                        (version == 1 ? RUN_BLOCK_AT - OPTIM_BLOCK_AT : 0);
    return sizeof(snapshot_header_t) - missing;
}

/* The header of an older version as this version's: an SGD run (v1) with no best value and no
 * elapsed time recorded; version and header_bytes stay the file's. Checks its checksum. */
static int read_legacy_header(int fd, const char *path, uint32_t version, snapshot_header_t *h,
                              char *err, size_t err_len) {
    uint8_t raw[sizeof *h];
    size_t bytes = header_bytes_of(version), head = version == 1 ? OPTIM_BLOCK_AT : RUN_BLOCK_AT;
    int rc = read_at(fd, raw, bytes, 0);
    if (rc < 0) {
        ddp_errf(err, err_len, "%s: cannot read its header: %s", path, strerror(-rc));
        return rc == -ENODATA ? -1 : SNAPSHOT_E_UNREADABLE;
    }
    uint64_t checksum;
    memcpy(&checksum, raw + bytes - sizeof checksum, sizeof checksum);
    if (XXH3_64bits(raw, bytes - sizeof checksum) != checksum)
        return ddp_errf(err, err_len, "%s: header checksum mismatch (corrupt)", path);
    memset(h, 0, sizeof *h);
    memcpy(h, raw, head);
    memcpy((uint8_t *)h + TAIL_AT, raw + head, bytes - head);
    h->best_value = NAN; /* "none yet", as a run without train.best_by writes it */
    return 0;
}

/* The header alone, checked for magic, version, its checksum and a sane section table. Versions 1
 * and 2 are read too (read_legacy_header). */
static int read_header(int fd, const char *path, uint64_t file_bytes, snapshot_header_t *h,
                       char *err, size_t err_len) {
    struct {
        char magic[8];
        uint32_t version, header_bytes;
    } id;
    int read_rc = file_bytes < sizeof id ? -ENODATA : read_at(fd, &id, sizeof id, 0);
    if (read_rc < 0 && read_rc != -ENODATA) {
        ddp_errf(err, err_len, "%s: cannot read: %s", path, strerror(-read_rc));
        return SNAPSHOT_E_UNREADABLE;
    }
    if (read_rc < 0)
        return ddp_errf(err, err_len,
                        "%s: %" PRIu64 " bytes, shorter than a snapshot header (torn?)", path,
                        file_bytes);
    if (memcmp(id.magic, SNAPSHOT_MAGIC, sizeof id.magic) != 0)
        return ddp_errf(err, err_len, "%s: not a ddpworker snapshot (bad magic)", path);
    if (id.version > SNAPSHOT_VERSION && id.version < 1000) {
        ddp_errf(err, err_len,
                 "%s: snapshot version %u, written by a newer ddpworker; this one reads "
                 "versions 1 to %u: run the newer ddpworker, or move the file away",
                 path, id.version, SNAPSHOT_VERSION);
        return SNAPSHOT_E_NEWER;
    }
    if (id.version < 1 || id.version > SNAPSHOT_VERSION ||
        id.header_bytes != header_bytes_of(id.version))
        return ddp_errf(err, err_len,
                        "%s: snapshot version %u (header %u bytes); this ddpworker "
                        "reads versions 1 to %u (corrupt)",
                        path, id.version, id.header_bytes, SNAPSHOT_VERSION);
    if (file_bytes < id.header_bytes)
        return ddp_errf(err, err_len,
                        "%s: %" PRIu64 " bytes, shorter than a snapshot header (torn?)", path,
                        file_bytes);
    if (id.version < SNAPSHOT_VERSION) {
        int rc = read_legacy_header(fd, path, id.version, h, err, err_len);
        if (rc < 0) return rc;
    } else {
        read_rc = read_at(fd, h, sizeof *h, 0);
        if (read_rc < 0) {
            ddp_errf(err, err_len, "%s: cannot read its header: %s", path, strerror(-read_rc));
            return read_rc == -ENODATA ? -1 : SNAPSHOT_E_UNREADABLE;
        }
        if (XXH3_64bits(h, HEADER_CHECKED_BYTES) != h->header_checksum)
            return ddp_errf(err, err_len, "%s: header checksum mismatch (corrupt)", path);
    }
    if (h->optimizer > SNAPSHOT_OPTIM_ADAMW)
        return ddp_errf(err, err_len, "%s: unknown optimizer %u (corrupt)", path, h->optimizer);
    /* Adam counts only the steps it took: never more than the run's */
    if (has_second_moment(h) ? h->optim_steps > h->step : h->optim_steps != 0)
        return ddp_errf(err, err_len,
                        "%s: %" PRIu64 " optimizer steps at step %" PRIu64 " (corrupt)", path,
                        h->optim_steps, h->step);
    if (h->n_sections != (has_second_moment(h) ? 4u : 3u) || h->n_params > (1ull << 40) ||
        h->n_buffers > (1ull << 40))
        return ddp_errf(err, err_len, "%s: unexpected section table (%u sections)", path,
                        h->n_sections);
    for (uint32_t i = 0; i < h->n_sections; i++) {
        const snapshot_section_t *s = &h->sections[i];
        if (s->kind < SNAPSHOT_SECTION_PARAMS || s->kind > SNAPSHOT_SECTION_SECOND_MOMENT ||
            s->n_bytes != section_floats(h, s->kind) * sizeof(float) || s->offset > file_bytes ||
            s->n_bytes > file_bytes - s->offset)
            return ddp_errf(err, err_len,
                            "%s: section %u lies outside the file's %" PRIu64 " bytes (truncated)",
                            path, i, file_bytes);
    }
    /* 0 is "no loss scaling"; a scale the run cannot multiply by is damage, not state */
    if (!(h->loss_scale >= 0 && h->loss_scale <= 3.0e38) || h->loss_scale_good_steps > UINT32_MAX)
        return ddp_errf(err, err_len,
                        "%s: loss scale %g (%" PRIu64 " good steps) is out of range "
                        "(corrupt)",
                        path, h->loss_scale, h->loss_scale_good_steps);
    /* train.hours resumes from elapsed_s, and best_by says what best_value measures */
    if (!(h->elapsed_s >= 0 && h->elapsed_s < 1e12) || h->best_by > 2)
        return ddp_errf(err, err_len, "%s: elapsed %g s, best_by %u (corrupt)", path, h->elapsed_s,
                        h->best_by);
    return 0;
}

static const char *section_name(uint32_t kind) {
    return kind == SNAPSHOT_SECTION_PARAMS     ? "params"
           : kind == SNAPSHOT_SECTION_MOMENTUM ? "momentum"
           : kind == SNAPSHOT_SECTION_BUFFERS  ? "buffers"
                                               : "second_moment";
}

static float **section_slot(snapshot_data_t *d, uint32_t kind) {
    return kind == SNAPSHOT_SECTION_PARAMS     ? &d->params
           : kind == SNAPSHOT_SECTION_MOMENTUM ? &d->momentum
           : kind == SNAPSHOT_SECTION_BUFFERS  ? &d->buffers
                                               : &d->second_moment;
}

int snapshot_read(const char *path, snapshot_data_t *d, char *err, size_t err_len) {
    memset(d, 0, sizeof *d);
    struct stat st;
    char why[128];
    int fd = fs_open_regular(path, &st, why, sizeof why); /* a FIFO does not block it */
    if (fd < 0) { /* a FIFO or a folder named like a snapshot is no snapshot; a failed open
                   * is a snapshot the file system did not give */
        int refused = ddp_errf(err, err_len, "%s: %s", path, why);
        return strncmp(why, "not a regular file", 18) == 0 ? refused : SNAPSHOT_E_UNREADABLE;
    }
    int rc = read_header(fd, path, (uint64_t)st.st_size, &d->header, err, err_len);
    for (uint32_t i = 0; rc == 0 && i < d->header.n_sections; i++) {
        const snapshot_section_t *s = &d->header.sections[i];
        float **slot = section_slot(d, s->kind);
        if (*slot) {
            rc =
                ddp_errf(err, err_len, "%s: section %s appears twice", path, section_name(s->kind));
            break;
        }
        *slot = malloc(s->n_bytes ? s->n_bytes : 1);
        int read_rc = *slot ? read_at(fd, *slot, s->n_bytes, s->offset) : -ENOMEM;
        if (read_rc < 0) {
            ddp_errf(err, err_len, "%s: cannot read section %s: %s", path, section_name(s->kind),
                     read_rc == -ENODATA ? "the file ends first (torn?)" : strerror(-read_rc));
            rc = read_rc == -ENODATA ? -1 : SNAPSHOT_E_UNREADABLE;
        } else if (XXH3_64bits(*slot, s->n_bytes) != s->checksum)
            rc = ddp_errf(err, err_len, "%s: section %s checksum mismatch (corrupt or torn)", path,
                          section_name(s->kind));
    }
    if (rc == 0 && (!d->params || !d->momentum || !d->buffers ||
                    (has_second_moment(&d->header) && !d->second_moment)))
        rc = ddp_errf(err, err_len, "%s: a section is missing", path);
    close(fd);
    if (rc < 0) snapshot_data_free(d);
    return rc;
}

/* A snapshot that does not verify is renamed to NAME.corrupt: kept for a post-mortem, but out of
 * the listing, so retention never counts it as kept nor deletes valid ones in its favour, and the
 * next resume does not read it again. Non-regular files (a FIFO) are not ours: left alone. */
static void quarantine(const char *path, FILE *report) {
    struct stat st;
    if (lstat(path, &st) < 0 || !S_ISREG(st.st_mode)) return;
    char moved[4200];
    snprintf(moved, sizeof moved, "%s.corrupt", path);
    if (rename(path, moved) == 0) {
        if (report) fprintf(report, "ddpworker: warning: moved %s aside to %s\n", path, moved);
    } else if (report) {
        fprintf(report, "ddpworker: warning: cannot move %s aside: %s\n", path, strerror(errno));
    }
}

/* Whether path is a snapshot a resume could use, judged by its header alone (the sections are
 * hashed when a resume reads them, not at every write): a regular file, readable, whose header
 * verifies. When it is not, why gets "PATH: the reason". */
static bool is_resumable(const char *path, char *why, size_t why_len) {
    struct stat st;
    if (lstat(path, &st) < 0) {
        ddp_errf(why, why_len, "%s: %s", path, strerror(errno));
        return false;
    }
    if (!S_ISREG(st.st_mode)) { /* never opened: a FIFO, a device or a link is not ours */
        ddp_errf(why, why_len, "%s: not a regular file", path);
        return false;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) {
        ddp_errf(why, why_len, "%s: cannot open: %s", path, strerror(errno));
        return false;
    }
    snapshot_header_t h;
    bool is_ok = read_header(fd, path, (uint64_t)st.st_size, &h, why, why_len) == 0;
    close(fd);
    return is_ok;
}

/* keep-N retention once the snapshot `written` (of step written_step) is in place. Only the
 * snapshots a resume could use count toward keep: the one just written, and older regular files
 * whose header verifies. Whatever the resume skips and leaves (a FIFO named like a snapshot, a file
 * it may not read, one of a later step than this run's) is neither counted nor removed: counted,
 * a FIFO of step 999999 outranked every snapshot the run wrote, each unlinked as it landed. Files
 * older than the oldest one kept are removed as before (a non-regular one never). Files not counted
 * are reported on stderr when the set of them changes (*reported: a fingerprint of the last). */
static void prune(const char *dir, const snapshot_retention_t *keep, const char *written,
                  uint64_t written_step, uint64_t *reported) {
    entry_t *list;
    size_t n;
    if (list_snapshots(dir, &list, &n) < 0) return;
    size_t want = (size_t)(keep->keep > 0 ? keep->keep : 1), n_kept = 0;
    bool *is_stray = calloc(n ? n : 1, sizeof *is_stray);
    uint64_t fingerprint = 0;
    char path[4096], why[4400];
    for (size_t i = 0; i < n && is_stray; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, list[i].name);
        bool is_written = strcmp(list[i].name, written) == 0;
        if (!is_written && ((uint64_t)list[i].step > written_step ||
                            (n_kept < want && !is_resumable(path, why, sizeof why)))) {
            is_stray[i] = true;
        } else if (n_kept < want) {
            n_kept++;
        } else if (keep->keep_every <= 0 || list[i].step % keep->keep_every != 0) {
            struct stat st;
            if (lstat(path, &st) == 0 && S_ISREG(st.st_mode))
                unlink(path);
            else
                is_stray[i] = true;
        }
        if (is_stray[i]) fingerprint += XXH3_64bits(list[i].name, strlen(list[i].name)) | 1;
    }
    if (is_stray && fingerprint != *reported) {
        for (size_t i = 0; i < n; i++) {
            if (!is_stray[i]) continue;
            snprintf(path, sizeof path, "%s/%s", dir, list[i].name);
            if (is_resumable(path, why, sizeof why)) /* then not counted for its step alone */
                snprintf(why, sizeof why,
                         "%s: step %" PRId64 " is past the snapshot just written (step %" PRIu64
                         "): the resume did not take it",
                         path, list[i].step, written_step);
            fprintf(stderr,
                    "ddpworker: warning: snapshot.dir: %s; not counted toward snapshot.keep, "
                    "left in place\n",
                    why);
        }
        *reported = fingerprint;
    }
    free(is_stray);
    free(list);
}

int64_t snapshot_newest_step(const char *dir) {
    entry_t *list;
    size_t n;
    if (list_snapshots(dir, &list, &n) < 0) return -1;
    int64_t step = n ? list[0].step : -1;
    free(list);
    return step;
}

int snapshot_find_latest(const char *dir, FILE *report, snapshot_data_t *d, char *path_out,
                         size_t path_len, char *err, size_t err_len) {
    entry_t *list;
    size_t n;
    int rc = list_snapshots(dir, &list, &n);
    if (rc == -ENOENT) return 0;
    if (rc < 0)
        return ddp_errf(err, err_len, "snapshot.dir %s: cannot list: %s", dir, strerror(-rc));
    int found = 0;
    for (size_t i = 0; i < n && !found; i++) {
        snprintf(path_out, path_len, "%s/%s", dir, list[i].name);
        char why[1024];
        int read_rc = snapshot_read(path_out, d, why, sizeof why);
        if (read_rc == 0) {
            found = 1;
            continue;
        }
        if (read_rc == SNAPSHOT_E_NEWER) { /* not damage: not ours to skip or move aside */
            found = SNAPSHOT_E_NEWER;
            snprintf(err, err_len, "%s", why);
            break;
        }
        if (report)
            fprintf(report, "ddpworker: warning: skipping snapshot %s%s\n", why,
                    read_rc == SNAPSHOT_E_UNREADABLE ? " (left in place: not damage)" : "");
        /* the file system's refusal (permissions, descriptors, memory, I/O) says nothing of the
         * file: a good snapshot must not be moved out of every later resume for it */
        if (read_rc != SNAPSHOT_E_UNREADABLE) quarantine(path_out, report);
    }
    free(list);
    return found;
}

uint64_t snapshot_state_hash(const snapshot_data_t *d) {
    XXH3_state_t *s = XXH3_createState();
    if (!s) return 0;
    XXH3_64bits_reset(s);
    XXH3_64bits_update(s, d->params, d->header.n_params * sizeof(float));
    XXH3_64bits_update(s, d->momentum, d->header.n_params * sizeof(float));
    XXH3_64bits_update(s, d->buffers, d->header.n_buffers * sizeof(float));
    if (has_second_moment(&d->header)) {
        XXH3_64bits_update(s, d->second_moment, d->header.n_params * sizeof(float));
        XXH3_64bits_update(s, &d->header.optim_steps, sizeof d->header.optim_steps);
    }
    uint64_t h = XXH3_64bits_digest(s);
    XXH3_freeState(s);
    return h;
}

const char *snapshot_data_kind_name(uint32_t data_kind) {
    static const char *const names[] = {[SNAPSHOT_DATA_UNRECORDED] = "not recorded",
                                        [SNAPSHOT_DATA_FASHION_MNIST] = "fashion-mnist",
                                        [SNAPSHOT_DATA_MNIST] = "mnist",
                                        [SNAPSHOT_DATA_CIFAR10] = "cifar10",
                                        [SNAPSHOT_DATA_CIFAR100] = "cifar100",
                                        [SNAPSHOT_DATA_SYNTHETIC] = "synthetic",
                                        [SNAPSHOT_DATA_IMAGEFOLDER] = "imagefolder"};
    return data_kind < sizeof names / sizeof *names ? names[data_kind] : "unknown";
}

int snapshot_inspect(const char *path, FILE *out) {
    snapshot_data_t d;
    char err[1024];
    if (snapshot_read(path, &d, err, sizeof err) < 0) {
        fprintf(out, "%s: does not verify: %s\n", path, err);
        return -1;
    }
    const snapshot_header_t *h = &d.header;
    time_t taken = (time_t)(h->unix_time_ms / 1000);
    char when[64];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&taken));
    fprintf(out, "file:        %s\nversion:     %u%s\ntaken:       %s\n", path, h->version,
            h->version < SNAPSHOT_VERSION ? " (an older format: read without what it lacks)" : "",
            when);
    fprintf(out,
            "step:        %" PRIu64 " (next to run)\nepoch:       %" PRIu64
            "\ncursor:      %" PRIu64 " of %" PRIu64 " samples\nseed:        %" PRIu64
            "\nworld size:  %u\n",
            h->step, h->epoch + 1 /* from 1, as the logs and metrics */, h->cursor,
            h->train_samples, h->seed, h->world_size);
    fprintf(out,
            "model:       %.32s width %u, input %ux%ux%u, %u classes, %" PRIu64
            " parameters, %" PRIu64 " buffer values\n",
            h->model, h->width, h->height, h->img_width, h->channels, h->classes, h->n_params,
            h->n_buffers);
    fprintf(out, "data:        %s\n", snapshot_data_kind_name(h->data_kind));
    if (has_second_moment(h))
        fprintf(out, "optimizer:   %s lr %g weight decay %g, %" PRIu64 " steps taken\n",
                h->optimizer == SNAPSHOT_OPTIM_ADAM ? "adam" : "adamw", h->lr, h->weight_decay,
                h->optim_steps);
    else
        fprintf(out, "optimizer:   sgd lr %g momentum %g weight decay %g%s\n", h->lr, h->momentum,
                h->weight_decay, h->is_nesterov ? " nesterov" : "");
    if (h->best_by && h->best_value == h->best_value) /* NaN: no validation yet */
        fprintf(out, "best:        %s %.17g at step %" PRIu64 "\n",
                h->best_by == 1 ? "val_loss" : "val_top1", h->best_value, h->best_step);
    fprintf(out, "elapsed:     %.3f s of training\n", h->elapsed_s);
    fprintf(out, "finished:    %s\n", h->is_finished ? "yes (the run ended here)" : "no");
    fprintf(out, "loss scale:  %g (%" PRIu64 " good steps)\n", h->loss_scale,
            h->loss_scale_good_steps);
    for (uint32_t i = 0; i < h->n_sections; i++)
        fprintf(out,
                "section:     %-8s %12" PRIu64 " bytes at %-10" PRIu64 " xxh3 %016" PRIx64 " ok\n",
                section_name(h->sections[i].kind), h->sections[i].n_bytes, h->sections[i].offset,
                h->sections[i].checksum);
    fprintf(out, "checksums:   ok\nstate hash:  %016" PRIx64 "\n", snapshot_state_hash(&d));
    snapshot_data_free(&d);
    return 0;
}

/* ---- the writer thread ---- */

struct snapshot_writer {
    char dir[2048];
    snapshot_retention_t keep;
    snapshot_data_t data; /* host buffers the trainer fills */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool is_pending, is_busy, is_stopping;
    int last_rc; /* of the last write, until reported */
    char last_err[1024];
    char last_path[2300];
    snapshot_progress_t progress;
    uint64_t reported; /* prune's, of the files it last reported: the writer thread's */
    /* the last snapshot that landed (CLOCK_MONOTONIC seconds, 0: none yet) and the error of the
     * writes that failed since (empty once one lands) */
    double landed_s;
    uint64_t landed_step;
    char failure[1024];
    /* a wait for the write in flight that lasts notice_after_s is said on notice (every
     * NOTICE_REPEAT_S after): a hung disk holds the trainer, and the other ranks then blame this
     * one in their next collective without naming the disk */
    double notice_after_s;
    FILE *notice;
};

#define NOTICE_AFTER_S  10.0
#define NOTICE_REPEAT_S 60.0

static void *writer_main(void *arg) {
    snapshot_writer_t *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->is_pending && !w->is_stopping)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->is_pending) break;
        w->is_pending = false;
        w->is_busy = true;
        pthread_mutex_unlock(&w->mu);
        char err[1024];
        int rc =
            write_snapshot(w->dir, &w->data, &w->keep, &w->progress, &w->reported, err, sizeof err);
        pthread_mutex_lock(&w->mu);
        w->is_busy = false;
        w->last_rc = rc;
        if (rc < 0) {
            snprintf(w->last_err, sizeof w->last_err, "%s", err);
            snprintf(w->failure, sizeof w->failure, "%s", err);
        } else {
            snprintf(w->last_path, sizeof w->last_path,
                     "%s/" SNAPSHOT_FILE_PREFIX "%012" PRIu64 SNAPSHOT_FILE_SUFFIX, w->dir,
                     w->data.header.step);
            w->landed_s = clock_now_s();
            w->landed_step = w->data.header.step;
            w->failure[0] = '\0';
        }
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Leftovers of a crash mid-write: temp files nobody will rename. */
static void remove_temp_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (e->d_name[0] != '.' || n < 5 || strcmp(e->d_name + n - 4, ".tmp") != 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
}

int snapshot_writer_create(const char *dir, size_t n_params, size_t n_buffers,
                           bool has_second_moment, const snapshot_retention_t *keep,
                           snapshot_writer_t **out, char *err, size_t err_len) {
    *out = NULL;
    int rc = fs_mkdir_p(dir);
    if (rc < 0)
        return ddp_errf(err, err_len, "snapshot.dir: cannot create %s: %s", dir, strerror(-rc));
    if (access(dir, W_OK) < 0)
        return ddp_errf(err, err_len, "snapshot.dir: cannot write into %s: %s", dir,
                        strerror(errno));
    remove_temp_files(dir);
    snapshot_writer_t *w = calloc(1, sizeof *w);
    if (!w) return ddp_errf(err, err_len, "out of memory");
    snprintf(w->dir, sizeof w->dir, "%s", dir);
    w->keep = *keep;
    w->data.header.n_params = n_params;
    w->data.header.n_buffers = n_buffers;
    w->data.params = malloc((n_params ? n_params : 1) * sizeof(float));
    w->data.momentum = malloc((n_params ? n_params : 1) * sizeof(float));
    w->data.buffers = malloc((n_buffers ? n_buffers : 1) * sizeof(float));
    if (has_second_moment)
        w->data.second_moment = malloc((n_params ? n_params : 1) * sizeof(float));
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC); /* clock_now_s's clock */
    pthread_cond_init(&w->cv, &monotonic);
    pthread_condattr_destroy(&monotonic);
    w->notice_after_s = NOTICE_AFTER_S;
    w->notice = stderr;
    if (!w->data.params || !w->data.momentum || !w->data.buffers ||
        (has_second_moment && !w->data.second_moment) ||
        pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        snapshot_data_free(&w->data);
        free(w);
        return ddp_errf(err, err_len, "snapshot: out of memory for %zu parameters", n_params);
    }
    *out = w;
    return 0;
}

static int wait_idle(snapshot_writer_t *w, char *err, size_t err_len) {
    pthread_mutex_lock(&w->mu);
    double start = clock_now_s(), notice_at = start + w->notice_after_s;
    while (w->is_pending || w->is_busy) {
        struct timespec until = {.tv_sec = (time_t)notice_at,
                                 .tv_nsec = (long)((notice_at - (double)(time_t)notice_at) * 1e9)};
        if (pthread_cond_timedwait(&w->cv, &w->mu, &until) != ETIMEDOUT) continue;
        if (!w->is_pending && !w->is_busy) break;
        fprintf(w->notice,
                "ddpworker: waiting %.0f s for the snapshot of step %" PRIu64
                " to be written to %s: the disk is slow or hung (training waits for it, and the "
                "other ranks for this one)\n",
                clock_now_s() - start, w->data.header.step, w->dir);
        fflush(w->notice);
        notice_at = clock_now_s() + NOTICE_REPEAT_S;
    }
    int rc = w->last_rc;
    if (rc < 0) snprintf(err, err_len, "%s", w->last_err);
    w->last_rc = 0;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

int snapshot_writer_acquire(snapshot_writer_t *w, snapshot_data_t **buffers, char *err,
                            size_t err_len) {
    int rc = wait_idle(w, err, err_len);
    *buffers = &w->data;
    return rc;
}

void snapshot_writer_submit(snapshot_writer_t *w) {
    pthread_mutex_lock(&w->mu);
    w->is_pending = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int snapshot_writer_flush(snapshot_writer_t *w, char *err, size_t err_len) {
    return wait_idle(w, err, err_len);
}

const char *snapshot_writer_last_path(const snapshot_writer_t *w) {
    return w->last_path;
}

void snapshot_writer_set_progress(snapshot_writer_t *w, const snapshot_progress_t *progress) {
    pthread_mutex_lock(&w->mu);
    w->progress = *progress;
    pthread_mutex_unlock(&w->mu);
}

void snapshot_writer_set_notice(snapshot_writer_t *w, double after_s, FILE *out) {
    w->notice_after_s = after_s;
    w->notice = out;
}

double snapshot_writer_landed(snapshot_writer_t *w, uint64_t *step, char *failure,
                              size_t failure_len) {
    pthread_mutex_lock(&w->mu);
    double landed_s = w->landed_s;
    *step = w->landed_step;
    snprintf(failure, failure_len, "%s", w->failure);
    pthread_mutex_unlock(&w->mu);
    return landed_s;
}

void snapshot_writer_destroy(snapshot_writer_t *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->is_stopping = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    snapshot_data_free(&w->data);
    free(w);
}
