/* slurm: see slurm.h. The node-list parser works on caller buffers with a fixed depth (one name is
 * at most SLURM_HOST_MAX_BYTES); scontrol runs as a child with a pipe and a deadline. */
#include "slurm.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddp_error.h"
#include "endpoint.h"

extern char **environ;

/* ---- the node-list parser ------------------------------------------------------------------ */

typedef struct {
    const char *list; /* the whole list, for positions in messages */
    char *out;
    size_t out_len, used;
    long n_hosts;
    char *err;
    size_t err_len;
} sink_t;

static bool is_host_char(char c) {
    return isalnum((unsigned char)c) || c == '-' || c == '.' || c == '_';
}

static int emit(sink_t *s, const char *name, size_t len) {
    if (len == 0) return DDP_ERRF_EINVAL(s->err, s->err_len, "an empty host name");
    if (++s->n_hosts > SLURM_MAX_HOSTS)
        return DDP_ERRF_EINVAL(s->err, s->err_len, "more than %d hosts", SLURM_MAX_HOSTS);
    if (s->used + len + 2 <= s->out_len) {
        memcpy(s->out + s->used, name, len);
        s->used += len;
        s->out[s->used++] = '\n';
        s->out[s->used] = '\0';
    }
    return 0;
}

/* A decimal bound of a range: digits only, at most 9 of them. */
static int parse_bound(sink_t *s, const char *p, size_t len, long *out) {
    if (len == 0 || len > 9)
        return DDP_ERRF_EINVAL(s->err, s->err_len,
                               "'%.*s' at position %td is not a number of 1-9 digits", (int)len, p,
                               p - s->list);
    long v = 0;
    for (size_t i = 0; i < len; i++) {
        if (!isdigit((unsigned char)p[i]))
            return DDP_ERRF_EINVAL(s->err, s->err_len,
                                   "'%c' at position %td is not a digit in a range", p[i],
                                   p + i - s->list);
        v = v * 10 + (p[i] - '0');
    }
    *out = v;
    return 0;
}

/* Expands item[0, len) after the name built so far (name[0, name_used)): the text up to the next
 * '[' joins the name, each value of the bracket's ranges is appended in turn, and the rest of the
 * item is expanded after it. Recursion depth = bracket groups in one name (< its length). */
static int expand_item(sink_t *s, const char *item, size_t len, char *name, size_t name_used) {
    const char *open = memchr(item, '[', len);
    size_t plain = open ? (size_t)(open - item) : len;
    for (size_t i = 0; i < plain; i++) {
        if (item[i] == ']')
            return DDP_ERRF_EINVAL(s->err, s->err_len, "']' at position %td has no '['",
                                   item + i - s->list);
        if (!is_host_char(item[i]))
            return DDP_ERRF_EINVAL(s->err, s->err_len, "'%c' at position %td is not in a host name",
                                   isprint((unsigned char)item[i]) ? item[i] : '?',
                                   item + i - s->list);
    }
    if (name_used + plain >= SLURM_HOST_MAX_BYTES)
        return DDP_ERRF_EINVAL(s->err, s->err_len, "a host name longer than %d bytes",
                               SLURM_HOST_MAX_BYTES - 1);
    memcpy(name + name_used, item, plain);
    name_used += plain;
    if (!open) return emit(s, name, name_used);

    const char *close = memchr(open, ']', len - plain);
    const char *nested =
        memchr(open + 1, '[', close ? (size_t)(close - open - 1) : len - plain - 1);
    if (!close || nested)
        return DDP_ERRF_EINVAL(s->err, s->err_len, "'[' at position %td is not closed by ']'",
                               open - s->list);
    const char *rest = close + 1;
    size_t rest_len = len - (size_t)(rest - item);
    const char *p = open + 1;
    if (p == close)
        return DDP_ERRF_EINVAL(s->err, s->err_len, "an empty range at position %td", p - s->list);
    while (p < close) {
        const char *comma = memchr(p, ',', (size_t)(close - p));
        const char *end = comma ? comma : close;
        const char *dash = memchr(p, '-', (size_t)(end - p));
        long lo, hi;
        int rc = parse_bound(s, p, (size_t)((dash ? dash : end) - p), &lo);
        if (rc == 0) rc = dash ? parse_bound(s, dash + 1, (size_t)(end - dash - 1), &hi) : 0;
        if (rc < 0) return rc;
        if (!dash) hi = lo;
        if (lo > hi)
            return DDP_ERRF_EINVAL(s->err, s->err_len, "the range %.*s at position %td goes down",
                                   (int)(end - p), p, p - s->list);
        if (hi - lo >= SLURM_MAX_HOSTS)
            return DDP_ERRF_EINVAL(s->err, s->err_len, "more than %d hosts", SLURM_MAX_HOSTS);
        int width = (int)((dash ? dash : end) - p); /* "01-10": 01 ... 10 */
        for (long v = lo; v <= hi; v++) {
            char digits[16];
            int n = snprintf(digits, sizeof digits, "%0*ld", width, v);
            if (name_used + (size_t)n >= SLURM_HOST_MAX_BYTES)
                return DDP_ERRF_EINVAL(s->err, s->err_len, "a host name longer than %d bytes",
                                       SLURM_HOST_MAX_BYTES - 1);
            memcpy(name + name_used, digits, (size_t)n);
            if ((rc = expand_item(s, rest, rest_len, name, name_used + (size_t)n)) < 0) return rc;
        }
        p = comma ? comma + 1 : close;
        if (comma && p == close)
            return DDP_ERRF_EINVAL(s->err, s->err_len, "an empty range at position %td",
                                   p - s->list);
    }
    return 0;
}

int slurm_hostlist_expand(const char *list, char *out, size_t out_len, long *n_hosts, char *err,
                          size_t err_len) {
    sink_t s = {.list = list, .out = out, .out_len = out_len, .err = err, .err_len = err_len};
    if (out_len) out[0] = '\0';
    *n_hosts = 0;
    if (!*list) return DDP_ERRF_EINVAL(err, err_len, "an empty node list");
    const char *p = list;
    for (;;) { /* split at the commas outside brackets */
        const char *q = p;
        int depth = 0;
        while (*q && (*q != ',' || depth)) {
            depth += *q == '[' ? 1 : *q == ']' ? -1 : 0;
            q++;
        }
        char name[SLURM_HOST_MAX_BYTES];
        int rc = expand_item(&s, p, (size_t)(q - p), name, 0);
        if (rc < 0) return rc;
        if (!*q) break;
        p = q + 1;
    }
    *n_hosts = s.n_hosts;
    return 0;
}

/* ---- scontrol ------------------------------------------------------------------------------ */

/* `scontrol show hostnames LIST`'s first line into host. Returns 0, -ENOENT when scontrol cannot
 * be run, -EINVAL when it fails or says nothing or not a host name (the message in err). */
static int scontrol_first_host(const char *list, char *host, size_t host_len, char *err,
                               size_t err_len) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0) return -errno;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
    char *argv[] = {"scontrol", "show", "hostnames", (char *)(uintptr_t)list, NULL};
    pid_t pid;
    int rc = posix_spawnp(&pid, "scontrol", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        return -ENOENT;
    }
    char buf[SLURM_HOST_MAX_BYTES + 1];
    size_t got = 0;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) { /* until the first newline, EOF, or 10 s */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left_ms =
            10000 - ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000);
        struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
        if (left_ms <= 0 || poll(&pfd, 1, (int)left_ms) <= 0) break;
        ssize_t n = read(fds[0], buf + got, sizeof buf - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
        if (memchr(buf, '\n', got) || got == sizeof buf - 1) break;
    }
    close(fds[0]);
    kill(pid, SIGKILL); /* done with it: the rest of the list is not needed */
    int status = 0;
    waitpid(pid, &status, 0);
    buf[got] = '\0';
    char *nl = strchr(buf, '\n');
    if (nl) *nl = '\0';
    if (!buf[0] || strlen(buf) >= host_len)
        return DDP_ERRF_EINVAL(err, err_len, "`scontrol show hostnames %s` gave no host name",
                               list);
    for (const char *c = buf; *c; c++)
        if (!is_host_char(*c))
            return DDP_ERRF_EINVAL(err, err_len, "scontrol gave '%s', not a host name", buf);
    strcpy(host, buf);
    return 0;
}

int slurm_first_host(const char *list, char *host, size_t host_len, char *err, size_t err_len) {
    /* scontrol fails without a slurm.conf to read (a login node set up otherwise, a container):
     * then the parser decides */
    if (scontrol_first_host(list, host, host_len, err, err_len) == 0) return 0;
    int rc;
    char hosts[2 * SLURM_HOST_MAX_BYTES];
    long n;
    if ((rc = slurm_hostlist_expand(list, hosts, sizeof hosts, &n, err, err_len)) < 0) return rc;
    size_t first = strcspn(hosts, "\n");
    if (first >= host_len)
        return DDP_ERRF_EINVAL(err, err_len, "the first host of %s is too long", list);
    memcpy(host, hosts, first);
    host[first] = '\0';
    return 0;
}

/* ---- the allocation ------------------------------------------------------------------------ */

/* The first of the variables that is set and not empty, and its name. */
static const char *env_first(const char **names, size_t n, const char **which) {
    for (size_t i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) {
            *which = names[i];
            return v;
        }
    }
    return NULL;
}

static int env_count(const char *name, const char *v, long min, long max, long *out, char *err,
                     size_t err_len) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < min || x > max)
        return DDP_ERRF_EINVAL(err, err_len, "%s='%s' is not a whole number in [%ld, %ld]", name, v,
                               min, max);
    *out = x;
    return 0;
}

int slurm_apply_defaults(ddprun_opts_t *o, char *err, size_t err_len) {
    const char *which = NULL;
    const char *job = env_first((const char *[]){"SLURM_JOB_ID", "SLURM_JOBID"}, 2, &which);
    const char *enabled = getenv("DDPRUN_SLURM");
    if (!job || (enabled && strcmp(enabled, "0") == 0)) return 0;
    long job_num, nodes = 1, node_id = 0;
    if (strlen(job) >= sizeof o->slurm_job_id)
        return DDP_ERRF_EINVAL(err, err_len, "%s='%s' is too long", which, job);
    for (const char *c = job; *c; c++)
        if (!is_host_char(*c))
            return DDP_ERRF_EINVAL(err, err_len, "%s='%s' is not a job id", which, job);
    const char *v = env_first(
        (const char *[]){"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, 3, &which);
    if (v && env_count(which, v, 1, SLURM_MAX_HOSTS, &nodes, err, err_len) < 0) return -EINVAL;
    v = env_first((const char *[]){"SLURM_NODEID"}, 1, &which);
    if (v && env_count(which, v, 0, SLURM_MAX_HOSTS - 1, &node_id, err, err_len) < 0)
        return -EINVAL;
    /* srun starts SLURM_STEP_NUM_TASKS copies: one ddprun per node, which starts the workers */
    long tasks = 0, step_nodes = 0;
    const char *t = getenv("SLURM_STEP_NUM_TASKS"), *sn = getenv("SLURM_STEP_NUM_NODES");
    if (t && sn && env_count("SLURM_STEP_NUM_TASKS", t, 1, 1L << 30, &tasks, err, err_len) == 0 &&
        env_count("SLURM_STEP_NUM_NODES", sn, 1, SLURM_MAX_HOSTS, &step_nodes, err, err_len) == 0 &&
        tasks > step_nodes)
        return DDP_ERRF_EINVAL(err, err_len,
                               "srun started %ld tasks on %ld nodes: ddprun starts the workers "
                               "itself and runs once per node (srun --ntasks-per-node=1 ddprun "
                               "--nproc-per-node N ...)",
                               tasks, step_nodes);

    snprintf(o->slurm_job_id, sizeof o->slurm_job_id, "%s", job);
    o->slurm_nodes = (int)nodes;
    o->slurm_node_id = (int)node_id;
    snprintf(o->rdzv_id, sizeof o->rdzv_id, "%s", job);
    o->min_nodes = o->max_nodes = (unsigned)nodes;
    o->node_rank = (int)node_id;
    const char *list = env_first(
        (const char *[]){"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, 3, &which);
    if (!list) return 0; /* no endpoint to offer: --rdzv-endpoint it is */
    char host[SLURM_HOST_MAX_BYTES], msg[512];
    if (slurm_first_host(list, host, sizeof host, msg, sizeof msg) < 0)
        return DDP_ERRF_EINVAL(err, err_len, "%s='%.200s': %s", which, list, msg);
    job_num = strtol(job, NULL, 10); /* numeric in Slurm; anything else: port 29400 */
    if (job_num < 0) job_num = 0;
    strcpy(o->rdzv_backend, "c10d");
    snprintf(o->rdzv_host, sizeof o->rdzv_host, "%s", host);
    o->rdzv_port = (uint16_t)(DDP_DEFAULT_STORE_PORT + job_num % 1000);
    o->has_rdzv_endpoint = true;
    snprintf(o->master_addr, sizeof o->master_addr, "%s", host);
    o->master_port = o->rdzv_port;
    return 0;
}
