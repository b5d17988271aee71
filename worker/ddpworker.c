/* ddpworker: the trainer `ddprun ... train.conf` runs, one process per rank. Reads the rank and
 * the job's store from torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT, TORCHELASTIC_RUN_ID, DDPRUN_ATTEMPT; without them it is a world of one), loads
 * train.conf, builds the backend (cpu, or cuda from libddpworker_cuda.so) and the collective while
 * the data loads on a thread of its own, and trains. As ddprun's warm spare (DDPRUN_SPARE_FD) it
 * first prepares everything that does not depend on the round and waits for one (spare.h). Exit
 * codes (proto/exit_codes.h) tell the agent whether a restart can help. */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "build_info.h"
#include "comm.h"
#include "cuda/cuda_api.h"
#include "dataset.h"
#include "fs.h"
#include "snapshot.h"
#include "spare.h"
#include "startup_trace.h"
#include "exit_codes.h"
#include "die.h"
#include "trainer.h"

static const char usage[] =
    "usage: ddpworker train.conf [section.key=value ...]\n"
    "       ddpworker --keys      every train.conf key with its default (see train.conf(5))\n"
    "       ddpworker inspect FILE   a snapshot's header, checksums and state hash\n"
    "       ddpworker --version   version, commit, backends and collectives of this build\n"
    "Run by `ddprun [options] train.conf`, which sets RANK, WORLD_SIZE, MASTER_ADDR, ...;\n"
    "run directly it trains as a world of one.\n";

/* The datasets, loaded on a thread of their own: decompressing Fashion-MNIST takes ~0.2 s, which
 * then overlaps the GPU's start and the collective's rendezvous instead of preceding them. */
typedef struct {
    const train_conf_t *conf;
    data_splits_t data;
    char err[1024];
    int rc;
} data_load_t;

static void *load_data(void *arg) {
    data_load_t *l = arg;
    l->rc = data_splits_load(l->conf, &l->data, l->err, sizeof l->err);
    return NULL;
}

/* The loading thread's result; a dataset that cannot be loaded ends the process (DDP_EXIT_DATA),
 * naming the rank once it is known (rank -1: a warm spare, before its round). */
static void finish_loading(data_load_t *l, pthread_t loader, bool is_loading, int rank) {
    if (is_loading) pthread_join(loader, NULL);
    if (l->rc == 0) return;
    if (rank >= 0)
        fprintf(stderr, "ddpworker: rank %d: %s\n", rank, l->err);
    else
        fprintf(stderr, "ddpworker: %s\n", l->err);
    exit(DDP_EXIT_DATA);
}

/* An integer from the environment, or def when unset; a malformed one is a launcher bug. */
static long env_long(const char *name, long def, long min, long max) {
    const char *v = getenv(name);
    if (!v || !*v) return def;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (*end || errno || x < min || x > max)
        die(DDP_EXIT_USAGE, "environment: %s='%s' is not a whole number in [%ld, %ld]", name, v,
            min, max);
    return x;
}

static const ddpworker_cuda_api_t *cuda_api; /* libddpworker_cuda.so's, when train.backend=cuda */
static int cuda_devices;

/* Rank 0's fresh ncclUniqueId reaches the others through the store, under this round's prefix. */
static comm_t *make_nccl(int rank, int world, store_client_t *store, const char *prefix,
                         int64_t timeout_ms, backend_t *backend) {
    if (!cuda_api->nccl_id_bytes || !cuda_api->nccl_unique_id || !cuda_api->nccl_create)
        die(DDP_EXIT_CONFIG, "train.collective: nccl, but this libddpworker_cuda.so was built "
                             "without NCCL (CMake did not find nccl.h and libnccl)");
    unsigned char id[1024];
    size_t n = cuda_api->nccl_id_bytes();
    char err[512], key[600];
    if (n > sizeof id) die(DDP_EXIT_BUG, "an ncclUniqueId of %zu bytes", n);
    snprintf(key, sizeof key, "%snccl_id", prefix);
    if (rank == 0) {
        if (cuda_api->nccl_unique_id(id, err, sizeof err) < 0)
            die(DDP_EXIT_PEER_FAILURE, "NCCL: %s", err);
        if (store && store_client_set(store, key, id, n) < 0)
            die(DDP_EXIT_PEER_FAILURE, "publishing the NCCL id: %s", store_client_error(store));
    } else {
        uint8_t *val = NULL;
        size_t len = 0;
        if (store_client_get(store, key, &val, &len) < 0)
            die(DDP_EXIT_PEER_FAILURE, "waiting for rank 0's NCCL id: %s",
                store_client_error(store));
        if (len != n) die(DDP_EXIT_PEER_FAILURE, "%s: %zu bytes, not an NCCL id", key, len);
        memcpy(id, val, n);
        free(val);
    }
    comm_t *comm = NULL;
    if (cuda_api->nccl_create(backend, id, rank, world, timeout_ms, &comm, err, sizeof err) < 0)
        die(DDP_EXIT_PEER_FAILURE, "cannot join the NCCL communicator: %s", err);
    return comm;
}

static comm_t *make_comm(int rank, int world, int local_world, const train_conf_t *conf,
                         backend_t *backend) {
    comm_t *comm = NULL;
    bool is_nccl = conf->collective == COLLECTIVE_NCCL;
    if (is_nccl && conf->backend != BACKEND_CUDA)
        die(DDP_EXIT_CONFIG, "train.collective: nccl needs train.backend=cuda");
    int64_t timeout_ms = (int64_t)(conf->collective_timeout_s * 1000);
    if (world == 1) {
        if (is_nccl) return make_nccl(0, 1, NULL, "", timeout_ms, backend);
        if (comm_null_create(&comm) < 0) die(DDP_EXIT_BUG, "out of memory");
        return comm;
    }
    const char *host = getenv("MASTER_ADDR");
    long port = env_long("MASTER_PORT", 0, 1, 65535);
    if (!host || !*host || port == 0)
        die(DDP_EXIT_USAGE,
            "WORLD_SIZE is %d but MASTER_ADDR/MASTER_PORT are not set "
            "(run it with ddprun)",
            world);
    /* the agent's: its store and the ring's handshake ask for it (docs/protocol.md) */
    static store_secret_t secret;
    char err[512];
    if (store_secret_from_env(&secret, err, sizeof err) < 0) die(DDP_EXIT_CONFIG, "%s", err);
    store_client_opts_t so = {.host = host,
                              .port = (uint16_t)port,
                              .connect_timeout_ms = 60000,
                              .op_timeout_ms = timeout_ms,
                              .secret = &secret};
    store_client_t *store = NULL;
    if (store_client_connect(&so, &store) < 0)
        die(DDP_EXIT_PEER_FAILURE, "cannot reach the job's store: %s", store_client_error(store));
    const char *run_id = getenv("TORCHELASTIC_RUN_ID");
    char prefix[512];
    snprintf(prefix, sizeof prefix, "/ddpworker/%s/%ld/", run_id && *run_id ? run_id : "none",
             env_long("DDPRUN_ATTEMPT", env_long("TORCHELASTIC_RESTART_COUNT", 0, 0, INT_MAX), 0,
                      INT_MAX));
    if (conf->collective == COLLECTIVE_AUTO && conf->backend == BACKEND_CUDA) {
        /* NCCL needs a GPU per rank, and nodes may differ: every rank says whether its node has
         * enough, and all take NCCL only if all can */
        if (comm_agree_all(store, prefix, "nccl_possible", rank, world, local_world <= cuda_devices,
                           &is_nccl, err, sizeof err) < 0)
            die(DDP_EXIT_PEER_FAILURE, "agreeing on the collective: %s", err);
    }
    if (is_nccl) {
        comm = make_nccl(rank, world, store, prefix, timeout_ms, backend);
        store_client_destroy(store);
        return comm;
    }
    const char *local_addr = getenv("DDPRUN_LOCAL_ADDR"); /* ddprun --local-addr */
    comm_ring_opts_t ro = {.rank = rank,
                           .world = world,
                           .store = store,
                           .key_prefix = prefix,
                           .store_host = host,
                           .advertise_host = local_addr && *local_addr ? local_addr : NULL,
                           .timeout_ms = timeout_ms,
                           .secret = &secret};
    if (comm_ring_create(&ro, &comm, err, sizeof err) < 0)
        die(DDP_EXIT_PEER_FAILURE, "cannot join the ring of %d workers: %s", world, err);
    store_client_destroy(store);
    if (conf->backend == BACKEND_CUDA) { /* gradients live on the GPU: through host memory */
        comm_t *staged = NULL;
        if (comm_staged_create(comm, backend, &staged) < 0) die(DDP_EXIT_BUG, "out of memory");
        comm = staged;
    }
    return comm;
}

/* The CPU backend's OpenMP loops and OpenBLAS's own threads take turns on the same cores, and
 * idle threads of either that spin starve the other: OpenMP threads spinning after each loop made
 * ResNet-18 2.7x slower; OpenBLAS's threads yielding for 2^28 cycles after each GEMM took 17% of
 * the CPU time and 5-12% of the speed (2 cores, 2026-11-23). Both libraries read their setting
 * once, when loaded, so set what the user did not and exec again (same pid, a few ms). */
static void ensure_passive_threads(char **argv) {
    if (getenv("OMP_WAIT_POLICY") && getenv("OPENBLAS_THREAD_TIMEOUT")) return;
    setenv("OMP_WAIT_POLICY", "passive", 0);
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 0); /* 2^4 cycles, OpenBLAS's shortest: sleep at once */
    execv("/proc/self/exe", argv);
    /* exec failed: train anyway, only slower */
}

/* ${XDG_CACHE_HOME:-~/.cache}/ddpworker/cudnn_algos.txt, its folder made ("" when there is no
 * such place). */
static void user_algo_cache(char *path, size_t len) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[PATH_MAX];
    path[0] = '\0';
    if (xdg && *xdg)
        snprintf(dir, sizeof dir, "%s", xdg);
    else if (home && *home)
        snprintf(dir, sizeof dir, "%s/.cache", home);
    else
        return;
    mkdir(dir, 0755);
    size_t at = strlen(dir);
    snprintf(dir + at, sizeof dir - at, "/ddpworker");
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) return;
    snprintf(path, len, "%s/cudnn_algos.txt", dir);
}

/* Where the cuda backend keeps the convolution algorithms it searched for (backend_cuda.h): the
 * run's own file $DDPWORKER_ALGO_CACHE, with none shared; else beside the snapshots, with the
 * user's cache shared (a new job on this machine skips the search for the shapes an earlier one
 * searched, and its snapshots keep the algorithms it used); else the user's cache as its own.
 * Empty where there is no such place (every start then searches). */
static void algo_cache_paths(const train_conf_t *conf, char *own, char *shared, size_t len) {
    const char *env = getenv("DDPWORKER_ALGO_CACHE");
    own[0] = shared[0] = '\0';
    if (env)
        snprintf(own, len, "%s", env);
    else if (!conf->snapshot_dir[0])
        user_algo_cache(own, len);
    else {
        snprintf(own, len, "%s/cudnn_algos.txt", conf->snapshot_dir);
        user_algo_cache(shared, len);
    }
}

/* The path with its longest existing prefix resolved: /usr/lib/ddprun/..., not
 * /usr/bin/../lib/ddprun/..., also when the library (or its folder) is not installed, so that
 * the error names where it looked in words a user can check. */
/* libddpworker_cuda.so: $DDPWORKER_CUDA_LIB, else next to this executable (the build tree), else
 * where `cmake --install` puts it relative to this executable (DDP_CUDA_LIB_RELDIR, e.g.
 * ../lib/x86_64-linux-gnu/ddprun), so an installed tree works under any prefix or DESTDIR. The
 * path returned is the one to try (the installed one when neither exists). */
static void cuda_lib_path(char *path, size_t len) {
    const char *env = getenv("DDPWORKER_CUDA_LIB");
    if (env && *env) {
        snprintf(path, len, "%s", env);
        return;
    }
    const char *paths[] = {"libddpworker_cuda.so", DDP_CUDA_LIB_RELDIR "/libddpworker_cuda.so"};
    fs_find_beside_self(paths, 2, F_OK, path, len); /* not found: the installed place, resolved */
}

static backend_t *make_backend(const train_conf_t *conf, int threads) {
    if (conf->backend == BACKEND_CPU) {
        backend_t *b = backend_cpu_create(threads);
        if (!b) die(DDP_EXIT_BUG, "out of memory for the cpu backend");
        return b;
    }
    char path[PATH_MAX];
    cuda_lib_path(path, sizeof path);
    double t = startup_trace_now();
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    startup_trace_end("loading libddpworker_cuda.so (CUDA, cuDNN, cuBLAS, NCCL)", t);
    if (!lib)
        die(DDP_EXIT_CONFIG,
            "train.backend: cuda needs %s (built when CMake finds CUDA and "
            "cuDNN; packaged as ddprun-cuda): %s",
            path, dlerror());
    const ddpworker_cuda_api_t *api = dlsym(lib, DDPWORKER_CUDA_API_SYMBOL);
    if (!api)
        die(DDP_EXIT_CONFIG, "%s: not a ddpworker backend (no %s)", path,
            DDPWORKER_CUDA_API_SYMBOL);
    if (api->version != DDPWORKER_CUDA_API_VERSION || api->size != sizeof *api)
        die(DDP_EXIT_CONFIG,
            "%s is from another build of ddprun (its table is version %u "
            "of %u bytes; this ddpworker needs version %u of %zu): install the matching "
            "ddprun-cuda",
            path, api->version, api->size, DDPWORKER_CUDA_API_VERSION, sizeof *api);
    cuda_api = api;
    int devices = cuda_devices = api->device_count();
    if (devices == 0) die(DDP_EXIT_CONFIG, "train.backend: cuda, but no GPU is visible");
    char err[512];
    int device = (int)(env_long("LOCAL_RANK", 0, 0, INT_MAX) % devices);
    char own[PATH_MAX], shared[PATH_MAX];
    algo_cache_paths(conf, own, shared, sizeof own);
    backend_cuda_algo_cache_t cache = {.own = own[0] ? own : NULL,
                                       .shared = shared[0] ? shared : NULL};
    unsigned flags = conf->precision == PRECISION_TF32   ? 1u /* BACKEND_CUDA_TF32 */
                     : conf->precision == PRECISION_BF16 ? 2u /* BACKEND_CUDA_BF16 */
                     : conf->precision == PRECISION_FP16 ? 4u /* BACKEND_CUDA_FP16 */
                                                         : 0u;
    backend_t *b = api->backend_create(device, flags, &cache, err, sizeof err);
    if (!b) die(DDP_EXIT_BUG, "cannot start the cuda backend: %s", err);
    return b;
}

int main(int argc, char **argv) {
    ensure_passive_threads(argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? DDP_EXIT_USAGE : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        build_info_print("ddpworker", stdout);
        if (build_info.has_cuda_backend) { /* a separate package: say whether it is there */
            char path[PATH_MAX];
            cuda_lib_path(path, sizeof path);
            printf("cuda library: %s (%s)\n", path,
                   access(path, R_OK) == 0 ? "present" : "missing: install ddprun-cuda");
        }
        return 0;
    }
    if (!strcmp(argv[1], "--keys")) {
        train_conf_print_keys(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "inspect")) {
        if (argc != 3) {
            fputs(usage, stderr);
            return DDP_EXIT_USAGE;
        }
        return snapshot_inspect(argv[2], stdout) == 0 ? 0 : DDP_EXIT_DATA;
    }
    /* a warm spare learns its round (rank, world, store) only after its start: until then, only
     * what a spare is started with (LOCAL_RANK, LOCAL_WORLD_SIZE) may be read */
    int spare_fd = spare_fd_from_env();
    int local_world = (int)env_long("LOCAL_WORLD_SIZE", 1, 1, 1 << 20);
    double t = startup_trace_now();

    train_conf_t conf;
    char err[1024];
    if (train_conf_load(argv[1], argv + 2, argc - 2, &conf, err, sizeof err) < 0) {
        fprintf(stderr, "ddpworker: %s\n", err);
        return DDP_EXIT_CONFIG;
    }
    if (conf.precision != PRECISION_FP32 && conf.backend != BACKEND_CUDA)
        die(DDP_EXIT_CONFIG,
            "precision.mode: %s needs train.backend=cuda (the cpu backend "
            "is the fp32 reference)",
            conf.precision == PRECISION_TF32   ? "tf32"
            : conf.precision == PRECISION_BF16 ? "bf16"
                                               : "fp16");
    data_load_t load = {.conf = &conf};
    pthread_t loader;
    bool is_loading = pthread_create(&loader, NULL, load_data, &load) == 0;
    if (!is_loading) load_data(&load);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads =
        conf.threads ? (int)conf.threads : (int)(cores / local_world > 1 ? cores / local_world : 1);
    t = startup_trace_end("reading the configuration", t);
    backend_t *backend = make_backend(&conf, threads);
    t = startup_trace_end("backend (all of it)", t);
    trainer_t tr;
    if (spare_fd >= 0) { /* everything but the round, then wait for one */
        finish_loading(&load, loader, is_loading, -1);
        trainer_prepare(&tr, &conf, &load.data, backend);
        trainer_warm_up(&tr);
        spare_wait_for_round(spare_fd);
        tr.was_spare = true;
        t = startup_trace_now();
    }
    int world = (int)env_long("WORLD_SIZE", 1, 1, 1 << 20);
    int rank = (int)env_long("RANK", 0, 0, world - 1);
    local_world = (int)env_long("LOCAL_WORLD_SIZE", 1, 1, 1 << 20);
    /* a fresh worker joins the collective while its data loads */
    comm_t *comm = make_comm(rank, world, local_world, &conf, backend);
    t = startup_trace_end("collective", t);
    if (spare_fd < 0) {
        finish_loading(&load, loader, is_loading, rank);
        t = startup_trace_end("waiting for the data", t);
        trainer_prepare(&tr, &conf, &load.data, backend);
        t = startup_trace_end("model and trainer (arenas)", t);
    }
    trainer_start(&tr, comm);
    startup_trace_end("trainer start (initial parameters or snapshot, broadcast)", t);
    trainer_run(&tr);
    trainer_free(&tr);
    comm->ops->destroy(comm);
    backend->mem->destroy(backend);
    data_splits_free(&load.data);
    return 0;
}
