/* train_conf: train.conf, the trainer's INI file (ini_file.h), and `section.key=value` overrides
 * from the command line. One table describes every key: its section, type, range and default;
 * parsing, overrides and docs/train.conf.5 (checked by a test) all follow it. Errors name the file,
 * the line and the key ("train.conf:12: optim.lr: 'fast' is not a number"). Pure apart from reading
 * the file; no allocation kept. */
#ifndef DDP_WORKER_TRAIN_CONF_H
#define DDP_WORKER_TRAIN_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define TRAIN_CONF_PATH_MAX 1024

typedef enum { SCHEDULE_CONSTANT, SCHEDULE_STEP, SCHEDULE_COSINE, SCHEDULE_ONE_CYCLE } schedule_t;
typedef enum { LR_SCALING_NONE, LR_SCALING_LINEAR, LR_SCALING_SQRT } lr_scaling_t;
typedef enum {
    DATA_FASHION_MNIST,
    DATA_MNIST,
    DATA_CIFAR10,
    DATA_CIFAR100,
    DATA_SYNTHETIC,
    DATA_IMAGEFOLDER
} data_kind_t;
typedef enum { TRAIN_TRANSFORM_RANDOM_RESIZED_CROP, TRAIN_TRANSFORM_RESIZE } train_transform_t;
typedef enum { EVAL_TRANSFORM_RESIZE_CENTER_CROP, EVAL_TRANSFORM_RESIZE } eval_transform_t;
typedef enum { BAD_IMAGE_ERROR, BAD_IMAGE_SKIP } bad_image_t;
typedef enum { BACKEND_CPU, BACKEND_CUDA } backend_kind_t;
typedef enum { COLLECTIVE_AUTO, COLLECTIVE_RING, COLLECTIVE_NCCL } collective_kind_t;
typedef enum { PRECISION_FP32, PRECISION_TF32, PRECISION_FP16, PRECISION_BF16 } precision_t;
typedef enum { LOSS_SCALING_AUTO, LOSS_SCALING_DYNAMIC, LOSS_SCALING_OFF } loss_scaling_t;
typedef enum { BEST_BY_NONE, BEST_BY_VAL_LOSS, BEST_BY_VAL_TOP1 } best_by_t;
/* The values are the snapshot header's (proto/snapshot_format.h, SNAPSHOT_OPTIM_*). */
typedef enum { OPTIM_SGD, OPTIM_ADAM, OPTIM_ADAMW } optim_kind_t;

typedef struct {
    /* [model] */
    char model[32];        /* mlp, cnn, resnet18 ... resnet152, vgg11 ... vgg19_bn */
    int64_t width;         /* base channel count / hidden units */
    int64_t model_classes; /* 0: the dataset's class count */
    int model_stem;        /* model_stem_t's order: auto, imagenet, cifar */
    bool is_zero_init_residual;
    int64_t fc_width;                          /* vgg classifier */
    double dropout;                            /* vgg classifier */
    char model_init[TRAIN_CONF_PATH_MAX];      /* safetensors to start from (empty: none) */
    bool is_init_skip_mismatched;              /* the final layer may keep its drawn values */
    char model_init_skip[TRAIN_CONF_PATH_MAX]; /* tensors not to load: "a,b,prefix*" */
    /* [data] */
    data_kind_t data_kind;
    char data_dir[TRAIN_CONF_PATH_MAX];
    int64_t train_limit; /* use only the first N training samples (0: all) */
    int64_t test_limit;  /* evaluate on the first N test samples (0: all) */
    int64_t height, width_px, channels, classes; /* synthetic data's shape */
    double val_split;  /* fraction of train held out for validation (0: none) */
    bool is_augmented; /* random crop with padding + horizontal flip */
    int64_t crop_padding;
    int64_t image_size; /* imagefolder */
    train_transform_t train_transform;
    eval_transform_t eval_transform;
    double mean[3], std[3]; /* NaN: the dataset's own (auto) */
    int64_t workers;        /* decode threads, 0: auto */
    bad_image_t on_bad_image;
    /* [optim] */
    optim_kind_t optimizer;
    double lr, momentum, weight_decay, label_smoothing;
    double betas[2]; /* adam, adamw: (beta1, beta2) */
    double eps;      /* adam, adamw */
    bool is_nesterov;
    schedule_t schedule;
    double warmup_epochs, step_gamma;
    int64_t step_every_epochs;
    lr_scaling_t lr_scaling;
    /* [train] */
    int64_t batch_size;        /* per rank */
    int64_t epochs, max_steps; /* max_steps -1: no limit; 0: only evaluate */
    double hours;              /* wall-clock budget, 0: none */
    int64_t eval_interval;     /* steps, 0: at the end of every epoch */
    int64_t seed;
    double collective_timeout_s;
    backend_kind_t backend;
    collective_kind_t collective;
    int64_t threads; /* 0: cores / workers on the node */
    char metrics_file[TRAIN_CONF_PATH_MAX];
    char tensorboard_dir[TRAIN_CONF_PATH_MAX]; /* rank 0's TensorBoard event files (tb_events.h) */
    char params_file[TRAIN_CONF_PATH_MAX];     /* final params + BN statistics, raw fp32 */
    best_by_t best_by;
    char best_file[TRAIN_CONF_PATH_MAX]; /* the best weights by best_by, as params_file */
    int64_t log_interval;
    /* [snapshot] */
    char snapshot_dir[TRAIN_CONF_PATH_MAX];
    int64_t snapshot_every, snapshot_keep, snapshot_keep_every;
    int64_t snapshot_every_memory; /* steps between memory snapshots under ddprun (0: none) */
    /* [precision] */
    precision_t precision;
    loss_scaling_t loss_scaling; /* auto: dynamic for fp16, off otherwise */
    double loss_scale_init;
    int64_t loss_scale_growth_interval;
    /* where it came from (train_conf_load), for reports: the file, the overrides as given */
    char source_path[TRAIN_CONF_PATH_MAX];
    char overrides[2048];
} train_conf_t;

/* Defaults for every key. */
void train_conf_default(train_conf_t *c);
/* Read path over the defaults, then apply overrides ("section.key=value"). Returns 0, or -1 with
 * "file:line: section.key: why" (or "override N: ...") in err. */
int train_conf_load(const char *path, char *const *overrides, int n_overrides, train_conf_t *out,
                    char *err, size_t err_len);
/* Set one key from text. Returns 0, or -1 with "section.key: why" in err. */
int train_conf_set(train_conf_t *c, const char *section, const char *key, const char *value,
                   char *err, size_t err_len);
/* Every key as "section.key" with its default and help, one per line (the docs test reads it). */
void train_conf_print_keys(FILE *f);

#endif
