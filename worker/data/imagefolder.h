/* imagefolder: an ImageFolder tree as torchvision reads it: ROOT/train/<class>/..., and optionally
 * ROOT/val/<class>/... and ROOT/test/<class>/...; classes are train's subfolders (hidden ones
 * too, links followed) sorted by name (byte order, as Python's sorted()), labels their index;
 * files are those with torchvision's IMG_EXTENSIONS (any case), in the order of torchvision's
 * make_dataset (sorted(os.walk()): directories by whole path, then files by name, subfolders
 * followed). val and test use train's classes by name: a class train lacks is an error naming
 * it, and so is a class folder without images in any split (torchvision's "Found no valid file").
 * Scanning only: images are read by the loader. Main thread, at start-up. */
#ifndef DDP_WORKER_IMAGEFOLDER_H
#define DDP_WORKER_IMAGEFOLDER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char **paths;    /* (n) file paths */
    int32_t *labels; /* (n) */
    int64_t n;
} imagefolder_split_t;

typedef struct {
    char **classes; /* (n_classes) names, sorted */
    int n_classes;
    imagefolder_split_t train, val, test; /* val, test: n == 0 when absent */
} imagefolder_t;

/* Scan root. Returns 0, or -1 with "what and where" in err (no train/, no classes, an empty
 * class, a val/test class that train lacks, an unreadable directory). */
int imagefolder_scan(const char *root, imagefolder_t *out, char *err, size_t err_len);
void imagefolder_free(imagefolder_t *f);
/* Free one split (its paths and labels); the others stay. */
void imagefolder_split_free(imagefolder_split_t *s);

#endif
