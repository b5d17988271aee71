/* status_cmd: `ddprun status`, a running job as its agents and workers left it in the store: the
 * round and its state, the nodes (host, node rank, ranks), restarts used and left, the last
 * failure (node, rank, exit code or signal, time, first lines of its error), and per rank the last
 * step, img/s and snapshot step (rendezvous.h's and status_report.h's records). As a table, or one
 * JSON object with --json. Reads only, never waits for a key (MULTI_GET), so a store that is there
 * answers at once; bounded by --timeout. The calling thread, blocking. */
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "commands.h"
#include "endpoint.h"
#include "store_client.h"

static const char status_usage[] =
    "usage: ddprun status --rdzv-endpoint HOST[:PORT] --rdzv-id JOB [--rdzv-backend c10d] [--json]\n"
    "                     [--timeout MS]\n"
    "A running job's round, nodes, restarts, last failure and per-rank progress, from its store.\n";

static const struct option status_options[] = {
    {"rdzv-endpoint", required_argument, NULL, 'e'}, {"rdzv_endpoint", required_argument, NULL, 'e'},
    {"rdzv-id", required_argument, NULL, 'i'},       {"rdzv_id", required_argument, NULL, 'i'},
    {"rdzv-backend", required_argument, NULL, 'b'},  {"rdzv_backend", required_argument, NULL, 'b'},
    {"json", no_argument, NULL, 'j'},                {"timeout", required_argument, NULL, 't'},
    {"help", no_argument, NULL, 'h'},                {NULL, 0, NULL, 0},
};

#define MAX_READ 4096 /* keys read in one status */

typedef struct {
    store_client_t *c;
    char prefix[300];
} reader_t;

/* The JSON value of the key rel (under the job's prefix), or NULL when missing or not JSON. */
static cJSON *read_key(reader_t *r, const char *rel) {
    char k[512];
    snprintf(k, sizeof k, "%s/%s", r->prefix, rel);
    const char *keys[] = {k};
    uint8_t *val = NULL;
    size_t n = 0;
    if (store_client_multi_get(r->c, keys, 1, &val, &n) < 0 || n == 0) {
        free(val);
        return NULL;
    }
    cJSON *o = cJSON_ParseWithLength((const char *)val, n);
    free(val);
    return o;
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
    cJSON *restart = round >= 0 ? read_fmt(r, "r%d/restart", round) : NULL;
    cJSON *all_done = round >= 0 ? read_fmt(r, "r%d/all_done", round) : NULL;
    const char *state = !job ? "unknown" : all_done ? "finished" : restart ? "restarting"
                        : n_nodes ? "running" : "joining";
    cJSON_AddStringToObject(out, "state", state);
    cJSON_Delete(all_done);
    cJSON_Delete(restart);
    int max_restarts = number(job, "max_restarts", 0);
    cJSON *restarts = cJSON_AddObjectToObject(out, "restarts");
    cJSON_AddNumberToObject(restarts, "used", failures);
    cJSON_AddNumberToObject(restarts, "left", max_restarts > failures ? max_restarts - failures : 0);
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
        cJSON *p = read_fmt(r, "progress/%d", rank);
        if (!p) continue;
        cJSON_AddNumberToObject(p, "rank", rank);
        cJSON_DeleteItemFromObjectCaseSensitive(p, "event");
        cJSON_AddItemToArray(ranks, p);
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
        if (number(f, "signal", 0)) snprintf(how, sizeof how, "killed by signal %d", number(f, "signal", 0));
        else snprintf(how, sizeof how, "exit %d", number(f, "exit_code", number(f, "code", 0)));
        printf("last failure: round %d, node %d, rank %d, %s%s%s\n", number(f, "round", 0),
               number(f, "node", -1), number(f, "rank", -1), how,
               str_of(f, "time", NULL) ? " at " : "", str_of(f, "time", ""));
        const char *err = str_of(f, "error", NULL);
        if (err) printf("  %.300s\n", err);
    }
    printf("%-6s %-10s %-7s %-10s %-10s %s\n", "rank", "step", "epoch", "img/s", "snapshot", "time");
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

int status_cmd_main(int argc, char **argv) {
    char host[256] = "", id[128] = "", msg[256];
    uint16_t port = 0;
    bool is_json = false;
    long timeout_ms = 10000;
    optind = 1;
    opterr = 0;
    for (int opt; (opt = getopt_long(argc, argv, "+h", status_options, NULL)) != -1;) {
        switch (opt) {
        case 'h': fputs(status_usage, stdout); return 0;
        case 'e':
            if (endpoint_parse(optarg, 29400, host, sizeof host, &port, msg, sizeof msg) < 0) {
                fprintf(stderr, "ddprun status: --rdzv-endpoint: %s\n", msg);
                return 2;
            }
            break;
        case 'i': snprintf(id, sizeof id, "%s", optarg); break;
        case 'b':
            if (strcmp(optarg, "c10d") != 0 && strcmp(optarg, "static") != 0) {
                fprintf(stderr, "ddprun status: --rdzv-backend %s: c10d or static\n", optarg);
                return 2;
            }
            break;
        case 'j': is_json = true; break;
        case 't': timeout_ms = strtol(optarg, NULL, 10); break;
        default: fprintf(stderr, "ddprun status: unknown option %s\n%s", argv[optind - 1], status_usage); return 2;
        }
    }
    if (!host[0] || !id[0] || timeout_ms <= 0) {
        fprintf(stderr, "ddprun status: --rdzv-endpoint and --rdzv-id are needed\n%s", status_usage);
        return 2;
    }
    store_client_opts_t so = {.host = host, .port = port, .connect_timeout_ms = timeout_ms,
                              .op_timeout_ms = timeout_ms};
    reader_t r = {0};
    snprintf(r.prefix, sizeof r.prefix, "/ddprun/%s", id);
    if (store_client_connect(&so, &r.c) < 0) {
        fprintf(stderr, "ddprun status: %s\n", store_client_error(r.c));
        store_client_destroy(r.c);
        return 1;
    }
    cJSON *s = gather(&r);
    store_client_destroy(r.c);
    if (is_json) {
        char *text = cJSON_PrintUnformatted(s);
        printf("%s\n", text ? text : "{}");
        cJSON_free(text);
    } else {
        print_table(s, id);
    }
    int rc = strcmp(str_of(s, "state", ""), "unknown") == 0 ? 1 : 0;
    if (rc) fprintf(stderr, "ddprun status: no job '%s' in the store at %s:%u\n", id, host, port);
    cJSON_Delete(s);
    return rc;
}
