/* Unit tests of worker/report/tb_events: CRC-32C and its TFRecord mask against known values (RFC
 * 3720's iSCSI vectors; the masked ones and a whole record computed by TensorBoard's own
 * tensorboard.summary.writer.record_writer), and the files tb_events_open writes: every record's
 * framing verifies, the first is the file version, names sort in the order they were opened. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json_lines.h"
#include "tb_events.h"

Test(tb_events, crc32c_of_known_vectors) {
    uint8_t zeros[32] = {0}, ones[32], inc[32];
    memset(ones, 0xff, sizeof ones);
    for (int i = 0; i < 32; i++)
        inc[i] = (uint8_t)i;
    cr_assert_eq(tb_crc32c("123456789", 9), 0xe3069283u);
    cr_assert_eq(tb_crc32c(zeros, 32), 0x8a9136aau); /* RFC 3720, B.4 */
    cr_assert_eq(tb_crc32c(ones, 32), 0x62a8ab43u);
    cr_assert_eq(tb_crc32c(inc, 32), 0x46dd794eu);
    cr_assert_eq(tb_crc32c("", 0), 0u);
}

Test(tb_events, masked_crc32c_as_tensorboard_computes_it) {
    uint8_t zeros[32] = {0}, inc[32];
    for (int i = 0; i < 32; i++)
        inc[i] = (uint8_t)i;
    cr_assert_eq(tb_masked_crc32c("123456789", 9), 0xc78ab0e5u);
    cr_assert_eq(tb_masked_crc32c("", 0), 0xa282ead8u);
    cr_assert_eq(tb_masked_crc32c(zeros, 32), 0x0fd7fffau);
    cr_assert_eq(tb_masked_crc32c(inc, 32), 0x951f7892u);
}

Test(tb_events, a_record_frames_as_tensorboards_record_writer) {
    /* RecordWriter(f).write(b"ddprun") */
    static const uint8_t want[] = {0x06, 0,   0,   0,   0,   0,   0,   0,    0x73, 0x69, 0xd5,
                                   0x37, 'd', 'd', 'p', 'r', 'u', 'n', 0x87, 0xed, 0xc2, 0x33};
    uint8_t got[sizeof want];
    memcpy(got + TB_RECORD_HEADER_BYTES, "ddprun", 6);
    tb_record_frame("ddprun", 6, got, got + TB_RECORD_HEADER_BYTES + 6);
    cr_assert_arr_eq(got, want, sizeof want);
}

static char *make_dir(void) {
    char *dir = strdup("/tmp/test_tb_events.XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    return dir;
}

/* The event files in dir, sorted by name (as TensorBoard reads them); returns how many. */
static int event_files(const char *dir, char names[][512], int max) {
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort), k = 0;
    cr_assert_geq(n, 0);
    for (int i = 0; i < n; i++) {
        if (strstr(list[i]->d_name, "tfevents") && k < max)
            snprintf(names[k++], 512, "%s/%s", dir, list[i]->d_name);
        free(list[i]);
    }
    free(list);
    return k;
}

/* Every record of path verified; the payloads concatenated into out (NUL-free search via memmem).
 */
static size_t read_records(const char *path, uint8_t *out, size_t cap, int *n_records) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    static uint8_t buf[1 << 16];
    size_t len = fread(buf, 1, sizeof buf, f), at = 0, used = 0;
    fclose(f);
    *n_records = 0;
    while (at < len) {
        cr_assert_geq(len - at, TB_RECORD_HEADER_BYTES + TB_RECORD_FOOTER_BYTES, "torn record");
        uint64_t n = 0;
        for (int i = 0; i < 8; i++)
            n |= (uint64_t)buf[at + i] << (8 * i);
        cr_assert_leq(n, len - at - 16, "record length %llu past the end", (unsigned long long)n);
        uint8_t header[TB_RECORD_HEADER_BYTES], footer[TB_RECORD_FOOTER_BYTES];
        tb_record_frame(buf + at + 12, n, header, footer);
        cr_assert_arr_eq(header, buf + at, sizeof header, "record %d: bad length CRC", *n_records);
        cr_assert_arr_eq(footer, buf + at + 12 + n, sizeof footer, "record %d: bad CRC",
                         *n_records);
        cr_assert_leq(used + n, cap);
        memcpy(out + used, buf + at + 12, n);
        used += n;
        at += 16 + n;
        (*n_records)++;
    }
    return used;
}

Test(tb_events, files_hold_verified_records_and_sort_in_opening_order) {
    char *dir = make_dir(), conf[600], err[512];
    snprintf(conf, sizeof conf, "%s/x.conf", dir);
    FILE *f = fopen(conf, "w");
    fputs("[train]\nepochs = 2\n", f);
    fclose(f);
    tb_events_t *w;
    cr_assert_eq(tb_events_open(dir, 0, conf, "train.seed=3", &w, err, sizeof err), 0, "%s", err);
    cJSON *line = json_line_new("train");
    json_line_int(line, "step", 8);
    json_line_num(line, "loss", 2.5);
    json_line_num(line, "lr", NAN); /* null: written as NaN */
    cr_assert_eq(tb_events_metrics(w, line), 0);
    cJSON_Delete(line);
    tb_events_close(w);
    /* a restart within the same second: its file must sort after the first */
    cr_assert_eq(tb_events_open(dir, 8, NULL, NULL, &w, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tb_events_scalar(w, "train/loss", 16, 1.5), 0);
    tb_events_close(w);

    char names[4][512];
    cr_assert_eq(event_files(dir, names, 4), 2);
    static uint8_t payload[1 << 16];
    int n;
    size_t len = read_records(names[0], payload, sizeof payload, &n);
    cr_assert_eq(n, 4, "file version, START, config, one summary: %d records", n);
    cr_assert_not_null(memmem(payload, len, "brain.Event:2", 13));
    cr_assert_not_null(memmem(payload, len, "epochs = 2", 10), "the config text");
    cr_assert_not_null(memmem(payload, len, "train.seed=3", 12), "the overrides");
    cr_assert_not_null(memmem(payload, len, "train/loss", 10));
    cr_assert_not_null(memmem(payload, len, "train/lr", 8));
    float v = 2.5f;
    cr_assert_not_null(memmem(payload, len, &v, sizeof v), "the loss as a float");
    len = read_records(names[1], payload, sizeof payload, &n);
    cr_assert_eq(n, 3, "file version, START at 9, one scalar: %d records", n);
    /* the second file's START: Event{step: 9 (field 2), session_log (7): {status: START}} */
    static const uint8_t start_at_9[] = {0x10, 0x09, 0x3a, 0x02, 0x08, 0x01};
    cr_assert_not_null(memmem(payload, len, start_at_9, sizeof start_at_9));
    for (int i = 0; i < 2; i++)
        unlink(names[i]);
    unlink(conf);
    rmdir(dir);
    free(dir);
}

Test(tb_events, a_directory_that_cannot_be_made_is_an_error_naming_it) {
    char err[512];
    tb_events_t *w = (tb_events_t *)1;
    cr_assert_eq(tb_events_open("/proc/no/such/dir", 0, NULL, NULL, &w, err, sizeof err), -1);
    cr_assert_null(w);
    cr_assert(strstr(err, "train.tensorboard_dir") && strstr(err, "/proc/no/such/dir"), "%s", err);
}
