/* comm_ring (and comm_null, comm_staged over it, comm_agree_all through the store): all-reduce sums
 * in f32 and f64 for awkward sizes and world sizes,
 * bit-identical results on every rank, broadcast from every root, barrier, and failures: a peer
 * that exits or hangs makes the others fail within the deadline with a message naming a rank, never
 * hang; ranks that disagree on a collective fail on its opening frame; an agreement whose store
 * dies mid-reply fails cleanly. Ranks are forked processes;
 * the store they meet through is a forked `store_server` (a libuv loop in a child process). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "comm.h"
#include "ddp_error.h"
#include "stop_signal.h"
#include "store/store_server.h"
#include "store_auth.h"
#include "store_proto.h"

#define MAX_WORLD 4

typedef struct {
    uint64_t result_hash[MAX_WORLD];
    int64_t failed_after_ms[MAX_WORLD];
    int64_t failed_at_ms[MAX_WORLD],
        killed_at_ms; /* CLOCK_MONOTONIC, comparable across processes */
    int rc[MAX_WORLD];
    char err[MAX_WORLD][512];
} shared_t;

static shared_t *shared;
static pid_t store_pid;
static uint16_t store_port;

static void start_store(void) {
    signal(SIGPIPE, SIG_IGN);
    shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(shared, MAP_FAILED);
    int p[2];
    cr_assert_eq(pipe(p), 0);
    store_pid = fork();
    if (store_pid == 0) {
        uv_loop_t loop;
        uv_loop_init(&loop);
        store_server_opts_t o = {.host = "127.0.0.1", .port = 0};
        store_limits_default(&o.limits);
        store_server_t *srv;
        char err[256];
        if (store_server_start(&loop, &o, &srv, err, sizeof err) < 0) _exit(1);
        uint16_t port = store_server_port(srv);
        if (write(p[1], &port, sizeof port) != sizeof port) _exit(1);
        uv_run(&loop, UV_RUN_DEFAULT);
        _exit(0);
    }
    cr_assert_eq(read(p[0], &store_port, sizeof store_port), (ssize_t)sizeof store_port);
    close(p[0]);
    close(p[1]);
}

static void stop_store(void) {
    kill(store_pid, SIGKILL);
    waitpid(store_pid, NULL, 0);
    munmap(shared, sizeof *shared);
}

TestSuite(comm_ring, .init = start_store, .fini = stop_store, .timeout = 60);

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* A client of the store at port (the suite's: store_port); NULL when it cannot connect. */
static store_client_t *connect_store(uint16_t port, int64_t op_timeout_ms) {
    store_client_opts_t so = {.host = "127.0.0.1",
                              .port = port,
                              .connect_timeout_ms = 5000,
                              .op_timeout_ms = op_timeout_ms};
    store_client_t *store = NULL;
    return store_client_connect(&so, &store) == 0 ? store : NULL;
}

typedef int (*rank_fn)(comm_t *c, int rank, int world);

/* Runs fn on `world` forked ranks joined in a ring, rank r holding the store secret secrets[r]
 * (secrets NULL, or an entry NULL: none); returns how many ranks exited non-zero. A rank that
 * cannot join leaves its message in shared->err[rank]. */
static int run_ring_with_secrets(int world, int64_t timeout_ms, rank_fn fn,
                                 const char *const *secrets) {
    static int round;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "/test/%d/%d/", (int)getpid(), round++);
    pid_t pids[MAX_WORLD];
    for (int rank = 0; rank < world; rank++) {
        pids[rank] = fork();
        if (pids[rank] != 0) continue;
        store_client_t *store = connect_store(store_port, 10000);
        if (!store) _exit(10);
        store_secret_t secret = {0};
        char err[512];
        if (secrets && secrets[rank] &&
            store_secret_from_text(secrets[rank], strlen(secrets[rank]), "test", &secret, err,
                                   sizeof err) < 0)
            _exit(12);
        comm_ring_opts_t ro = {.rank = rank,
                               .world = world,
                               .store = store,
                               .key_prefix = prefix,
                               .store_host = "127.0.0.1",
                               .timeout_ms = timeout_ms,
                               .secret = &secret};
        comm_t *c = NULL;
        if (comm_ring_create(&ro, &c, err, sizeof err) < 0) {
            fprintf(stderr, "rank %d: %s\n", rank, err);
            snprintf(shared->err[rank], sizeof shared->err[rank], "%s", err);
            _exit(11);
        }
        store_client_destroy(store);
        int rc = fn(c, rank, world);
        c->ops->destroy(c);
        _exit(rc);
    }
    int failed = 0;
    for (int rank = 0; rank < world; rank++) {
        int status;
        waitpid(pids[rank], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
    }
    return failed;
}

static int run_ring(int world, int64_t timeout_ms, rank_fn fn) {
    return run_ring_with_secrets(world, timeout_ms, fn, NULL);
}

/* n < world (0 to world - 1 covers every world here), a prime, odd large sizes */
static const size_t sizes[] = {0, 1, 2, 3, 5, 1000, (1u << 20) + 7};
#define N_SIZES (sizeof sizes / sizeof sizes[0])

/* Small integers: every order of summation gives the exact sum. */
static int allreduce_exact(comm_t *c, int rank, int world) {
    for (size_t s = 0; s < N_SIZES; s++) {
        size_t n = sizes[s];
        float *f = malloc((n + 1) * sizeof *f);
        double *d = malloc((n + 1) * sizeof *d);
        for (size_t i = 0; i < n; i++)
            f[i] = d[i] = (float)((rank + 1) * (int)(i % 7));
        if (c->ops->allreduce_sum_f32(c, f, n) < 0 || c->ops->allreduce_sum_f64(c, d, n) < 0) {
            fprintf(stderr, "rank %d: %s\n", rank, comm_error(c));
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            double want = (double)(world * (world + 1) / 2) * (double)(i % 7);
            if (f[i] != want || d[i] != want) {
                fprintf(stderr, "rank %d size %zu [%zu]: %g %g, want %g\n", rank, n, i, f[i], d[i],
                        want);
                return 1;
            }
        }
        free(f);
        free(d);
    }
    return 0;
}

Test(comm_ring, allreduce_sums_every_size_on_worlds_of_one_to_four) {
    for (int world = 1; world <= MAX_WORLD; world++)
        cr_assert_eq(run_ring(world, 10000, allreduce_exact), 0, "world %d", world);
}

/* Values whose sum depends on the order: every rank must still end with the same bits. */
static int allreduce_bits(comm_t *c, int rank, int world) {
    (void)world;
    size_t n = 300001;
    float *f = malloc(n * sizeof *f);
    uint64_t state = 77 + (uint64_t)rank;
    for (size_t i = 0; i < n; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        f[i] = (float)(state >> 40) / 1677.7216f - 5000.0f;
    }
    if (c->ops->allreduce_sum_f32(c, f, n) < 0) return 1;
    shared->result_hash[rank] = hash_bytes(f, n * sizeof *f);
    free(f);
    return 0;
}

Test(comm_ring, every_rank_ends_with_the_same_bits_every_time) {
    uint64_t first = 0;
    for (int run = 0; run < 2; run++) {
        cr_assert_eq(run_ring(3, 10000, allreduce_bits), 0);
        for (int r = 1; r < 3; r++)
            cr_assert_eq(shared->result_hash[r], shared->result_hash[0], "rank %d differs", r);
        if (run == 0)
            first = shared->result_hash[0];
        else
            cr_assert_eq(shared->result_hash[0], first, "a second run summed differently");
    }
}

static int broadcast_every_root(comm_t *c, int rank, int world) {
    size_t lens[] = {0, 5, (3u << 20) + 1};
    for (int root = 0; root < world; root++) {
        for (size_t k = 0; k < 3; k++) {
            uint8_t *buf = malloc(lens[k] + 1);
            for (size_t i = 0; i < lens[k]; i++)
                buf[i] = (uint8_t)(rank == root ? i * 31 + root : 0xEE);
            if (c->ops->broadcast(c, buf, lens[k], root) < 0) return 1;
            for (size_t i = 0; i < lens[k]; i++)
                if (buf[i] != (uint8_t)(i * 31 + root)) return 2;
            free(buf);
        }
    }
    return c->ops->barrier(c) < 0 ? 3 : 0;
}

Test(comm_ring, broadcast_from_every_root_and_barrier) {
    for (int world = 2; world <= MAX_WORLD; world++)
        cr_assert_eq(run_ring(world, 10000, broadcast_every_root), 0, "world %d", world);
}

/* Rank world-1 leaves after joining; the others' all-reduce must fail, naming a rank. */
static int last_rank_dies(comm_t *c, int rank, int world) {
    if (rank == world - 1) _exit(0);
    size_t n = 1u << 20;
    float *f = calloc(n, sizeof *f);
    int64_t start = now_ms();
    int rc = c->ops->allreduce_sum_f32(c, f, n);
    shared->failed_after_ms[rank] = now_ms() - start;
    snprintf(shared->err[rank], sizeof shared->err[rank], "%s", comm_error(c));
    free(f);
    return rc < 0 ? 0 : 1; /* success here is the bug */
}

Test(comm_ring, a_peer_that_exits_fails_the_collective_with_its_rank_named) {
    cr_assert_eq(run_ring(3, 3000, last_rank_dies), 0);
    for (int r = 0; r < 2; r++) {
        cr_assert_lt(shared->failed_after_ms[r], 5000, "rank %d: %s", r, shared->err[r]);
        cr_assert(strstr(shared->err[r], "rank "), "rank %d: '%s'", r, shared->err[r]);
    }
    cr_assert(strstr(shared->err[0], "rank 2 (127.0.0.1:") && strstr(shared->err[0], "closed"),
              "rank 0's prev is the dead rank 2: '%s'", shared->err[0]);
}

/* Rank 1 never enters the collective: the others fail on the deadline, not on a hang. */
static int middle_rank_hangs(comm_t *c, int rank, int world) {
    (void)world;
    if (rank == 1) {
        sleep(4);
        return 0;
    }
    double x = 1;
    int64_t start = now_ms();
    int rc = c->ops->allreduce_sum_f64(c, &x, 1);
    shared->failed_after_ms[rank] = now_ms() - start;
    snprintf(shared->err[rank], sizeof shared->err[rank], "%s", comm_error(c));
    return rc < 0 ? 0 : 1;
}

Test(comm_ring, a_silent_peer_fails_the_collective_at_the_deadline) {
    cr_assert_eq(run_ring(3, 1000, middle_rank_hangs), 0);
    /* rank 2 waits on rank 1 and gives up at the deadline; rank 0 waits on rank 2 and sees it
     * leave then (or its own deadline): a failure propagates around the ring, nobody hangs */
    cr_assert(strstr(shared->err[2], "no data from rank 1 (127.0.0.1:") &&
                  strstr(shared->err[2], "1000 ms"),
              "rank 2: '%s'", shared->err[2]);
    for (int r = 0; r < 3; r += 2) {
        cr_assert_geq(shared->failed_after_ms[r], 900, "rank %d", r);
        cr_assert_lt(shared->failed_after_ms[r], 3500, "rank %d: %s", r, shared->err[r]);
        cr_assert(strstr(shared->err[r], "rank "), "rank %d: '%s'", r, shared->err[r]);
    }
}

static void *publish_rank_1_late(void *arg) {
    const char *prefix = arg;
    usleep(1000 * 1000);
    store_client_t *store = connect_store(store_port, 5000);
    char key[128];
    snprintf(key, sizeof key, "%sring/1", prefix);
    if (store) store_client_set(store, key, "127.0.0.1:1", 11);
    store_client_destroy(store);
    return NULL;
}

/* Rank 0 of 3 joins; rank 1 publishes its address late and rank 2 never: the join gives up at the
 * ring's timeout (2 s), not one timeout per neighbour (rank 1's late key restarted the wait: 3 s,
 * or the store client's own bound, and the connect had no time left). */
Test(comm_ring, joining_waits_one_timeout_for_both_neighbours) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "/late/%d/", (int)getpid());
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, publish_rank_1_late, prefix), 0);
    store_client_t *store = connect_store(store_port, 10000);
    cr_assert_not_null(store);
    comm_ring_opts_t ro = {.rank = 0,
                           .world = 3,
                           .store = store,
                           .key_prefix = prefix,
                           .store_host = "127.0.0.1",
                           .timeout_ms = 2000};
    comm_t *c = NULL;
    char err[512];
    int64_t start = now_ms();
    int rc = comm_ring_create(&ro, &c, err, sizeof err);
    int64_t took = now_ms() - start;
    pthread_join(t, NULL);
    cr_assert_eq(rc, DDP_ETIMEOUT, "rc %d: %s", rc, err);
    cr_assert(strstr(err, "rank 2 never published its address within 2000 ms"), "%s", err);
    cr_assert_lt(took, 2800, "gave up after %lld ms", (long long)took);
    store_client_destroy(store);
}

/* SIGTERM (caught, as the trainer catches it once it has a snapshot folder) while rank 0 waits in
 * a collective on rank 1, silent: the wait ends after the stop's grace, not collective_timeout (30
 * s here; an agent stopping this worker SIGKILLed it after --shutdown-timeout). */
static int stopped_while_a_peer_is_silent(comm_t *c, int rank, int world) {
    (void)world;
    if (rank == 1) {
        sleep(10);
        return 0;
    }
    stop_signal_catch();
    double x = 1;
    int64_t start = now_ms();
    raise(SIGTERM);
    int rc = c->ops->allreduce_sum_f64(c, &x, 1);
    shared->failed_after_ms[rank] = now_ms() - start;
    shared->rc[rank] = rc;
    snprintf(shared->err[rank], sizeof shared->err[rank], "%s", comm_error(c));
    return 0;
}

Test(comm_ring, a_stop_does_not_wait_for_a_silent_peer) {
    cr_assert_eq(run_ring(2, 30000, stopped_while_a_peer_is_silent), 0);
    cr_assert_eq(shared->rc[0], -ECANCELED, "rc %d: %s", shared->rc[0], shared->err[0]);
    cr_assert(strstr(shared->err[0], "stopping (SIGTERM) while rank 1 (127.0.0.1:"), "%s",
              shared->err[0]);
    cr_assert_geq(shared->failed_after_ms[0], 4900);
    cr_assert_lt(shared->failed_after_ms[0], 8000, "%s", shared->err[0]);
}

/* Every rank is stopped (a preemption) and one reaches the collective a second late: the live peer
 * is waited for, the collective completes (the trainer then stops at the step's boundary). */
static int stopped_with_every_peer_alive(comm_t *c, int rank, int world) {
    stop_signal_catch();
    raise(SIGTERM);
    if (rank == 1) usleep(1000 * 1000);
    double x = 1;
    int rc = c->ops->allreduce_sum_f64(c, &x, 1);
    if (rc < 0) fprintf(stderr, "rank %d: %s\n", rank, comm_error(c));
    return rc == 0 && x == world ? 0 : 1;
}

Test(comm_ring, a_stop_with_every_peer_alive_completes_the_collective) {
    cr_assert_eq(run_ring(2, 30000, stopped_with_every_peer_alive), 0);
}

static void *kill_self_soon(void *arg) {
    (void)arg;
    usleep(30 * 1000);
    shared->killed_at_ms = now_ms();
    raise(SIGKILL);
    return NULL;
}

/* Rank 2 is killed (-9) while the ranks are in the middle of all-reducing 4 MB buffers. */
static int killed_mid_collective(comm_t *c, int rank, int world) {
    (void)world;
    pthread_t t;
    if (rank == 2 && pthread_create(&t, NULL, kill_self_soon, NULL) != 0) return 1;
    size_t n = 1u << 20;
    float *f = calloc(n, sizeof *f);
    int rc = 0;
    for (int i = 0; i < 2000 && rc == 0; i++)
        rc = c->ops->allreduce_sum_f32(c, f, n);
    shared->failed_at_ms[rank] = now_ms();
    shared->rc[rank] = rc;
    snprintf(shared->err[rank], sizeof shared->err[rank], "%s", comm_error(c));
    /* the ring is unusable now: the next call fails at once with the same error (at once: well
     * within the 3000 ms deadline it would otherwise wait out, whatever the machine's load) */
    int64_t start = now_ms();
    int again = c->ops->barrier(c);
    int is_sticky =
        again == rc && now_ms() - start < 1500 && strcmp(comm_error(c), shared->err[rank]) == 0;
    free(f);
    return rc < 0 && is_sticky ? 0 : 1;
}

Test(comm_ring, a_peer_killed_mid_collective_fails_the_others_naming_it) {
    /* rank 2 dies by signal: one abnormal exit; ranks 0 and 1 must have failed (status 0) */
    cr_assert_eq(run_ring(3, 3000, killed_mid_collective), 1);
    cr_assert_gt(shared->killed_at_ms, 0, "rank 2 finished 2000 all-reduces before its kill");
    for (int r = 0; r < 2; r++) {
        cr_assert_lt(shared->rc[r], 0, "rank %d", r);
        cr_assert_lt(shared->failed_at_ms[r] - shared->killed_at_ms, 3000, "rank %d hung: %s", r,
                     shared->err[r]);
        cr_assert(strstr(shared->err[r], "ring: ") && strstr(shared->err[r], "rank "),
                  "rank %d: '%s'", r, shared->err[r]);
    }
    cr_log_info("rank 0: %s\nrank 1: %s", shared->err[0], shared->err[1]);
    /* whichever of 0 and 1 failed first did so because of rank 2; the other may name the first */
    cr_assert(strstr(shared->err[0], "rank 2 (127.0.0.1:") ||
                  strstr(shared->err[1], "rank 2 (127.0.0.1:"),
              "nobody named the dead rank 2: '%s' / '%s'", shared->err[0], shared->err[1]);
}

/* Rank 1 all-reduces one element fewer than the others: caught by the opening frame, not the
 * deadline, and not by summing misaligned bytes. */
static int rank_one_disagrees(comm_t *c, int rank, int world) {
    (void)world;
    float f[11] = {0};
    int64_t start = now_ms();
    int rc = c->ops->allreduce_sum_f32(c, f, rank == 1 ? 10 : 11);
    shared->failed_after_ms[rank] = now_ms() - start;
    shared->rc[rank] = rc;
    snprintf(shared->err[rank], sizeof shared->err[rank], "%s", comm_error(c));
    return rc < 0 ? 0 : 1;
}

Test(comm_ring, ranks_that_disagree_on_the_size_fail_at_once) {
    cr_assert_eq(run_ring(3, 5000, rank_one_disagrees), 0);
    for (int r = 0; r < 3; r++)
        cr_assert_lt(shared->failed_after_ms[r], 2000, "rank %d waited for the deadline: %s", r,
                     shared->err[r]);
    cr_log_info("rank 2: %s", shared->err[2]);
    cr_assert_eq(shared->rc[2], DDP_EPROTO, "rank 2: %s", shared->err[2]);
    cr_assert(strstr(shared->err[2], "rank 1 (127.0.0.1:") &&
                  strstr(shared->err[2], "allreduce(f32) of 40 bytes") &&
                  strstr(shared->err[2], "rank 2 entered allreduce(f32) of 44 bytes"),
              "rank 2: '%s'", shared->err[2]);
    cr_assert_eq(shared->rc[1], DDP_EPROTO, "rank 1: %s", shared->err[1]);
}

Test(comm_ring, null_comm_is_a_world_of_one) {
    comm_t *c = NULL;
    cr_assert_eq(comm_null_create(&c), 0);
    float f[2] = {1, 2};
    cr_assert_eq(c->ops->allreduce_sum_f32(c, f, 2), 0);
    cr_assert(f[0] == 1 && f[1] == 2 && c->world == 1 && c->rank == 0);
    cr_assert_eq(c->ops->broadcast(c, f, sizeof f, 0), 0);
    cr_assert_eq(c->ops->barrier(c), 0);
    c->ops->destroy(c);
}

Test(comm_ring, a_rank_outside_the_world_is_refused) {
    comm_ring_opts_t ro = {.rank = 3, .world = 2, .key_prefix = "/x/"};
    comm_t *c = NULL;
    char err[256];
    cr_assert_lt(comm_ring_create(&ro, &c, err, sizeof err), 0);
    cr_assert(strstr(err, "rank 3 is outside a world of 2"), "%s", err);
}

/* ---- comm_staged: the ring over "device" memory, through host chunks. The GPU e2e tests run it
 * on a real GPU; here a stand-in backend marks one buffer as device memory and copies with memcpy,
 * so the chunking (sizes over the 8 MiB stage, every root, f32 and f64) is checked on every CI
 * run, and so is the pass-through of host memory. ---- */

#include "backend.h"

typedef struct {
    backend_t base;
    const char *device; /* [device, device + device_bytes) plays device memory */
    size_t device_bytes;
    size_t copies; /* to_host calls on it */
} fake_device_t;

static bool fake_is_device(backend_t *b, const void *p) {
    fake_device_t *f = (fake_device_t *)b;
    return (const char *)p >= f->device && (const char *)p < f->device + f->device_bytes;
}

static void fake_to_host(backend_t *b, void *dst, const void *src, size_t n) {
    ((fake_device_t *)b)->copies++;
    memcpy(dst, src, n);
}

static void fake_to_device(backend_t *b, void *dst, const void *src, size_t n) {
    (void)b;
    memcpy(dst, src, n);
}

static const backend_memory_i fake_mem = {.name = "fake device",
                                          .is_device = fake_is_device,
                                          .to_host = fake_to_host,
                                          .to_device = fake_to_device};

static int staged_collectives(comm_t *ring, int rank, int world) {
    size_t n = (3u << 20) + 5; /* 12 MiB of floats: two stage chunks and a bit */
    char *device = calloc(n * sizeof(double) + 64, 1);
    fake_device_t fake = {
        .base = {.mem = &fake_mem}, .device = device, .device_bytes = n * sizeof(double) + 64};
    comm_t *c = NULL;
    if (comm_staged_create(ring, &fake.base, &c) < 0) return 1;
    float *f = (float *)device;
    for (size_t i = 0; i < n; i++)
        f[i] = (float)((rank + 1) * (int)(i % 5));
    if (c->ops->allreduce_sum_f32(c, f, n) < 0) return 2;
    for (size_t i = 0; i < n; i++)
        if (f[i] != (float)(world * (world + 1) / 2 * (int)(i % 5))) return 3;
    double *d = (double *)device;
    for (size_t i = 0; i < n; i++)
        d[i] = (double)(rank + 1) * (double)(i % 3);
    if (c->ops->allreduce_sum_f64(c, d, n) < 0) return 4;
    for (size_t i = 0; i < n; i++)
        if (d[i] != (double)(world * (world + 1) / 2) * (double)(i % 3)) return 5;
    for (int root = 0; root < world; root++) {
        size_t len = (9u << 20) + 3;
        for (size_t i = 0; i < len; i++)
            device[i] = (char)(rank == root ? i * 7 + root : 0x55);
        if (c->ops->broadcast(c, device, len, root) < 0) return 6;
        for (size_t i = 0; i < len; i++)
            if (device[i] != (char)(i * 7 + root)) return 7;
    }
    size_t copies = fake.copies;
    double host[3] = {1, 2, (double)rank}; /* host memory: straight through, no copies */
    if (c->ops->allreduce_sum_f64(c, host, 3) < 0 || host[0] != world || fake.copies != copies)
        return 8;
    int rc = copies >= 6 ? 0 : 9; /* every collective above went through the stage, in chunks */
    c->ops->destroy(c);           /* and the ring with it */
    free(device);
    return rc;
}

static int run_staged(comm_t *c, int rank, int world) {
    int rc = staged_collectives(c, rank, world);
    if (rc) fprintf(stderr, "rank %d: staged check %d failed\n", rank, rc);
    _exit(rc); /* the staged comm destroyed the ring: run_ring must not destroy it again */
}

Test(comm_ring, staged_collectives_over_device_memory_match_the_ring) {
    for (int world = 2; world <= 3; world++)
        cr_assert_eq(run_ring(world, 10000, run_staged), 0, "world %d", world);
}

/* ---- comm_agree_all: every rank gets the same answer, "no" from any rank wins ---- */

static int agree_as(int rank, int world, const char *prefix, unsigned yes_mask) {
    store_client_t *store = connect_store(store_port, 5000);
    if (!store) return 10;
    bool all_yes = true;
    char err[256];
    if (comm_agree_all(store, prefix, "q", rank, world, (yes_mask >> rank) & 1, &all_yes, err,
                       sizeof err) < 0) {
        fprintf(stderr, "rank %d: %s\n", rank, err);
        return 11;
    }
    store_client_destroy(store);
    bool want = yes_mask == (1u << world) - 1;
    return all_yes == want ? 0 : 12;
}

static int run_agree(int world, unsigned yes_mask) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "/agree/%d/%u/%d/", (int)getpid(), yes_mask, world);
    pid_t pids[MAX_WORLD];
    for (int rank = 0; rank < world; rank++)
        if ((pids[rank] = fork()) == 0) _exit(agree_as(rank, world, prefix, yes_mask));
    int failed = 0;
    for (int rank = 0; rank < world; rank++) {
        int status;
        waitpid(pids[rank], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
    }
    return failed;
}

Test(comm_ring, every_rank_gets_the_same_agreement_and_one_no_wins) {
    for (int world = 1; world <= MAX_WORLD; world++)
        for (unsigned mask = 0; mask < (1u << world); mask++)
            cr_assert_eq(run_agree(world, mask), 0, "world %d, yes from ranks %#x", world, mask);
}

Test(comm_ring, agreement_refuses_a_value_that_is_not_a_vote) {
    store_client_t *store = connect_store(store_port, 5000);
    cr_assert_not_null(store);
    cr_assert_eq(store_client_set(store, "/bad/q/1", "maybe", 5), 0);
    bool all_yes = true;
    char err[256] = "";
    cr_assert_lt(comm_agree_all(store, "/bad/", "q", 0, 2, true, &all_yes, err, sizeof err), 0);
    cr_assert(!all_yes);
    cr_assert(strstr(err, "/bad/q/1") && strstr(err, "not 0 or 1"), "%s", err);
    store_client_destroy(store);
}

Test(comm_ring, agreement_with_a_missing_rank_ends_at_the_store_timeout) {
    store_client_t *store = connect_store(store_port, 500);
    cr_assert_not_null(store);
    bool all_yes = true;
    char err[256] = "";
    int64_t start = now_ms();
    cr_assert_lt(comm_agree_all(store, "/lonely/", "q", 0, 2, true, &all_yes, err, sizeof err), 0);
    cr_assert(!all_yes && now_ms() - start < 5000, "%s", err);
    cr_assert(strstr(err, "q") != NULL, "%s", err);
    store_client_destroy(store);
}

/* Between a client and the suite's store: forwards both ways until the client's MULTI_GET, then
 * relays the reply's first value only and closes both sides: the store's host dying mid-reply.
 * The client frees what it got, and comm_agree_all must not free it again (a double free that
 * aborted the worker instead of its exit 75). */
static void *store_that_dies_mid_reply(void *arg) {
    int listener = *(int *)arg;
    int client = accept(listener, NULL, NULL);
    int store = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(store_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (client < 0 || connect(store, (struct sockaddr *)&sa, sizeof sa) < 0) goto out;
    uint8_t req[1 << 16];
    size_t req_len = 0;
    store_dialect_t dialect = STORE_DIALECT_UNKNOWN;
    store_limits_t lim;
    store_limits_default(&lim);
    for (;;) {
        struct pollfd p[2] = {{.fd = client, .events = POLLIN}, {.fd = store, .events = POLLIN}};
        if (poll(p, 2, 10000) <= 0) goto out;
        uint8_t buf[4096];
        if (p[1].revents & POLLIN) {
            ssize_t n = recv(store, buf, sizeof buf, 0);
            if (n <= 0 || send(client, buf, (size_t)n, MSG_NOSIGNAL) != n) goto out;
        }
        if (!(p[0].revents & (POLLIN | POLLHUP))) continue;
        ssize_t n = recv(client, req + req_len, sizeof req - req_len, 0);
        if (n <= 0 || send(store, req + req_len, (size_t)n, MSG_NOSIGNAL) != n) goto out;
        req_len += (size_t)n;
        if (dialect == STORE_DIALECT_UNKNOWN &&
            (dialect = store_proto_detect_dialect(req, req_len)) == STORE_DIALECT_UNKNOWN)
            continue;
        store_request_t q;
        int used;
        while ((used = store_proto_decode_request(dialect, &lim, req, req_len, &q, NULL)) > 0) {
            if (q.op == STORE_OP_MULTI_GET) {
                uint64_t first_len;
                if (recv(store, &first_len, 8, MSG_WAITALL) != 8 || first_len > sizeof buf ||
                    recv(store, buf, first_len, MSG_WAITALL) != (ssize_t)first_len)
                    goto out;
                send(client, &first_len, 8, MSG_NOSIGNAL);
                send(client, buf, first_len, MSG_NOSIGNAL);
                goto out;
            }
            memmove(req, req + used, req_len - (size_t)used);
            req_len -= (size_t)used;
        }
    }
out:
    if (client >= 0) close(client);
    close(store);
    return NULL;
}

Test(comm_ring, agreement_whose_store_dies_mid_reply_fails_cleanly) {
    store_client_t *direct = connect_store(store_port, 5000);
    cr_assert_not_null(direct);
    cr_assert_eq(store_client_set(direct, "/dying/q/1", "1", 1), 0); /* rank 1's vote */
    store_client_destroy(direct);
    int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sa_len = sizeof sa;
    cr_assert_eq(bind(listener, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(listener, 4), 0);
    cr_assert_eq(getsockname(listener, (struct sockaddr *)&sa, &sa_len), 0);
    pthread_t t;
    pthread_create(&t, NULL, store_that_dies_mid_reply, &listener);
    store_client_t *store = connect_store(ntohs(sa.sin_port), 5000);
    cr_assert_not_null(store);
    bool all_yes = true;
    char err[256] = "";
    int rc = comm_agree_all(store, "/dying/", "q", 0, 2, true, &all_yes, err, sizeof err);
    store_client_destroy(store);
    pthread_join(t, NULL);
    close(listener);
    cr_assert(rc < 0 && !all_yes, "rc %d: %s", rc, err);
}

/* ---- ranks played by hand: the join's handshake (comm_ring_join.c) on raw sockets ---- */

static uint64_t fnv1a(const char *s) { /* the ring's job hash of its key prefix */
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

#define HAND_MAGIC 0x444450524e473032ull
enum { HAND_ACCEPTED = 1, HAND_NOT_THIS_JOB, HAND_BAD_PROOF, HAND_WRONG_RANK };

typedef struct {
    uint64_t magic;
    uint32_t has_secret, reserved;
    uint8_t nonce[32];
} hand_challenge_t;

typedef struct {
    uint64_t magic, job_hash;
    uint32_t rank, world;
    uint8_t nonce[32], mac[32];
} hand_hello_t;

typedef struct {
    uint64_t magic;
    uint32_t verdict, reserved;
    uint8_t mac[32];
} hand_verdict_t;

/* A rank's listener on loopback, its address published as rank's under prefix; the listening fd.
 * next: the address rank + 1 (of world) published, as a sockaddr. */
static int hand_join(const char *prefix, int rank, int world, struct sockaddr_in *next) {
    store_client_t *store = connect_store(store_port, 10000);
    if (!store) _exit(10);
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sa_len = sizeof sa;
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(ls, 4) < 0 ||
        getsockname(ls, (struct sockaddr *)&sa, &sa_len) < 0)
        _exit(11);
    char key[128], addr[64];
    snprintf(key, sizeof key, "%sring/%d", prefix, rank);
    snprintf(addr, sizeof addr, "127.0.0.1:%u", ntohs(sa.sin_port));
    if (store_client_set(store, key, addr, strlen(addr)) < 0) _exit(12);
    snprintf(key, sizeof key, "%sring/%d", prefix, (rank + 1) % world);
    uint8_t *next_addr = NULL;
    size_t next_len = 0;
    if (store_client_get(store, key, &next_addr, &next_len) < 0) _exit(13);
    char text[64];
    snprintf(text, sizeof text, "%.*s", (int)next_len, (const char *)next_addr);
    char *colon = strrchr(text, ':');
    if (!colon) _exit(14);
    *next = (struct sockaddr_in){.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)atoi(colon + 1)),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    free(next_addr);
    store_client_destroy(store);
    return ls;
}

/* Take prev's connection: challenge (saying it holds a secret when has_secret, though it proves
 * none), its hello, ACCEPTED. The connected fd. */
static int hand_accept(int ls, bool has_secret) {
    int in = accept(ls, NULL, NULL);
    hand_challenge_t ch = {.magic = HAND_MAGIC, .has_secret = has_secret};
    hand_hello_t hello;
    hand_verdict_t v = {.magic = HAND_MAGIC, .verdict = HAND_ACCEPTED};
    if (in < 0 || send(in, &ch, sizeof ch, MSG_NOSIGNAL) != (ssize_t)sizeof ch ||
        recv(in, &hello, sizeof hello, MSG_WAITALL) != (ssize_t)sizeof hello ||
        send(in, &v, sizeof v, MSG_NOSIGNAL) != (ssize_t)sizeof v)
        _exit(15);
    return in;
}

/* Connect to next and say hello as rank of world of prefix's job, with a MAC of zeros (no secret,
 * or a forged proof); the connected fd, the verdict in *verdict. */
static int hand_connect(const struct sockaddr_in *next, const char *prefix, int rank, int world,
                        uint32_t *verdict) {
    int out = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    hand_challenge_t ch;
    hand_hello_t hello = {.magic = HAND_MAGIC,
                          .job_hash = fnv1a(prefix),
                          .rank = (uint32_t)rank,
                          .world = (uint32_t)world};
    hand_verdict_t v;
    if (connect(out, (const struct sockaddr *)next, sizeof *next) < 0 ||
        recv(out, &ch, sizeof ch, MSG_WAITALL) != (ssize_t)sizeof ch || ch.magic != HAND_MAGIC ||
        send(out, &hello, sizeof hello, MSG_NOSIGNAL) != (ssize_t)sizeof hello ||
        recv(out, &v, sizeof v, MSG_WAITALL) != (ssize_t)sizeof v)
        _exit(16);
    *verdict = v.verdict;
    return out;
}

/* Rank 1 of 2 played by hand: it joins the ring (rank 0 connects first: it accepts, then
 * connects), then echoes rank 0's opening frame and sends the collective's data a byte every
 * 100 ms. */
static void trickling_rank(const char *prefix) {
    struct sockaddr_in next;
    int ls = hand_join(prefix, 1, 2, &next);
    int in = hand_accept(ls, false);
    uint32_t verdict = 0;
    int out = hand_connect(&next, prefix, 1, 2, &verdict);
    uint8_t frame[32];
    if (verdict != HAND_ACCEPTED ||
        recv(in, frame, sizeof frame, MSG_WAITALL) != (ssize_t)sizeof frame ||
        send(out, frame, sizeof frame, MSG_NOSIGNAL) != (ssize_t)sizeof frame)
        _exit(17);
    uint8_t sink[4096], zero = 0;
    for (int i = 0; i < 600; i++) { /* a minute at most */
        if (send(out, &zero, 1, MSG_NOSIGNAL) != 1) break;
        while (recv(in, sink, sizeof sink, MSG_DONTWAIT) > 0) {
        }
        usleep(100 * 1000);
    }
    _exit(0);
}

Test(comm_ring, a_peer_that_trickles_fails_the_collective_within_its_bound) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "/trickle/%d/", (int)getpid());
    pid_t fake = fork();
    if (fake == 0) trickling_rank(prefix);
    store_client_t *store = connect_store(store_port, 10000);
    cr_assert_not_null(store);
    comm_ring_opts_t ro = {.rank = 0,
                           .world = 2,
                           .store = store,
                           .key_prefix = prefix,
                           .store_host = "127.0.0.1",
                           .timeout_ms = 3000};
    comm_t *c = NULL;
    char err[512];
    cr_assert_eq(comm_ring_create(&ro, &c, err, sizeof err), 0, "%s", err);
    store_client_destroy(store);
    /* 256 KiB: the bound is 3 s plus 2 s at the slowest rate allowed; the trickle moves 10 B/s */
    size_t n = 64 * 1024;
    float *data = calloc(n, sizeof *data);
    int64_t start = now_ms();
    int rc = c->ops->allreduce_sum_f32(c, data, n);
    int64_t took = now_ms() - start;
    cr_assert_lt(rc, 0, "the collective ended well on a trickle");
    cr_assert_lt(took, 15000, "held %lld ms", (long long)took);
    cr_assert(strstr(comm_error(c), "too slowly"), "%s", comm_error(c));
    c->ops->destroy(c);
    free(data);
    kill(fake, SIGKILL);
    waitpid(fake, NULL, 0);
}

/* ---- the store's shared secret on the ring ---- */

static const char *const same_secret[] = {"the-job-secret-0123456789", "the-job-secret-0123456789",
                                          "the-job-secret-0123456789"};

Test(comm_ring, ranks_that_prove_the_store_secret_make_a_ring) {
    cr_assert_eq(run_ring_with_secrets(3, 10000, allreduce_exact, same_secret), 0, "%s | %s | %s",
                 shared->err[0], shared->err[1], shared->err[2]);
}

Test(comm_ring, ranks_with_different_secrets_are_refused_naming_the_secret) {
    const char *const secrets[] = {"the-job-secret-0123456789", "another-secret-0123456789"};
    memset(shared->err, 0, sizeof shared->err);
    int64_t start = now_ms();
    cr_assert_eq(run_ring_with_secrets(2, 3000, allreduce_exact, secrets), 2);
    cr_assert_lt(now_ms() - start, 10000);
    /* the rank that connects first (rank 0) hears the refusal at once */
    cr_assert(strstr(shared->err[0], "hold different secrets"), "%s", shared->err[0]);
}

Test(comm_ring, a_rank_without_the_secret_is_told_its_peer_requires_it) {
    const char *const secrets[] = {NULL, "the-job-secret-0123456789"};
    memset(shared->err, 0, sizeof shared->err);
    cr_assert_eq(run_ring_with_secrets(2, 3000, allreduce_exact, secrets), 2);
    cr_assert(strstr(shared->err[0], "requires the store's shared secret"), "%s", shared->err[0]);
}

/* Rank 1 of 2 with the secret, rank 0 a stranger that knows the job's prefix and the ring's
 * address but not the secret (rank_alone, by hand) */
static int join_alone(const char *prefix, int rank, int64_t timeout_ms, char *err, size_t err_len) {
    store_client_t *store = connect_store(store_port, 10000);
    cr_assert_not_null(store);
    store_secret_t secret;
    cr_assert_eq(store_secret_from_text(same_secret[0], strlen(same_secret[0]), "test", &secret,
                                        err, err_len),
                 0);
    comm_ring_opts_t ro = {.rank = rank,
                           .world = 2,
                           .store = store,
                           .key_prefix = prefix,
                           .store_host = "127.0.0.1",
                           .timeout_ms = timeout_ms,
                           .secret = &secret};
    comm_t *c = NULL;
    int rc = comm_ring_create(&ro, &c, err, err_len);
    store_client_destroy(store);
    if (c) c->ops->destroy(c);
    return rc;
}

/* The stranger says hello as rank 0 with a forged proof: rank 1 refuses it (BAD_PROOF), never
 * joins it, and names it when rank 0 never comes. */
Test(comm_ring, a_stranger_without_the_secret_cannot_join_the_ring) {
    char prefix[64], err[512];
    snprintf(prefix, sizeof prefix, "/stranger/%d/", (int)getpid());
    uint32_t *verdict = (uint32_t *)&shared->result_hash[0];
    *verdict = 0;
    pid_t fake = fork();
    if (fake == 0) {
        struct sockaddr_in next;
        hand_join(prefix, 0, 2, &next);
        close(hand_connect(&next, prefix, 0, 2, verdict));
        pause();
        _exit(0);
    }
    int rc = join_alone(prefix, 1, 2000, err, sizeof err);
    kill(fake, SIGKILL);
    waitpid(fake, NULL, 0);
    cr_assert_lt(rc, 0, "a ring with a stranger in it");
    cr_assert_eq(*verdict, HAND_BAD_PROOF);
    cr_assert(strstr(err, "failed the proof of the store's shared secret"), "%s", err);
}

/* The stranger listens as rank 1 and takes rank 0's hello without proving the secret back: rank 0
 * does not go on with it. */
Test(comm_ring, a_rank_that_does_not_prove_the_secret_back_is_not_joined) {
    char prefix[64], err[512];
    snprintf(prefix, sizeof prefix, "/impostor/%d/", (int)getpid());
    pid_t fake = fork();
    if (fake == 0) {
        struct sockaddr_in next;
        close(hand_accept(hand_join(prefix, 1, 2, &next), true));
        pause();
        _exit(0);
    }
    int64_t start = now_ms();
    int rc = join_alone(prefix, 0, 5000, err, sizeof err);
    kill(fake, SIGKILL);
    waitpid(fake, NULL, 0);
    cr_assert_lt(rc, 0, "rank 0 joined an impostor");
    cr_assert_lt(now_ms() - start, 4000, "not at once");
    cr_assert(strstr(err, "did not prove the store's shared secret"), "%s", err);
}
