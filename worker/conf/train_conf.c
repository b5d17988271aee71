/* train_conf: see train_conf.h. The key table is the single source of train.conf's keys. */
#include "train_conf.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ini_file.h"

/* KEY_PAIR: numbers "a,b[,c]", each in [min, max), into a double[2] (torch's betas) or double[3]
 * (per-channel mean and std; values "auto" then also accepts auto, stored as NaN). */
typedef enum { KEY_INT, KEY_DOUBLE, KEY_BOOL, KEY_STRING, KEY_ENUM, KEY_PAIR } key_type_t;

typedef struct {
    const char *section, *key;
    key_type_t type;
    size_t offset;
    size_t size;        /* KEY_STRING: buffer size */
    double min, max;    /* KEY_INT, KEY_DOUBLE */
    const char *values; /* KEY_ENUM: "a|b|c" in enum order */
    const char *def;    /* the default, as text */
    const char *help;
} key_spec_t;

#define F(field) offsetof(train_conf_t, field), sizeof(((train_conf_t *)0)->field)

static const key_spec_t keys[] = {
    {"model", "name", KEY_ENUM, F(model), 0, 0,
     "mlp|cnn|resnet18|resnet34|resnet50|resnet101|resnet152|vgg11|vgg11_bn|vgg13|vgg13_bn|vgg16|"
     "vgg16_bn|vgg19|vgg19_bn",
     "cnn", "the network (torchvision's resnets and vggs)"},
    {"model", "width", KEY_INT, F(width), 1, 4096, NULL, "64",
     "base channels (64: torchvision's) / hidden units"},
    {"model", "classes", KEY_INT, F(model_classes), 0, 1000000, NULL, "0",
     "classifier outputs (0: the dataset's class count; any other count must equal it)"},
    {"model", "stem", KEY_ENUM, F(model_stem), 0, 0, "auto|imagenet|cifar", "auto",
     "resnets' first layers: imagenet (7x7/2 conv, bn, relu, 3x3/2 max-pool) or cifar (3x3/1 "
     "conv, bn, relu); auto: imagenet when both image sides are at least 64 pixels"},
    {"model", "zero_init_residual", KEY_BOOL, F(is_zero_init_residual), 0, 0, NULL, "false",
     "resnets: each block's last batch norm starts with gamma 0 (torchvision's "
     "zero_init_residual)"},
    {"model", "fc_width", KEY_INT, F(fc_width), 1, 65536, NULL, "4096",
     "vggs: the classifier's hidden width"},
    {"model", "dropout", KEY_DOUBLE, F(dropout), 0, 0.99, NULL, "0.5",
     "vggs: the classifier's dropout probability (drawn from train.seed, the step and the rank)"},
    {"model", "init", KEY_STRING, F(model_init), 0, 0, NULL, "",
     "start from this safetensors file of torchvision's state_dict names and layouts (a fresh run "
     "only: a resumed run takes its snapshot's weights)"},
    {"model", "init_skip_mismatched", KEY_BOOL, F(is_init_skip_mismatched), 0, 0, NULL, "false",
     "model.init: the final layer's tensors (fc, classifier.6: a new classifier head), when their "
     "shape differs or the file lacks them, keep their drawn initial values, named on stderr; a "
     "mismatch anywhere else still stops the run, naming the first ones (see model.init_skip)"},
    {"model", "init_skip", KEY_STRING, F(model_init_skip), 0, 0, NULL, "",
     "model.init: tensors not to load, which keep their drawn initial values: comma-separated "
     "state_dict names, NAME* for every name that begins so (e.g. classifier.*); tensors of the "
     "file that the model lacks are ignored when listed"},
    {"data", "kind", KEY_ENUM, F(data_kind), 0, 0,
     "fashion-mnist|mnist|cifar10|cifar100|synthetic|imagefolder", "fashion-mnist",
     "dataset (imagefolder: data.dir holds train/<class>/<image> and val/, test/ alike)"},
    {"data", "dir", KEY_STRING, F(data_dir), 0, 0, NULL, "/usr/share/datasets/fashion-mnist",
     "where the dataset's files are"},
    {"data", "train_limit", KEY_INT, F(train_limit), 0, 1e12, NULL, "0",
     "use only the first N training samples (0: all)"},
    {"data", "test_limit", KEY_INT, F(test_limit), 0, 1e12, NULL, "0",
     "evaluate on the first N test samples only (0: all)"},
    {"data", "height", KEY_INT, F(height), 1, 4096, NULL, "32", "synthetic: image height"},
    {"data", "width", KEY_INT, F(width_px), 1, 4096, NULL, "32", "synthetic: image width"},
    {"data", "channels", KEY_INT, F(channels), 1, 64, NULL, "3", "synthetic: channels"},
    {"data", "classes", KEY_INT, F(classes), 2, 100000, NULL, "10", "synthetic: classes"},
    {"data", "val_split", KEY_DOUBLE, F(val_split), 0, 0.99, NULL, "0",
     "fraction of the training set held out for validation (the same samples for any seed and "
     "world size); without it, validation runs on the test set"},
    {"data", "augment", KEY_BOOL, F(is_augmented), 0, 0, NULL, "false",
     "random crop with padding and horizontal flip"},
    {"data", "crop_padding", KEY_INT, F(crop_padding), 0, 64, NULL, "4", "padding of the crop"},
    {"data", "image_size", KEY_INT, F(image_size), 8, 4096, NULL, "224",
     "imagefolder: the side of the square samples"},
    {"data", "train_transform", KEY_ENUM, F(train_transform), 0, 0, "random-resized-crop|resize",
     "random-resized-crop",
     "imagefolder: torchvision's RandomResizedCrop (scale 0.08-1, ratio "
     "3/4-4/3) and a horizontal flip, or a Resize to image_size x image_size"},
    {"data", "eval_transform", KEY_ENUM, F(eval_transform), 0, 0, "resize-center-crop|resize",
     "resize-center-crop",
     "imagefolder: the shorter side to int(image_size/0.875) then the "
     "centre crop, or a Resize to image_size x image_size"},
    {"data", "mean", KEY_PAIR, F(mean), -1e3, 1e3, "auto", "auto",
     "per-channel mean (0..1 scale) subtracted (auto: ImageNet's for imagefolder, the dataset's "
     "own otherwise)"},
    {"data", "std", KEY_PAIR, F(std), 1e-6, 1e3, "auto", "auto",
     "per-channel standard deviation divided by (auto: as data.mean)"},
    {"data", "workers", KEY_INT, F(workers), 0, 1024, NULL, "0",
     "imagefolder: decode threads per worker (0: the cores divided among the node's workers)"},
    {"data", "on_bad_image", KEY_ENUM, F(on_bad_image), 0, 0, "error|skip", "error",
     "imagefolder: a file that cannot be decoded stops the run naming it (exit 65), or is replaced "
     "by the next sample that decodes and counted"},
    {"optim", "name", KEY_ENUM, F(optimizer), 0, 0, "sgd|adam|adamw", "sgd",
     "the optimizer, as torch.optim's SGD, Adam or AdamW"},
    {"optim", "lr", KEY_DOUBLE, F(lr), 0, 1e3, NULL, "0.1", "learning rate (before scaling)"},
    {"optim", "momentum", KEY_DOUBLE, F(momentum), 0, 1, NULL, "0.9", "SGD momentum (sgd only)"},
    {"optim", "nesterov", KEY_BOOL, F(is_nesterov), 0, 0, NULL, "false",
     "Nesterov momentum (sgd only)"},
    {"optim", "weight_decay", KEY_DOUBLE, F(weight_decay), 0, 1, NULL, "0.0005",
     "sgd and adam: L2 penalty added to the gradient; adamw: decoupled decay"},
    {"optim", "betas", KEY_PAIR, F(betas), 0, 1, NULL, "0.9,0.999",
     "adam, adamw: decay rates of the running averages of the gradient and its square"},
    {"optim", "eps", KEY_DOUBLE, F(eps), 0, 1, NULL, "1e-8",
     "adam, adamw: added to the denominator"},
    {"optim", "label_smoothing", KEY_DOUBLE, F(label_smoothing), 0, 0.999, NULL, "0",
     "label smoothing of the loss"},
    {"optim", "schedule", KEY_ENUM, F(schedule), 0, 0, "constant|step|cosine|one-cycle", "cosine",
     "learning-rate schedule"},
    {"optim", "warmup_epochs", KEY_DOUBLE, F(warmup_epochs), 0, 1e6, NULL, "0",
     "linear warm-up length"},
    {"optim", "step_every_epochs", KEY_INT, F(step_every_epochs), 1, 1e6, NULL, "30",
     "step schedule: period"},
    {"optim", "step_gamma", KEY_DOUBLE, F(step_gamma), 0, 1, NULL, "0.1", "step schedule: factor"},
    {"optim", "lr_scaling", KEY_ENUM, F(lr_scaling), 0, 0, "none|linear|sqrt", "none",
     "scale lr with the world size"},
    {"train", "batch_size", KEY_INT, F(batch_size), 1, 1 << 20, NULL, "128", "per rank"},
    {"train", "epochs", KEY_INT, F(epochs), 0, 1e6, NULL, "1", "epochs (0: none)"},
    {"train", "max_steps", KEY_INT, F(max_steps), -1, 1e12, NULL, "-1",
     "stop after N steps (-1: no limit; 0: only evaluate the initial or imported weights)"},
    {"train", "hours", KEY_DOUBLE, F(hours), 0, 1e5, NULL, "0", "wall-clock budget (0: none)"},
    {"train", "eval_interval", KEY_INT, F(eval_interval), 0, 1e12, NULL, "0",
     "evaluate every N steps (0: after every epoch)"},
    {"train", "collective_timeout", KEY_DOUBLE, F(collective_timeout_s), 1, 1e5, NULL, "300",
     "seconds a collective may wait for a peer before the worker exits with \"peer failure\""},
    {"train", "backend", KEY_ENUM, F(backend), 0, 0, "cpu|cuda", "cpu",
     "compute backend: the CPU reference or one GPU per rank (LOCAL_RANK picks it)"},
    {"train", "collective", KEY_ENUM, F(collective), 0, 0, "auto|ring|nccl", "auto",
     "gradient all-reduce: auto picks nccl when each rank of a cuda run has a GPU of its own, "
     "else the ring (over host memory); a world of one needs none unless nccl is named"},
    {"train", "threads", KEY_INT, F(threads), 0, 1024, NULL, "0",
     "compute threads per worker (0: the cores divided among the node's workers)"},
    {"train", "seed", KEY_INT, F(seed), 0, 9.007199254740992e15, NULL, "0", "of everything random"},
    {"train", "metrics_file", KEY_STRING, F(metrics_file), 0, 0, NULL, "", "JSON lines here"},
    {"train", "tensorboard_dir", KEY_STRING, F(tensorboard_dir), 0, 0, NULL, "",
     "rank 0 writes TensorBoard event files here (empty: none)"},
    {"train", "params_file", KEY_STRING, F(params_file), 0, 0, NULL, "",
     "rank 0 writes the final parameters here (empty: nowhere)"},
    {"train", "best_by", KEY_ENUM, F(best_by), 0, 0, "none|val_loss|val_top1", "none",
     "keep the weights of the best validation so far in train.best_file (the value survives "
     "restarts), and test them at the end"},
    {"train", "best_file", KEY_STRING, F(best_file), 0, 0, NULL, "",
     "where train.best_by keeps the best weights (written atomically, as train.params_file)"},
    {"train", "log_interval", KEY_INT, F(log_interval), 1, 1e12, NULL, "50",
     "progress line period"},
    {"snapshot", "dir", KEY_STRING, F(snapshot_dir), 0, 0, NULL, "",
     "snapshots here (empty: none)"},
    {"snapshot", "every", KEY_INT, F(snapshot_every), 0, 1e12, NULL, "0",
     "steps between snapshots"},
    {"snapshot", "every_memory", KEY_INT, F(snapshot_every_memory), 0, 1e12, NULL, "1",
     "steps between snapshots into the agent's shared memory (under ddprun; 0: none)"},
    {"snapshot", "keep", KEY_INT, F(snapshot_keep), 1, 1e6, NULL, "3", "newest snapshots kept"},
    {"snapshot", "keep_every", KEY_INT, F(snapshot_keep_every), 0, 1e12, NULL, "0",
     "also keep every Nth step's snapshot forever (0: none)"},
    {"precision", "mode", KEY_ENUM, F(precision), 0, 0, "fp32|tf32|fp16|bf16", "fp32",
     "arithmetic of the compute backend"},
    {"precision", "loss_scaling", KEY_ENUM, F(loss_scaling), 0, 0, "auto|dynamic|off", "auto",
     "dynamic loss scaling as GradScaler (auto: for fp16 only)"},
    {"precision", "loss_scale", KEY_DOUBLE, F(loss_scale_init), 1, 3.4e38, NULL, "65536",
     "initial dynamic loss scale"},
    {"precision", "growth_interval", KEY_INT, F(loss_scale_growth_interval), 1, 1e9, NULL, "2000",
     "steps without overflow before the loss scale doubles"},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

static int fail(char *err, size_t len, const key_spec_t *k, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t len, const key_spec_t *k, const char *fmt, ...) {
    int n = k ? snprintf(err, len, "%s.%s: ", k->section, k->key) : 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, len - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

static int set_value(train_conf_t *c, const key_spec_t *k, const char *v, char *err, size_t el) {
    char *field = (char *)c + k->offset, *end;
    switch (k->type) {
    case KEY_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || errno || x < k->min || x > k->max)
            return fail(err, el, k, "'%s' is not a whole number in [%.0f, %.0f]", v, k->min,
                        k->max);
        *(int64_t *)field = x;
        return 0;
    }
    case KEY_DOUBLE: {
        double x = strtod(v, &end);
        if (!*v || *end || !isfinite(x) || x < k->min || x > k->max)
            return fail(err, el, k, "'%s' is not a number in [%g, %g]", v, k->min, k->max);
        *(double *)field = x;
        return 0;
    }
    case KEY_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "1") || !strcmp(v, "on"))
            *(bool *)field = true;
        else if (!strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "0") || !strcmp(v, "off"))
            *(bool *)field = false;
        else
            return fail(err, el, k, "'%s' is not true or false", v);
        return 0;
    case KEY_STRING:
        if (strlen(v) >= k->size)
            return fail(err, el, k, "longer than %zu characters", k->size - 1);
        strcpy(field, v);
        return 0;
    case KEY_PAIR: { /* as many numbers as the field holds doubles (2: betas, 3: mean/std) */
        double x[8];
        size_t n = k->size / sizeof(double);
        if (k->values && strcmp(v, "auto") == 0) { /* "auto": NaN, which the user of it replaces */
            for (size_t i = 0; i < n; i++)
                x[i] = NAN;
            memcpy(field, x, n * sizeof(double));
            return 0;
        }
        const char *p = v;
        for (size_t i = 0; i < n; i++) {
            x[i] = strtod(p, &end);
            if (end == p || !isfinite(x[i]) || x[i] < k->min || x[i] >= k->max ||
                *end != (i + 1 < n ? ',' : '\0'))
                return fail(err, el, k, "'%s' is not %zu numbers in [%g, %g) separated by commas%s",
                            v, n, k->min, k->max, k->values ? " (or auto)" : "");
            p = end + 1;
        }
        memcpy(field, x, n * sizeof(double));
        return 0;
    }
    case KEY_ENUM: {
        int index = 0;
        size_t vlen = strlen(v);
        for (const char *p = k->values; *p; index++) {
            const char *bar = strchr(p, '|');
            size_t n = bar ? (size_t)(bar - p) : strlen(p);
            if (n == vlen && strncmp(p, v, n) == 0) {
                if (k->size == sizeof(int))
                    *(int *)field = index; /* a C enum */
                else
                    snprintf(field, k->size, "%s", v); /* kept as text (model) */
                return 0;
            }
            p += n + (bar != NULL);
        }
        return fail(err, el, k, "'%s' is not one of %s", v, k->values);
    }
    }
    return fail(err, el, k, "unsupported type");
}

int train_conf_set(train_conf_t *c, const char *section, const char *key, const char *value,
                   char *err, size_t err_len) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].section, section) && !strcmp(keys[i].key, key))
            return set_value(c, &keys[i], value, err, err_len);
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].section, section))
            return fail(err, err_len, NULL, "%s.%s: unknown key (see train.conf(5))", section, key);
    return fail(err, err_len, NULL,
                "%s.%s: unknown section [%s] (model, data, optim, train, "
                "snapshot, precision)",
                section, key, section);
}

void train_conf_default(train_conf_t *c) {
    memset(c, 0, sizeof *c);
    char err[256];
    for (size_t i = 0; i < N_KEYS; i++) {
        int rc = set_value(c, &keys[i], keys[i].def, err, sizeof err);
        (void)rc; /* defaults are valid by construction; the unit test proves it */
    }
}

/* Which keys the file set, and on which line, so a key set twice is an error, not "last wins". */
typedef struct {
    train_conf_t *conf;
    int set_on_line[N_KEYS];
} parse_ctx_t;

static int on_key(void *user, const char *section, const char *key, const char *value, int line,
                  char *err, size_t err_len) {
    parse_ctx_t *ctx = user;
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strcmp(keys[i].section, section) || strcmp(keys[i].key, key)) continue;
        if (ctx->set_on_line[i])
            return fail(err, err_len, &keys[i], "set twice (first on line %d); keep one",
                        ctx->set_on_line[i]);
        ctx->set_on_line[i] = line;
        break;
    }
    return train_conf_set(ctx->conf, section, key, value, err, err_len);
}

/* Keys that are each valid but not together: refused as torch.optim refuses them, rather than
 * run as something else (SGD's nesterov and momentum are ignored by adam and adamw, as the
 * shipped examples' nesterov = true is when optim.name is overridden). */
static int check_together(const train_conf_t *c, char *err, size_t err_len) {
    if (c->optimizer == OPTIM_SGD && c->is_nesterov && c->momentum == 0)
        return fail(err, err_len, NULL,
                    "optim.nesterov needs optim.momentum > 0 (torch.optim.SGD refuses it too)");
    return 0;
}

int train_conf_load(const char *path, char *const *overrides, int n_overrides, train_conf_t *out,
                    char *err, size_t err_len) {
    train_conf_default(out);
    parse_ctx_t ctx = {.conf = out};
    if (ini_file_parse(path, on_key, &ctx, err, err_len) < 0) return -1;
    snprintf(out->source_path, sizeof out->source_path, "%s", path);
    for (int i = 0; i < n_overrides; i++) {
        size_t used = strlen(out->overrides); /* as given, for reports; cut where it is full */
        snprintf(out->overrides + used, sizeof out->overrides - used, "%s%s", used ? " " : "",
                 overrides[i]);
        char buf[TRAIN_CONF_PATH_MAX + 128];
        snprintf(buf, sizeof buf, "%s", overrides[i]);
        char *dot = strchr(buf, '.'), *eq = strchr(buf, '=');
        if (!dot || !eq || dot > eq)
            return fail(err, err_len, NULL, "override '%s': expected section.key=value",
                        overrides[i]);
        *dot = *eq = '\0';
        char msg[512];
        if (train_conf_set(out, buf, dot + 1, eq + 1, msg, sizeof msg) < 0)
            return fail(err, err_len, NULL, "override '%s': %s", overrides[i], msg);
    }
    if (check_together(out, err, err_len) < 0) return -1;
    return 0;
}

void train_conf_print_keys(FILE *f) {
    for (size_t i = 0; i < N_KEYS; i++)
        fprintf(f, "%s.%s = %s\t%s%s%s\n", keys[i].section, keys[i].key, keys[i].def, keys[i].help,
                keys[i].values ? "; one of " : "", keys[i].values ? keys[i].values : "");
}
