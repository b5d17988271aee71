/* Unit tests of worker/data/imagefolder on folders written here: torchvision's class and file
 * order, labels by train's class names, and errors that name the folder. (image_decode and
 * loader: test_image_decode.c, test_loader.c; against torchvision itself:
 * tests/interop/test_image_decode.py.) */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "temp_dir.h"
#include "imagefolder.h"

static char root[64];

static void setup(void) {
    temp_dir_make(root, sizeof root, "imagefolder_test");
}

static void cleanup(void) {
    temp_dir_remove(root);
}

TestSuite(imagefolder, .init = setup, .fini = cleanup);

/* A w x h JPEG of one colour at root/rel. */
static void write_jpeg(const char *rel, int w, int h, unsigned char value) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0755);
            *p = '/';
        }
    unsigned char *rgb = malloc((size_t)w * h * 3);
    memset(rgb, value, (size_t)w * h * 3);
    tjhandle tj = tjInitCompress();
    unsigned char *jpeg = NULL;
    unsigned long size = 0;
    cr_assert_eq(tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &jpeg, &size, TJSAMP_444, 95, 0), 0);
    FILE *f = fopen(path, "wb");
    fwrite(jpeg, 1, size, f);
    fclose(f);
    tjFree(jpeg);
    tjDestroy(tj);
    free(rgb);
}

Test(imagefolder, classes_and_files_in_torchvisions_order) {
    write_jpeg("train/b/2.jpg", 8, 8, 10);
    write_jpeg("train/b/1.JPG", 8, 8, 10);
    write_jpeg("train/a/z/3.jpeg", 8, 8, 10);
    write_jpeg("train/a/0.png.txt", 8, 8, 10); /* not an image name: ignored */
    write_jpeg("train/a/1.jpg", 8, 8, 10);
    write_jpeg("train/b/z/y/0.jpg", 8, 8, 10); /* directories by whole path: b/z/y ... */
    write_jpeg("train/b/z-/0.jpg", 8, 8, 10);  /* ... after b/z- ('-' < '/'), not depth first */
    write_jpeg("train/b/.jpg", 8, 8, 10);      /* a name that is all extension counts */
    write_jpeg("train/.h/1.jpg", 8, 8, 10);    /* torchvision takes hidden folders as classes */
    write_jpeg("val/b/x.jpg", 8, 8, 10);
    imagefolder_t f;
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), 0, "%s", err);
    cr_assert_eq(f.n_classes, 3);
    cr_assert(!strcmp(f.classes[0], ".h") && !strcmp(f.classes[1], "a") &&
              !strcmp(f.classes[2], "b"));
    cr_assert_eq(f.train.n, 8);
    /* class a: its own files, then its subfolder's; class b: by name, then b/z- before b/z/y */
    const char *want[] = {"train/.h/1.jpg",   "train/a/1.jpg",    "train/a/z/3.jpeg",
                          "train/b/.jpg",     "train/b/1.JPG",    "train/b/2.jpg",
                          "train/b/z-/0.jpg", "train/b/z/y/0.jpg"};
    int labels[] = {0, 1, 1, 2, 2, 2, 2, 2};
    for (int i = 0; i < 8; i++) {
        cr_assert(strstr(f.train.paths[i], want[i]), "%s", f.train.paths[i]);
        cr_assert_eq(f.train.labels[i], labels[i]);
    }
    cr_assert(f.val.n == 1 && f.val.labels[0] == 2, "val/b is train's class 2 by name");
    cr_assert_eq(f.test.n, 0);
    imagefolder_free(&f);
}

Test(imagefolder, errors_name_the_folder) {
    imagefolder_t f;
    char err[512];
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "no train/ folder"), "%s", err);
    write_jpeg("train/a/1.jpg", 8, 8, 1);
    mkdir(strcat(strcpy(err, root), "/train/empty"), 0755);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "class 'empty' has no image files"), "%s", err);
}

Test(imagefolder, errors_name_what_is_wrong_and_where) {
    imagefolder_t f;
    char err[512], path[512];
    cr_assert_eq(imagefolder_scan("/nonexistent/dir", &f, err, sizeof err), -1);
    cr_assert(strstr(err, "/nonexistent/dir: no train/ folder"), "%s", err);
    snprintf(path, sizeof path, "%s/train", root);
    mkdir(path, 0755);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "/train: no class folders"), "%s", err);
    write_jpeg("train/a/1.jpg", 8, 8, 1);
    write_jpeg("train/b/notes.txt", 8, 8, 1);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "train/b: class 'b' has no image files (.jpg"), "%s", err);
    write_jpeg("train/b/1.png", 8, 8, 1);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), 0, "%s", err);
    imagefolder_free(&f);
    write_jpeg("val/c/1.jpg", 8, 8, 1);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "val/c: class 'c' is not among") && strstr(err, "train's 2 classes"),
              "%s", err);
    snprintf(path, sizeof path, "rm -r %s/val/c", root);
    cr_assert_eq(system(path), 0);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "/val: no image files in any class folder"), "%s", err);
    snprintf(path, sizeof path, "rm -r %s/val && mkdir -p %s/test/a", root, root);
    cr_assert_eq(system(path), 0);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "test/a: class 'a' has no image files"), "%s", err);
    /* a link back up: a loop, reported instead of followed forever */
    snprintf(path, sizeof path, "%s/test/a/1.jpg", root);
    cr_assert_eq(symlink("../../train/a/1.jpg", path), 0);
    snprintf(path, sizeof path, "%s/test/a/loop", root);
    cr_assert_eq(symlink("..", path), 0);
    cr_assert_eq(imagefolder_scan(root, &f, err, sizeof err), -1);
    cr_assert(strstr(err, "nested more than"), "%s", err);
}
