/* bench_rdzv_agents: the rendezvous protocol at scale without the processes: N agents' joins as N
 * threads of this one process, each with its own client (a TCP store connection, or an etcd
 * client), doing what an agent's join does (launcher/rendezvous.c: the round, ADD, records, close,
 * read the records; on etcd also the lease, each node record under it). Then one
 * "agent" asks for a restart and every one waits for it and joins the next round, as agents do once
 * their workers are stopped. No workers, no heartbeats, no process starts: what is left is the
 * protocol's own cost, which bench_scale.py's 1024 real agents on a 2-core machine cannot show
 * (there, starting 2048 processes is most of the time). bench_scale.py --protocol drives it.
 *
 *   bench_rdzv_agents c10d HOST:PORT N      (a `ddprun store` listening there)
 *   bench_rdzv_agents etcd ENDPOINTS N
 *
 * Prints one JSON line: {"agents": N, "rendezvous_s": ..., "restart_s": ..., "errors": ...}. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ddp_error.h"
#include "log.h"
#include "options.h"
#include "rdzv/rdzv_kv.h"
#include "rdzv/rendezvous.h"
#include "store_limits.h"

typedef struct {
    int index;
    pthread_t thread;
    int rc;
    char err[512];
    uint64_t joined_ns, rejoined_ns;
} sim_agent_t;

static ddprun_opts_t opts;
static pthread_barrier_t start_line;
static atomic_int n_joined;
static uint64_t t_start_ns, t_restart_ns;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t all_joined = PTHREAD_COND_INITIALIZER;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* As the agent: the job's round, or the one after the round that ended when the job's counter
 * has not moved yet (the restart key is written before it). */
static int join_round(rdzv_t *r, rdzv_kv_t *kv, sim_agent_t *a, int at_least, rdzv_result_t *out) {
    int round = 0;
    TRY(rdzv_current_round(r, kv, &round, a->err, sizeof a->err));
    return rdzv_join(r, kv, round > at_least ? round : at_least, out, a->err, sizeof a->err);
}

static void *sim_agent_main(void *arg) {
    sim_agent_t *a = arg;
    rdzv_lease_t *lease = strcmp(opts.rdzv_backend, "etcd") == 0 ? rdzv_lease_new(600) : NULL;
    rdzv_kv_t *kv = NULL;
    rdzv_t r;
    rdzv_init(&r, &opts, false);
    if (lease) rdzv_set_own_store(&r, "127.0.0.1", (uint16_t)(20000 + a->index)); /* as on etcd */
    a->rc = rdzv_kv_connect(&opts, lease, 60000, 600000, &kv);
    if (a->rc < 0)
        snprintf(a->err, sizeof a->err, "connect: %s",
                 kv ? kv->ops->error(kv) : ddp_strerror(a->rc));
    pthread_barrier_wait(&start_line);
    rdzv_result_t out;
    if (a->rc == 0) a->rc = join_round(&r, kv, a, 0, &out);
    a->joined_ns = now_ns();
    pthread_mutex_lock(&mu);
    if (atomic_fetch_add(&n_joined, 1) + 1 == (int)opts.min_nodes)
        pthread_cond_broadcast(&all_joined);
    pthread_mutex_unlock(&mu);
    if (a->rc == 0 && a->index == 0) { /* a worker failed here: every agent must follow */
        pthread_mutex_lock(&mu);
        while (atomic_load(&n_joined) < (int)opts.min_nodes)
            pthread_cond_wait(&all_joined, &mu);
        pthread_mutex_unlock(&mu);
        t_restart_ns = now_ns();
        rdzv_why_t why = {.code = 1, .node = out.group_rank, .rank = out.rank_offset};
        a->rc = rdzv_request_restart(&r, kv, out.round, &why);
    }
    char why[512];
    if (a->rc == 0) a->rc = rdzv_wait_restart(&r, kv, &out, why, sizeof why);
    if (a->rc == 0) a->rc = join_round(&r, kv, a, out.round + 1, &out);
    a->rejoined_ns = now_ns();
    if (a->rc < 0 && !a->err[0])
        snprintf(a->err, sizeof a->err, "%s", kv ? kv->ops->error(kv) : "");
    rdzv_kv_destroy(kv);
    rdzv_lease_free(lease);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4 || (strcmp(argv[1], "c10d") != 0 && strcmp(argv[1], "etcd") != 0)) {
        fprintf(stderr, "usage: bench_rdzv_agents c10d HOST:PORT N | etcd ENDPOINTS N\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    log_init("bench_rdzv_agents", LOG_LEVEL_WARN);
    int n = atoi(argv[3]);
    if (n < 1 || n > RDZV_MAX_NODES) {
        fprintf(stderr, "bench_rdzv_agents: N=%s is not 1-%d\n", argv[3], RDZV_MAX_NODES);
        return 2;
    }
    opts.min_nodes = opts.max_nodes = (unsigned)n;
    opts.nproc_per_node = 1;
    opts.node_rank = -1;
    snprintf(opts.rdzv_backend, sizeof opts.rdzv_backend, "%s", argv[1]);
    snprintf(opts.rdzv_endpoints, sizeof opts.rdzv_endpoints, "%s", argv[2]);
    snprintf(opts.rdzv_id, sizeof opts.rdzv_id, "bench%ld-%d", (long)time(NULL), (int)getpid());
    if (strcmp(argv[1], "c10d") == 0) {
        char *colon = strrchr(argv[2], ':');
        if (!colon) {
            fprintf(stderr, "bench_rdzv_agents: %s is not HOST:PORT\n", argv[2]);
            return 2;
        }
        snprintf(opts.rdzv_host, sizeof opts.rdzv_host, "%.*s", (int)(colon - argv[2]), argv[2]);
        opts.rdzv_port = (uint16_t)atoi(colon + 1);
    }
    opts.lease_ttl_s = 600; /* no keep-alive here: the leases must outlive the bench */
    opts.join_timeout_s = 600;
    opts.read_timeout_s = 60;
    opts.last_call_timeout_s = 0;
    opts.store_max_value_bytes = STORE_DEFAULT_MAX_VALUE_BYTES;
    sim_agent_t *agents = calloc((size_t)n, sizeof *agents);
    pthread_barrier_init(&start_line, NULL, (unsigned)n + 1);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < n; i++) {
        agents[i].index = i;
        if (pthread_create(&agents[i].thread, &attr, sim_agent_main, &agents[i]) != 0) {
            fprintf(stderr, "bench_rdzv_agents: thread %d: %s\n", i, strerror(errno));
            return 1;
        }
    }
    pthread_barrier_wait(&start_line); /* every client connected: the joins begin */
    t_start_ns = now_ns();
    int errors = 0;
    uint64_t joined = 0, rejoined = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(agents[i].thread, NULL);
        if (agents[i].rc < 0 && errors++ == 0)
            fprintf(stderr, "bench_rdzv_agents: agent %d: %s\n", i, agents[i].err);
        if (agents[i].joined_ns > joined) joined = agents[i].joined_ns;
        if (agents[i].rejoined_ns > rejoined) rejoined = agents[i].rejoined_ns;
    }
    printf("{\"agents\": %d, \"backend\": \"%s\", \"rendezvous_s\": %.3f, \"restart_s\": %.3f, "
           "\"errors\": %d}\n",
           n, argv[1], (double)(joined - t_start_ns) / 1e9, (double)(rejoined - t_restart_ns) / 1e9,
           errors);
    free(agents);
    return errors ? 1 : 0;
}
