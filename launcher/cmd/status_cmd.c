/* status_cmd: `ddprun status`, a running job as its agents and workers left it in the store: the
 * round and its state, the nodes (host, node rank, ranks), restarts used and left, the last
 * failure (node, rank, exit code or signal, time, first lines of its error), and per rank the last
 * step, img/s and snapshot step (rendezvous.h's and status_report.h's records). As a table, or one
 * JSON object with --json. Reads only, never waits for a key (MULTI_GET, a few requests: the newest
 * 64 rounds are scanned in one), so a store that is there answers at once; the whole command is
 * bounded by --timeout (a watchdog thread interrupts what is in progress then). A read that fails
 * fails the command (exit 1, naming the store): a missing key is not an error, a lost connection
 * is. The calling thread, blocking. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "clock.h"
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

#define MAX_READ   4096 /* members, failures or ranks read in one status */
#define MAX_ROUNDS 64   /* rounds scanned back from the round counter, in one request */

/* The deadline of the whole command: at --timeout from the start, a watchdog thread interrupts
 * the operation in progress (the kvs' interrupt is safe from any thread), and read_many starts no
 * new one after it. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    uint64_t deadline_ms;
    rdzv_kv_t *kvs[2]; /* the job's kv and the round's store, under mu (published by main) */
    bool is_done, has_fired, is_running;
} watchdog_t;

typedef struct {
    rdzv_kv_t *kv;       /* the job's rendezvous: the store, or etcd */
    rdzv_kv_t *progress; /* etcd while the job runs: the round's store, where workers report */
    const ddprun_opts_t *opts;
    watchdog_t *dog;
    char where[1040]; /* the store's address (etcd: its members), for messages */
    char prefix[300];
    char err[768]; /* why the status cannot be read; set once */
    bool has_err;
} reader_t;

static void *watchdog_run(void *arg) {
    watchdog_t *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->is_done) {
        int left_ms = clock_remaining_ms(w->deadline_ms);
        if (left_ms == 0) {
            w->has_fired = true;
            for (int i = 0; i < 2; i++) {
                rdzv_kv_t *kv = __atomic_load_n(&w->kvs[i], __ATOMIC_ACQUIRE);
                if (kv && kv->ops->interrupt) kv->ops->interrupt(kv);
            }
            break;
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += left_ms / 1000;
        until.tv_nsec += (long)(left_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&w->cv, &w->mu, &until);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static void watchdog_stop(watchdog_t *w) {
    if (!w->is_running) return;
    pthread_mutex_lock(&w->mu);
    w->is_done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    w->is_running = false;
}

static bool watchdog_fired(watchdog_t *w) {
    pthread_mutex_lock(&w->mu);
    bool fired = w->has_fired || clock_remaining_ms(w->deadline_ms) == 0;
    pthread_mutex_unlock(&w->mu);
    return fired;
}

static void fail(reader_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(reader_t *r, const char *fmt, ...) {
    if (r->has_err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, sizeof r->err, fmt, ap);
    va_end(ap);
    r->has_err = true;
}

/* The keys rels[0, n) under the job's prefix, in one request, as JSON: out[i] NULL where missing
 * or not JSON. 0, or -1 when the read failed (is_optional: say nothing; else r->err says why,
 * naming the store and the first key). Nothing is read after the deadline or a failure. */
static int read_many(reader_t *r, rdzv_kv_t *kv, char (*rels)[64], size_t n, cJSON **out,
                     bool is_optional) {
    for (size_t i = 0; i < n; i++)
        out[i] = NULL;
    if (n == 0) return 0;
    if (r->has_err) return -1;
    if (watchdog_fired(r->dog)) {
        fail(r, "no answer from the store at %s within --timeout (reading %s/%s)", r->where,
             r->prefix, rels[0]);
        return -1;
    }
    char(*keys)[sizeof r->prefix + 64] = calloc(n, sizeof *keys);
    const char **key_ptrs = calloc(n, sizeof *key_ptrs);
    uint8_t **vals = calloc(n, sizeof *vals);
    size_t *lens = calloc(n, sizeof *lens);
    int rc = keys && key_ptrs && vals && lens ? 0 : -ENOMEM;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        snprintf(keys[i], sizeof keys[i], "%s/%s", r->prefix, rels[i]);
        key_ptrs[i] = keys[i];
    }
    if (rc == 0) rc = kv->ops->multi_get(kv, key_ptrs, n, vals, lens);
    if (rc == 0) {
        for (size_t i = 0; i < n; i++)
            out[i] = lens[i] ? cJSON_ParseWithLength((const char *)vals[i], lens[i]) : NULL;
    } else if (watchdog_fired(r->dog)) {
        fail(r, "no answer from the store at %s within --timeout (reading %s)", r->where,
             keys ? keys[0] : rels[0]);
    } else if (!is_optional) {
        fail(r, "reading %s from the store at %s failed: %s", keys ? keys[0] : rels[0], r->where,
             rc == -ENOMEM ? "out of memory" : kv->ops->error(kv));
    }
    for (size_t i = 0; vals && i < n; i++)
        free(vals[i]);
    free(keys);
    free(key_ptrs);
    free(vals);
    free(lens);
    return rc == 0 ? 0 : -1;
}

/* etcd: connect to the store node 0 of round `round` serves (in every member's rank record
 * r<R>/rank/<i>; join index 0 is a member of every round that closed). */
static void open_round_store(reader_t *r, int round) {
    char key[sizeof r->prefix + 64];
    snprintf(key, sizeof key, "%s/r%d/rank/0", r->prefix, round);
    const char *k = key;
    uint8_t *val = NULL;
    size_t n = 0;
    if (r->has_err || watchdog_fired(r->dog) || r->kv->ops->multi_get(r->kv, &k, 1, &val, &n) < 0) {
        free(val);
        return;
    }
    rdzv_rank_record_t place;
    bool is_ok = n && rdzv_record_rank_parse((const char *)val, n, &place);
    free(val);
    if (!is_ok || !place.store_host[0]) return;
    ddprun_opts_t o = *r->opts;
    strcpy(o.rdzv_backend, "c10d");
    snprintf(o.rdzv_host, sizeof o.rdzv_host, "%s", place.store_host);
    o.rdzv_port = place.store_port;
    int left_ms = clock_remaining_ms(r->dog->deadline_ms);
    int64_t t = left_ms < 2000 ? left_ms : 2000; /* gone when the job ended */
    rdzv_kv_t *kv = NULL;
    if (t <= 0 || rdzv_kv_connect(&o, NULL, t, t, &kv) < 0) {
        rdzv_kv_destroy(kv);
        return;
    }
    r->progress = kv;
    __atomic_store_n(&r->dog->kvs[1], kv, __ATOMIC_RELEASE);
}

static int number(const cJSON *o, const char *key, int def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? (int)v->valuedouble : def;
}

/* items are reused from read to read: each is NULL once deleted */
static void delete_all(cJSON **items, size_t n) {
    for (size_t i = 0; i < n; i++) {
        cJSON_Delete(items[i]);
        items[i] = NULL;
    }
}

/* The status as one JSON object, or NULL when it could not be read (r->err says why). */
static cJSON *gather(reader_t *r) {
    char(*rels)[64] = calloc(2 * MAX_READ + 2 * MAX_ROUNDS + 4, sizeof *rels);
    cJSON **vals = calloc(2 * MAX_READ + 2 * MAX_ROUNDS + 4, sizeof *vals);
    cJSON *out = NULL, *job = NULL;
    if (!rels || !vals) {
        fail(r, "out of memory");
        goto done;
    }
    strcpy(rels[0], "round");
    strcpy(rels[1], "job");
    strcpy(rels[2], "failures");
    if (read_many(r, r->kv, rels, 3, vals, false) < 0) goto done;
    cJSON *round_v = vals[0];
    job = vals[1];
    int failures = cJSON_IsNumber(vals[2]) ? (int)vals[2]->valuedouble : 0;
    vals[0] = vals[1] = NULL; /* round_v and job: taken */
    delete_all(vals + 2, 1);
    /* the counter is the store's, so anyone's: an integer in int's range, or no status */
    double round_d = cJSON_IsNumber(round_v) ? round_v->valuedouble : 0;
    bool is_round_ok = !round_v || (cJSON_IsNumber(round_v) && round_d >= 0 &&
                                    round_d <= INT_MAX - 1 && round_d == (double)(int)round_d);
    cJSON_Delete(round_v);
    if (!is_round_ok) {
        fail(r, "%s/round in the store at %s is not a round number (0-%d)", r->prefix, r->where,
             INT_MAX - 1);
        goto done;
    }
    int counter = (int)round_d;
    /* the newest round that has members (a round being joined has none yet) and the restart
     * records of the rounds before it, the newest MAX_ROUNDS in one request */
    int lo = counter >= MAX_ROUNDS ? counter - MAX_ROUNDS + 1 : 0, n_scan = counter - lo + 1;
    for (int i = 0; i < n_scan; i++) {
        snprintf(rels[2 * i], sizeof rels[0], "r%d/closed", counter - i);
        snprintf(rels[2 * i + 1], sizeof rels[0], "r%d/restart", counter - i);
    }
    if (read_many(r, r->kv, rels, 2 * (size_t)n_scan, vals, false) < 0) goto done;
    int found = -1, n_nodes = 0;
    for (int i = 0; i < n_scan && found < 0; i++)
        if (cJSON_IsNumber(vals[2 * i])) {
            found = counter - i;
            n_nodes = (int)vals[2 * i]->valuedouble;
        }
    if (n_nodes < 0) n_nodes = 0;
    if (n_nodes > MAX_READ) n_nodes = MAX_READ;
    /* the found round ended (a restart record) but its next has no members yet: restarting;
     * read before the failure's record is taken out of vals below */
    bool is_restarting = found >= 0 && vals[2 * (counter - found) + 1] != NULL;
    /* the last failure: the newest round up to the found one whose restart record names one */
    cJSON *why = NULL;
    int why_round = -1;
    for (int i = found < 0 ? n_scan : counter - found; i < n_scan && !why; i++) {
        cJSON *rec = vals[2 * i + 1];
        if (rec && number(rec, "code", 0) != 0) {
            why = rec;
            why_round = counter - i;
            vals[2 * i + 1] = NULL;
        }
    }
    delete_all(vals, 2 * (size_t)n_scan);
    out = cJSON_CreateObject();
    cJSON_AddNumberToObject(out, "round", found < 0 ? 0 : found);
    if (strcmp(r->opts->rdzv_backend, "etcd") == 0 && found >= 0) open_round_store(r, found);

    /* the round's end, members and failures in one request */
    size_t n = 0;
    int why_node = why ? number(why, "node", -1) : -1; /* the store's: bounded before use */
    if (why_node < -1 || why_node >= MAX_READ) why_node = -1;
    int n_fail = why ? (why_node + 1 > n_nodes ? why_node + 1 : n_nodes) : 0;
    if (n_fail > MAX_READ) n_fail = MAX_READ;
    if (found >= 0) snprintf(rels[n++], sizeof rels[0], "r%d/all_done", found);
    for (int i = 0; i < n_nodes; i++)
        snprintf(rels[n++], sizeof rels[0], "r%d/member/%d", found, i);
    for (int g = 0; g < n_fail; g++)
        snprintf(rels[n++], sizeof rels[0], "r%d/failure/%d", why_round, g);
    if (read_many(r, r->kv, rels, n, vals, false) < 0) {
        cJSON_Delete(why);
        goto done;
    }
    bool is_all_done = found >= 0 && vals[0];
    const char *state = !job            ? "unknown"
                        : is_all_done   ? "finished"
                        : is_restarting ? "restarting"
                        : n_nodes       ? "running"
                                        : "joining";
    cJSON_AddStringToObject(out, "state", state);
    int max_restarts = number(job, "max_restarts", 0);
    cJSON *restarts = cJSON_AddObjectToObject(out, "restarts");
    cJSON_AddNumberToObject(restarts, "used", failures);
    cJSON_AddNumberToObject(restarts, "left",
                            max_restarts > failures ? max_restarts - failures : 0);
    if (job) cJSON_AddItemToObject(out, "job", job);
    job = NULL;
    cJSON *nodes = cJSON_AddArrayToObject(out, "nodes");
    int world = 0;
    size_t at = found >= 0 ? 1 : 0;
    for (int i = 0; i < n_nodes; i++, at++) {
        cJSON *m = vals[at];
        vals[at] = NULL;
        if (!m) continue;
        world = number(m, "world_size", world);
        cJSON_AddItemToArray(nodes, m);
    }
    if (why) {
        /* the root cause: a node's own failure beats its peers' "peer failure" (75) that it set
         * off, whichever of them reached the restart key first */
        cJSON **fails = vals + at;
        cJSON *detail = why_node >= 0 && why_node < n_fail ? fails[why_node] : NULL;
        for (int g = 0; g < n_fail && (!detail || number(detail, "exit_code", 0) == 75); g++)
            if (fails[g] && number(fails[g], "exit_code", 0) != 75) detail = fails[g];
        for (int g = 0; g < n_fail; g++)
            if (fails[g] == detail) fails[g] = NULL;
        cJSON *failure = detail ? detail : why;
        if (detail) cJSON_Delete(why);
        cJSON_AddNumberToObject(failure, "round", why_round);
        cJSON_AddItemToObject(out, "last_failure", failure);
    }
    delete_all(vals, n);

    /* per rank progress and the newest resume: from the round's store while it is there (etcd),
     * else from the job's */
    if (world > MAX_READ) world = MAX_READ;
    if (world < 0) world = 0; /* a member record's world_size is anyone's */
    for (int rank = 0; rank < world; rank++)
        snprintf(rels[rank], sizeof rels[0], "progress/%d", rank);
    strcpy(rels[world], "progress/resume");
    n = (size_t)world + 1;
    cJSON **from_job = vals + n;
    for (size_t i = 0; i < n; i++) /* without a round store, only the job's are read */
        vals[i] = NULL;
    if (r->progress && read_many(r, r->progress, rels, n, vals, true) < 0 && r->has_err) goto done;
    if (read_many(r, r->kv, rels, n, from_job, false) < 0) {
        delete_all(vals, n);
        goto done;
    }
    cJSON *ranks = cJSON_AddArrayToObject(out, "ranks");
    for (size_t i = 0; i < n; i++) {
        cJSON *p = vals[i] ? vals[i] : from_job[i];
        if (p == vals[i]) cJSON_Delete(from_job[i]);
        if (!p) continue;
        cJSON_DeleteItemFromObjectCaseSensitive(p, "event");
        if (i < (size_t)world) {
            cJSON_AddNumberToObject(p, "rank", (double)i);
            cJSON_AddItemToArray(ranks, p);
        } else {
            cJSON_AddItemToObject(out, "last_resume", p);
        }
    }
done:
    cJSON_Delete(job);
    if (r->has_err) {
        cJSON_Delete(out);
        out = NULL;
    }
    free(rels);
    free(vals);
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
    uint64_t timeout_ms = 10000;
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
            if (parse_u64(optarg, 1, 86400000, &timeout_ms) < 0) {
                fprintf(stderr,
                        "ddprun status: --timeout %s is not milliseconds in [1, 86400000]\n",
                        optarg);
                return 2;
            }
            break;
        case 's':
            snprintf(o.store_secret_file, sizeof o.store_secret_file, "%s", optarg);
            break;
        default:
            fprintf(stderr, "ddprun status: unknown option %s\n%s", argv[optind - 1], status_usage);
            return 2;
        }
    }
    if (!o.rdzv_endpoints[0] || !o.rdzv_id[0]) {
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
    /* a static job's store is its MASTER_PORT, whose default is 29500 */
    uint16_t default_port = strcmp(o.rdzv_backend, "static") == 0 ? 29500 : DDP_DEFAULT_STORE_PORT;
    if (!is_etcd && endpoint_parse(o.rdzv_endpoints, default_port, o.rdzv_host, sizeof o.rdzv_host,
                                   &o.rdzv_port, msg, sizeof msg) < 0) {
        fprintf(stderr, "ddprun status: --rdzv-endpoint: %s\n", msg);
        return 2;
    }
    static watchdog_t dog; /* one per process: the command runs once */
    dog.deadline_ms = clock_deadline_ms((int64_t)timeout_ms);
    reader_t r = {.opts = &o, .dog = &dog};
    if (is_etcd)
        snprintf(r.where, sizeof r.where, "%s", o.rdzv_endpoints);
    else
        snprintf(r.where, sizeof r.where, strchr(o.rdzv_host, ':') ? "[%s]:%u" : "%s:%u",
                 o.rdzv_host, o.rdzv_port);
    int probe = is_etcd ? 0 : probe_store(o.rdzv_host, o.rdzv_port, (long)timeout_ms);
    if (probe == -ECONNREFUSED) {
        fprintf(stderr,
                "ddprun status: the job's store at %s is gone (connection refused): job '%s' "
                "has ended, or its host is down (or --rdzv-endpoint names another host or port)\n",
                r.where, o.rdzv_id);
        return 1;
    }
    if (probe < 0) {
        fprintf(stderr,
                "ddprun status: the job's store at %s cannot be reached (%s): its host is "
                "down or unreachable, or job '%s' has ended\n",
                r.where, probe == -ETIMEDOUT ? "no answer within --timeout" : strerror(-probe),
                o.rdzv_id);
        return 1;
    }
    snprintf(r.prefix, sizeof r.prefix, "/ddprun/%s", o.rdzv_id);
    pthread_mutex_init(&dog.mu, NULL);
    pthread_cond_init(&dog.cv, NULL);
    int left_ms = clock_remaining_ms(dog.deadline_ms);
    int64_t left = left_ms > 0 ? left_ms : 1;
    /* the kv is published before it connects: the watchdog can interrupt the connect too */
    dog.is_running = pthread_create(&dog.thread, NULL, watchdog_run, &dog) == 0;
    cJSON *s = NULL;
    if (rdzv_kv_connect(&o, NULL, left, left, &dog.kvs[0]) < 0) {
        r.kv = dog.kvs[0];
        fail(&r, "%s",
             watchdog_fired(&dog) ? "no answer from the store within --timeout"
             : r.kv               ? r.kv->ops->error(r.kv)
                                  : "cannot connect");
    } else {
        r.kv = dog.kvs[0];
        s = gather(&r);
    }
    watchdog_stop(&dog);
    rdzv_kv_destroy(r.kv);
    rdzv_kv_destroy(r.progress);
    pthread_cond_destroy(&dog.cv);
    pthread_mutex_destroy(&dog.mu);
    if (!s) {
        fprintf(stderr, "ddprun status: job '%s': %s\n", o.rdzv_id, r.err);
        return 1;
    }
    if (is_json) {
        char *text = cJSON_PrintUnformatted(s);
        printf("%s\n", text ? text : "{}");
        cJSON_free(text);
    } else {
        print_table(s, o.rdzv_id);
    }
    int rc = strcmp(str_of(s, "state", ""), "unknown") == 0 ? 1 : 0;
    if (rc) fprintf(stderr, "ddprun status: no job '%s' at %s\n", o.rdzv_id, r.where);
    cJSON_Delete(s);
    return rc;
}
