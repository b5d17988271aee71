/* memory_snapshot: generations alternate between the two slots and each reads back as a snapshot;
 * the newest that verifies wins; a torn copy (a section half overwritten, a header not yet
 * written) never hides the good generation; a corrupt one is reported; a peer's copy is found and
 * loses a tie to the node's own; the slots survive the writer (a new process keeps the newest);
 * the progress record; a slot whose sections do not verify, or sealed for another state, is
 * reused by the next writer, never the good one. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory_snapshot.h"
#include "temp_dir.h"

static char dir[256];

static void make_dir(void) {
    temp_dir_make(dir, sizeof dir, "test_memory_snapshot");
}

static void remove_dir(void) {
    temp_dir_remove(dir);
}

TestSuite(memory_snapshot, .init = make_dir, .fini = remove_dir, .timeout = 30);

#define N_PARAMS  1000
#define N_BUFFERS 10

static void fill(snapshot_data_t *d, int64_t step) {
    for (int i = 0; i < N_PARAMS; i++) {
        d->params[i] = (float)i * 0.5f + (float)step;
        d->momentum[i] = -(float)i - (float)step;
    }
    for (int i = 0; i < N_BUFFERS; i++)
        d->buffers[i] = (float)(i + step);
}

static void take(memory_snapshot_t *m, int64_t step) {
    snapshot_data_t *d = memory_snapshot_begin(m);
    fill(d, step);
    snapshot_header_t h = {0};
    h.step = (uint64_t)step;
    h.n_params = N_PARAMS;
    h.n_buffers = N_BUFFERS;
    h.world_size = 2;
    memory_snapshot_submit(m, &h);
    memory_snapshot_flush(m);
    memory_snapshot_mark_reached(m, step);
}

static memory_snapshot_t *open_slots(void) {
    memory_snapshot_t *m;
    char err[512];
    cr_assert_eq(memory_snapshot_create(dir, N_PARAMS, N_BUFFERS, false, NULL, &m, err, sizeof err),
                 0, "%s", err);
    return m;
}

static int64_t found_step(memory_snapshot_source_t *source, int64_t *reached) {
    snapshot_data_t d;
    char path[4096];
    int64_t r;
    *source = memory_snapshot_find_latest(dir, NULL, &d, path, sizeof path, reached ? reached : &r);
    if (*source == MEMORY_SNAPSHOT_NONE) return -1;
    cr_assert_float_eq(d.params[3], 1.5f + (float)d.header.step, 0);
    int64_t step = (int64_t)d.header.step;
    snapshot_data_free(&d);
    return step;
}

/* Bytes at offset of slot file name: overwritten with value. */
static void scribble(const char *name, long offset, int value, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY);
    cr_assert(fd >= 0);
    char buf[4096];
    memset(buf, value, n);
    cr_assert_eq(pwrite(fd, buf, n, offset), (ssize_t)n);
    close(fd);
}

/* The slot holding step (own-0 or own-1). */
static const char *slot_of(int64_t step) {
    static const char *names[2] = {"own-0.ddps", "own-1.ddps"};
    for (int i = 0; i < 2; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        snapshot_data_t d;
        char err[256];
        if (snapshot_read(path, &d, err, sizeof err) == 0) {
            int64_t s = (int64_t)d.header.step;
            snapshot_data_free(&d);
            if (s == step) return names[i];
        }
    }
    cr_assert_fail("no slot holds step %lld", (long long)step);
    return NULL;
}

Test(memory_snapshot, generations_alternate_and_the_newest_wins) {
    memory_snapshot_t *m = open_slots();
    cr_assert_eq(memory_snapshot_sealed_step(m), -1);
    for (int64_t s = 1; s <= 5; s++)
        take(m, s);
    cr_assert_eq(memory_snapshot_sealed_step(m), 5);
    memory_snapshot_source_t source;
    int64_t reached;
    cr_assert_eq(found_step(&source, &reached), 5);
    cr_assert_eq(source, MEMORY_SNAPSHOT_OWN);
    cr_assert_eq(reached, 5);
    cr_assert_neq(strcmp(slot_of(5), slot_of(4)), 0, "two generations share a slot");
    memory_snapshot_destroy(m);
}

Test(memory_snapshot, a_torn_newest_copy_falls_back_to_the_previous_generation) {
    memory_snapshot_t *m = open_slots();
    take(m, 7);
    take(m, 8);
    memory_snapshot_destroy(m);
    /* half of step 8's parameters overwritten, its header intact: as a copy cut short */
    scribble(slot_of(8), (long)sizeof(snapshot_header_t) + 100, 0x5a, 2000);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 7);
    /* a header not yet written (what begin leaves) is no generation either */
    scribble(slot_of(7), 0, 0, 16);
    cr_assert_eq(found_step(&source, NULL), -1);
    cr_assert_eq(source, MEMORY_SNAPSHOT_NONE);
}

Test(memory_snapshot, a_new_writer_keeps_the_newest_generation_and_overwrites_the_older) {
    memory_snapshot_t *m = open_slots();
    take(m, 3);
    take(m, 4);
    memory_snapshot_destroy(m);
    m = open_slots(); /* the restarted worker */
    cr_assert_eq(memory_snapshot_sealed_step(m), 4);
    const char *slot4 = slot_of(4);
    snapshot_data_t *d = memory_snapshot_begin(m); /* killed while copying step 5 */
    fill(d, 5);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 4);
    cr_assert_str_eq(slot_of(4), slot4);
    memory_snapshot_destroy(m);
}

/* A slot whose header verifies but whose sections do not (a stray write, a byte flipped) holds no
 * generation: a new writer reuses it rather than the good one. It used to take the header's word,
 * overwrite the older, good slot at every generation and leave the corrupt one as it was: one slot
 * in use, and a kill while its header was zeroed left no memory snapshot at all. */
Test(memory_snapshot, a_slot_with_corrupt_sections_is_reused_not_the_good_one) {
    memory_snapshot_t *m = open_slots();
    take(m, 3);
    take(m, 4);
    memory_snapshot_destroy(m);
    char bad[32], good[32];
    snprintf(bad, sizeof bad, "%s", slot_of(4));
    snprintf(good, sizeof good, "%s", slot_of(3));
    scribble(bad, 1000, 0x5a, 1); /* a parameter's byte, the header intact */
    m = open_slots();             /* the restarted worker */
    cr_assert_eq(memory_snapshot_sealed_step(m), 3, "the corrupt slot counted as step 4");
    snapshot_data_t *d = memory_snapshot_begin(m); /* killed while copying step 5 */
    fill(d, 5);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 3, "the good generation was overwritten");
    cr_assert_str_eq(slot_of(3), good);
    memory_snapshot_destroy(m);
    m = open_slots();
    take(m, 5);
    take(m, 6);
    memory_snapshot_destroy(m);
    cr_assert_neq(strcmp(slot_of(5), slot_of(6)), 0, "two generations share a slot");
}

/* Slots sealed for another state (the region outlived a run of another train.conf) are not this
 * state's generations: both are reused, never read past the resized mapping. */
Test(memory_snapshot, slots_of_another_state_size_hold_no_generation) {
    memory_snapshot_t *m;
    char err[512];
    cr_assert_eq(
        memory_snapshot_create(dir, 2 * N_PARAMS, N_BUFFERS, false, NULL, &m, err, sizeof err), 0,
        "%s", err);
    for (int64_t step = 100; step <= 101; step++) {
        snapshot_data_t *d = memory_snapshot_begin(m);
        memset(d->params, 0, 2 * N_PARAMS * sizeof(float));
        memset(d->momentum, 0, 2 * N_PARAMS * sizeof(float));
        memset(d->buffers, 0, N_BUFFERS * sizeof(float));
        snapshot_header_t h = {
            .step = (uint64_t)step, .n_params = 2 * N_PARAMS, .n_buffers = N_BUFFERS};
        memory_snapshot_submit(m, &h);
        memory_snapshot_flush(m);
    }
    memory_snapshot_destroy(m);
    m = open_slots(); /* half the parameters: the files shrink under the old headers */
    cr_assert_eq(memory_snapshot_sealed_step(m), -1);
    take(m, 1);
    take(m, 2);
    memory_snapshot_destroy(m);
    cr_assert_neq(strcmp(slot_of(1), slot_of(2)), 0, "two generations share a slot");
}

Test(memory_snapshot, a_peer_copy_is_found_and_the_own_one_wins_a_tie) {
    memory_snapshot_t *m = open_slots();
    take(m, 6);
    memory_snapshot_destroy(m);
    char from[512], to[512], cmd[1100];
    snprintf(from, sizeof from, "%s/%s", dir, slot_of(6));
    snprintf(to, sizeof to, "%s/peer-1-0.ddps", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
    cr_assert_eq(system(cmd), 0);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 6);
    cr_assert_eq(source, MEMORY_SNAPSHOT_OWN);
    unlink(from);
    cr_assert_eq(found_step(&source, NULL), 6);
    cr_assert_eq(source, MEMORY_SNAPSHOT_PEER);
}

Test(memory_snapshot, no_directory_is_no_snapshot) {
    snapshot_data_t d;
    char path[64];
    int64_t reached;
    cr_assert_eq(
        memory_snapshot_find_latest("/nonexistent/dir", NULL, &d, path, sizeof path, &reached),
        MEMORY_SNAPSHOT_NONE);
    cr_assert_eq(reached, -1);
}

Test(memory_snapshot, the_progress_record_alone_counts_steps_without_slots) {
    memory_snapshot_t *m;
    char err[512];
    cr_assert_eq(memory_snapshot_create_progress(dir, &m, err, sizeof err), 0, "%s", err);
    memory_snapshot_mark_reached(m, 41);
    cr_assert_eq(memory_snapshot_sealed_step(m), -1);
    memory_snapshot_destroy(m);
    memory_snapshot_source_t source;
    int64_t reached;
    cr_assert_eq(found_step(&source, &reached), -1);
    cr_assert_eq(reached, 41);
    /* a peer's word on how far its node got counts too: the newest wins */
    char path[512];
    snprintf(path, sizeof path, "%s/peer-1-progress", dir);
    FILE *f = fopen(path, "wb");
    uint64_t v[2] = {57, ~(uint64_t)57};
    fwrite(v, sizeof v, 1, f);
    fclose(f);
    cr_assert_eq(found_step(&source, &reached), -1);
    cr_assert_eq(reached, 57);
}

/* The cpu backend's hand-off: the copies land before the seal and before wait_copied returns,
 * whether the writer's thread makes them (inline_bytes 0) or the submitting call (a small state).
 */
static void copies_land_before_the_seal(size_t inline_bytes) {
    memory_snapshot_t *m = open_slots();
    memory_snapshot_set_inline_bytes(m, inline_bytes);
    static float params[N_PARAMS], momentum[N_PARAMS];
    for (int i = 0; i < N_PARAMS; i++) {
        params[i] = (float)i * 0.5f + 9.0f; /* fill()'s values for step 9 */
        momentum[i] = -(float)i - 9.0f;
    }
    snapshot_data_t *d = memory_snapshot_begin(m);
    for (int i = 0; i < N_BUFFERS; i++)
        d->buffers[i] = (float)(i + 9);
    snapshot_header_t h = {.step = 9, .n_params = N_PARAMS, .n_buffers = N_BUFFERS};
    memory_snapshot_copy_t copies[2] = {{d->params, params, sizeof params},
                                        {d->momentum, momentum, sizeof momentum}};
    memory_snapshot_submit_copies(m, &h, copies, 2);
    memory_snapshot_wait_copied(m);
    params[3] = -1; /* the sources may change now: the copy is made */
    memory_snapshot_flush(m);
    memory_snapshot_destroy(m);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 9); /* checks params[3] == 1.5 + 9 */
}

Test(memory_snapshot, copies_handed_to_the_writer_land_before_the_seal) {
    copies_land_before_the_seal(0);
}

Test(memory_snapshot, copies_of_a_small_state_are_made_in_the_call) {
    copies_land_before_the_seal(SIZE_MAX);
}

/* A state of several hash chunks (128 KiB each, the last one partial), copied and hashed in one
 * pass: the checksums a reader computes over each whole section match, on either thread, and a
 * copy that does not fill a whole section is made too. */
static void a_large_state_verifies(size_t inline_bytes) {
    enum { N = 100003, NB = 77 };
    memory_snapshot_t *m;
    char err[512];
    cr_assert_eq(memory_snapshot_create(dir, N, NB, true, NULL, &m, err, sizeof err), 0, "%s", err);
    memory_snapshot_set_inline_bytes(m, inline_bytes);
    static float params[N], momentum[N], second[N];
    for (int i = 0; i < N; i++) {
        params[i] = (float)i * 0.25f;
        momentum[i] = (float)i * -0.5f;
        second[i] = (float)(i % 977);
    }
    snapshot_data_t *d = memory_snapshot_begin(m);
    snapshot_header_t h = {.step = 12, .n_params = N, .n_buffers = NB, .optimizer = 1};
    h.optim_steps = 12;
    memory_snapshot_copy_t copies[4] = {
        {d->params, params, sizeof params},
        {d->momentum, momentum, sizeof momentum},
        {d->second_moment, second, N / 2 * sizeof(float)},
        {d->second_moment + N / 2, second + N / 2, (N - N / 2) * sizeof(float)}};
    for (int i = 0; i < NB; i++)
        d->buffers[i] = (float)i;
    memory_snapshot_submit_copies(m, &h, copies, 4);
    memory_snapshot_flush(m);
    memory_snapshot_destroy(m);
    snapshot_data_t r;
    char path[4096];
    int64_t reached;
    cr_assert_eq(memory_snapshot_find_latest(dir, stderr, &r, path, sizeof path, &reached),
                 MEMORY_SNAPSHOT_OWN);
    cr_assert_eq(r.header.step, 12);
    cr_assert_eq(memcmp(r.params, params, sizeof params), 0);
    cr_assert_eq(memcmp(r.momentum, momentum, sizeof momentum), 0);
    cr_assert_eq(memcmp(r.second_moment, second, sizeof second), 0);
    cr_assert_float_eq(r.buffers[NB - 1], (float)(NB - 1), 0);
    snapshot_data_free(&r);
}

Test(memory_snapshot, a_large_state_hashed_as_it_is_copied_verifies_on_the_writers_thread) {
    a_large_state_verifies(0);
}

Test(memory_snapshot, a_large_state_hashed_as_it_is_copied_verifies_in_the_call) {
    a_large_state_verifies(SIZE_MAX);
}

/* A diverged step (a NaN or an inf in the parameters or the optimizer's state) is never sealed:
 * the generation before stays the newest to resume, and training on to a finite state seals
 * again; an overflowed batch-norm statistic alone does not stop the sealing. */
static void a_non_finite_state_is_not_sealed(size_t inline_bytes) {
    memory_snapshot_t *m = open_slots();
    memory_snapshot_set_inline_bytes(m, inline_bytes);
    take(m, 3);
    for (int64_t step = 4; step <= 5; step++) {
        snapshot_data_t *d = memory_snapshot_begin(m);
        fill(d, step);
        if (step == 4)
            d->momentum[N_PARAMS - 1] = NAN;
        else
            d->params[0] = -INFINITY;
        snapshot_header_t h = {
            .step = (uint64_t)step, .n_params = N_PARAMS, .n_buffers = N_BUFFERS};
        memory_snapshot_submit(m, &h);
        memory_snapshot_flush(m);
        cr_assert_eq(memory_snapshot_sealed_step(m), 3);
        memory_snapshot_source_t source;
        cr_assert_eq(found_step(&source, NULL), 3);
    }
    take(m, 6);
    cr_assert_eq(memory_snapshot_sealed_step(m), 6);
    /* a running variance overflowed while training goes on: sealed (the disk path takes it too) */
    snapshot_data_t *d = memory_snapshot_begin(m);
    fill(d, 7);
    d->buffers[1] = INFINITY;
    snapshot_header_t h = {.step = 7, .n_params = N_PARAMS, .n_buffers = N_BUFFERS};
    memory_snapshot_submit(m, &h);
    memory_snapshot_flush(m);
    cr_assert_eq(memory_snapshot_sealed_step(m), 7);
    memory_snapshot_destroy(m);
    memory_snapshot_source_t source;
    cr_assert_eq(found_step(&source, NULL), 7);
    cr_assert_neq(strcmp(slot_of(7), slot_of(6)), 0);
}

Test(memory_snapshot, a_non_finite_state_is_not_sealed_on_the_writers_thread) {
    a_non_finite_state_is_not_sealed(0);
}

Test(memory_snapshot, a_non_finite_state_is_not_sealed_in_the_call) {
    a_non_finite_state_is_not_sealed(SIZE_MAX);
}

/* A /dev/shm too small for the slots (Docker's default is 64 MiB; a ResNet-18's slot is 94 MB): a
 * clear error at the start, not a SIGBUS at the first snapshot's write into a page the full tmpfs
 * cannot supply (a sized tmpfs file is sparse). A private 1 MiB tmpfs, in a mount namespace of
 * this test's process (root only). */
Test(memory_snapshot, slots_too_big_for_the_tmpfs_are_an_error_not_a_sigbus) {
    if (geteuid() != 0) cr_skip_test("needs root for a tmpfs of its own");
    cr_assert_eq(unshare(CLONE_NEWNS), 0, "unshare: %s", strerror(errno));
    cr_assert_eq(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL), 0, "%s", strerror(errno));
    cr_assert_eq(mount("tmpfs", dir, "tmpfs", 0, "size=1m"), 0, "mount: %s", strerror(errno));
    enum { N = 1 << 20 }; /* 4 MiB of parameters, twice (momentum), in each of two slots */
    memory_snapshot_t *m = NULL;
    char err[512] = "";
    int rc = memory_snapshot_create(dir, N, 16, false, NULL, &m, err, sizeof err);
    if (rc == 0) { /* before the fix: sized and mapped, then a SIGBUS here */
        snapshot_data_t *d = memory_snapshot_begin(m);
        memset(d->params, 1, (size_t)N * sizeof(float));
    }
    cr_assert_lt(rc, 0, "a 1 MiB tmpfs took 16 MiB of slots");
    cr_assert(strstr(err, "No space left on device") && strstr(err, dir), "%s", err);
    umount2(dir, MNT_DETACH);
}

/* A GPU's copies still on their way (the wait callback holds the writer's thread): the generation
 * is sealing until they land, then sealed; a trainer that must not wait sees it and skips. */
static atomic_bool copies_landed;

static void wait_for_copies(void *arg, snapshot_header_t *h) {
    (void)arg, (void)h;
    while (!atomic_load(&copies_landed))
        usleep(1000);
}

Test(memory_snapshot, a_generation_is_sealing_until_its_copies_land) {
    memory_snapshot_t *m;
    char err[512];
    memory_snapshot_wait_t wait = {.cb = wait_for_copies};
    cr_assert_eq(
        memory_snapshot_create(dir, N_PARAMS, N_BUFFERS, false, &wait, &m, err, sizeof err), 0,
        "%s", err);
    atomic_store(&copies_landed, false);
    cr_assert_not(memory_snapshot_is_sealing(m));
    snapshot_data_t *d = memory_snapshot_begin(m);
    fill(d, 7);
    snapshot_header_t h = {
        .step = 7, .n_params = N_PARAMS, .n_buffers = N_BUFFERS, .world_size = 2};
    memory_snapshot_submit(m, &h);
    usleep(20000);
    cr_assert(memory_snapshot_is_sealing(m), "sealed before its copies landed");
    cr_assert_eq(memory_snapshot_sealed_step(m), -1);
    atomic_store(&copies_landed, true);
    memory_snapshot_flush(m);
    cr_assert_not(memory_snapshot_is_sealing(m));
    cr_assert_eq(memory_snapshot_sealed_step(m), 7);
    memory_snapshot_destroy(m);
}
