/* snapshot_format: the on-disk layout of a ddpworker snapshot (docs/snapshot.md), shared by the
 * writer, the loader, `ddpworker inspect` and tests. Little-endian, fixed-size header followed by
 * the sections at the offsets the header names; every section and the header itself carry an
 * XXH3-64 checksum (seed 0), so a torn or flipped file is recognized before anything is used. */
#ifndef DDP_PROTO_SNAPSHOT_FORMAT_H
#define DDP_PROTO_SNAPSHOT_FORMAT_H

#include <stdint.h>

#define SNAPSHOT_MAGIC        "DDPSNAP\x01" /* 8 bytes */
#define SNAPSHOT_VERSION      3u
#define SNAPSHOT_MAX_SECTIONS 8
#define SNAPSHOT_FILE_PREFIX  "snapshot-"
#define SNAPSHOT_FILE_SUFFIX  ".ddps"
#define SNAPSHOT_MANIFEST     "latest"
/* Memory snapshots: the agent names its node's shared-memory folder to its workers in this
 * variable (launcher/memory/memory_region.c makes it, worker/snapshot/memory_snapshot.c writes
 * there in this format). */
#define SNAPSHOT_MEMORY_DIR_ENV "DDPRUN_MEMORY_SNAPSHOT_DIR"

typedef enum {
    SNAPSHOT_SECTION_PARAMS = 1,   /* fp32, the model's parameter arena */
    SNAPSHOT_SECTION_MOMENTUM = 2, /* fp32, SGD momentum or Adam's first moment, as params */
    SNAPSHOT_SECTION_BUFFERS = 3,  /* fp32, batch-norm running mean/var (rank 0's) */
    SNAPSHOT_SECTION_SECOND_MOMENT =
        4, /* fp32, Adam's second moment, as params (adam/adamw only) */
} snapshot_section_kind_t;

typedef enum {
    SNAPSHOT_OPTIM_SGD = 0,
    SNAPSHOT_OPTIM_ADAM = 1,
    SNAPSHOT_OPTIM_ADAMW = 2
} snapshot_optim_t;

/* data.kind, as the header records it (numbers of the format, not of train.conf's enum) */
typedef enum {
    SNAPSHOT_DATA_UNRECORDED = 0, /* written before the field was: not compared on resume */
    SNAPSHOT_DATA_FASHION_MNIST = 1,
    SNAPSHOT_DATA_MNIST = 2,
    SNAPSHOT_DATA_CIFAR10 = 3,
    SNAPSHOT_DATA_CIFAR100 = 4,
    SNAPSHOT_DATA_SYNTHETIC = 5,
    SNAPSHOT_DATA_IMAGEFOLDER = 6
} snapshot_data_kind_t;

typedef struct {
    uint32_t kind;     /* snapshot_section_kind_t */
    uint32_t reserved; /* 0 */
    uint64_t offset;   /* from the start of the file */
    uint64_t n_bytes;
    uint64_t checksum; /* XXH3-64 of the section's bytes */
} snapshot_section_t;

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes; /* sizeof(snapshot_header_t) */
    /* where training stands: the next step to run is `step`; `cursor` global sample positions of
     * epoch `epoch` are consumed. Augmentation and shuffling are functions of (seed, epoch,
     * index), so these three numbers and the seed are the whole random state. */
    uint64_t step, epoch, cursor;
    uint64_t seed;
    uint32_t world_size; /* at save */
    uint32_t reserved0;
    uint64_t train_samples; /* dataset size the cursor refers to */
    /* the model */
    char model[32];
    uint32_t width, height, img_width, channels, classes;
    /* data.kind (snapshot_data_kind_t); 0 in older files, where the field was reserved */
    uint32_t data_kind;
    uint64_t n_params, n_buffers;
    /* the optimizer (informational: train.conf may change it on resume) */
    double lr, momentum, weight_decay;
    uint32_t is_nesterov, precision;
    /* the optimizer's kind and Adam's step count (skipped steps not counted; 0 for SGD) are state:
     * adam and adamw snapshots carry the second-moment section */
    uint32_t optimizer; /* snapshot_optim_t */
    uint32_t reserved3; /* 0 */
    uint64_t optim_steps;
    /* the run itself: the best validation so far (train.best_by; NaN: none yet) and the step that
     * reached it, so a crash never forgets it; the training wall time so far (train.hours) */
    double best_value;
    uint64_t best_step;
    double elapsed_s;
    uint32_t best_by;     /* train.best_by at save: 0 none, 1 val_loss, 2 val_top1 */
    uint32_t is_finished; /* 1: the run ended here (its epochs, max_steps or hours used up);
                             0 in older files: the field was reserved, always 0 */
    /* the dynamic loss scaler (fp16): scale 1 and 0 steps when unused */
    double loss_scale;
    uint64_t loss_scale_good_steps;
    uint64_t unix_time_ms; /* when it was taken */
    uint32_t n_sections, reserved2;
    snapshot_section_t sections[SNAPSHOT_MAX_SECTIONS];
    uint64_t header_checksum; /* XXH3-64 of every byte above */
} snapshot_header_t;

_Static_assert(sizeof(snapshot_header_t) % 8 == 0, "the header keeps sections 8-byte aligned");

#endif
