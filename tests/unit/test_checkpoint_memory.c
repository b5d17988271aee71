/* checkpoint_memory with a backend whose copies out are asynchronous, as a GPU's are (the test's
 * backend queues them and makes them when the writer's thread waits for them, which the test holds
 * back): a due snapshot is skipped while the last one is still on its way, never waited for, and
 * counted; the one after is taken; the sealed generation holds the state of the step it was taken
 * at, copied out, not what the arenas hold later, and its loss scale copied out with it (no
 * read-back, which would wait for the GPU). The cuda backend's own copies (a device buffer, then
 * the side stream) need a GPU: tests/gpu. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint_memory.h"
#include "loss_scale.h"
#include "memory_snapshot.h"
#include "model.h"
#include "optimizer.h"
#include "temp_dir.h"

#define N_PARAMS  64
#define N_BUFFERS 4

/* ---- a backend whose copies out wait for the test's go ---- */

typedef struct {
    void *dst;
    const void *src;
    size_t n;
} queued_t;

static queued_t queue[8];
static int n_queued;
static atomic_bool may_copy;
static float held[8][N_PARAMS]; /* each copy's source as it was when queued: what a device copy
                                   made at once would have read */

static void copy_out_begin(backend_t *b) {
    (void)b;
}

static void copy_out(backend_t *b, void *dst, const void *src, size_t n) {
    (void)b;
    cr_assert(n_queued < 8 && n <= sizeof held[0]);
    int i = n_queued++;
    memcpy(held[i], src, n);
    queue[i] = (queued_t){dst, held[i], n};
}

static void copy_out_fence(backend_t *b) {
    (void)b;
}

/* the writer's thread, before it hashes: the copies land once the test lets them */
static void copy_out_wait(backend_t *b) {
    (void)b;
    while (!atomic_load(&may_copy))
        usleep(1000);
    for (int i = 0; i < n_queued; i++)
        memcpy(queue[i].dst, queue[i].src, queue[i].n);
    n_queued = 0;
}

static bool is_device(backend_t *b, const void *p) {
    (void)b, (void)p;
    return true;
}

static int pin_host(backend_t *b, void *p, size_t n) {
    (void)b, (void)p, (void)n;
    return 0;
}

static void unpin_host(backend_t *b, void *p) {
    (void)b, (void)p;
}

/* no to_host: a read-back, which would wait for the GPU, crashes the test */
static backend_memory_i mem = {.name = "async-test",
                               .is_device = is_device,
                               .pin_host = pin_host,
                               .unpin_host = unpin_host,
                               .copy_out_begin = copy_out_begin,
                               .copy_out = copy_out,
                               .copy_out_fence = copy_out_fence,
                               .copy_out_wait = copy_out_wait};

Test(checkpoint_memory, a_snapshot_due_while_the_last_is_on_its_way_is_skipped_not_waited_for,
     .timeout = 30) {
    char dir[256];
    temp_dir_make(dir, sizeof dir, "test_checkpoint_memory");
    setenv(MEMORY_SNAPSHOT_DIR_ENV, dir, 1);
    backend_t backend = {.mem = &mem};
    train_conf_t conf;
    train_conf_default(&conf);
    conf.snapshot_every_memory = 1;
    static float params[N_PARAMS], momentum[N_PARAMS], buffers[N_BUFFERS];
    model_t model = {.n_params = N_PARAMS,
                     .n_buffers = N_BUFFERS,
                     .params = params,
                     .momentum = momentum,
                     .buffers = buffers,
                     .h = 8,
                     .w = 8,
                     .c = 1,
                     .classes = 10};
    snprintf(model.name, sizeof model.name, "mlp");
    optimizer_t optim = {.kind = OPTIM_SGD};
    data_splits_t data = {.train = {.n = 1000}};
    train_parts_t parts = {.conf = &conf,
                           .data = &data,
                           .backend = &backend,
                           .model = &model,
                           .optim = &optim,
                           .rank = 0,
                           .world = 1};
    static loss_scale_t scale = {.scale = 1024.0f, .good_steps = 7};
    train_state_t state = {.loss_scale = &scale}; /* fp16: its scale goes into the header */
    checkpoint_memory_t cm = {0};
    atomic_store(&may_copy, false);
    checkpoint_memory_init(&cm, &parts); /* the slots open on a thread of their own */
    for (int i = 0; i < N_PARAMS; i++)
        params[i] = 1.0f;
    state.step = 1;
    checkpoint_memory_take(&cm, &parts, &state); /* queued; its copies held back */
    cr_assert_not_null(cm.memory, "no memory snapshots in %s", dir);
    cr_assert_not(cm.is_opening);
    checkpoint_memory_fence(&cm, &parts);
    for (int i = 0; i < N_PARAMS; i++)
        params[i] = 2.0f; /* the optimizer of step 2 */
    scale = (loss_scale_t){.scale = 2048.0f, .good_steps = 0};
    state.step = 2;
    checkpoint_memory_take(&cm, &parts, &state); /* returns: step 1 is still on its way */
    cr_assert_eq(cm.n_taken, 1);
    cr_assert_eq(cm.n_skipped, 1, "step 2 was not skipped");
    cr_assert(memory_snapshot_is_sealing(cm.memory));
    atomic_store(&may_copy, true);
    memory_snapshot_flush(cm.memory);
    cr_assert_eq(memory_snapshot_sealed_step(cm.memory), 1);
    snapshot_data_t d;
    char path[4096];
    int64_t reached;
    cr_assert_eq(memory_snapshot_find_latest(dir, NULL, &d, path, sizeof path, &reached),
                 MEMORY_SNAPSHOT_OWN);
    cr_assert(d.header.step == 1 && reached == 2, "step %llu, reached %lld",
              (unsigned long long)d.header.step, (long long)reached);
    cr_assert_float_eq(d.params[0], 1.0f, 0, "step 1's parameters, not the later ones");
    cr_assert(d.header.loss_scale == 1024.0f && d.header.loss_scale_good_steps == 7,
              "step 1's loss scale, copied out with the state: %g, %u", d.header.loss_scale,
              d.header.loss_scale_good_steps);
    snapshot_data_free(&d);
    state.step = 3;
    checkpoint_memory_take(&cm, &parts, &state);
    memory_snapshot_flush(cm.memory);
    cr_assert_eq(cm.n_taken, 2);
    cr_assert_eq(memory_snapshot_sealed_step(cm.memory), 3);
    checkpoint_memory_free(&cm, &parts);
    cr_assert_eq(memory_snapshot_find_latest(dir, NULL, &d, path, sizeof path, &reached),
                 MEMORY_SNAPSHOT_OWN);
    cr_assert_eq(d.header.step, 3);
    cr_assert_eq(reached, 3);
    cr_assert_float_eq(d.params[0], 2.0f, 0);
    snapshot_data_free(&d);
    temp_dir_remove(dir);
}
