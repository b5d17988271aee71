/* imagefolder: see imagefolder.h. */
#include "imagefolder.h"
#include "ddp_error.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#define MAX_DEPTH 16 /* symlink loops end here */

static int by_string(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* torchvision's IMG_EXTENSIONS */
#define EXTENSIONS_TEXT ".jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp, any case"
static bool is_image_name(const char *name) {
    static const char *exts[] = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                 ".pgm", ".tif",  ".tiff", ".webp"};
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof exts / sizeof exts[0]; i++) {
        size_t m = strlen(exts[i]);
        if (n >= m && strcasecmp(name + n - m, exts[i]) == 0) return true; /* ".jpg" too */
    }
    return false;
}

typedef struct {
    char **items;
    size_t n, cap;
} list_t;

static int push(list_t *l, char *s) {
    if (!s) return -1;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        char **p = realloc(l->items, cap * sizeof *p);
        if (!p) {
            free(s);
            return -1;
        }
        l->items = p;
        l->cap = cap;
    }
    l->items[l->n++] = s;
    return 0;
}

static void list_free(list_t *l) {
    for (size_t i = 0; i < l->n; i++)
        free(l->items[i]);
    free(l->items);
    memset(l, 0, sizeof *l);
}

/* Whether path is a directory, following links (os.DirEntry.is_dir()). */
static bool is_dir_path(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The subdirectory names of dir (following links, hidden ones too, as torchvision's
 * find_classes), sorted. */
static int subdirs(const char *dir, list_t *out, char *err, size_t err_len) {
    DIR *d = opendir(dir);
    if (!d) return ddp_errf(err, err_len, "%s: cannot open: %s", dir, strerror(errno));
    for (struct dirent *e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (is_dir_path(path) && push(out, strdup(e->d_name)) < 0) {
            closedir(d);
            return ddp_errf(err, err_len, "out of memory listing %s", dir);
        }
    }
    closedir(d);
    if (out->n) qsort(out->items, out->n, sizeof *out->items, by_string);
    return 0;
}

/* make_dataset's order: sorted(os.walk(class_dir)) orders directories by their whole path (so
 * "a/b" < "a/b-c" < "a/b/d", which a depth-first walk would not give), then sorted(fnames)
 * orders each directory's files by name: compare the directory parts, then the names. */
static int by_dir_then_name(const void *a, const void *b) {
    const char *pa = *(char *const *)a, *pb = *(char *const *)b;
    size_t da = (size_t)(strrchr(pa, '/') - pa), db = (size_t)(strrchr(pb, '/') - pb);
    int c = memcmp(pa, pb, da < db ? da : db);
    if (c != 0) return c;
    if (da != db) return da < db ? -1 : 1;
    return strcmp(pa + da + 1, pb + db + 1);
}

/* Every file under dir with an image extension, as os.walk(followlinks=True) lists them: any
 * entry that is not a directory counts as a file (a dangling link or a FIFO too: the loader
 * then names it as torchvision's loader would fail on it). Unsorted. */
static int walk(const char *dir, int depth, list_t *files, char *err, size_t err_len) {
    if (depth > MAX_DEPTH)
        return ddp_errf(err, err_len, "%s: nested more than %d deep (a link loop?)", dir,
                        MAX_DEPTH);
    DIR *d = opendir(dir);
    if (!d) return ddp_errf(err, err_len, "%s: cannot open: %s", dir, strerror(errno));
    int rc = 0;
    for (struct dirent *e; rc == 0 && (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char path[4096];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) {
            rc = ddp_errf(err, err_len, "%s/%s: path longer than %zu bytes", dir, e->d_name,
                          sizeof path);
        } else if (e->d_type == DT_DIR ||
                   ((e->d_type == DT_LNK || e->d_type == DT_UNKNOWN) && is_dir_path(path))) {
            /* d_type spares a stat per file (1.3 million for ImageNet); links are followed */
            rc = walk(path, depth + 1, files, err, err_len);
        } else if (is_image_name(e->d_name) && push(files, strdup(path)) < 0) {
            rc = ddp_errf(err, err_len, "out of memory listing %s", dir);
        }
    }
    closedir(d);
    return rc;
}

static int find_class(const imagefolder_t *f, const char *name) {
    for (int i = 0; i < f->n_classes; i++)
        if (strcmp(f->classes[i], name) == 0) return i;
    return -1;
}

/* One split: every class folder of root/split, labelled by train's class index. */
static int scan_split(const imagefolder_t *f, const char *root, const char *split,
                      imagefolder_split_t *out, char *err, size_t err_len) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, split);
    list_t classes = {0}, files = {0};
    int rc = subdirs(dir, &classes, err, err_len);
    size_t *counts = rc == 0 ? calloc(classes.n + 1, sizeof *counts) : NULL;
    int *label_of = rc == 0 ? calloc(classes.n + 1, sizeof *label_of) : NULL;
    if (rc == 0 && (!counts || !label_of)) rc = ddp_errf(err, err_len, "out of memory");
    for (size_t c = 0; rc == 0 && c < classes.n; c++) {
        if ((label_of[c] = find_class(f, classes.items[c])) < 0) {
            rc = ddp_errf(err, err_len, "%s/%s: class '%s' is not among %s/train's %d classes", dir,
                          classes.items[c], classes.items[c], root, f->n_classes);
            break;
        }
        char class_dir[4200];
        snprintf(class_dir, sizeof class_dir, "%s/%s", dir, classes.items[c]);
        size_t before = files.n;
        rc = walk(class_dir, 0, &files, err, err_len);
        counts[c] = files.n - before;
        if (rc == 0 && counts[c] > 1)
            qsort(files.items + before, counts[c], sizeof *files.items, by_dir_then_name);
        /* as torchvision's ImageFolder: "Found no valid file for the classes ..." */
        if (rc == 0 && counts[c] == 0)
            rc = ddp_errf(err, err_len, "%s: class '%s' has no image files (%s)", class_dir,
                          classes.items[c], EXTENSIONS_TEXT);
    }
    if (rc == 0 && files.n == 0)
        rc = ddp_errf(err, err_len, "%s: no image files in any class folder", dir);
    if (rc == 0) {
        out->n = (int64_t)files.n;
        out->paths = files.items;
        out->labels = malloc(sizeof *out->labels * (files.n + 1));
        if (!out->labels) rc = ddp_errf(err, err_len, "out of memory");
        for (size_t c = 0, i = 0; rc == 0 && c < classes.n; c++)
            for (size_t k = 0; k < counts[c]; k++)
                out->labels[i++] = label_of[c];
        files.items = NULL;
        files.n = 0;
        if (rc < 0) imagefolder_split_free(out);
    }
    free(counts);
    free(label_of);
    list_free(&classes);
    list_free(&files);
    return rc;
}

static bool is_dir(const char *root, const char *split) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, split);
    return is_dir_path(dir);
}

int imagefolder_scan(const char *root, imagefolder_t *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    if (!is_dir(root, "train"))
        return ddp_errf(err, err_len,
                        "%s: no train/ folder (an ImageFolder: train/<class>/<image>, "
                        "and val/ or test/ alike)",
                        root);
    char train_dir[4096];
    snprintf(train_dir, sizeof train_dir, "%s/train", root);
    list_t classes = {0};
    if (subdirs(train_dir, &classes, err, err_len) < 0) return -1;
    if (classes.n == 0) {
        list_free(&classes);
        return ddp_errf(err, err_len, "%s: no class folders", train_dir);
    }
    out->classes = classes.items;
    out->n_classes = (int)classes.n;
    int rc = scan_split(out, root, "train", &out->train, err, err_len);
    if (rc == 0 && is_dir(root, "val")) rc = scan_split(out, root, "val", &out->val, err, err_len);
    if (rc == 0 && is_dir(root, "test"))
        rc = scan_split(out, root, "test", &out->test, err, err_len);
    if (rc < 0) imagefolder_free(out);
    return rc;
}

void imagefolder_split_free(imagefolder_split_t *s) {
    for (int64_t i = 0; s->paths && i < s->n; i++)
        free(s->paths[i]);
    free(s->paths);
    free(s->labels);
    memset(s, 0, sizeof *s);
}

void imagefolder_free(imagefolder_t *f) {
    imagefolder_split_free(&f->train);
    imagefolder_split_free(&f->val);
    imagefolder_split_free(&f->test);
    for (int i = 0; f->classes && i < f->n_classes; i++)
        free(f->classes[i]);
    free(f->classes);
    memset(f, 0, sizeof *f);
}
