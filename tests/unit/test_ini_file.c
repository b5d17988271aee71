/* Unit tests of worker/conf/ini_file (train.conf's INI reader) and of train_conf's use of it: every
 * malformed file is an error naming file and line, never a silent default or raw bytes. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "temp_dir.h"
#include "ini_file.h"
#include "train_conf.h"

static char dir[64], path[128];

static void setup(void) {
    temp_dir_make(dir, sizeof dir, "ini_file_test");
    snprintf(path, sizeof path, "%s/train.conf", dir);
}

static void cleanup(void) {
    temp_dir_remove(dir);
}

TestSuite(ini_file, .init = setup, .fini = cleanup);

static void write_bytes(const char *text, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(text, 1, n, f), n);
    fclose(f);
}

static void write_text(const char *text) {
    write_bytes(text, strlen(text));
}

typedef struct {
    char seen[8][3][300];
    int lines[8];
    int n;
} collect_t;

static int collect(void *user, const char *section, const char *key, const char *value, int line,
                   char *err, size_t err_len) {
    (void)err, (void)err_len;
    collect_t *c = user;
    cr_assert_lt(c->n, 8);
    snprintf(c->seen[c->n][0], 300, "%s", section);
    snprintf(c->seen[c->n][1], 300, "%s", key);
    snprintf(c->seen[c->n][2], 300, "%s", value);
    c->lines[c->n++] = line;
    return 0;
}

static int parse(collect_t *c, char *err, size_t err_len) {
    memset(c, 0, sizeof *c);
    return ini_file_parse(path, collect, c, err, err_len);
}

Test(ini_file, sections_keys_comments_and_long_lines) {
    char long_value[260];
    memset(long_value, 'x', sizeof long_value - 1);
    long_value[sizeof long_value - 1] = '\0';
    char text[1024];
    snprintf(text, sizeof text,
             "\xEF\xBB\xBF; comment\n# another\n[ model ]  ; trailing\n  name = cnn ; inline\n"
             "width: 16\n\n[data]\ndir = /a;b#c\nkey_with_empty_value =\nlong = %s\r\n",
             long_value);
    write_text(text);
    collect_t c;
    char err[256] = "";
    cr_assert_eq(parse(&c, err, sizeof err), 0, "%s", err);
    cr_assert_eq(c.n, 5);
    cr_assert_str_eq(c.seen[0][0], "model");
    cr_assert_str_eq(c.seen[0][2], "cnn");
    cr_assert_eq(c.lines[0], 4);
    cr_assert_str_eq(c.seen[1][1], "width");
    cr_assert_str_eq(c.seen[1][2], "16");
    cr_assert_str_eq(c.seen[2][2], "/a;b#c", "no blank before ';': part of the value");
    cr_assert_str_eq(c.seen[3][2], "");
    cr_assert_str_eq(c.seen[4][2], long_value, "inih cut lines at 200 bytes; we do not");
}

static void expect_error(const char *needle) {
    collect_t c;
    char err[512] = "";
    cr_assert_eq(parse(&c, err, sizeof err), -1);
    cr_assert(strstr(err, needle), "wanted '%s' in: %s", needle, err);
    for (const char *p = err; *p; p++)
        cr_assert(*p >= 0x20 && *p < 0x7f, "a non-printable byte in the message: %s", err);
}

Test(ini_file, malformed_files_are_named_errors) {
    write_text("[model\nname = cnn\n");
    expect_error(":1: section header '[model' is not closed");
    write_text("name = cnn\n");
    expect_error(":1: key 'name' comes before any [section]");
    write_text("[model]\njust words\n");
    expect_error(":2: 'just words' is not 'key = value'");
    write_text("[]\n");
    expect_error(":1: empty section name");
    write_text("[model] junk\n");
    expect_error(":1: text after the section header");
    write_bytes("[model]\nname = \x01\x02\x7f\xff\n", 19);
    expect_error(":2: byte 0x01 at column 8: not a text file");
    write_bytes("\x7f"
                "ELF\x02\x01\x01\0\0\0",
                10);
    expect_error(":1: byte 0x7f at column 1");
}

Test(ini_file, only_regular_files) {
    snprintf(path, sizeof path, "%s", dir);
    expect_error(": not a regular file (a directory)");
    snprintf(path, sizeof path, "%s/fifo.conf", dir);
    cr_assert_eq(mkfifo(path, 0600), 0);
    expect_error(": not a regular file (a FIFO)"); /* and it returned: the open did not block */
    snprintf(path, sizeof path, "%s/missing.conf", dir);
    expect_error(": cannot open: No such file or directory");
}

Test(ini_file, train_conf_refuses_a_key_set_twice) {
    write_text("[model]\nname = cnn\n[optim]\nlr = 0.1\n[model]\nname = mlp\n");
    train_conf_t c;
    char err[512] = "";
    cr_assert_eq(train_conf_load(path, NULL, 0, &c, err, sizeof err), -1);
    cr_assert(strstr(err, ":6: model.name: set twice (first on line 2)"), "%s", err);
    /* the same key in an override is the way to change it */
    write_text("[model]\nname = cnn\n");
    char *overrides[] = {"model.name=mlp"};
    cr_assert_eq(train_conf_load(path, overrides, 1, &c, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(c.model, "mlp");
}
