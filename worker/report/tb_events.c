/* tb_events: see tb_events.h. The Event messages come from report/tb_event.proto through
 * protoc-c; this file fills them, frames them and appends them to the file with one write(2) per
 * record, so that a process killed mid-run leaves whole records (and at worst a partial last one,
 * which TensorBoard's reader stops at). */
#include "tb_events.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef DDP_HAVE_TENSORBOARD
/* Built without protobuf-c and ISA-L: the key is accepted, and opening says what is missing. */
int tb_events_open(const char *dir, int64_t first_step, const char *conf_path,
                   const char *overrides, tb_events_t **out, char *err, size_t err_len) {
    (void)dir, (void)first_step, (void)conf_path, (void)overrides;
    *out = NULL;
    snprintf(err, err_len,
             "train.tensorboard_dir: this ddpworker was built without TensorBoard "
             "support (it needs protobuf-c and ISA-L: libprotobuf-c-dev, protobuf-c-compiler and "
             "libisal-dev, which deploy/setup.sh installs)");
    return -1;
}
int tb_events_metrics(tb_events_t *w, const cJSON *line) {
    (void)w, (void)line;
    return 0;
}
const char *tb_events_path(const tb_events_t *w) {
    (void)w;
    return "";
}
void tb_events_close(tb_events_t *w) {
    (void)w;
}
#else

#include <isa-l/crc.h>

#include "fs.h"
#include "tb_event.pb-c.h"

/* protobuf-c's messages hold strings as `char *` that packing only reads, and its INIT macros cast
 * its own const empty string: const data goes in by a cast, never written through */
#pragma GCC diagnostic ignored "-Wcast-qual"

#define FILE_PREFIX "events.out.tfevents."
#define MAX_VALUES  8 /* scalars in one metrics line's event */

struct tb_events {
    int fd;
    bool has_failed, is_opening; /* is_opening: failures go to tb_events_open's err instead */
    int last_errno;
    char path[4096];
};

uint32_t tb_crc32c(const void *data, size_t len) {
    /* ISA-L's crc32_iscsi leaves the final inversion to the caller; it takes an int length */
    uint32_t crc = 0xffffffffu;
    const unsigned char *p = data;
    while (len > 0) {
        int n = len > (1u << 30) ? 1 << 30 : (int)len;
        crc = crc32_iscsi((unsigned char *)p, n, crc);
        p += n;
        len -= (size_t)n;
    }
    return ~crc;
}

uint32_t tb_masked_crc32c(const void *data, size_t len) {
    uint32_t crc = tb_crc32c(data, len);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

static void put_u32_le(uint8_t *out, uint32_t v) {
    for (int i = 0; i < 4; i++)
        out[i] = (uint8_t)(v >> (8 * i));
}

void tb_record_frame(const void *payload, size_t len, uint8_t header[TB_RECORD_HEADER_BYTES],
                     uint8_t footer[TB_RECORD_FOOTER_BYTES]) {
    uint64_t n = len;
    for (int i = 0; i < 8; i++)
        header[i] = (uint8_t)(n >> (8 * i));
    put_u32_le(header + 8, tb_masked_crc32c(header, 8));
    put_u32_le(footer, tb_masked_crc32c(payload, len));
}

static double wall_time_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void fail_once(tb_events_t *w, const char *what, int err) {
    w->last_errno = err;
    if (!w->has_failed && !w->is_opening)
        fprintf(stderr,
                "ddpworker: warning: train.tensorboard_dir: %s %s: %s; no more TensorBoard "
                "events in this attempt (training goes on)\n",
                what, w->path, strerror(err));
    w->has_failed = true;
}

/* ev framed and appended in one write. */
static int write_event(tb_events_t *w, Tensorboard__Event *ev) {
    if (w->has_failed) return -1;
    ev->wall_time = wall_time_s();
    size_t len = tensorboard__event__get_packed_size(ev);
    uint8_t *buf = malloc(TB_RECORD_HEADER_BYTES + len + TB_RECORD_FOOTER_BYTES);
    if (!buf) {
        fail_once(w, "encoding an event for", ENOMEM);
        return -1;
    }
    uint8_t *payload = buf + TB_RECORD_HEADER_BYTES;
    tensorboard__event__pack(ev, payload);
    tb_record_frame(payload, len, buf, payload + len);
    size_t total = TB_RECORD_HEADER_BYTES + len + TB_RECORD_FOOTER_BYTES, done = 0;
    while (done < total) {
        ssize_t n = write(w->fd, buf + done, total - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int e = errno;
            free(buf);
            fail_once(w, "writing", e);
            return -1;
        }
        done += (size_t)n;
    }
    free(buf);
    return 0;
}

static int write_summary(tb_events_t *w, int64_t step, Tensorboard__Summary__Value **values,
                         size_t n) {
    Tensorboard__Summary summary = TENSORBOARD__SUMMARY__INIT;
    summary.n_value = n;
    summary.value = values;
    Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
    ev.step = step;
    ev.what_case = TENSORBOARD__EVENT__WHAT_SUMMARY;
    ev.summary = &summary;
    return write_event(w, &ev);
}

int tb_events_scalar(tb_events_t *w, const char *tag, int64_t step, double value) {
    Tensorboard__Summary__Value v = TENSORBOARD__SUMMARY__VALUE__INIT, *values[1] = {&v};
    v.tag = (char *)tag;
    v.value_case = TENSORBOARD__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
    v.simple_value = (float)value;
    return write_summary(w, step, values, 1);
}

int tb_events_text(tb_events_t *w, const char *tag, int64_t step, const char *text) {
    /* the text plugin's form: a DT_STRING scalar tensor, its metadata naming the plugin */
    Tensorboard__SummaryMetadata__PluginData plugin =
        TENSORBOARD__SUMMARY_METADATA__PLUGIN_DATA__INIT;
    plugin.plugin_name = "text";
    Tensorboard__SummaryMetadata meta = TENSORBOARD__SUMMARY_METADATA__INIT;
    meta.plugin_data = &plugin;
    Tensorboard__TensorShapeProto shape = TENSORBOARD__TENSOR_SHAPE_PROTO__INIT;
    ProtobufCBinaryData str = {.len = strlen(text), .data = (uint8_t *)text};
    Tensorboard__TensorProto tensor = TENSORBOARD__TENSOR_PROTO__INIT;
    tensor.dtype = TENSORBOARD__DATA_TYPE__DT_STRING;
    tensor.tensor_shape = &shape;
    tensor.n_string_val = 1;
    tensor.string_val = &str;
    Tensorboard__Summary__Value v = TENSORBOARD__SUMMARY__VALUE__INIT, *values[1] = {&v};
    v.tag = (char *)tag;
    v.metadata = &meta;
    v.value_case = TENSORBOARD__SUMMARY__VALUE__VALUE_TENSOR;
    v.tensor = &tensor;
    return write_summary(w, step, values, 1);
}

typedef struct {
    const char *event, *key, *tag; /* tag NULL: "<split>/<key>" */
} mapping_t;

static const mapping_t mappings[] = {
    {"train", "loss", "train/loss"},
    {"train", "lr", "train/lr"},
    {"train", "img_per_s", "train/img_per_s"},
    {"train", "loss_scale", "train/loss_scale"},
    {"eval", "loss", NULL},
    {"eval", "top1", NULL},
    {"eval", "top5", NULL},
    {"final", "loss", "final/loss"},
    {"final", "top1", "final/top1"},
    {"final", "top5", "final/top5"},
    {"epoch", "img_per_s", "epoch/img_per_s"},
    {"epoch", "wall_s", "epoch/wall_s"},
};

/* A metrics line's number: json_lines writes numbers as raw text (exact digits), cJSON's own as
 * numbers; null stands for NaN or inf. Returns false for anything else. */
static bool number_of(const cJSON *item, double *out) {
    if (cJSON_IsNumber(item)) {
        *out = item->valuedouble;
        return true;
    }
    if (cJSON_IsNull(item)) {
        *out = NAN;
        return true;
    }
    if (!cJSON_IsRaw(item) || !item->valuestring) return false;
    char *end;
    *out = strtod(item->valuestring, &end);
    return end != item->valuestring && *end == '\0';
}

int tb_events_metrics(tb_events_t *w, const cJSON *line) {
    if (!w || !line) return 0;
    const cJSON *event = cJSON_GetObjectItemCaseSensitive(line, "event");
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(line, "step");
    const cJSON *split = cJSON_GetObjectItemCaseSensitive(line, "split");
    double step_value;
    if (!cJSON_IsString(event) || !number_of(step, &step_value) || !isfinite(step_value)) return 0;
    Tensorboard__Summary__Value values[MAX_VALUES], *ptrs[MAX_VALUES];
    char tags[MAX_VALUES][64];
    size_t n = 0;
    for (size_t i = 0; i < sizeof mappings / sizeof mappings[0] && n < MAX_VALUES; i++) {
        const mapping_t *m = &mappings[i];
        if (strcmp(m->event, event->valuestring) != 0) continue;
        const cJSON *item = cJSON_GetObjectItemCaseSensitive(line, m->key);
        double value;
        if (!number_of(item, &value)) continue; /* absent: not measured (loss_scale unscaled) */
        if (m->tag)
            snprintf(tags[n], sizeof tags[n], "%s", m->tag);
        else
            snprintf(tags[n], sizeof tags[n], "%s/%s",
                     cJSON_IsString(split) ? split->valuestring : "eval", m->key);
        values[n] = (Tensorboard__Summary__Value)TENSORBOARD__SUMMARY__VALUE__INIT;
        values[n].tag = tags[n];
        values[n].value_case = TENSORBOARD__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
        values[n].simple_value = (float)value;
        ptrs[n] = &values[n];
        n++;
    }
    return n ? write_summary(w, (int64_t)step_value, ptrs, n) : 0;
}

/* The seconds field of a name FILE_PREFIX<seconds>.<host>..., or -1. */
static long long name_seconds(const char *name) {
    if (strncmp(name, FILE_PREFIX, strlen(FILE_PREFIX)) != 0) return -1;
    char *end;
    long long s = strtoll(name + strlen(FILE_PREFIX), &end, 10);
    return *end == '.' ? s : -1;
}

/* TensorBoard reads a directory's files in name order: the seconds in this file's name are now,
 * or one more than the latest already there (a restart within the same second, a clock set
 * back), so that this file sorts after every earlier one. */
static long long next_file_seconds(const char *dir, char *err, size_t err_len) {
    long long seconds = (long long)time(NULL);
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, err_len, "train.tensorboard_dir: cannot read %s: %s", dir, strerror(errno));
        return -1;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        long long s = name_seconds(e->d_name);
        if (s >= seconds) seconds = s + 1;
    }
    closedir(d);
    return seconds;
}

/* The "config" text: the train.conf as a Markdown code block (each line indented), then the
 * overrides. malloc'd, or NULL (out of memory). A file that cannot be read says so in the text:
 * the summary is a report, the run does not depend on it. */
static char *config_text(const char *conf_path, const char *overrides) {
    enum { MAX_FILE_BYTES = 64 * 1024 };
    char *file = calloc(1, MAX_FILE_BYTES + 1);
    if (!file) return NULL;
    size_t n = 0;
    FILE *f = fopen(conf_path, "r");
    if (f) {
        n = fread(file, 1, MAX_FILE_BYTES, f);
        fclose(f);
    } else {
        snprintf(file, MAX_FILE_BYTES, "(cannot read it: %s)", strerror(errno));
        n = strlen(file);
    }
    file[n] = '\0';
    size_t lines = 1;
    for (size_t i = 0; i < n; i++)
        lines += file[i] == '\n';
    size_t cap = strlen(conf_path) + 4 * lines + n + (overrides ? strlen(overrides) : 0) + 128;
    char *text = malloc(cap), *o = text;
    if (!text) {
        free(file);
        return NULL;
    }
    o += sprintf(o, "**train.conf** `%s`\n\n", conf_path);
    for (char *line = file, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        o += sprintf(o, "    %s\n", line);
    }
    if (overrides && overrides[0]) sprintf(o, "\n**overrides** `%s`\n", overrides);
    free(file);
    return text;
}

int tb_events_open(const char *dir, int64_t first_step, const char *conf_path,
                   const char *overrides, tb_events_t **out, char *err, size_t err_len) {
    *out = NULL;
    int rc_dir = fs_mkdir_p(dir);
    if (rc_dir < 0) {
        snprintf(err, err_len, "train.tensorboard_dir: cannot create %s: %s", dir,
                 strerror(-rc_dir));
        return -1;
    }
    long long seconds = next_file_seconds(dir, err, err_len);
    if (seconds < 0) return -1;
    tb_events_t *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, err_len, "train.tensorboard_dir: out of memory");
        return -1;
    }
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    /* TensorFlow's own name form (events.out.tfevents.<seconds>.<host>.<pid>.<n>) */
    if (snprintf(w->path, sizeof w->path, "%s/" FILE_PREFIX "%010lld.%s.%d.0", dir, seconds, host,
                 (int)getpid()) >= (int)sizeof w->path) {
        snprintf(err, err_len, "train.tensorboard_dir: %s: path too long", dir);
        free(w);
        return -1;
    }
    w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        snprintf(err, err_len, "train.tensorboard_dir: cannot create %s: %s", w->path,
                 strerror(errno));
        free(w);
        return -1;
    }
    w->is_opening = true;
    Tensorboard__Event version = TENSORBOARD__EVENT__INIT;
    version.what_case = TENSORBOARD__EVENT__WHAT_FILE_VERSION;
    version.file_version = "brain.Event:2"; /* 2: readers honour SessionLog START (below) */
    Tensorboard__SessionLog start_log = TENSORBOARD__SESSION_LOG__INIT;
    start_log.status = TENSORBOARD__SESSION_LOG__SESSION_STATUS__START;
    Tensorboard__Event start = TENSORBOARD__EVENT__INIT;
    start.step = first_step + 1;
    start.what_case = TENSORBOARD__EVENT__WHAT_SESSION_LOG;
    start.session_log = &start_log;
    /* the config at first_step + 1, not first_step: a restart from the same step drops the
     * previous attempt's copy with everything else from that step on */
    int rc = write_event(w, &version);
    if (rc == 0) rc = write_event(w, &start);
    if (rc == 0 && conf_path) {
        char *text = config_text(conf_path, overrides);
        rc = text ? tb_events_text(w, "config", first_step + 1, text) : -1;
        if (!text) w->last_errno = ENOMEM;
        free(text);
    }
    if (rc < 0) {
        snprintf(err, err_len, "train.tensorboard_dir: cannot write %s: %s", w->path,
                 strerror(w->last_errno));
        tb_events_close(w);
        return -1;
    }
    w->is_opening = false;
    *out = w;
    return 0;
}

const char *tb_events_path(const tb_events_t *w) {
    return w->path;
}

void tb_events_close(tb_events_t *w) {
    if (!w) return;
    close(w->fd);
    free(w);
}

#endif /* DDP_HAVE_TENSORBOARD */
