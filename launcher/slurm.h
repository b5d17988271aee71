/* slurm: ddprun inside a Slurm allocation. From SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID and
 * SLURM_JOB_NODELIST (their SLURM_STEP_* forms first, under srun) it derives the rendezvous, so
 * that `srun ddprun --nproc-per-node 4 train.conf` needs no rendezvous flags: c10d, the job id as
 * the rendezvous id, the first host of the node list as the endpoint. These become ddprun's
 * defaults, so PET_* variables and flags still win. Also the node-list parser (Slurm's compressed
 * form: node[01-04,07],gpu-[1-2]). Reads the environment and may run `scontrol show hostnames`;
 * no allocation kept. */
#ifndef DDP_LAUNCHER_SLURM_H
#define DDP_LAUNCHER_SLURM_H

#include <stddef.h>

#include "options.h"

#define SLURM_MAX_HOSTS      100000 /* as many nodes as --nnodes accepts */
#define SLURM_HOST_MAX_BYTES 256

/* Expand a Slurm host list ("node[01-04,07],gpu-[1-2],login1"; several bracket groups in one name
 * multiply: "r[1-2]n[1-2]" is r1n1 r1n2 r2n1 r2n2; "01-04" keeps the width of its lower bound).
 * Writes the hosts that fit into out (out_len bytes), each followed by '\n', NUL-terminated, and
 * counts all of them in *n_hosts. Returns 0, or -EINVAL with a message in err naming the
 * offending character or range and its position (unbalanced brackets, an empty name or range,
 * lo > hi, a character not in a host name, more than SLURM_MAX_HOSTS hosts). */
int slurm_hostlist_expand(const char *list, char *out, size_t out_len, long *n_hosts, char *err,
                          size_t err_len);

/* The first host of list: `scontrol show hostnames` when scontrol is on PATH and answers (Slurm's
 * own rules), else slurm_hostlist_expand. Waits for scontrol at most 10 s. Returns 0 or -EINVAL
 * (the parser's message in err). */
int slurm_first_host(const char *list, char *host, size_t host_len, char *err, size_t err_len);

/* Inside an allocation (SLURM_JOB_ID set, DDPRUN_SLURM not "0"), make the job's rendezvous o's
 * defaults: rdzv_backend c10d, rdzv_id the job id, rdzv endpoint the first host of the step's (or
 * job's) node list on port 29400 + job id % 1000 (two jobs sharing a node do not meet on one
 * port), MASTER_ADDR for --rdzv-backend static likewise, nnodes the step's node count, node_rank
 * SLURM_NODEID; fills o->slurm_*. Call after the built-in defaults, before PET_* and the command
 * line. Outside Slurm it changes nothing. Returns 0, or -EINVAL with a message in err naming the
 * variable (a malformed count or node list, several ddprun per node). */
int slurm_apply_defaults(ddprun_opts_t *o, char *err, size_t err_len);

#endif
