/* status_cmd: `ddprun status`, a running job as its agents and workers left it in the store: the
 * round and its state, the nodes (host, node rank, ranks), restarts used and left, the last
 * failure (node, rank, exit code or signal, time, first lines of its error), and per rank the last
 * step, img/s and snapshot step (rendezvous.h's and status_report.h's records). As a table, or one
 * JSON object with --json. Reads only, never waits for a key (MULTI_GET), so a store that is there
 * answers at once; bounded by --timeout. The calling thread, blocking. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cJSON.h>

#include "commands.h"
#include "endpoint.h"
#include "options.h"
#include "rdzv/rdzv_kv.h"
#include "rdzv/rdzv_record.h"
#include "store_limits.h"

static const char status_usage[] =
    "usage: ddprun status --rdzv-endpoint HOST[:PORT] --rdzv-id JOB [--rdzv-backend c10d|etcd]\n"
    "                     [--rdzv-conf cacert=..,cert=..,key=..,user=..,password_file=..] "
    "[--json]\n"
    "                     [--timeout MS] [--store-secret-file F]\n"
    "A job's round, nodes, restarts, last failure and per-rank progress, from its store (while it\n"
    "runs) or from etcd (while it runs, and for --rdzv-conf status_ttl after it ended).\n";

static const struct option status_options[] = {
    {"rdzv-endpoint", required_argument, NULL, 'e'},
    {"rdzv_endpoint", required_argument, NULL, 'e'},
    {"rdzv-id", required_argument, NULL, 'i'},
    {"rdzv_id", required_argument, NULL, 'i'},
    {"rdzv-backend", required_argument, NULL, 'b'},
    {"rdzv_backend", required_argument, NULL, 'b'},
    {"rdzv-conf", required_argument, NULL, 'c'},
    {"rdzv_conf", required_argument, NULL, 'c'},
    {"json", no_argument, NULL, 'j'},
    {"timeout", required_argument, NULL, 't'},
    {"store-secret-file", required_argument, NULL, 's'},
    {"secret-file", required_argument, NULL, 's'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

#define MAX_READ 4096 /* keys read in one status */

typedef struct {
    rdzv_kv_t *kv;       /* the job's rendezvous: the store, or etcd */
    rdzv_kv_t *progress; /* etcd while the job runs: the round's store, where workers report */
    const ddprun_opts_t *opts;
    int64_t timeout_ms;
    char prefix[300];
} reader_t;

/* The value of the key rel (under the job's prefix), malloc'd; NULL when missing. */
static uint8_t *read_raw(reader_t *r, rdzv_kv_t *kv, const char *rel, size_t *n) {
    char k[512];
    snprintf(k, sizeof k, "%s/%s", r->prefix, rel);
    const char *keys[] = {k};
    uint8_t *val = NULL;
    *n = 0;
    if (kv->ops->multi_get(kv, keys, 1, &val, n) < 0 || *n == 0) {
        free(val);
        return NULL;
    }
    return val;
}

/* The JSON value of the key rel, or NULL when missing or not JSON. */
static cJSON *read_key(reader_t *r, const char *rel) {
    size_t n;
    uint8_t *val = read_raw(r, r->kv, rel, &n);
    cJSON *o = val ? cJSON_ParseWithLength((const char *)val, n) : NULL;
    free(val);
    return o;
}

/* A worker's progress: from the round's store while it is there, else etcd's copy. */
static cJSON *read_progress_key(reader_t *r, const char *rel) {
    size_t n;
    uint8_t *val = r->progress ? read_raw(r, r->progress, rel, &n) : NULL;
    cJSON *o = val ? cJSON_ParseWithLength((const char *)val, n) : NULL;
    free(val);
    return o ? o : read_key(r, rel);
}

static cJSON *read_progress(reader_t *r, int rank) {
    char rel[64];
    snprintf(rel, sizeof rel, "progress/%d", rank);
    return read_progress_key(r, rel);
}

/* etcd: connect to the store node 0 of round `round` serves (in every member's rank record
 * r<R>/rank/<i>; join index 0 is a member of every round that closed). */
static void open_round_store(reader_t *r, int round) {
    char rel[64];
    snprintf(rel, sizeof rel, "r%d/rank/0", round);
    size_t n;
    uint8_t *val = read_raw(r, r->kv, rel, &n);
    rdzv_rank_record_t place;
    bool is_ok = val && rdzv_record_rank_parse((const char *)val, n, &place);
    free(val);
    if (!is_ok || !place.store_host[0]) return;
    ddprun_opts_t o = *r->opts;
    strcpy(o.rdzv_backend, "c10d");
    snprintf(o.rdzv_host, sizeof o.rdzv_host, "%s", place.store_host);
    o.rdzv_port = place.store_port;
    int64_t t = r->timeout_ms < 2000 ? r->timeout_ms : 2000; /* gone when the job ended */
    if (rdzv_kv_connect(&o, NULL, t, t, &r->progress) < 0) {
        rdzv_kv_destroy(r->progress);
        r->progress = NULL;
    }
}

/* read_key of the key a printf format names. */
static cJSON *read_fmt(reader_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static cJSON *read_fmt(reader_t *r, const char *fmt, ...) {
    char rel[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rel, sizeof rel, fmt, ap);
    va_end(ap);
    return read_key(r, rel);
}

static int number(const cJSON *o, const char *key, int def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? (int)v->valuedouble : def;
}

static cJSON *gather(reader_t *r) {
    cJSON *out = cJSON_CreateObject();
    cJSON *round_v = read_key(r, "round");
    int round = cJSON_IsNumber(round_v) ? (int)round_v->valuedouble : 0;
    cJSON_Delete(round_v);
    cJSON *job = read_key(r, "job");
    cJSON *failures_v = read_key(r, "failures");
    int failures = cJSON_IsNumber(failures_v) ? (int)failures_v->valuedouble : 0;
    cJSON_Delete(failures_v);
    /* the newest round that has members: a round being joined has none yet */
    cJSON *closed = NULL;
    for (; round >= 0; round--) {
        closed = read_fmt(r, "r%d/closed", round);
        if (cJSON_IsNumber(closed)) break;
        cJSON_Delete(closed);
        closed = NULL;
    }
    int n_nodes = cJSON_IsNumber(closed) ? (int)closed->valuedouble : 0;
    cJSON_Delete(closed);
    cJSON_AddNumberToObject(out, "round", round < 0 ? 0 : round);
    if (strcmp(r->opts->rdzv_backend, "etcd") == 0 && round >= 0) open_round_store(r, round);
    cJSON *restart = round >= 0 ? read_fmt(r, "r%d/restart", round) : NULL;
    cJSON *all_done = round >= 0 ? read_fmt(r, "r%d/all_done", round) : NULL;
    const char *state = !job       ? "unknown"
                        : all_done ? "finished"
                        : restart  ? "restarting"
                        : n_nodes  ? "running"
                                   : "joining";
    cJSON_AddStringToObject(out, "state", state);
    cJSON_Delete(all_done);
    cJSON_Delete(restart);
    int max_restarts = number(job, "max_restarts", 0);
    cJSON *restarts = cJSON_AddObjectToObject(out, "restarts");
    cJSON_AddNumberToObject(restarts, "used", failures);
    cJSON_AddNumberToObject(restarts, "left",
                            max_restarts > failures ? max_restarts - failures : 0);
    if (job) cJSON_AddItemToObject(out, "job", job);
    cJSON *nodes = cJSON_AddArrayToObject(out, "nodes");
    int world = 0;
    for (int i = 0; i < n_nodes && i < MAX_READ; i++) {
        cJSON *m = read_fmt(r, "r%d/member/%d", round, i);
        if (!m) continue;
        world = number(m, "world_size", world);
        cJSON_AddItemToArray(nodes, m);
    }
    /* the last failure: the newest round whose restart record names one */
    for (int k = round; k >= 0 && k > round - 64; k--) {
        cJSON *why = read_fmt(r, "r%d/restart", k);
        if (!why || number(why, "code", 0) == 0) {
            cJSON_Delete(why);
            continue;
        }
        /* the root cause: a node's own failure beats its peers' "peer failure" (75) that it set
         * off, whichever of them reached the restart key first */
        cJSON *detail = read_fmt(r, "r%d/failure/%d", k, number(why, "node", -1));
        for (int g = 0; g < MAX_READ && (!detail || number(detail, "exit_code", 0) == 75); g++) {
            cJSON *other = read_fmt(r, "r%d/failure/%d", k, g);
            if (!other && g >= n_nodes) break;
            if (other && number(other, "exit_code", 0) != 75) {
                cJSON_Delete(detail);
                detail = other;
            } else {
                cJSON_Delete(other);
            }
        }
        cJSON *failure = detail ? detail : why;
        if (detail) cJSON_Delete(why);
        cJSON_AddNumberToObject(failure, "round", k);
        cJSON_AddItemToObject(out, "last_failure", failure);
        break;
    }
    cJSON *ranks = cJSON_AddArrayToObject(out, "ranks");
    for (int rank = 0; rank < world && rank < MAX_READ; rank++) {
        cJSON *p = read_progress(r, rank);
        if (!p) continue;
        cJSON_AddNumberToObject(p, "rank", rank);
        cJSON_DeleteItemFromObjectCaseSensitive(p, "event");
        cJSON_AddItemToArray(ranks, p);
    }
    /* the newest restart's resume: where the state came from, how many steps it lost */
    cJSON *resume = read_progress_key(r, "progress/resume");
    if (resume) {
        cJSON_DeleteItemFromObjectCaseSensitive(resume, "event");
        cJSON_AddItemToObject(out, "last_resume", resume);
    }
    return out;
}

static const char *str_of(const cJSON *o, const char *key, const char *def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : def;
}

static void print_table(const cJSON *s, const char *id) {
    const cJSON *restarts = cJSON_GetObjectItemCaseSensitive(s, "restarts");
    printf("job %s: round %d, %s; restarts used %d, left %d\n", id, number(s, "round", 0),
           str_of(s, "state", "?"), number(restarts, "used", 0), number(restarts, "left", 0));
    const cJSON *n;
    printf("%-6s %-24s %-8s %s\n", "node", "host", "ranks", "agent pid");
    cJSON_ArrayForEach(n, cJSON_GetObjectItemCaseSensitive(s, "nodes")) {
        int first = number(n, "first_rank", 0), nproc = number(n, "nproc", 1);
        char ranks[32];
        snprintf(ranks, sizeof ranks, "%d-%d", first, first + nproc - 1);
        printf("%-6d %-24.24s %-8s %d\n", number(n, "node", -1), str_of(n, "host", "?"), ranks,
               number(n, "agent_pid", 0));
    }
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(s, "last_failure");
    if (f) {
        char how[48];
        if (number(f, "signal", 0))
            snprintf(how, sizeof how, "killed by signal %d", number(f, "signal", 0));
        else
            snprintf(how, sizeof how, "exit %d", number(f, "exit_code", number(f, "code", 0)));
        printf("last failure: round %d, node %d, rank %d, %s%s%s\n", number(f, "round", 0),
               number(f, "node", -1), number(f, "rank", -1), how,
               str_of(f, "time", NULL) ? " at " : "", str_of(f, "time", ""));
        /* the error's lines, indented, without the empty ones (an error file's message often ends
         * or starts with a newline), 300 characters at most */
        const char *err = str_of(f, "error", "");
        int budget = 300;
        for (const char *p = err; *p && budget > 0;) {
            const char *end = strchr(p, '\n');
            int line_len = end ? (int)(end - p) : (int)strlen(p);
            int k = line_len;
            while (k > 0 && (p[k - 1] == ' ' || p[k - 1] == '\t' || p[k - 1] == '\r'))
                k--;
            const char *q = p;
            while (k > 0 && (*q == ' ' || *q == '\t'))
                q++, k--;
            if (k > 0) {
                printf("  %.*s\n", k < budget ? k : budget, q);
                budget -= k;
            }
            p += line_len + (end != NULL);
        }
    }
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(s, "last_resume");
    if (res) {
        char lost[48] = "steps lost unknown";
        if (number(res, "steps_lost", -1) >= 0)
            snprintf(lost, sizeof lost, "%d step%s lost", number(res, "steps_lost", 0),
                     number(res, "steps_lost", 0) == 1 ? "" : "s");
        printf("last resume: step %d from %s (rank %d), %s%s%s\n", number(res, "step", 0),
               str_of(res, "source", "?"), number(res, "rank", -1), lost,
               str_of(res, "time", NULL) ? " at " : "", str_of(res, "time", ""));
    }
    printf("%-6s %-10s %-7s %-10s %-10s %s\n", "rank", "step", "epoch", "img/s", "snapshot",
           "time");
    cJSON_ArrayForEach(n, cJSON_GetObjectItemCaseSensitive(s, "ranks")) {
        const cJSON *rate = cJSON_GetObjectItemCaseSensitive(n, "img_per_s");
        char snap[24] = "-";
        if (cJSON_GetObjectItemCaseSensitive(n, "snapshot_step"))
            snprintf(snap, sizeof snap, "%d", number(n, "snapshot_step", 0));
        printf("%-6d %-10d %-7d %-10.0f %-10s %s\n", number(n, "rank", 0), number(n, "step", 0),
               number(n, "epoch", 0), cJSON_IsNumber(rate) ? rate->valuedouble : NAN, snap,
               str_of(n, "time", ""));
    }
}

/* One TCP connection attempt to the c10d store, at once: a store that is not there refuses
 * (ECONNREFUSED) and retrying it for the whole timeout, as a joining agent must, would only make
 * `ddprun status` of an ended job wait. Returns 0 (something listens), or -errno (ETIMEDOUT when
 * nothing answered within timeout_ms). */
static int probe_store(const char *host, uint16_t port, long timeout_ms) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV},
                    *res = NULL;
    char service[8];
    snprintf(service, sizeof service, "%u", port);
    if (getaddrinfo(host, service, &hints, &res) != 0) return -EHOSTUNREACH;
    int rc = -ECONNREFUSED;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd =
            socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            rc = -errno;
            continue;
        }
        rc = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : -errno;
        if (rc == -EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int ready = poll(&p, 1, (int)timeout_ms);
            int so_error = 0;
            socklen_t len = sizeof so_error;
            if (ready == 0)
                rc = -ETIMEDOUT;
            else if (ready < 0)
                rc = -errno;
            else
                rc = getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) < 0 ? -errno : -so_error;
        }
        close(fd);
        if (rc == 0) break;
    }
    freeaddrinfo(res);
    return rc;
}

int status_cmd_main(int argc, char **argv) {
    static ddprun_opts_t o; /* the rendezvous part of ddprun's options, as the agents had them */
    memset(&o, 0, sizeof o);
    strcpy(o.rdzv_backend, "c10d");
    o.lease_ttl_s = 10;
    o.status_ttl_s = 3600;
    o.store_max_value_bytes = STORE_DEFAULT_MAX_VALUE_BYTES;
    char msg[768];
    bool is_json = false;
    long timeout_ms = 10000;
    optind = 1;
    opterr = 0;
    for (int opt; (opt = getopt_long(argc, argv, "+h", status_options, NULL)) != -1;) {
        switch (opt) {
        case 'h':
            fputs(status_usage, stdout);
            return 0;
        case 'e':
            snprintf(o.rdzv_endpoints, sizeof o.rdzv_endpoints, "%s", optarg);
            break;
        case 'i':
            snprintf(o.rdzv_id, sizeof o.rdzv_id, "%s", optarg);
            break;
        case 'b':
            if (strcmp(optarg, "c10d") != 0 && strcmp(optarg, "static") != 0 &&
                strcmp(optarg, "etcd") != 0) {
                fprintf(stderr, "ddprun status: --rdzv-backend %s: c10d, etcd or static\n", optarg);
                return 2;
            }
            snprintf(o.rdzv_backend, sizeof o.rdzv_backend, "%s", optarg);
            break;
        case 'c':
            if (options_set_rdzv_conf(&o, optarg, msg, sizeof msg) < 0) {
                fprintf(stderr, "ddprun status: %s\n", msg);
                return 2;
            }
            break;
        case 'j':
            is_json = true;
            break;
        case 't':
            timeout_ms = strtol(optarg, NULL, 10);
            break;
        case 's':
            snprintf(o.store_secret_file, sizeof o.store_secret_file, "%s", optarg);
            break;
        default:
            fprintf(stderr, "ddprun status: unknown option %s\n%s", argv[optind - 1], status_usage);
            return 2;
        }
    }
    if (!o.rdzv_endpoints[0] || !o.rdzv_id[0] || timeout_ms <= 0) {
        fprintf(stderr, "ddprun status: --rdzv-endpoint and --rdzv-id are needed\n%s",
                status_usage);
        return 2;
    }
    if (options_load_store_secret(&o, msg, sizeof msg) < 0) {
        fprintf(stderr, "ddprun status: %s\n", msg);
        return 2;
    }
    bool is_etcd = strcmp(o.rdzv_backend, "etcd") == 0;
    o.has_rdzv_endpoint = true;
    if (is_etcd && options_finish_etcd(&o, msg, sizeof msg) < 0) {
        fprintf(stderr, "ddprun status: %s\n", msg);
        return 2;
    }
    if (!is_etcd && endpoint_parse(o.rdzv_endpoints, 29400, o.rdzv_host, sizeof o.rdzv_host,
                                   &o.rdzv_port, msg, sizeof msg) < 0) {
        fprintf(stderr, "ddprun status: --rdzv-endpoint: %s\n", msg);
        return 2;
    }
    int probe = is_etcd ? 0 : probe_store(o.rdzv_host, o.rdzv_port, timeout_ms);
    if (probe == -ECONNREFUSED) {
        fprintf(stderr,
                "ddprun status: the job's store at %s is gone (connection refused): job '%s' "
                "has ended, or its host is down (or --rdzv-endpoint names another host or port)\n",
                o.rdzv_endpoints, o.rdzv_id);
        return 1;
    }
    if (probe < 0) {
        fprintf(stderr,
                "ddprun status: the job's store at %s cannot be reached (%s): its host is "
                "down or unreachable, or job '%s' has ended\n",
                o.rdzv_endpoints,
                probe == -ETIMEDOUT ? "no answer within --timeout" : strerror(-probe), o.rdzv_id);
        return 1;
    }
    reader_t r = {.opts = &o, .timeout_ms = timeout_ms};
    snprintf(r.prefix, sizeof r.prefix, "/ddprun/%s", o.rdzv_id);
    if (rdzv_kv_connect(&o, NULL, timeout_ms, timeout_ms, &r.kv) < 0) {
        fprintf(stderr, "ddprun status: %s\n", r.kv ? r.kv->ops->error(r.kv) : "cannot connect");
        rdzv_kv_destroy(r.kv);
        return 1;
    }
    cJSON *s = gather(&r);
    rdzv_kv_destroy(r.kv);
    rdzv_kv_destroy(r.progress);
    if (is_json) {
        char *text = cJSON_PrintUnformatted(s);
        printf("%s\n", text ? text : "{}");
        cJSON_free(text);
    } else {
        print_table(s, o.rdzv_id);
    }
    int rc = strcmp(str_of(s, "state", ""), "unknown") == 0 ? 1 : 0;
    if (rc) fprintf(stderr, "ddprun status: no job '%s' at %s\n", o.rdzv_id, o.rdzv_endpoints);
    cJSON_Delete(s);
    return rc;
}
