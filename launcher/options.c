/* options: see options.h. The table below is the single source of ddprun's launcher flags. */
#include "options.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "ddp_error.h"
#include "endpoint.h"
#include "store_limits.h"

typedef int (*opt_set_fn)(ddprun_opts_t *o, const char *value, char *err, size_t err_len);

typedef struct {
    const char *name; /* canonical dashed spelling; the underscored one is accepted too */
    char short_name;
    const char *metavar; /* NULL: a switch without value */
    const char *help;
    opt_set_fn set;
} opt_spec_t;

static int parse_int(const char *v, long min, long max, long *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < min || x > max) return -EINVAL;
    *out = x;
    return 0;
}

static int parse_seconds(const char *v, double *out) {
    char *end;
    double x = strtod(v, &end);
    if (!*v || *end || !(x >= 0) || x > 1e7) return -EINVAL;
    *out = x;
    return 0;
}

static int copy_str(char *dst, size_t cap, const char *v, const char *what, char *err, size_t el) {
    if (strlen(v) >= cap)
        return DDP_ERRF_EINVAL(err, el, "%s is longer than %zu characters", what, cap - 1);
    strcpy(dst, v);
    return 0;
}

/* ---- resource counting -------------------------------------------------------------------- */

/* Whitespace off both ends of s, in place. */
static char *trim(char *s) {
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* The devices CUDA_VISIBLE_DEVICES leaves visible, as CUDA reads it: the entries up to the first
 * that is not a device ("-1", "none", a negative index: the usual ways to hide every GPU), empty
 * entries ignored ("0,1," is two). */
static int count_visible(const char *visible) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", visible);
    int n = 0;
    for (char *save, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        item = trim(item);
        if (!*item) continue;
        if (strncmp(item, "GPU-", 4) == 0 || strncmp(item, "MIG-", 4) == 0) {
            n++;
            continue;
        }
        long index;
        char *end;
        errno = 0;
        index = strtol(item, &end, 10);
        if (end == item || *end || errno || index < 0) break;
        n++;
    }
    return n;
}

static int count_gpus(void) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (visible) return count_visible(visible);
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* ---- setters ------------------------------------------------------------------------------ */

static int set_nnodes(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long lo, hi;
    const char *colon = strchr(v, ':');
    char first[32];
    if (colon) {
        size_t n = (size_t)(colon - v);
        if (n >= sizeof first)
            return DDP_ERRF_EINVAL(err, el, "--nnodes: '%s' is not N or MIN:MAX", v);
        memcpy(first, v, n);
        first[n] = '\0';
    }
    if (parse_int(colon ? first : v, 1, 100000, &lo) < 0 ||
        parse_int(colon ? colon + 1 : v, 1, 100000, &hi) < 0 || lo > hi)
        return DDP_ERRF_EINVAL(err, el, "--nnodes: '%s' is not N or MIN:MAX with 1 <= MIN <= MAX",
                               v);
    o->min_nodes = (unsigned)lo;
    o->max_nodes = (unsigned)hi;
    return 0;
}

static int set_nproc(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long n;
    int gpus = count_gpus();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (strcmp(v, "cpu") == 0)
        n = cpus;
    else if (strcmp(v, "gpu") == 0) {
        if (gpus == 0)
            return DDP_ERRF_EINVAL(err, el, "--nproc-per-node gpu: no GPU is visible here");
        n = gpus;
    } else if (strcmp(v, "auto") == 0)
        n = gpus > 0 ? gpus : cpus;
    else if (parse_int(v, 1, DDP_MAX_LOCAL_WORKERS, &n) < 0)
        return DDP_ERRF_EINVAL(err, el,
                               "--nproc-per-node: '%s' is not a count (1-%d), cpu, gpu or auto", v,
                               DDP_MAX_LOCAL_WORKERS);
    if (n > DDP_MAX_LOCAL_WORKERS) n = DDP_MAX_LOCAL_WORKERS;
    o->nproc_per_node = (int)n;
    return 0;
}

static int set_node_rank(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long r;
    if (parse_int(v, 0, 100000, &r) < 0)
        return DDP_ERRF_EINVAL(err, el, "--node-rank: '%s' is not >= 0", v);
    o->node_rank = (int)r;
    return 0;
}

static int set_backend(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    o->is_backend_given = true;
    if (strcmp(v, "etcd-v2") == 0)
        return DDP_ERRF_EINVAL(err, el,
                               "--rdzv-backend etcd-v2: etcd's v2 API is off by default since etcd "
                               "3.4 and removed in 3.6; ddprun's etcd backend speaks the v3 API: "
                               "use --rdzv-backend etcd");
    if (strcmp(v, "etcd-v3") == 0) v = "etcd";
    if (strcmp(v, "c10d") && strcmp(v, "static") && strcmp(v, "etcd"))
        return DDP_ERRF_EINVAL(err, el, "--rdzv-backend: '%s' is not c10d, etcd or static", v);
    strcpy(o->rdzv_backend, v);
    return 0;
}

/* Kept as given, without the whitespace around it (torch strips it): a list for etcd,
 * HOST[:PORT] for the store (parsed in finish, once the backend is known whatever the order of
 * the flags). */
static int set_endpoint(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    char buf[sizeof o->rdzv_endpoints];
    if (copy_str(buf, sizeof buf, v, "--rdzv-endpoint", err, el) < 0) return -EINVAL;
    strcpy(o->rdzv_endpoints, trim(buf));
    o->has_rdzv_endpoint = true;
    o->is_endpoint_given = true;
    return 0;
}

/* torch's RendezvousParameters.get_as_bool spellings, any case. 1, 0, or -1: not a bool. */
static int parse_bool(const char *v) {
    static const char *const yes[] = {"1", "true", "t", "yes", "y"};
    static const char *const no[] = {"0", "false", "f", "no", "n"};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        if (strcasecmp(v, yes[i]) == 0) return 1;
        if (strcasecmp(v, no[i]) == 0) return 0;
    }
    return -1;
}

static int set_rdzv_id(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return copy_str(o->rdzv_id, sizeof o->rdzv_id, v, "--rdzv-id", err, el);
}

int options_set_rdzv_conf(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    struct {
        const char *key;
        double *field;
    } keys[] = {{"join_timeout", &o->join_timeout_s},
                {"last_call_timeout", &o->last_call_timeout_s},
                {"close_timeout", &o->close_timeout_s},
                {"heartbeat_timeout", &o->heartbeat_timeout_s},
                {"keep_alive_interval", &o->keep_alive_interval_s},
                {"read_timeout", &o->read_timeout_s},
                {"lease_ttl", &o->lease_ttl_s},
                {"status_ttl", &o->status_ttl_s},
                {"timeout", &o->join_timeout_s}};
    char buf[1024];
    if (copy_str(buf, sizeof buf, v, "--rdzv-conf", err, el) < 0) return -EINVAL;
    bool is_heartbeat_given = false;
    for (char *save, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) {
            if (!*trim(item)) continue; /* "a=1, ,b=2" or a trailing comma */
            return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: '%s' is not key=value", item);
        }
        *eq = '\0';
        item = trim(item); /* "join_timeout=900, read_timeout=300": torch strips both sides */
        const char *v2 = trim(eq + 1);
        if (strcmp(item, "is_host") == 0) {
            int b = parse_bool(v2);
            if (b < 0)
                return DDP_ERRF_EINVAL(
                    err, el, "--rdzv-conf: is_host=%s is not true or false (1/0, yes/no)", v2);
            o->is_host = b;
            continue;
        }
        if (strcmp(item, "keep_alive_max_attempt") == 0) {
            long n;
            if (parse_int(v2, 1, 1000000, &n) < 0)
                return DDP_ERRF_EINVAL(
                    err, el, "--rdzv-conf: keep_alive_max_attempt=%s is not a count >= 1", v2);
            o->keep_alive_max_attempts = (int)n;
            continue;
        }
        is_heartbeat_given |= strcmp(item, "heartbeat_timeout") == 0;
        struct {
            const char *key;
            char *field;
            size_t size;
        } texts[] = {{"cacert", o->etcd_cacert, sizeof o->etcd_cacert},
                     {"cert", o->etcd_cert, sizeof o->etcd_cert},
                     {"key", o->etcd_key, sizeof o->etcd_key},
                     {"user", o->etcd_user, sizeof o->etcd_user},
                     {"password", o->etcd_password, sizeof o->etcd_password},
                     {"password_file", o->etcd_password_file, sizeof o->etcd_password_file}};
        size_t t = 0;
        while (t < sizeof texts / sizeof texts[0] && strcmp(texts[t].key, item) != 0)
            t++;
        if (t < sizeof texts / sizeof texts[0]) {
            if (strlen(v2) >= texts[t].size) /* never echo the value: it may be a password */
                return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: %s is longer than %zu bytes", item,
                                       texts[t].size - 1);
            strcpy(texts[t].field, v2);
            continue;
        }
        if (strcmp(item, "store_type") == 0) {
            if (strcasecmp(v2, "tcp") != 0)
                return DDP_ERRF_EINVAL(err, el,
                                       "--rdzv-conf: store_type=%s: ddprun's rendezvous store is a "
                                       "TCP store (store_type=tcp); a file store is not supported",
                                       v2);
            continue;
        }
        size_t i = 0, n = sizeof keys / sizeof keys[0];
        while (i < n && strcmp(keys[i].key, item) != 0)
            i++;
        if (i == n)
            return DDP_ERRF_EINVAL(
                err, el,
                "--rdzv-conf: unknown key '%s' (join_timeout, last_call_timeout, "
                "close_timeout, heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, "
                "read_timeout, is_host, store_type; etcd: lease_ttl, status_ttl, "
                "cacert, cert, key, user, password, password_file)",
                item);
        if (parse_seconds(v2, keys[i].field) < 0)
            return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: %s=%s is not a number of seconds", item,
                                   v2);
    }
    if (o->keep_alive_max_attempts > 0) {
        /* torch's c10d rendezvous: a node is lost after keep_alive_max_attempt missed beats,
         * whichever order the two keys came in */
        if (is_heartbeat_given)
            return DDP_ERRF_EINVAL(err, el,
                                   "--rdzv-conf: heartbeat_timeout and keep_alive_max_attempt "
                                   "both set how long a silent node lives: give one");
        o->heartbeat_timeout_s = o->keep_alive_interval_s * o->keep_alive_max_attempts;
    }
    return 0;
}

static int set_start_method(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (strcmp(v, "spawn") && strcmp(v, "fork") && strcmp(v, "forkserver"))
        return DDP_ERRF_EINVAL(err, el, "--start-method: '%s' is not spawn, fork or forkserver", v);
    strcpy(o->start_method, v);
    return 0;
}

static int set_run_path(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    (void)o, (void)v, (void)err, (void)el; /* a script already runs as __main__ (runpy's effect) */
    return 0;
}

static int set_standalone(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    (void)v, (void)err, (void)el;
    o->is_standalone = true;
    return 0;
}

static int set_max_restarts(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long n;
    if (parse_int(v, 0, 1000000, &n) < 0)
        return DDP_ERRF_EINVAL(err, el, "--max-restarts: '%s' is not >= 0", v);
    o->max_restarts = (int)n;
    return 0;
}

static int set_monitor(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (parse_seconds(v, &o->monitor_interval_s) < 0)
        return DDP_ERRF_EINVAL(err, el, "--monitor-interval: '%s' is not a number of seconds", v);
    return 0;
}

static int set_role(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return copy_str(o->role, sizeof o->role, v, "--role", err, el);
}

static int set_log_dir(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return copy_str(o->log_dir, sizeof o->log_dir, v, "--log-dir", err, el);
}

/* torchrun's Std spec: "3" for every rank, or "0:1,1:2" per local rank; 0 none 1 out 2 err 3 both.
 */
static int parse_std_spec(uint8_t *masks, const char *v, const char *flag, char *err, size_t el) {
    long m;
    if (parse_int(v, 0, 3, &m) == 0) {
        memset(masks, (int)m, DDP_MAX_LOCAL_WORKERS);
        return 0;
    }
    char buf[1024];
    if (copy_str(buf, sizeof buf, v, flag, err, el) < 0) return -EINVAL;
    memset(masks, 0, DDP_MAX_LOCAL_WORKERS);
    for (char *save, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        long rank;
        if (colon) *colon = '\0';
        if (!colon || parse_int(item, 0, DDP_MAX_LOCAL_WORKERS - 1, &rank) < 0 ||
            parse_int(colon + 1, 0, 3, &m) < 0)
            return DDP_ERRF_EINVAL(err, el, "%s: '%s' is not 0-3 or LOCAL_RANK:0-3,...", flag, v);
        masks[rank] = (uint8_t)m;
    }
    return 0;
}

static int set_redirects(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return parse_std_spec(o->redirects, v, "--redirects", err, el);
}

static int set_tee(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return parse_std_spec(o->tee, v, "--tee", err, el);
}

static int set_ranks_filter(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    char buf[1024];
    if (copy_str(buf, sizeof buf, v, "--local-ranks-filter", err, el) < 0) return -EINVAL;
    /* torchrun: an empty filter is no filter (every rank shown) */
    memset(o->is_rank_shown, !*trim(buf), sizeof o->is_rank_shown);
    for (char *save, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        long r;
        if (parse_int(item, 0, DDP_MAX_LOCAL_WORKERS - 1, &r) < 0)
            return DDP_ERRF_EINVAL(err, el,
                                   "--local-ranks-filter: '%s' is not a list of local ranks", v);
        o->is_rank_shown[r] = true;
    }
    return 0;
}

/* torchrun documents "[::1]" for IPv6: kept without the brackets, as endpoint_parse does. */
static int set_master_addr(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    size_t n = strlen(v);
    if (n >= 2 && v[0] == '[' && v[n - 1] == ']') {
        if (n == 2 || n - 2 >= sizeof o->master_addr)
            return DDP_ERRF_EINVAL(err, el, "--master-addr: '%s' is not a host", v);
        memcpy(o->master_addr, v + 1, n - 2);
        o->master_addr[n - 2] = '\0';
    } else if (copy_str(o->master_addr, sizeof o->master_addr, v, "--master-addr", err, el) < 0) {
        return -EINVAL;
    }
    o->is_master_addr_given = true;
    return 0;
}

static int set_master_port(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long p;
    if (parse_int(v, 0, 65535, &p) < 0)
        return DDP_ERRF_EINVAL(err, el, "--master-port: '%s' is not a port", v);
    o->master_port = (uint16_t)p;
    o->is_master_port_given = true;
    return 0;
}

static int set_local_addr(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    return copy_str(o->local_addr, sizeof o->local_addr, v, "--local-addr", err, el);
}

static int set_no_python(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    (void)v, (void)err, (void)el;
    o->is_no_python = true;
    return 0;
}

static int set_module(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    (void)v, (void)err, (void)el;
    o->is_module = true;
    return 0;
}

static int set_signals(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    static const struct {
        const char *name;
        int num;
    } names[] = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},
                 {"SIGQUIT", SIGQUIT}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}};
    char buf[256];
    if (copy_str(buf, sizeof buf, v, "--signals-to-handle", err, el) < 0) return -EINVAL;
    o->n_signals = 0;
    for (char *save, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*item))
            item++;
        size_t i = 0, n = sizeof names / sizeof names[0];
        while (i < n && strcmp(names[i].name, item) != 0)
            i++;
        if (i == n || o->n_signals == DDP_MAX_SIGNALS)
            return DDP_ERRF_EINVAL(
                err, el,
                "--signals-to-handle: '%s' is not one of SIGTERM, SIGINT, SIGHUP, "
                "SIGQUIT, SIGUSR1, SIGUSR2",
                item);
        o->signals[o->n_signals++] = names[i].num;
    }
    return 0;
}

static int set_shutdown_timeout(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (parse_seconds(v, &o->shutdown_timeout_s) < 0)
        return DDP_ERRF_EINVAL(err, el, "--shutdown-timeout: '%s' is not a number of seconds", v);
    return 0;
}

static int set_hang_timeout(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (parse_seconds(v, &o->hang_timeout_s) < 0)
        return DDP_ERRF_EINVAL(err, el, "--hang-timeout: '%s' is not a number of seconds", v);
    return 0;
}

static int set_store_max_value(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    long n;
    if (parse_int(v, 1, 1L << 30, &n) < 0)
        return DDP_ERRF_EINVAL(err, el,
                               "--store-max-value: '%s' is not a byte count in [1, 1073741824]", v);
    o->store_max_value_bytes = (size_t)n;
    return 0;
}

static int set_start_timeout(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (parse_seconds(v, &o->start_timeout_s) < 0)
        return DDP_ERRF_EINVAL(err, el, "--start-timeout: '%s' is not a number of seconds", v);
    return 0;
}

static int set_warm_spares(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    if (strcmp(v, "auto") == 0)
        o->warm_spares = -1;
    else if (strcmp(v, "0") == 0 || strcmp(v, "1") == 0)
        o->warm_spares = v[0] - '0';
    else
        return DDP_ERRF_EINVAL(err, el, "--warm-spares: '%s' is not 0, 1 or auto", v);
    return 0;
}

static int set_store_secret_file(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    char path[PATH_MAX];
    if (!realpath(v, path))
        return DDP_ERRF_EINVAL(err, el, "--store-secret-file %s: %s", v, strerror(errno));
    return copy_str(o->store_secret_file, sizeof o->store_secret_file, path, "--store-secret-file",
                    err, el);
}

static int set_dry_run(ddprun_opts_t *o, const char *v, char *err, size_t el) {
    (void)v, (void)err, (void)el;
    o->is_dry_run = true;
    return 0;
}

static const opt_spec_t opt_table[] = {
    {"nnodes", 0, "N|MIN:MAX", "number of nodes, or a range for elastic jobs (1:1)", set_nnodes},
    {"nproc-per-node", 0, "N|cpu|gpu|auto", "workers per node (1)", set_nproc},
    {"node-rank", 0, "R", "this node's rank hint (static backend: its rank, default 0)",
     set_node_rank},
    {"rdzv-backend", 0, "c10d|etcd|static", "rendezvous backend (static)", set_backend},
    {"rdzv-endpoint", 0, "HOST[:PORT]",
     "the store of the rendezvous ([v6]:port too; port 29400); "
     "etcd: H1[:2379],H2,... its members",
     set_endpoint},
    {"rdzv-id", 0, "ID", "job id shared by all nodes (none)", set_rdzv_id},
    {"rdzv-conf", 0, "K=V,...",
     "join_timeout, last_call_timeout, close_timeout, "
     "heartbeat_timeout, keep_alive_interval, read_timeout (seconds), keep_alive_max_attempt, "
     "is_host (true|false), store_type (tcp); etcd: lease_ttl (10), "
     "cacert, cert, key, user, password_file, status_ttl (3600)",
     options_set_rdzv_conf},
    {"standalone", 0, NULL, "single node: own store on a free port, random job id", set_standalone},
    {"max-restarts", 0, "N", "restarts of the whole job before giving up (0)", set_max_restarts},
    {"monitor-interval", 0, "SECONDS", "how often workers are checked (0.1)", set_monitor},
    {"role", 0, "NAME", "role of the workers (default)", set_role},
    {"log-dir", 0, "DIR", "per-rank, per-attempt log files go here", set_log_dir},
    {"redirects", 'r', "0-3|R:0-3,...", "send worker stdout(1)/stderr(2)/both(3) to files only",
     set_redirects},
    {"tee", 't', "0-3|R:0-3,...", "copy worker stdout(1)/stderr(2)/both(3) to files too", set_tee},
    {"local-ranks-filter", 0, "R,...", "show only these local ranks on the console",
     set_ranks_filter},
    {"master-addr", 0, "HOST",
     "static backend without --rdzv-endpoint: the store's host (127.0.0.1; [::1] too)",
     set_master_addr},
    {"master-port", 0, "PORT", "static backend without --rdzv-endpoint: the store's port (29500)",
     set_master_port},
    {"local-addr", 0, "HOST", "this node's address as others reach it", set_local_addr},
    {"no-python", 0, NULL, "run the program directly, not under python3", set_no_python},
    {"module", 'm', NULL, "the program is a Python module (python3 -m)", set_module},
    {"signals-to-handle", 0, "SIG,...",
     "signals forwarded to the workers "
     "(SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
     set_signals},
    {"shutdown-timeout", 0, "SECONDS", "grace after forwarding a signal, then SIGKILL (30)",
     set_shutdown_timeout},
    {"hang-timeout", 0, "SECONDS",
     "restart the job when a worker that reports progress "
     "(ddpworker does) makes none for this long (0: off)",
     set_hang_timeout},
    {"store-max-value", 0, "BYTES",
     "the longest value the job's store accepts (8388608, as "
     "PyTorch's)",
     set_store_max_value},
    {"start-timeout", 0, "SECONDS",
     "restart the job when a worker has reported no progress this "
     "long after its start (120 for train.conf, else 0: off)",
     set_start_timeout},
    {"start-method", 0, "spawn|fork|forkserver",
     "accepted for torchrun's scripts: workers "
     "are always new processes (exec)",
     set_start_method},
    {"run-path", 0, NULL, "accepted for torchrun's scripts: a script always runs as __main__",
     set_run_path},
    {"warm-spares", 0, "0|1|auto",
     "keep an initialized spare train.conf worker per local rank "
     "that a restart takes over (auto: on a GPU node)",
     set_warm_spares},
    {"store-secret-file", 0, "FILE",
     "the store's shared secret (as ddprun store --secret-file; else "
     "$DDPRUN_STORE_SECRET[_FILE]): agents, workers and the hosted store prove it",
     set_store_secret_file},
    {"dry-run", 0, NULL, "print the resolved configuration and exit", set_dry_run},
};
#define N_OPTS (sizeof opt_table / sizeof opt_table[0])

void options_print_help(FILE *f) {
    fputs("usage: ddprun [options] PROGRAM [ARGS...]\n"
          "       ddprun store|store-client ...   (ddprun store --help)\n"
          "       ddprun plot RUN.jsonl... -o curves.png|.svg [--csv curves.csv]\n\n"
          "Run PROGRAM on every node as torchrun does: train.conf runs the built-in trainer,\n"
          "script.py runs under python3 -u, anything else is executed. Options may also come from\n"
          "PET_<NAME> environment variables (PET_NPROC_PER_NODE=4); dashes and underscores are\n"
          "alike in flag names (--nproc_per_node).\n\n",
          f);
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt_spec_t *s = &opt_table[i];
        char left[64];
        if (s->short_name)
            snprintf(left, sizeof left, "-%c, --%s%s%s", s->short_name, s->name,
                     s->metavar ? " " : "", s->metavar ? s->metavar : "");
        else
            snprintf(left, sizeof left, "    --%s%s%s", s->name, s->metavar ? " " : "",
                     s->metavar ? s->metavar : "");
        fprintf(f, "  %-36s %s\n", left, s->help);
    }
    fputs("      --version                        version, commit, backends and collectives\n"
          "  -h, --help                           this text\n",
          f);
}

static void set_defaults(ddprun_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->min_nodes = o->max_nodes = 1;
    o->nproc_per_node = 1;
    o->node_rank = -1;
    strcpy(o->rdzv_backend, "static");
    strcpy(o->rdzv_id, "none");
    o->rdzv_port = DDP_DEFAULT_STORE_PORT;
    o->join_timeout_s = 600;
    o->last_call_timeout_s = 1;
    o->close_timeout_s = 30;
    o->heartbeat_timeout_s = 30;
    o->keep_alive_interval_s = 5;
    o->read_timeout_s = 60; /* torch's c10d rendezvous default */
    o->lease_ttl_s = 10;
    o->status_ttl_s = 3600;
    o->start_timeout_s = -1; /* not given: decided by the program (finish) */
    o->warm_spares = -1;     /* auto (finish) */
    o->store_max_value_bytes = STORE_DEFAULT_MAX_VALUE_BYTES;
    o->is_host = -1;
    strcpy(o->start_method, "spawn");
    o->monitor_interval_s = 0.1;
    strcpy(o->role, "default");
    memset(o->is_rank_shown, 1, sizeof o->is_rank_shown);
    strcpy(o->master_addr, "127.0.0.1");
    o->master_port = 29500;
    o->signals[0] = SIGTERM;
    o->signals[1] = SIGINT;
    o->signals[2] = SIGHUP;
    o->signals[3] = SIGQUIT;
    o->n_signals = 4;
    o->shutdown_timeout_s = 30;
}

/* The table entry for a flag name, dashes and underscores alike. */
static const opt_spec_t *find_long(const char *name, size_t len) {
    for (size_t i = 0; i < N_OPTS; i++) {
        const char *n = opt_table[i].name;
        if (strlen(n) != len) continue;
        size_t j = 0;
        while (j < len && (n[j] == name[j] || (n[j] == '-' && name[j] == '_')))
            j++;
        if (j == len) return &opt_table[i];
    }
    return NULL;
}

static const opt_spec_t *find_short(char c) {
    for (size_t i = 0; i < N_OPTS; i++)
        if (opt_table[i].short_name == c) return &opt_table[i];
    return NULL;
}

static int apply_env(ddprun_opts_t *o, char *err, size_t el) {
    for (size_t i = 0; i < N_OPTS; i++) {
        char env[64] = "PET_";
        size_t n = 4;
        for (const char *p = opt_table[i].name; *p && n < sizeof env - 1; p++)
            env[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
        env[n] = '\0';
        const char *v = getenv(env);
        if (!v || (!opt_table[i].metavar && (!*v || strcmp(v, "0") == 0))) continue;
        char msg[512];
        if (opt_table[i].set(o, v, msg, sizeof msg) < 0)
            return DDP_ERRF_EINVAL(err, el, "%s (from $%s)", msg, env);
    }
    return 0;
}

/* etcd: the endpoint list, the lease, TLS files that exist, and the password (from password=,
 * password_file= or $DDPRUN_ETCD_PASSWORD) when there is a user. */
int options_finish_etcd(ddprun_opts_t *o, char *err, size_t el) {
#ifndef DDP_HAVE_ETCD /* rdzv/rdzv_kv's build, libcurl found or not */
    return DDP_ERRF_EINVAL(err, el,
                           "--rdzv-backend etcd: this ddprun was built without libcurl, "
                           "so without its etcd backend");
#endif
    if (!o->has_rdzv_endpoint || !o->rdzv_endpoints[0])
        return DDP_ERRF_EINVAL(err, el,
                               "--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT],...");
    if (o->lease_ttl_s < 1 || o->lease_ttl_s > 3600)
        return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: lease_ttl=%g is not 1-3600 seconds",
                               o->lease_ttl_s);
    if (o->status_ttl_s < 1 || o->status_ttl_s > 30 * 86400)
        return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: status_ttl=%g is not 1 s - 30 days",
                               o->status_ttl_s);
    const char *files[] = {o->etcd_cacert, o->etcd_cert, o->etcd_key};
    const char *names[] = {"cacert", "cert", "key"};
    for (int i = 0; i < 3; i++)
        if (files[i][0] && access(files[i], R_OK) != 0)
            return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: %s=%s: %s", names[i], files[i],
                                   strerror(errno));
    if (!o->etcd_cert[0] != !o->etcd_key[0])
        return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: cert= and key= go together");
    const char *env = getenv("DDPRUN_ETCD_PASSWORD");
    if (o->etcd_password_file[0]) {
        FILE *f = fopen(o->etcd_password_file, "r");
        if (!f)
            return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: password_file=%s: %s",
                                   o->etcd_password_file, strerror(errno));
        size_t n = fread(o->etcd_password, 1, sizeof o->etcd_password - 1, f);
        bool is_long = n == sizeof o->etcd_password - 1 && fgetc(f) != EOF;
        fclose(f);
        o->etcd_password[n] = '\0';
        o->etcd_password[strcspn(o->etcd_password, "\r\n")] = '\0';
        if (is_long)
            return DDP_ERRF_EINVAL(err, el, "--rdzv-conf: password_file=%s: longer than %zu bytes",
                                   o->etcd_password_file, sizeof o->etcd_password - 1);
    } else if (!o->etcd_password[0] && env && strlen(env) < sizeof o->etcd_password) {
        strcpy(o->etcd_password, env);
    }
    if (o->etcd_user[0] && !o->etcd_password[0])
        return DDP_ERRF_EINVAL(err, el,
                               "--rdzv-conf: user=%s needs a password (password_file=, "
                               "$DDPRUN_ETCD_PASSWORD or password=)",
                               o->etcd_user);
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "%.*s", (int)strcspn(o->rdzv_endpoints, ","),
             o->rdzv_endpoints);
    return 0;
}

/* --standalone and the backends' implied settings; errors for combinations torchrun rejects. */
static int finish(ddprun_opts_t *o, char *err, size_t el) {
    const char *prog = o->program_argv[0];
    size_t prog_len = strlen(prog);
    bool is_builtin = prog_len > 5 && strcmp(prog + prog_len - 5, ".conf") == 0;
    /* only ddpworker is known to report progress from its start */
    if (o->start_timeout_s < 0) o->start_timeout_s = is_builtin ? 120 : 0;
    /* only ddpworker can wait as a spare; on a GPU a fresh one spends most of its start on the
     * CUDA context and the libraries' handles */
    if (o->warm_spares == 1 && !is_builtin)
        return DDP_ERRF_EINVAL(
            err, el,
            "--warm-spares 1: only the built-in trainer (a train.conf) can wait as "
            "a spare, not %s",
            prog);
    if (o->warm_spares < 0) o->warm_spares = is_builtin && count_gpus() > 0;
    if (o->slurm_job_id[0] && (o->is_master_addr_given || o->is_master_port_given) &&
        !o->is_backend_given && !o->is_endpoint_given) {
        /* the user named the store of torchrun's default backend: the allocation's c10d
         * rendezvous gives way (its host and port stay the defaults of the half not given) */
        strcpy(o->rdzv_backend, "static");
        o->has_rdzv_endpoint = false;
    }
    if (o->is_standalone) {
        if (o->is_endpoint_given)
            fprintf(stderr, "ddprun: --standalone ignores --rdzv-endpoint %s\n", o->rdzv_endpoints);
        strcpy(o->rdzv_backend, "c10d");
        strcpy(o->rdzv_host, "127.0.0.1");
        o->rdzv_port = 0; /* a free one */
        o->has_rdzv_endpoint = true;
        o->min_nodes = o->max_nodes = 1;
        uint8_t id[8];
        if (getrandom(id, sizeof id, 0) != (ssize_t)sizeof id) memset(id, 0x5a, sizeof id);
        snprintf(o->rdzv_id, sizeof o->rdzv_id, "%02x%02x%02x%02x-%02x%02x%02x%02x", id[0], id[1],
                 id[2], id[3], id[4], id[5], id[6], id[7]);
    }
    bool is_etcd = strcmp(o->rdzv_backend, "etcd") == 0;
    bool is_static = strcmp(o->rdzv_backend, "static") == 0;
    /* none given and none from Slurm's defaults (which set the endpoint, not is_endpoint_given) */
    if ((o->is_endpoint_given ? !o->rdzv_endpoints[0] : !o->has_rdzv_endpoint) &&
        !o->is_standalone && !is_etcd && !is_static) {
        /* torch's parse_rendezvous_endpoint of "" or none: torchrun's c10d meets there */
        strcpy(o->rdzv_host, "localhost");
        o->rdzv_port = DDP_DEFAULT_STORE_PORT;
        o->has_rdzv_endpoint = true;
    }
    if (o->is_endpoint_given && !o->is_standalone && !is_etcd && o->rdzv_endpoints[0]) {
        char msg[256];
        if (strchr(o->rdzv_endpoints, ','))
            return DDP_ERRF_EINVAL(err, el,
                                   "--rdzv-endpoint %s: a list of endpoints is for --rdzv-backend "
                                   "etcd; %s takes one HOST[:PORT]",
                                   o->rdzv_endpoints, o->rdzv_backend);
        if (endpoint_parse(o->rdzv_endpoints, is_static ? 0 : DDP_DEFAULT_STORE_PORT, o->rdzv_host,
                           sizeof o->rdzv_host, &o->rdzv_port, msg, sizeof msg) < 0)
            return DDP_ERRF_EINVAL(err, el, "--rdzv-endpoint: %s", msg);
        if (is_static && o->rdzv_port == 0)
            return DDP_ERRF_EINVAL(err, el,
                                   "--rdzv-endpoint %s: the static backend needs HOST:PORT (as "
                                   "torchrun)",
                                   o->rdzv_endpoints);
    }
    if (is_etcd && options_finish_etcd(o, err, el) < 0) return -EINVAL;
    if (strcmp(o->rdzv_backend, "static") == 0) {
        if (o->min_nodes != o->max_nodes)
            return DDP_ERRF_EINVAL(
                err, el, "--nnodes %u:%u needs --rdzv-backend c10d (static is fixed-size)",
                o->min_nodes, o->max_nodes);
        if (o->node_rank < 0)
            o->node_rank = 0; /* torchrun's default: the card's command is node 0 */
        if (o->node_rank >= (int)o->min_nodes)
            return DDP_ERRF_EINVAL(err, el, "--node-rank %d is not below --nnodes %u", o->node_rank,
                                   o->min_nodes);
        /* The static backend's store, hosted by node 0: --rdzv-endpoint when given (parsed
         * above), else MASTER_ADDR:MASTER_PORT, as torchrun's get_rdzv_endpoint. */
        if (!o->is_endpoint_given || !o->rdzv_endpoints[0]) {
            strcpy(o->rdzv_host, o->master_addr);
            o->rdzv_port = o->master_port;
        }
        o->has_rdzv_endpoint = true;
    } else if (!o->has_rdzv_endpoint) {
        return DDP_ERRF_EINVAL(err, el, "--rdzv-backend %s needs --rdzv-endpoint %s",
                               o->rdzv_backend, is_etcd ? "HOST[:PORT],..." : "HOST[:PORT]");
    }
    if (o->is_no_python && o->is_module)
        return DDP_ERRF_EINVAL(err, el, "--no-python and --module exclude each other");
    return options_load_store_secret(o, err, el);
}

int options_load_store_secret(ddprun_opts_t *o, char *err, size_t el) {
    char msg[512];
    int rc = store_auth_init();
    if (rc == 0)
        rc = store_secret_load(o->store_secret_file[0] ? o->store_secret_file : NULL,
                               &o->store_secret, msg, sizeof msg);
    else
        snprintf(msg, sizeof msg, "libsodium failed to start");
    if (rc < 0) return DDP_ERRF_EINVAL(err, el, "%s", msg);
    return 0;
}

int options_parse(int argc, char **argv, ddprun_opts_t *o, options_defaults_fn defaults,
                  FILE *errf_out) {
    char err[768];
    set_defaults(o);
    int rc = defaults ? defaults(o, err, sizeof err) : 0; /* then PET_* and flags override them */
    if (rc == 0) rc = apply_env(o, err, sizeof err);
    int i = 1;
    for (; rc == 0 && i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[0] != '-' || a[1] == '\0') break; /* the program */
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            options_print_help(stdout);
            return 1;
        }
        const opt_spec_t *s;
        const char *value = NULL;
        if (a[1] == '-') {
            const char *eq = strchr(a + 2, '=');
            s = find_long(a + 2, eq ? (size_t)(eq - a - 2) : strlen(a + 2));
            if (eq) value = eq + 1;
        } else {
            s = find_short(a[1]);
            if (s && a[2] != '\0') {
                if (s->metavar)
                    value = a + 2; /* -r3, as argparse */
                else
                    s = NULL;
            }
        }
        if (!s) {
            rc = DDP_ERRF_EINVAL(err, sizeof err, "unknown option %s", a);
            break;
        }
        if (s->metavar && !value) {
            if (i + 1 >= argc) {
                rc = DDP_ERRF_EINVAL(err, sizeof err, "option --%s needs a value (%s)", s->name,
                                     s->metavar);
                break;
            }
            value = argv[++i];
        } else if (!s->metavar && value) {
            rc = DDP_ERRF_EINVAL(err, sizeof err, "option --%s takes no value", s->name);
            break;
        }
        rc = s->set(o, value ? value : "", err, sizeof err);
    }
    if (rc == 0 && i >= argc)
        rc = DDP_ERRF_EINVAL(err, sizeof err,
                             "no program given: ddprun [options] train.conf|script.py|PROGRAM");
    if (rc == 0) {
        o->program_argv = argv + i;
        o->program_argc = argc - i;
        rc = finish(o, err, sizeof err);
    }
    if (rc < 0) {
        fprintf(errf_out, "ddprun: %s (see ddprun --help)\n", err);
        return 2;
    }
    return 0;
}

void options_print(const ddprun_opts_t *o, FILE *f) {
    fprintf(f, "nnodes: %u:%u\nnproc_per_node: %d\nnode_rank: %d\n", o->min_nodes, o->max_nodes,
            o->nproc_per_node, o->node_rank);
    if (strcmp(o->rdzv_backend, "etcd") == 0)
        fprintf(f,
                "rdzv_backend: etcd\nrdzv_endpoint: %s\nrdzv_id: %s\netcd: lease_ttl=%g,"
                "status_ttl=%g,cacert=%s,cert=%s,key=%s,user=%s,password=%s\n",
                o->rdzv_endpoints, o->rdzv_id, o->lease_ttl_s, o->status_ttl_s, o->etcd_cacert,
                o->etcd_cert, o->etcd_key, o->etcd_user, o->etcd_password[0] ? "(set)" : "");
    else
        fprintf(f, "rdzv_backend: %s\nrdzv_endpoint: %s:%u\nrdzv_id: %s\n", o->rdzv_backend,
                o->rdzv_host, o->rdzv_port, o->rdzv_id);
    fprintf(f,
            "rdzv_conf: join_timeout=%g,last_call_timeout=%g,close_timeout=%g,"
            "heartbeat_timeout=%g,keep_alive_interval=%g,read_timeout=%g,is_host=%s\n",
            o->join_timeout_s, o->last_call_timeout_s, o->close_timeout_s, o->heartbeat_timeout_s,
            o->keep_alive_interval_s, o->read_timeout_s,
            o->is_host < 0 ? "auto"
            : o->is_host   ? "true"
                           : "false");
    fprintf(f, "start_method: %s\nstore_secret: %s\n", o->start_method,
            !o->store_secret.is_set   ? "none"
            : o->store_secret_file[0] ? o->store_secret_file
                                      : "(from the environment)");
    if (o->slurm_job_id[0])
        fprintf(f, "slurm: job %s, %d node(s), this node %d\n", o->slurm_job_id, o->slurm_nodes,
                o->slurm_node_id);
    else
        fprintf(f, "slurm: none\n");
    fprintf(f, "standalone: %d\nmax_restarts: %d\nmonitor_interval: %g\nrole: %s\nlog_dir: %s\n",
            o->is_standalone, o->max_restarts, o->monitor_interval_s, o->role, o->log_dir);
    fprintf(f, "redirects:");
    for (int r = 0; r < o->nproc_per_node; r++)
        fprintf(f, " %d", o->redirects[r]);
    fprintf(f, "\ntee:");
    for (int r = 0; r < o->nproc_per_node; r++)
        fprintf(f, " %d", o->tee[r]);
    fprintf(f, "\nlocal_ranks_shown:");
    for (int r = 0; r < o->nproc_per_node; r++)
        if (o->is_rank_shown[r]) fprintf(f, " %d", r);
    fprintf(f,
            "\nmaster: %s:%u\nlocal_addr: %s\nno_python: %d\nmodule: %d\nsignals:", o->master_addr,
            o->master_port, o->local_addr, o->is_no_python, o->is_module);
    for (int s = 0; s < o->n_signals; s++)
        fprintf(f, " %d", o->signals[s]);
    fprintf(f,
            "\nshutdown_timeout: %g\nhang_timeout: %g\nstart_timeout: %g\nstore_max_value: %zu\n"
            "warm_spares: %d\nprogram:",
            o->shutdown_timeout_s, o->hang_timeout_s, o->start_timeout_s, o->store_max_value_bytes,
            o->warm_spares);
    for (int a = 0; a < o->program_argc; a++)
        fprintf(f, " %s", o->program_argv[a]);
    fputc('\n', f);
}
