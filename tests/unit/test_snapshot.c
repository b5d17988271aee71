/* snapshot: round trip, verification of every kind of damage (magic, header, sections, torn
 * files), newest-good selection with reports, retention (keep N, keep every Mth; only snapshots a
 * resume could use count, and what is no snapshot of the run is left alone), the manifest, the
 * writer thread (including a failed write reported on the next acquire), and Adam's state (the
 * second-moment section and the step count). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "snapshot.h"
#include "temp_dir.h"

static char dir[256];

static void make_dir(void) {
    temp_dir_make(dir, sizeof dir, "test_snapshot");
}

static void remove_dir(void) {
    temp_dir_remove(dir);
}

TestSuite(snapshot, .init = make_dir, .fini = remove_dir, .timeout = 30);

#define N_PARAMS  1000
#define N_BUFFERS 10

static float params[N_PARAMS], momentum[N_PARAMS], buffers[N_BUFFERS];

static snapshot_data_t sample(uint64_t step) {
    for (int i = 0; i < N_PARAMS; i++) {
        params[i] = (float)i * 0.5f + (float)step;
        momentum[i] = -(float)i;
    }
    for (int i = 0; i < N_BUFFERS; i++)
        buffers[i] = (float)i;
    snapshot_data_t d = {.params = params, .momentum = momentum, .buffers = buffers};
    d.header.step = step;
    d.header.epoch = 2;
    d.header.cursor = 640;
    d.header.world_size = 4;
    d.header.n_params = N_PARAMS;
    d.header.n_buffers = N_BUFFERS;
    snprintf(d.header.model, sizeof d.header.model, "cnn");
    return d;
}

static void write_step(uint64_t step, const snapshot_retention_t *keep) {
    snapshot_data_t d = sample(step);
    char err[1024];
    cr_assert_eq(snapshot_write(dir, &d, keep, NULL, err, sizeof err), 0, "%s", err);
}

static const snapshot_retention_t keep_all = {.keep = 100};

static void path_of(uint64_t step, char *out, size_t len) {
    snprintf(out, len, "%s/snapshot-%012llu.ddps", dir, (unsigned long long)step);
}

static void damage(const char *path, long offset, int mode /* 0 flip, 1 truncate */) {
    if (mode == 1) {
        cr_assert_eq(truncate(path, offset), 0);
        return;
    }
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    fseek(f, offset, SEEK_SET);
    int c = fgetc(f);
    fseek(f, offset, SEEK_SET);
    fputc(c ^ 1, f);
    fclose(f);
}

Test(snapshot, round_trip_keeps_every_field_and_value) {
    write_step(7, &keep_all);
    char path[512], err[1024];
    path_of(7, path, sizeof path);
    snapshot_data_t d;
    cr_assert_eq(snapshot_read(path, &d, err, sizeof err), 0, "%s", err);
    cr_assert_eq(d.header.step, 7);
    cr_assert_eq(d.header.epoch, 2);
    cr_assert_eq(d.header.cursor, 640);
    cr_assert_eq(d.header.world_size, 4);
    cr_assert_str_eq(d.header.model, "cnn");
    snapshot_data_t want = sample(7);
    cr_assert_eq(memcmp(d.params, params, sizeof params), 0);
    cr_assert_eq(memcmp(d.momentum, momentum, sizeof momentum), 0);
    cr_assert_eq(memcmp(d.buffers, buffers, sizeof buffers), 0);
    want.header = d.header;
    cr_assert_eq(snapshot_state_hash(&d), snapshot_state_hash(&want));
    snapshot_data_free(&d);
    char manifest[512];
    snprintf(manifest, sizeof manifest, "%s/latest", dir);
    FILE *f = fopen(manifest, "r");
    cr_assert_not_null(f);
    char line[128] = "";
    cr_assert_not_null(fgets(line, sizeof line, f));
    fclose(f);
    cr_assert_str_eq(line, "snapshot-000000000007.ddps\n");
}

static void expect_damaged(long offset, int mode, const char *needle) {
    write_step(3, &keep_all);
    char path[512], err[1024];
    path_of(3, path, sizeof path);
    damage(path, offset, mode);
    snapshot_data_t d;
    cr_assert_eq(snapshot_read(path, &d, err, sizeof err), -1, "damage at %ld not found", offset);
    cr_assert(strstr(err, path) && strstr(err, needle), "'%s' should name the file and '%s'", err,
              needle);
}

Test(snapshot, bad_magic_is_not_a_snapshot) {
    expect_damaged(0, 0, "not a ddpworker snapshot");
}
Test(snapshot, a_flipped_header_byte_fails_its_checksum) {
    expect_damaged(40, 0, "header checksum");
}
Test(snapshot, a_flipped_param_fails_the_section_checksum) {
    expect_damaged((long)sizeof(snapshot_header_t) + 100, 0, "section params checksum mismatch");
}
Test(snapshot, a_flipped_buffer_fails_the_section_checksum) {
    expect_damaged((long)sizeof(snapshot_header_t) + 2 * N_PARAMS * 4 + 3, 0, "section buffers");
}
Test(snapshot, a_torn_file_is_truncated) {
    expect_damaged((long)sizeof(snapshot_header_t) + 10, 1, "truncated");
}
Test(snapshot, a_file_shorter_than_the_header_is_torn) {
    expect_damaged(10, 1, "shorter than");
}

/* A header whose checksum holds but whose loss scale no run could have written. */
Test(snapshot, an_impossible_loss_scale_is_refused_as_corrupt) {
    double bad[] = {INFINITY, NAN, -1.0, 1e39};
    for (int i = 0; i < 4; i++) {
        snapshot_data_t d = sample(5);
        d.header.loss_scale = bad[i];
        char err[1024], path[512];
        cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
        path_of(5, path, sizeof path);
        snapshot_data_t got;
        cr_assert_eq(snapshot_read(path, &got, err, sizeof err), -1, "scale %g accepted", bad[i]);
        cr_assert(strstr(err, path) && strstr(err, "loss scale"), "%s", err);
    }
    snapshot_data_t d = sample(5);
    d.header.loss_scale = 32768.0;
    d.header.loss_scale_good_steps = 17;
    char err[1024], path[512];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
    path_of(5, path, sizeof path);
    snapshot_data_t got;
    cr_assert_eq(snapshot_read(path, &got, err, sizeof err), 0, "%s", err);
    cr_assert_eq(got.header.loss_scale, 32768.0);
    cr_assert_eq(got.header.loss_scale_good_steps, 17);
    snapshot_data_free(&got);
}

Test(snapshot, the_newest_good_snapshot_wins_and_damaged_ones_are_reported) {
    for (uint64_t s = 10; s <= 30; s += 10)
        write_step(s, &keep_all);
    char p30[512], p20[512];
    path_of(30, p30, sizeof p30);
    path_of(20, p20, sizeof p20);
    damage(p30, (long)sizeof(snapshot_header_t) + 5, 0);
    damage(p20, 100, 1);
    char report_buf[4096] = "", found[512], err[1024];
    FILE *report = fmemopen(report_buf, sizeof report_buf, "w");
    snapshot_data_t d;
    cr_assert_eq(snapshot_find_latest(dir, report, &d, found, sizeof found, err, sizeof err), 1);
    fclose(report);
    cr_assert_eq(d.header.step, 10);
    cr_assert(strstr(found, "snapshot-000000000010.ddps"), "%s", found);
    cr_assert(strstr(report_buf, p30) && strstr(report_buf, p20), "report: %s", report_buf);
    snapshot_data_free(&d);
}

/* A snapshot the file system refuses to give (here: no permission, for a user other than its
 * owner; likewise no descriptor left, no memory, an I/O error) is skipped, but not moved aside as
 * damaged: nothing is known of its bytes, and the next resume may read it. */
Test(snapshot, a_snapshot_that_cannot_be_opened_is_skipped_not_moved_aside) {
    if (geteuid() != 0) cr_skip_test("needs root to become another user");
    write_step(10, &keep_all);
    write_step(20, &keep_all);
    char p20[512];
    path_of(20, p20, sizeof p20);
    cr_assert_eq(chmod(dir, 0777), 0);
    cr_assert_eq(chmod(p20, 0), 0);
    pid_t pid = fork();
    if (pid == 0) { /* nobody: neither the file's owner nor able to override its mode */
        if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
        char found[512], err[1024], report_buf[4096] = "";
        FILE *report = fmemopen(report_buf, sizeof report_buf, "w");
        snapshot_data_t d;
        int rc = snapshot_find_latest(dir, report, &d, found, sizeof found, err, sizeof err);
        fclose(report);
        _exit(rc == 1 && d.header.step == 10 && strstr(report_buf, "Permission denied") &&
                      strstr(report_buf, "left in place")
                  ? 0
                  : 3);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d", status);
    struct stat st;
    cr_assert_eq(stat(p20, &st), 0, "the unreadable snapshot was moved aside");
    chmod(p20, 0600);
}

Test(snapshot, no_directory_and_no_snapshot_mean_a_fresh_start) {
    char missing[300], found[512], err[1024];
    snprintf(missing, sizeof missing, "%s/nope", dir);
    snapshot_data_t d;
    cr_assert_eq(snapshot_find_latest(missing, NULL, &d, found, sizeof found, err, sizeof err), 0);
    cr_assert_eq(snapshot_find_latest(dir, NULL, &d, found, sizeof found, err, sizeof err), 0);
}

Test(snapshot, retention_keeps_the_newest_and_every_mth) {
    snapshot_retention_t keep = {.keep = 2, .keep_every = 10};
    for (uint64_t s = 5; s <= 35; s += 5)
        write_step(s, &keep);
    /* newest two: 35, 30; multiples of 10: 10, 20, 30 */
    uint64_t expect_present[] = {10, 20, 30, 35}, expect_gone[] = {5, 15, 25};
    char path[512];
    for (size_t i = 0; i < 4; i++) {
        path_of(expect_present[i], path, sizeof path);
        cr_assert_eq(access(path, F_OK), 0, "step %llu was pruned",
                     (unsigned long long)expect_present[i]);
    }
    for (size_t i = 0; i < 3; i++) {
        path_of(expect_gone[i], path, sizeof path);
        cr_assert_neq(access(path, F_OK), 0, "step %llu was kept",
                      (unsigned long long)expect_gone[i]);
    }
}

static bool exists(uint64_t step) {
    char path[512];
    path_of(step, path, sizeof path);
    struct stat st;
    return lstat(path, &st) == 0;
}

static void make_fifo(uint64_t step) {
    char path[512];
    path_of(step, path, sizeof path);
    cr_assert_eq(mkfifo(path, 0644), 0, "mkfifo %s", path);
}

/* A FIFO named like a snapshot of a later step (the resume skips it and leaves it): with keep = 1
 * it must not outrank every snapshot the run writes, each unlinked right after being written. */
Test(snapshot, retention_never_deletes_what_it_just_wrote_for_a_fifo_of_a_later_step) {
    make_fifo(999999);
    snapshot_retention_t keep = {.keep = 1};
    for (uint64_t s = 1; s <= 3; s++) {
        write_step(s, &keep);
        cr_assert(exists(s), "step %llu was unlinked right after being written",
                  (unsigned long long)s);
    }
    cr_assert(!exists(1) && !exists(2), "keep = 1 kept older snapshots");
    cr_assert(exists(999999), "the FIFO is not ours: left alone");
    char found[512], err[1024];
    snapshot_data_t d;
    cr_assert_eq(snapshot_find_latest(dir, NULL, &d, found, sizeof found, err, sizeof err), 1);
    cr_assert_eq(d.header.step, 3);
    snapshot_data_free(&d);
}

/* Only snapshots a resume could use count toward keep: a FIFO, a file of another kind, anything
 * past the step just written stay and count for nothing; older regular files beyond the window go
 * as before, a FIFO never. */
Test(snapshot, retention_counts_only_the_snapshots_a_resume_could_use) {
    snapshot_retention_t keep = {.keep = 2};
    write_step(10, &keep);
    write_step(20, &keep);
    make_fifo(25);
    char path[512];
    path_of(27, path, sizeof path);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("not a snapshot", f);
    fclose(f);
    write_step(30, &keep);
    cr_assert(exists(30) && exists(20), "the two newest good snapshots were not both kept");
    cr_assert(exists(25) && exists(27),
              "files that are no snapshot were removed inside the window");
    cr_assert(!exists(10), "step 10 is a third good snapshot: pruned");
    write_step(40, &keep);
    cr_assert(exists(40) && exists(30) && !exists(20), "keep 2: 40 and 30");
    cr_assert(!exists(27), "a regular file older than the kept ones goes as before");
    cr_assert(exists(25), "a FIFO is never removed");
}

/* A symbolic link named like a snapshot (to a good one elsewhere) is not a file the writer made:
 * retention neither counts it (in place of a snapshot of the run) nor removes it. */
Test(snapshot, retention_leaves_a_link_named_like_a_snapshot_alone) {
    write_step(3, &keep_all);
    char p3[512], target[512], link5[512], link15[512];
    path_of(3, p3, sizeof p3);
    snprintf(target, sizeof target, "%s/elsewhere.ddps", dir);
    cr_assert_eq(rename(p3, target), 0);
    path_of(5, link5, sizeof link5);
    path_of(15, link15, sizeof link15);
    cr_assert_eq(symlink(target, link5), 0);
    cr_assert_eq(symlink(target, link15), 0);
    snapshot_retention_t keep = {.keep = 2};
    write_step(10, &keep);
    write_step(20, &keep);
    cr_assert(exists(20) && exists(10), "keep 2: the run's two, the link between them not counted");
    cr_assert(exists(5) && exists(15), "a link is not the writer's to remove");
}

/* A snapshot the file system does not let this run read (here: another user's, mode 0; likewise
 * EIO) is neither counted toward keep nor allowed to outrank the snapshot just written. */
Test(snapshot, retention_does_not_count_a_snapshot_it_cannot_read) {
    if (geteuid() != 0) cr_skip_test("needs root to become another user");
    write_step(999, &keep_all);
    char p999[512];
    path_of(999, p999, sizeof p999);
    cr_assert_eq(chmod(dir, 0777), 0);
    cr_assert_eq(chmod(p999, 0), 0);
    pid_t pid = fork();
    if (pid == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
        snapshot_retention_t keep = {.keep = 1};
        for (uint64_t s = 1; s <= 2; s++) {
            snapshot_data_t d = sample(s);
            char err[1024];
            if (snapshot_write(dir, &d, &keep, NULL, err, sizeof err) != 0) _exit(3);
        }
        _exit(exists(2) && !exists(1) ? 0 : 4);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d", status);
    cr_assert(exists(999), "the unreadable snapshot stays: nothing is known of its bytes");
}

/* The writer's buffers filled with sample(step), handed to its thread. */
static void submit_sample(snapshot_writer_t *w, uint64_t step) {
    snapshot_data_t *buf;
    char err[1024];
    cr_assert_eq(snapshot_writer_acquire(w, &buf, err, sizeof err), 0, "%s", err);
    snapshot_data_t s = sample(step);
    buf->header = s.header;
    memcpy(buf->params, params, sizeof params);
    memcpy(buf->momentum, momentum, sizeof momentum);
    memcpy(buf->buffers, buffers, sizeof buffers);
    snapshot_writer_submit(w);
}

Test(snapshot, the_writer_thread_writes_and_reports_a_failure_once) {
    snapshot_writer_t *w;
    char err[1024], sub[300];
    snprintf(sub, sizeof sub, "%s/a/b", dir);
    snapshot_retention_t keep = {.keep = 3};
    cr_assert_eq(
        snapshot_writer_create(sub, N_PARAMS, N_BUFFERS, false, &keep, &w, err, sizeof err), 0,
        "%s", err);
    submit_sample(w, 4);
    cr_assert_eq(snapshot_writer_flush(w, err, sizeof err), 0, "%s", err);
    cr_assert(strstr(snapshot_writer_last_path(w), "snapshot-000000000004.ddps"));
    /* the directory disappears: the next write fails, and the failure comes back once */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", sub);
    cr_assert_eq(system(cmd), 0);
    snapshot_data_t *buf;
    cr_assert_eq(snapshot_writer_acquire(w, &buf, err, sizeof err), 0);
    buf->header.step = 8;
    snapshot_writer_submit(w);
    cr_assert_eq(snapshot_writer_acquire(w, &buf, err, sizeof err), -1);
    cr_assert(strstr(err, "cannot create") && strstr(err, sub), "%s", err);
    cr_assert_eq(snapshot_writer_flush(w, err, sizeof err), 0, "reported once");
    snapshot_writer_destroy(w);
}

Test(snapshot, inspect_prints_the_header_and_the_state_hash) {
    write_step(12, &keep_all);
    char path[512], out[4096] = "";
    path_of(12, path, sizeof path);
    FILE *f = fmemopen(out, sizeof out, "w");
    cr_assert_eq(snapshot_inspect(path, f), 0);
    fclose(f);
    cr_assert(strstr(out, "step:        12 (next to run)") && strstr(out, "checksums:   ok") &&
                  strstr(out, "state hash:  "),
              "%s", out);
    damage(path, (long)sizeof(snapshot_header_t) + 1, 0);
    f = fmemopen(out, sizeof out, "w");
    cr_assert_eq(snapshot_inspect(path, f), -1);
    fclose(f);
    cr_assert(strstr(out, "does not verify"), "%s", out);
}

static float second_moment[N_PARAMS];

static snapshot_data_t adam_sample(uint64_t step, uint32_t optimizer, uint64_t optim_steps) {
    snapshot_data_t d = sample(step);
    for (int i = 0; i < N_PARAMS; i++)
        second_moment[i] = (float)i * 1e-3f;
    d.second_moment = second_moment;
    d.header.optimizer = optimizer;
    d.header.optim_steps = optim_steps;
    return d;
}

Test(snapshot, adam_state_round_trips_and_counts_in_the_state_hash) {
    snapshot_data_t d = adam_sample(9, SNAPSHOT_OPTIM_ADAMW, 6);
    char err[1024], path[512];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
    path_of(9, path, sizeof path);
    snapshot_data_t got;
    cr_assert_eq(snapshot_read(path, &got, err, sizeof err), 0, "%s", err);
    cr_assert_eq(got.header.n_sections, 4);
    cr_assert_eq(got.header.optimizer, SNAPSHOT_OPTIM_ADAMW);
    cr_assert_eq(got.header.optim_steps, 6);
    cr_assert_not_null(got.second_moment);
    cr_assert_eq(memcmp(got.second_moment, second_moment, sizeof second_moment), 0);
    cr_assert_eq(memcmp(got.momentum, momentum, sizeof momentum), 0);
    uint64_t hash = snapshot_state_hash(&got);
    got.header.optim_steps = 5;
    cr_assert_neq(snapshot_state_hash(&got), hash, "the step count is state");
    got.header.optim_steps = 6;
    got.second_moment[3] += 1.0f;
    cr_assert_neq(snapshot_state_hash(&got), hash, "so is the second moment");
    snapshot_data_free(&got);
    char out[4096] = "";
    FILE *f = fmemopen(out, sizeof out, "w");
    cr_assert_eq(snapshot_inspect(path, f), 0);
    fclose(f);
    cr_assert(strstr(out, "optimizer:   adamw lr 0 weight decay 0, 6 steps taken") &&
                  strstr(out, "second_moment"),
              "%s", out);
    /* an sgd snapshot has no such section, and reads without one */
    write_step(10, &keep_all);
    path_of(10, path, sizeof path);
    cr_assert_eq(snapshot_read(path, &got, err, sizeof err), 0, "%s", err);
    cr_assert(got.header.n_sections == 3 && got.second_moment == NULL);
    snapshot_data_free(&got);
}

Test(snapshot, a_flipped_second_moment_fails_its_checksum) {
    snapshot_data_t d = adam_sample(3, SNAPSHOT_OPTIM_ADAM, 3);
    char err[1024], path[512];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
    path_of(3, path, sizeof path);
    damage(path, (long)sizeof(snapshot_header_t) + 2 * N_PARAMS * 4 + N_BUFFERS * 4 + 17, 0);
    snapshot_data_t got;
    cr_assert_eq(snapshot_read(path, &got, err, sizeof err), -1);
    cr_assert(strstr(err, "section second_moment checksum mismatch"), "%s", err);
}

/* Headers whose checksums hold but that no run could have written. */
Test(snapshot, impossible_optimizer_state_is_refused_as_corrupt) {
    struct {
        uint32_t optimizer;
        uint64_t optim_steps;
        const char *needle;
    } cases[] = {{7, 0, "unknown optimizer 7"},
                 {SNAPSHOT_OPTIM_ADAM, 12, "12 optimizer steps at step 11"},
                 {SNAPSHOT_OPTIM_SGD, 4, "4 optimizer steps at step 11"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snapshot_data_t d = adam_sample(11, cases[i].optimizer, cases[i].optim_steps);
        char err[1024], path[512];
        cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
        path_of(11, path, sizeof path);
        snapshot_data_t got;
        cr_assert_eq(snapshot_read(path, &got, err, sizeof err), -1, "case %zu accepted", i);
        cr_assert(strstr(err, path) && strstr(err, cases[i].needle), "%s", err);
    }
    snapshot_data_t d = adam_sample(11, SNAPSHOT_OPTIM_ADAM, 0);
    d.second_moment = NULL;
    char err[1024];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), -1);
    cr_assert(strstr(err, "needs the second moment"), "%s", err);
}

Test(snapshot, the_writer_keeps_a_second_moment_buffer_when_asked) {
    snapshot_writer_t *w;
    char err[1024];
    snapshot_retention_t keep = {.keep = 3};
    cr_assert_eq(snapshot_writer_create(dir, N_PARAMS, N_BUFFERS, true, &keep, &w, err, sizeof err),
                 0, "%s", err);
    snapshot_data_t *buf;
    cr_assert_eq(snapshot_writer_acquire(w, &buf, err, sizeof err), 0);
    cr_assert_not_null(buf->second_moment);
    snapshot_data_t s = adam_sample(4, SNAPSHOT_OPTIM_ADAM, 2);
    buf->header = s.header;
    memcpy(buf->params, params, sizeof params);
    memcpy(buf->momentum, momentum, sizeof momentum);
    memcpy(buf->buffers, buffers, sizeof buffers);
    memcpy(buf->second_moment, second_moment, sizeof second_moment);
    snapshot_writer_submit(w);
    cr_assert_eq(snapshot_writer_flush(w, err, sizeof err), 0, "%s", err);
    snapshot_data_t got;
    cr_assert_eq(snapshot_read(snapshot_writer_last_path(w), &got, err, sizeof err), 0, "%s", err);
    cr_assert_eq(memcmp(got.second_moment, second_moment, sizeof second_moment), 0);
    snapshot_data_free(&got);
    snapshot_writer_destroy(w);
}

static void count_chunk(void *arg) {
    (*(int *)arg)++;
}

Test(snapshot, a_large_write_reports_progress_chunk_by_chunk) {
    /* 3 x 4M floats = 48 MB: at least one progress report per 4 MiB on disk, so ddprun's
     * --hang-timeout sees a slow but moving write as progress */
    size_t n = (size_t)4 << 20;
    snapshot_data_t d = sample(7);
    d.params = calloc(n, sizeof(float));
    d.momentum = calloc(n, sizeof(float));
    cr_assert(d.params && d.momentum);
    d.header.n_params = n;
    int chunks = 0;
    snapshot_progress_t progress = {.cb = count_chunk, .arg = &chunks};
    char err[1024];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, &progress, err, sizeof err), 0, "%s", err);
    cr_assert_geq(chunks, 8, "%d progress reports for 32 MiB", chunks);
    free(d.params);
    free(d.momentum);
}

/* Files written by the ddpworker of each older version (the fuzz corpus of their day): they read
 * as this version's header, lacking only what their version did not record. */
Test(snapshot, versions_1_and_2_still_read) {
    snapshot_data_t d;
    char err[1024];
    cr_assert_eq(
        snapshot_read(DDP_SOURCE_DIR "/tests/unit/data/snapshot_v1.ddps", &d, err, sizeof err), 0,
        "%s", err);
    const snapshot_header_t *h = &d.header;
    cr_assert(h->version == 1 && h->step == 1 && h->cursor == 4 && h->train_samples == 8);
    cr_assert(strcmp(h->model, "mlp") == 0 && h->width == 2 && h->n_params == 22 &&
              h->n_buffers == 0);
    cr_assert(h->lr == 0.1 && h->momentum == 0.9 && h->loss_scale == 1.0,
              "the tail moved into place");
    cr_assert(h->optimizer == SNAPSHOT_OPTIM_SGD && h->optim_steps == 0 && d.second_moment == NULL);
    cr_assert(isnan(h->best_value) && h->best_by == 0 && h->elapsed_s == 0,
              "no run state recorded");
    cr_assert(h->n_sections == 3 && h->sections[0].offset == 464, "sections stay where they were");
    snapshot_data_free(&d);
    cr_assert_eq(
        snapshot_read(DDP_SOURCE_DIR "/tests/unit/data/snapshot_v2_adam.ddps", &d, err, sizeof err),
        0, "%s", err);
    cr_assert(h->version == 2 && h->step == 4 && h->n_params == 20 && h->n_buffers == 4);
    cr_assert(h->optimizer == SNAPSHOT_OPTIM_ADAM && h->optim_steps == 3 &&
              d.second_moment != NULL);
    cr_assert(isnan(h->best_value) && h->elapsed_s == 0 && h->loss_scale == 0);
    snapshot_data_free(&d);
}

Test(snapshot, an_old_header_with_a_flipped_byte_fails_its_checksum) {
    char path[512], cmd[1200], err[1024];
    snprintf(path, sizeof path, "%s/old.ddps", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", DDP_SOURCE_DIR "/tests/unit/data/snapshot_v1.ddps",
             path);
    cr_assert_eq(system(cmd), 0);
    damage(path, 300, 0);
    snapshot_data_t d;
    cr_assert_eq(snapshot_read(path, &d, err, sizeof err), -1);
    cr_assert(strstr(err, "header checksum"), "%s", err);
}

Test(snapshot, a_newer_version_is_refused_by_name) {
    write_step(6, &keep_all);
    char path[512], err[1024];
    path_of(6, path, sizeof path);
    FILE *f = fopen(path, "r+b");
    uint32_t version = SNAPSHOT_VERSION + 1;
    fseek(f, 8, SEEK_SET);
    fwrite(&version, sizeof version, 1, f);
    fclose(f);
    snapshot_data_t d;
    cr_assert_eq(snapshot_read(path, &d, err, sizeof err), SNAPSHOT_E_NEWER);
    cr_assert(strstr(err, path) && strstr(err, "snapshot version 4") &&
                  strstr(err, "reads versions 1 to 3") && strstr(err, "newer ddpworker"),
              "%s", err);
    /* a resume stops at it instead of moving it aside and starting over from an older one */
    write_step(2, &keep_all);
    char found[512];
    cr_assert_eq(snapshot_find_latest(dir, NULL, &d, found, sizeof found, err, sizeof err),
                 SNAPSHOT_E_NEWER);
    cr_assert(strstr(err, "newer ddpworker"), "%s", err);
    cr_assert_eq(access(path, F_OK), 0, "left where it was");
}

/* train.best_by's value and train.hours' elapsed time: state a resume continues from. */
Test(snapshot, the_run_state_round_trips_and_impossible_values_are_refused) {
    snapshot_data_t d = sample(8);
    d.header.best_value = 0.3125;
    d.header.best_step = 6;
    d.header.best_by = 2;
    d.header.elapsed_s = 7201.5;
    char err[1024], path[512];
    cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
    path_of(8, path, sizeof path);
    snapshot_data_t got;
    cr_assert_eq(snapshot_read(path, &got, err, sizeof err), 0, "%s", err);
    cr_assert(got.header.best_value == 0.3125 && got.header.best_step == 6 &&
              got.header.best_by == 2 && got.header.elapsed_s == 7201.5);
    snapshot_data_free(&got);
    char out[4096] = "";
    FILE *f = fmemopen(out, sizeof out, "w");
    cr_assert_eq(snapshot_inspect(path, f), 0);
    fclose(f);
    cr_assert(strstr(out, "best:        val_top1 0.3125 at step 6") &&
                  strstr(out, "elapsed:     7201.500 s"),
              "%s", out);
    double elapsed[] = {-1, NAN, INFINITY};
    for (int i = 0; i < 4; i++) {
        d = sample(8);
        if (i < 3)
            d.header.elapsed_s = elapsed[i];
        else
            d.header.best_by = 3;
        cr_assert_eq(snapshot_write(dir, &d, &keep_all, NULL, err, sizeof err), 0, "%s", err);
        cr_assert_eq(snapshot_read(path, &got, err, sizeof err), -1, "case %d accepted", i);
        cr_assert(strstr(err, path) && strstr(err, "(corrupt)"), "%s", err);
    }
}

/* A write the disk holds (its temp file a FIFO nobody reads: open(2) blocks, as on a hung mount)
 * is said while the trainer waits for it, with the step and the directory; the wait ends when the
 * disk lets go (the write then fails: a FIFO takes no fsync). */
static char fifo_path[4096];

static void *read_the_fifo_later(void *arg) {
    (void)arg;
    usleep(700 * 1000);
    int fd = open(fifo_path, O_RDONLY);
    char buf[4096];
    while (fd >= 0 && read(fd, buf, sizeof buf) > 0) {
    }
    if (fd >= 0) close(fd);
    return NULL;
}

Test(snapshot, a_write_the_disk_holds_is_said_while_the_trainer_waits) {
    snapshot_writer_t *w;
    char err[1024];
    snapshot_retention_t keep = {.keep = 3};
    cr_assert_eq(
        snapshot_writer_create(dir, N_PARAMS, N_BUFFERS, false, &keep, &w, err, sizeof err), 0,
        "%s", err);
    FILE *notice = tmpfile();
    cr_assert_not_null(notice);
    snapshot_writer_set_notice(w, 0.2, notice);
    snprintf(fifo_path, sizeof fifo_path,
             "%s/." SNAPSHOT_FILE_PREFIX "%012d" SNAPSHOT_FILE_SUFFIX ".tmp", dir, 10);
    cr_assert_eq(mkfifo(fifo_path, 0600), 0, "%s", strerror(errno));
    submit_sample(w, 10);
    pthread_t reader;
    cr_assert_eq(pthread_create(&reader, NULL, read_the_fifo_later, NULL), 0);
    snapshot_writer_flush(w, err, sizeof err); /* returns once the FIFO is read */
    pthread_join(reader, NULL);
    char said[1024] = "";
    rewind(notice);
    size_t n = fread(said, 1, sizeof said - 1, notice);
    said[n] = '\0';
    cr_assert(strstr(said, "ddpworker: waiting ") &&
                  strstr(said, " s for the snapshot of step 10 to be written to") &&
                  strstr(said, dir) && strstr(said, "the disk is slow or hung"),
              "said: %s", said);
    fclose(notice);
    snapshot_writer_destroy(w);
    unlink(fifo_path);
}
