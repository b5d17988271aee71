/* Unit tests of worker/conf/train_conf: defaults, parsing, overrides, and errors naming
 * file:line:key. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train_conf.h"

static char path[64];

static void write_conf(const char *text) {
    if (path[0]) unlink(path);
    strcpy(path, "/tmp/train_conf_test_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
}

static void cleanup(void) {
    if (path[0]) unlink(path);
}

TestSuite(train_conf, .fini = cleanup);

Test(train_conf, defaults_are_valid_and_documented) {
    train_conf_t c;
    train_conf_default(&c);
    cr_assert_str_eq(c.model, "cnn");
    cr_assert_eq(c.data_kind, DATA_FASHION_MNIST);
    cr_assert_float_eq(c.lr, 0.1, 1e-12);
    cr_assert_eq(c.batch_size, 128);
    cr_assert_eq(c.schedule, SCHEDULE_COSINE);
    cr_assert_eq(c.precision, PRECISION_FP32);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    train_conf_print_keys(f);
    fclose(f);
    cr_assert(strstr(text, "optim.lr = 0.1") && strstr(text, "snapshot.keep = 3"), "%s", text);
    /* every documented default is accepted by its own key */
    int n = 0;
    for (char *save, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        char section[32], key[64], value[1100] = "";
        cr_assert(sscanf(line, "%31[^.].%63s = %1099[^\t]", section, key, value) >= 2, "%s", line);
        char err[256];
        cr_assert_eq(train_conf_set(&c, section, key, value, err, sizeof err), 0, "%s", err);
        n++;
    }
    cr_assert_geq(n, 30);
    free(text);
}

Test(train_conf, file_then_overrides) {
    write_conf("; a comment\n[model]\nname = resnet18\nwidth = 32\n\n[optim]\nlr = 0.05\n"
               "nesterov = yes\nschedule = one-cycle\n[train]\nbatch_size = 256\nmax_steps = 100\n"
               "[precision]\nmode = bf16\n");
    char *overrides[] = {"optim.lr=0.2", "train.epochs=3", "data.kind=synthetic"};
    train_conf_t c;
    char err[512];
    cr_assert_eq(train_conf_load(path, overrides, 3, &c, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(c.model, "resnet18");
    cr_assert_eq(c.width, 32);
    cr_assert_float_eq(c.lr, 0.2, 1e-12, "the command line wins");
    cr_assert(c.is_nesterov);
    cr_assert_eq(c.schedule, SCHEDULE_ONE_CYCLE);
    cr_assert_eq(c.batch_size, 256);
    cr_assert_eq(c.max_steps, 100);
    cr_assert_eq(c.epochs, 3);
    cr_assert_eq(c.data_kind, DATA_SYNTHETIC);
    cr_assert_eq(c.precision, PRECISION_BF16);
}

static void expect_error(const char *text, char *const *overrides, int n, const char *needle) {
    write_conf(text);
    train_conf_t c;
    char err[512] = "";
    cr_assert_eq(train_conf_load(path, overrides, n, &c, err, sizeof err), -1, "accepted: %s",
                 text);
    cr_assert(strstr(err, needle), "error '%s' lacks '%s'", err, needle);
}

Test(train_conf, errors_name_file_line_and_key) {
    char where[128];
    expect_error("[optim]\nlr = 0.1\nmomentum = fast\n", NULL, 0, "optim.momentum: 'fast'");
    snprintf(where, sizeof where, "%s:3:", path);
    train_conf_t c;
    char err[512];
    cr_assert_eq(train_conf_load(path, NULL, 0, &c, err, sizeof err), -1);
    cr_assert(strstr(err, where), "'%s' lacks '%s'", err, where);
    expect_error("[optim]\nlearning_rate = 0.1\n", NULL, 0, "optim.learning_rate: unknown key");
    expect_error("[optimizer]\nlr = 0.1\n", NULL, 0, "unknown section [optimizer]");
    expect_error("[train]\nbatch_size = 0\n", NULL, 0, "train.batch_size: '0' is not a whole");
    expect_error("[train]\nbatch_size = 12x\n", NULL, 0, "train.batch_size");
    expect_error("[model]\nname = transformer\n", NULL, 0, "is not one of mlp|cnn");
    expect_error("[optim]\nnesterov = maybe\n", NULL, 0, "not true or false");
    char *no_momentum[] = {"optim.momentum=0"};
    expect_error("[optim]\nnesterov = true\n", no_momentum, 1,
                 "optim.nesterov needs optim.momentum > 0");
    expect_error("[optim]\nlr = nan\n", NULL, 0, "optim.lr");
    expect_error("[optim]\nlr 0.1\n", NULL, 0, ":2:");
    char *bad_override[] = {"optim.lr"};
    expect_error("", bad_override, 1, "expected section.key=value");
    char *unknown_override[] = {"optim.speed=3"};
    expect_error("", unknown_override, 1, "override 'optim.speed=3': optim.speed: unknown key");
    cr_assert_eq(train_conf_load("/nonexistent/train.conf", NULL, 0, &c, err, sizeof err), -1);
    cr_assert(strstr(err, "/nonexistent/train.conf: cannot open"), "%s", err);
}

Test(train_conf, loss_scaling_keys) {
    write_conf("[precision]\nmode = fp16\nloss_scaling = dynamic\nloss_scale = 1024\n"
               "growth_interval = 50\n");
    train_conf_t c;
    char err[512];
    cr_assert_eq(train_conf_load(path, NULL, 0, &c, err, sizeof err), 0, "%s", err);
    cr_assert_eq(c.precision, PRECISION_FP16);
    cr_assert_eq(c.loss_scaling, LOSS_SCALING_DYNAMIC);
    cr_assert_float_eq(c.loss_scale_init, 1024.0, 1e-12);
    cr_assert_eq(c.loss_scale_growth_interval, 50);
    train_conf_default(&c);
    cr_assert_eq(c.loss_scaling, LOSS_SCALING_AUTO);
    expect_error("[precision]\nloss_scaling = static\n", NULL, 0, "is not one of auto|dynamic|off");
    expect_error("[precision]\nloss_scale = 0.5\n", NULL, 0, "precision.loss_scale");
    expect_error("[precision]\nloss_scale = 1e39\n", NULL, 0, "precision.loss_scale");
    expect_error("[precision]\ngrowth_interval = 0\n", NULL, 0, "precision.growth_interval");
    expect_error("[precision]\ngrowth_interval = 5000000000\n", NULL, 0,
                 "precision.growth_interval");
}

Test(train_conf, the_man_page_documents_every_key) {
    FILE *man = fopen(DDP_SOURCE_DIR "/docs/train.conf.5", "r");
    cr_assert_not_null(man, "docs/train.conf.5 is missing");
    static char page[65536];
    size_t n = fread(page, 1, sizeof page - 1, man);
    fclose(man);
    page[n] = '\0';
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    train_conf_print_keys(f);
    fclose(f);
    for (char *save, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        char key[96], escaped[200];
        cr_assert_eq(sscanf(line, "%95s", key), 1);
        size_t j = 0;
        for (size_t i = 0; key[i] && j < sizeof escaped - 2; i++) {
            if (key[i] == '-') escaped[j++] = '\\';
            escaped[j++] = key[i];
        }
        escaped[j] = '\0';
        char needle[220];
        snprintf(needle, sizeof needle, ".B %s\n", escaped);
        cr_assert(strstr(page, needle), "docs/train.conf.5 does not document %s", key);
    }
    free(text);
}

Test(train_conf, optimizer_keys) {
    train_conf_t c;
    train_conf_default(&c);
    cr_assert_eq(c.optimizer, OPTIM_SGD);
    cr_assert(c.betas[0] == 0.9 && c.betas[1] == 0.999 && c.eps == 1e-8, "torch's defaults");
    write_conf("[optim]\nname = adamw\nbetas = 0.8, 0.95\neps = 1e-6\nweight_decay = 0.01\n");
    char err[512];
    cr_assert_eq(train_conf_load(path, NULL, 0, &c, err, sizeof err), 0, "%s", err);
    cr_assert_eq(c.optimizer, OPTIM_ADAMW);
    cr_assert(c.betas[0] == 0.8 && c.betas[1] == 0.95 && c.eps == 1e-6);
    char *adam[] = {"optim.name=adam", "optim.betas=0,0.5"};
    cr_assert_eq(train_conf_load(path, adam, 2, &c, err, sizeof err), 0, "%s", err);
    cr_assert(c.optimizer == OPTIM_ADAM && c.betas[0] == 0 && c.betas[1] == 0.5);
    expect_error("[optim]\nname = lamb\n", NULL, 0,
                 "optim.name: 'lamb' is not one of sgd|adam|adamw");
    const char *bad_betas[] = {"0.9",      "0.9,",      "0.9,0.999,0.5", "1,0.999", "0.9,1",
                               "-0.1,0.9", "0.9;0.999", "fast,slow",     "nan,0.9", "0.9,inf",
                               ""};
    for (size_t i = 0; i < sizeof bad_betas / sizeof *bad_betas; i++) {
        char text[128];
        snprintf(text, sizeof text, "[optim]\nname = adam\nbetas = %s\n", bad_betas[i]);
        expect_error(text, NULL, 0, "optim.betas");
        char where[256]; /* file, line, key and value */
        snprintf(where, sizeof where, "%s:3: optim.betas: '%s' is not 2 numbers in [0, 1)", path,
                 bad_betas[i]);
        cr_assert_eq(train_conf_load(path, NULL, 0, &c, err, sizeof err), -1);
        cr_assert(strstr(err, where), "'%s' lacks '%s'", err, where);
    }
    expect_error("[optim]\neps = -1e-8\n", NULL, 0, "optim.eps: '-1e-8' is not a number in [0, 1]");
    expect_error("[optim]\neps = tiny\n", NULL, 0, "optim.eps: 'tiny'");
    expect_error("[optim]\neps = inf\n", NULL, 0, "optim.eps");
    char *bad_override[] = {"optim.betas=0.9"};
    expect_error("", bad_override, 1, "override 'optim.betas=0.9': optim.betas");
}
