/* options: ddprun's command line, with torchrun's flags and meanings. One table drives parsing
 * (both spellings: --nproc-per-node and --nproc_per_node, --flag=value and --flag value), the
 * PET_* environment fallbacks torchrun reads, --help, and the man-page check in the tests.
 * Pure apart from reading the environment and counting CPUs/GPUs; no allocation kept. */
#ifndef DDP_LAUNCHER_OPTIONS_H
#define DDP_LAUNCHER_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "store_auth.h"

#define DDP_MAX_LOCAL_WORKERS 1024
#define DDP_MAX_SIGNALS       16

typedef struct {
    unsigned min_nodes, max_nodes;
    int nproc_per_node;
    int node_rank;         /* -1: not given */
    char rdzv_backend[16]; /* "c10d", "etcd" or "static" */
    char rdzv_host[256];   /* c10d, static: the store; etcd: unused */
    uint16_t rdzv_port;
    char rdzv_endpoints[1024]; /* --rdzv-endpoint as given (etcd: the member list) */
    bool has_rdzv_endpoint;    /* rdzv_host:rdzv_port is decided (by the flag, Slurm, ...) */
    /* given by a flag or PET_*, not by a default (Slurm's included): what the user asked for wins
     * over what an allocation implies, and only what they gave is echoed back */
    bool is_endpoint_given, is_backend_given, is_master_addr_given, is_master_port_given;
    /* etcd (--rdzv-conf): lease_ttl, TLS and auth; the password never printed */
    double lease_ttl_s;
    double status_ttl_s; /* how long `ddprun status` finds a finished job on etcd */
    char etcd_cacert[512], etcd_cert[512], etcd_key[512], etcd_user[128], etcd_password[256];
    char etcd_password_file[512];
    char rdzv_id[128];
    double join_timeout_s, last_call_timeout_s, close_timeout_s, heartbeat_timeout_s,
        keep_alive_interval_s, read_timeout_s;
    int keep_alive_max_attempts; /* --rdzv-conf keep_alive_max_attempt (torch's): 0 not given, else
                                    heartbeat_timeout = keep_alive_interval x this */
    int is_host;           /* --rdzv-conf is_host: -1 decide by binding the endpoint, 0 no, 1 yes */
    char start_method[16]; /* torchrun's --start-method, accepted: workers are always exec'd */
    bool is_standalone;
    int max_restarts;
    double monitor_interval_s;
    char role[64];
    char log_dir[1024];
    uint8_t redirects[DDP_MAX_LOCAL_WORKERS]; /* per local rank: bit 0 stdout, bit 1 stderr */
    uint8_t tee[DDP_MAX_LOCAL_WORKERS];
    bool is_rank_shown[DDP_MAX_LOCAL_WORKERS]; /* --local-ranks-filter */
    char master_addr[256];
    uint16_t master_port;
    char local_addr[256];
    bool is_no_python, is_module;
    int signals[DDP_MAX_SIGNALS];
    int n_signals;
    double shutdown_timeout_s;
    double hang_timeout_s; /* 0: no hang detection */
    size_t
        store_max_value_bytes; /* the hosted store's value limit, which our clients respect too */
    double start_timeout_s; /* 0: none; a worker must report progress this soon after its start */
    int warm_spares;        /* 1: keep a warm spare worker per local rank, 0: none (-1 auto until
                               parsed: 1 for train.conf on a GPU node) */
    char store_secret_file[1024]; /* --store-secret-file, absolute; "": the environment's */
    store_secret_t store_secret;  /* from that file, else DDPRUN_STORE_SECRET[_FILE]; agents,
                                     workers and the hosted store prove it (docs/protocol.md) */
    bool is_dry_run;
    char slurm_job_id[64]; /* "" outside Slurm; else the allocation these defaults came from */
    int slurm_nodes, slurm_node_id;
    char **program_argv; /* points into argv: the program and its arguments */
    int program_argc;
} ddprun_opts_t;

/* Defaults beyond the built-in ones, set before the PET_* environment and the flags, which win:
 * main passes a Slurm allocation's (slurm_apply_defaults, slurm.h, which sits above this file).
 * 0, or a negative code with the message in err. */
typedef int (*options_defaults_fn)(ddprun_opts_t *o, char *err, size_t err_len);
/* Parse argv (argv[0] is the program name) after the PET_* environment, itself after the built-in
 * defaults and then `defaults` (NULL: none). Returns 0, 1 when --help was printed (exit 0), or 2
 * after printing one line "ddprun: ..." to err (exit 2). */
int options_parse(int argc, char **argv, ddprun_opts_t *out, options_defaults_fn defaults,
                  FILE *err);
/* --rdzv-conf K=V,... into o (ddprun status parses it too); 0 or -1 with the message in err. */
int options_set_rdzv_conf(ddprun_opts_t *o, const char *v, char *err, size_t el);
/* etcd's settings checked and completed (the password from its file or the environment). */
int options_finish_etcd(ddprun_opts_t *o, char *err, size_t el);
/* o->store_secret from --store-secret-file, else the environment (options_parse does it; `ddprun
 * status` too). 0, or -EINVAL with a message naming the file or variable in err. */
int options_load_store_secret(ddprun_opts_t *o, char *err, size_t el);
/* The agent: run PROGRAM as configured until done; returns the process exit code (agent.c). */
int agent_main(ddprun_opts_t *o);
/* The --help text, generated from the option table. */
void options_print_help(FILE *f);
/* Print the resolved configuration, one "key: value" per line (--dry-run). */
void options_print(const ddprun_opts_t *o, FILE *f);

#endif
