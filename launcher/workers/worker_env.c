/* worker_env: see worker_env.h. */
#include "workers/worker_env.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "snapshot_format.h"

extern char **environ;

int worker_env_set(worker_env_t *e, const char *key, const char *fmt, ...) {
    char value[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(value, sizeof value, fmt, ap);
    va_end(ap);
    size_t klen = strlen(key);
    char *entry = malloc(klen + strlen(value) + 2);
    if (!entry) return -ENOMEM;
    sprintf(entry, "%s=%s", key, value);
    for (size_t i = 0; i < e->n; i++) {
        if (strncmp(e->vars[i], key, klen) == 0 && e->vars[i][klen] == '=') {
            free(e->vars[i]);
            e->vars[i] = entry;
            return 0;
        }
    }
    if (e->n + 1 >= e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 256;
        char **v = realloc(e->vars, cap * sizeof *v);
        if (!v) {
            free(entry);
            return -ENOMEM;
        }
        e->vars = v;
        e->cap = cap;
    }
    e->vars[e->n++] = entry;
    e->vars[e->n] = NULL;
    return 0;
}

void worker_env_free(worker_env_t *e) {
    for (size_t i = 0; i < e->n; i++)
        free(e->vars[i]);
    free(e->vars);
    *e = (worker_env_t){0};
}

int worker_env_base(worker_env_t *e, int nproc_per_node) {
    int rc = 0;
    for (char **p = environ; *p && rc == 0; p++) {
        char *eq = strchr(*p, '=');
        if (!eq) continue;
        char key[256];
        size_t klen = (size_t)(eq - *p);
        if (klen >= sizeof key) continue;
        memcpy(key, *p, klen);
        key[klen] = '\0';
        rc = worker_env_set(e, key, "%s", eq + 1);
    }
    /* as current torchrun: NCCL errors abort the process instead of hanging it */
    if (!getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        rc |= worker_env_set(e, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
    /* as torchrun: one thread each where several workers share the node's cores; a lone worker
     * keeps them all */
    if (!getenv("OMP_NUM_THREADS") && nproc_per_node > 1)
        rc |= worker_env_set(e, "OMP_NUM_THREADS", "1");
    if (!getenv("PYTHONUNBUFFERED")) rc |= worker_env_set(e, "PYTHONUNBUFFERED", "1");
    return rc;
}

int worker_env_round(const workers_spec_t *sp, int local_rank, worker_env_t *e) {
    const ddprun_opts_t *o = sp->opts;
    int rc = worker_env_base(e, o->nproc_per_node);
    int rank = sp->rank_offset + local_rank;
    rc |= worker_env_set(e, "RANK", "%d", rank);
    rc |= worker_env_set(e, "LOCAL_RANK", "%d", local_rank);
    rc |= worker_env_set(e, "WORLD_SIZE", "%d", sp->world_size);
    rc |= worker_env_set(e, "LOCAL_WORLD_SIZE", "%d", o->nproc_per_node);
    rc |= worker_env_set(e, "GROUP_RANK", "%d", sp->group_rank);
    rc |= worker_env_set(e, "GROUP_WORLD_SIZE", "%d", sp->group_world_size);
    rc |= worker_env_set(e, "ROLE_NAME", "%s", o->role);
    rc |= worker_env_set(e, "ROLE_RANK", "%d", rank);
    rc |= worker_env_set(e, "ROLE_WORLD_SIZE", "%d", sp->world_size);
    rc |= worker_env_set(e, "MASTER_ADDR", "%s", sp->master_addr);
    rc |= worker_env_set(e, "MASTER_PORT", "%u", sp->master_port);
    rc |= worker_env_set(e, "TORCHELASTIC_USE_AGENT_STORE", "True");
    rc |= worker_env_set(e, "TORCHELASTIC_RESTART_COUNT", "%d", sp->restart_count);
    rc |= worker_env_set(e, "TORCHELASTIC_MAX_RESTARTS", "%d", o->max_restarts);
    rc |= worker_env_set(e, "TORCHELASTIC_RUN_ID", "%s", sp->run_id);
    rc |= worker_env_set(e, "TORCHELASTIC_ERROR_FILE", "%s/%d/error.json", sp->attempt_dir,
                         local_rank);
    rc |= worker_env_set(e, "DDPRUN_ATTEMPT", "%d", sp->attempt);
    rc |= worker_env_set(e, "DDPRUN_PROGRESS_FILE", "%s/%d/progress", sp->attempt_dir, local_rank);
    rc |= worker_env_set(e, "DDPRUN_PID_FILE", "%s/%d/pid", sp->attempt_dir, local_rank);
    if (sp->memory_dir && sp->memory_dir[0])
        rc |= worker_env_set(e, SNAPSHOT_MEMORY_DIR_ENV, "%s", sp->memory_dir);
    /* the address other nodes reach this one at: ddpworker's ring listens there (its route to
     * the store may be loopback on the store's own node: 127.0.1.1 in /etc/hosts) */
    if (o->local_addr[0]) rc |= worker_env_set(e, "DDPRUN_LOCAL_ADDR", "%s", o->local_addr);
    /* --store-secret-file: the workers read it as the agent did (an empty DDPRUN_STORE_SECRET is
     * none, so the file is not outranked by one in the agent's environment) */
    if (o->store_secret_file[0]) {
        rc |= worker_env_set(e, STORE_SECRET_FILE_ENV, "%s", o->store_secret_file);
        rc |= worker_env_set(e, STORE_SECRET_ENV, "%s", "");
    }
    return rc;
}

int worker_env_program_pid(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[24] = {0};
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    char *end;
    long pid = n > 0 ? strtol(buf, &end, 10) : 0;
    return pid > 0 && pid < INT32_MAX && *end == '\n' ? (int)pid : 0;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

char **worker_env_argv(const ddprun_opts_t *o, const char *shim_exe, char *pid_text) {
    char **argv = calloc((size_t)o->program_argc + 9, sizeof *argv);
    if (!argv) return NULL;
    int n = 0;
    argv[n++] = (char *)(uintptr_t)shim_exe;
    argv[n++] = "__shim";
    argv[n++] = pid_text;
    argv[n++] = "--";
    bool is_python = !o->is_no_python && (o->is_module || ends_with(o->program_argv[0], ".py"));
    if (is_python) {
        const char *py = getenv("PYTHON_EXEC");
        argv[n++] = (char *)(uintptr_t)(py && *py ? py : "python3");
        argv[n++] = "-u";
        if (o->is_module) argv[n++] = "-m";
    }
    for (int i = 0; i < o->program_argc; i++)
        argv[n++] = o->program_argv[i];
    return argv;
}
