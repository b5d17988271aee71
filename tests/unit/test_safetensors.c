/* safetensors: the header parser accepts what PyTorch's safetensors writes and refuses every
 * malformed length, offset, dtype and shape with a message naming the tensor; the writer's files
 * parse back to the same tensors and bytes, 8-byte aligned, and a failed write leaves the old
 * file in place. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"

static int parse(const char *json, uint64_t data_len, safetensors_index_t *ix, char *err) {
    return safetensors_parse_header(json, strlen(json), data_len, ix, err, 512);
}

Test(safetensors, parses_a_header_as_pytorch_writes_it) {
    const char *json =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"bn.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
        "\"conv.weight\":{\"dtype\":\"F32\",\"shape\":[2,3,1,1],\"data_offsets\":[8,32]},"
        "\"half\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[32,38]},"
        "\"empty\":{\"dtype\":\"F16\",\"shape\":[0, 4],\"data_offsets\":[38,38]}}    ";
    safetensors_index_t ix;
    char err[512];
    cr_assert_eq(parse(json, 38, &ix, err), 0, "%s", err);
    cr_assert_eq(ix.n, 4);
    const safetensors_entry_t *e = safetensors_find(&ix, "conv.weight");
    cr_assert_not_null(e);
    cr_assert_eq(e->dtype, SAFETENSORS_F32);
    cr_assert_eq(e->ndim, 4);
    cr_assert_eq(e->shape[1], 3);
    cr_assert_eq(e->begin, 8);
    cr_assert_eq(e->end, 32);
    e = safetensors_find(&ix, "bn.num_batches_tracked");
    cr_assert_eq(e->ndim, 0);
    cr_assert_eq(safetensors_elems(e->ndim, e->shape), 1);
    cr_assert_null(safetensors_find(&ix, "__metadata__"));
    cr_assert_str_eq(safetensors_meta(&ix, "format"), "pt");
    cr_assert_null(safetensors_meta(&ix, "producer"));
    safetensors_index_free(&ix);
    /* as a JSON map reads: the last of a key given twice, the last __metadata__ given twice */
    const char *twice =
        "{\"__metadata__\":{\"a\":\"1\"},\"__metadata__\":{\"b\":\"2\",\"b\":\"3\"}}";
    cr_assert_eq(parse(twice, 0, &ix, err), 0, "%s", err);
    cr_assert_null(safetensors_meta(&ix, "a"));
    cr_assert_str_eq(safetensors_meta(&ix, "b"), "3");
    safetensors_index_free(&ix);
}

Test(safetensors, refuses_malformed_headers_naming_the_tensor) {
    struct {
        const char *json;
        uint64_t data_len;
        const char *needle;
    } cases[] = {
        {"", 0, "not JSON"},
        {"[1, 2]", 0, "not a JSON object"},
        {"{\"a\": 1}", 0, "tensor 'a': not a JSON object"},
        {"{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, "tensor 'a': no \"dtype\""},
        {"{\"a\": {\"dtype\": \"F128\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
         "unknown dtype"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": 1, \"data_offsets\": [0, 4]}}", 4,
         "no \"shape\" array"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4,
         "not a whole number"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4,
         "not a whole number"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}",
         4, "9 dimensions"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, "
         "4]}}",
         4, "overflows"},
        {"{\"a\": {\"dtype\": \"F64\", \"shape\": [67108864, 67108864, 67108864], "
         "\"data_offsets\": [0, 8]}}",
         8, "overflows"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", 4,
         "not [begin, end]"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 0]}}", 4, "outside"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 4,
         "outside the 4 bytes"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 4,
         "4 bytes for 2 elements"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
         " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
         8, "'a' appears twice"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
         " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
         8, "overlap"},
        {"{\"\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
         "tensor name of 0 bytes"},
        {"{\"__metadata__\": {\"k\": 1}}", 0, "__metadata__ 'k' is not a string"},
        {"{} x", 0, "bytes after its JSON object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        safetensors_index_t ix;
        char err[512] = "";
        cr_assert_eq(parse(cases[i].json, cases[i].data_len, &ix, err), -1, "case %zu accepted", i);
        cr_assert(strstr(err, cases[i].needle), "case %zu: '%s' lacks '%s'", i, err,
                  cases[i].needle);
        cr_assert_eq(ix.n, 0);
        cr_assert_null(ix.entries);
    }
}

Test(safetensors, refuses_header_lengths_beyond_the_buffer) {
    uint8_t buf[64] = {0};
    safetensors_index_t ix;
    char err[512];
    uint64_t n = 57; /* 8 + 57 > 64 */
    memcpy(buf, &n, 8);
    cr_assert_eq(safetensors_parse_buffer(buf, sizeof buf, &ix, err, sizeof err), -1);
    cr_assert(strstr(err, "header length of 57 bytes"), "%s", err);
    n = UINT64_MAX;
    memcpy(buf, &n, 8);
    cr_assert_eq(safetensors_parse_buffer(buf, sizeof buf, &ix, err, sizeof err), -1);
    cr_assert_eq(safetensors_parse_buffer(buf, 5, &ix, err, sizeof err), -1);
    cr_assert(strstr(err, "shorter than the 8-byte header length"), "%s", err);
    n = 2;
    memcpy(buf, &n, 8);
    memcpy(buf + 8, "{}", 2);
    cr_assert_eq(safetensors_parse_buffer(buf, 10, &ix, err, sizeof err), 0, "%s", err);
    cr_assert_eq(ix.n, 0);
    cr_assert_eq(ix.data_offset, 10);
}

static const float values[6] = {1, -2, 3.5f, 0.25f, 1e-3f, -7};

static int fill(void *arg, int i, void *buf, char *err, size_t err_len) {
    (void)arg;
    if (i == 0) {
        memcpy(buf, values, sizeof values);
    } else if (i == 1) {
        int64_t steps = 1234567890123;
        memcpy(buf, &steps, sizeof steps);
    } else {
        snprintf(err, err_len, "no bytes for tensor %d", i);
        return -1;
    }
    return 0;
}

Test(safetensors, written_files_read_back_aligned) {
    char dir[] = "/tmp/test_safetensors_XXXXXX", path[256], err[512];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    safetensors_tensor_t t[2] = {
        {.name = "layer1.0.conv1.weight", .dtype = SAFETENSORS_F32, .ndim = 2, .shape = {2, 3}},
        {.name = "bn1.num_batches_tracked", .dtype = SAFETENSORS_I64, .ndim = 0}};
    const char *meta[] = {"format", "pt", NULL};
    cr_assert_eq(safetensors_write(path, t, 2, meta, fill, NULL, err, sizeof err), 0, "%s", err);
    safetensors_index_t ix;
    int fd = safetensors_open(path, &ix, err, sizeof err);
    cr_assert_geq(fd, 0, "%s", err);
    cr_assert_eq(ix.data_offset % 8, 0, "the data starts 8-byte aligned");
    cr_assert_eq(ix.n, 2);
    cr_assert_str_eq(ix.entries[0].name, "layer1.0.conv1.weight");
    float got[6];
    cr_assert_eq(safetensors_read(fd, &ix, &ix.entries[0], got, err, sizeof err), 0);
    cr_assert(memcmp(got, values, sizeof got) == 0);
    int64_t steps;
    cr_assert_eq(safetensors_read(fd, &ix, safetensors_find(&ix, "bn1.num_batches_tracked"), &steps,
                                  err, sizeof err),
                 0);
    cr_assert_eq(steps, 1234567890123);
    close(fd);
    safetensors_index_free(&ix);
    /* a failing fill: an error naming the file, and the earlier file intact */
    safetensors_tensor_t three[3] = {
        t[0], t[1], {.name = "x", .dtype = SAFETENSORS_F32, .ndim = 1, .shape = {1}}};
    cr_assert_eq(safetensors_write(path, three, 3, meta, fill, NULL, err, sizeof err), -1);
    cr_assert(strstr(err, path) && strstr(err, "no bytes for tensor 2"), "%s", err);
    fd = safetensors_open(path, &ix, err, sizeof err);
    cr_assert_geq(fd, 0, "%s", err);
    cr_assert_eq(ix.n, 2);
    close(fd);
    safetensors_index_free(&ix);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "ls %s | wc -l", dir);
    FILE *ls = popen(cmd, "r");
    int files = 0;
    cr_assert_eq(fscanf(ls, "%d", &files), 1);
    pclose(ls);
    cr_assert_eq(files, 1, "no temporary file left behind");
    unlink(path);
    rmdir(dir);
}

Test(safetensors, open_names_the_file) {
    safetensors_index_t ix;
    char err[512];
    cr_assert_eq(safetensors_open("/nonexistent/x.safetensors", &ix, err, sizeof err), -1);
    cr_assert(strstr(err, "/nonexistent/x.safetensors: cannot open"), "%s", err);
    cr_assert_eq(safetensors_open("/tmp", &ix, err, sizeof err), -1);
    cr_assert(strstr(err, "/tmp: not a regular file (a directory)"), "%s", err);
}

/* model.init or train.best_file naming a FIFO: open() without O_NONBLOCK waited for a writer
 * forever. */
Test(safetensors, a_fifo_is_refused_not_waited_on, .timeout = 10) {
    char dir[] = "/tmp/safetensors_fifo.XXXXXX", path[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/init.safetensors", dir);
    cr_assert_eq(mkfifo(path, 0600), 0);
    safetensors_index_t ix;
    char err[512] = "";
    cr_assert_eq(safetensors_open(path, &ix, err, sizeof err), -1);
    cr_assert(strstr(err, "init.safetensors: not a regular file (a FIFO)"), "%s", err);
    unlink(path);
    rmdir(dir);
}
