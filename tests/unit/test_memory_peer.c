/* Unit tests of launcher/memory/memory_peer against the other side played by the test (a
 * plain socket): with the agents' shared secret the sender waits on one connection for the
 * receiver's nonce and answers it with its own and the MAC over both (docs/protocol.md); a
 * receiver slow to send its nonce gets no second connection meanwhile (the 2026-11-27 "sent too
 * much": a connection per 10 ms poll, each left open, both nonces read as one challenge), and one
 * that never sends it is dropped after CHALLENGE_MS and connected to again; on the receiving side
 * a connection that never proves the secret is closed after PROOF_MS; a frame of another run id
 * writes nothing, and another origin's copies go only where they are older than the one received.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "memory/memory_peer.h"
#include "memory/memory_peer_internal.h"
#include "store_auth.h"
#include "temp_dir.h"
#include "xxh3_simd.h"

#define SECRET "memory-peer-unit-test-secret"

static char dir[256];
static uv_loop_t loop;
static ddprun_opts_t opts;
static int receiver = -1;
static uint16_t receiver_port;

static void setup(void) {
    temp_dir_make(dir, sizeof dir, "memory_peer");
    cr_assert_eq(uv_loop_init(&loop), 0);
    memset(&opts, 0, sizeof opts);
    char err[256];
    cr_assert_eq(store_auth_init(), 0);
    cr_assert_eq(
        store_secret_from_text(SECRET, strlen(SECRET), "test", &opts.store_secret, err, sizeof err),
        0, "%s", err);
    strcpy(opts.local_addr, "127.0.0.1");
    strcpy(opts.rdzv_id, "unit-job");
    /* the next node's receiver: a listener that accepts only when the test says so */
    receiver = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    cr_assert_geq(receiver, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    cr_assert_eq(bind(receiver, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(receiver, 256), 0);
    cr_assert_eq(getsockname(receiver, (struct sockaddr *)&sa, &len), 0);
    receiver_port = ntohs(sa.sin_port);
}

static void teardown(void) {
    if (receiver >= 0) close(receiver);
    uv_loop_close(&loop);
    temp_dir_remove(dir);
}

TestSuite(memory_peer, .init = setup, .fini = teardown, .timeout = 60);

static void stop_loop(uv_timer_t *t) {
    uv_stop(t->loop);
}

/* Run the agent's loop for ms milliseconds. */
static void run_for(int ms) {
    uv_timer_t t;
    uv_timer_init(&loop, &t);
    uv_timer_start(&t, stop_loop, (uint64_t)ms, 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* The connections the sender made since the last call, accepted (at most n). */
static int accept_all(int *fds, int n) {
    int got = 0;
    for (;;) {
        int fd = accept4(receiver, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            cr_assert(errno == EAGAIN || errno == EWOULDBLOCK, "accept: %s", strerror(errno));
            return got;
        }
        if (got < n)
            fds[got++] = fd;
        else
            close(fd), got++;
    }
}

static memory_peer_t *start_sender(void) {
    memory_peer_t *p = NULL;
    char err[512];
    cr_assert_eq(memory_peer_start(&loop, &opts, dir, &p, err, sizeof err), 0, "%s", err);
    memory_peer_round(p, 0, 0, 2, "127.0.0.1", receiver_port);
    return p;
}

static void stop_sender(memory_peer_t *p) {
    memory_peer_stop(p);
    uv_run(&loop, UV_RUN_DEFAULT); /* until its handles closed and p is freed */
}

Test(memory_peer, a_slow_receiver_gets_one_connection_and_the_proof_of_its_nonce) {
    memory_peer_t *p = start_sender();
    run_for(400); /* 40 polls while the receiver has not sent its nonce */
    int fds[64];
    int n = accept_all(fds, 64);
    cr_assert_eq(n, 1, "%d connections while the first waited for its challenge", n);
    uint8_t nonce[STORE_AUTH_NONCE_BYTES], proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES];
    store_auth_random_nonce(nonce);
    cr_assert_eq(write(fds[0], nonce, sizeof nonce), (ssize_t)sizeof nonce);
    run_for(200);
    cr_assert_eq(recv(fds[0], proof, sizeof proof, MSG_DONTWAIT), (ssize_t)sizeof proof);
    uint8_t want[STORE_AUTH_MAC_BYTES];
    store_auth_mac(&opts.store_secret, MEMORY_PEER_ROLE, nonce, proof, NULL, 0, want);
    cr_assert(store_auth_mac_equal(want, proof + STORE_AUTH_NONCE_BYTES), "the proof is not ours");
    run_for(100);
    cr_assert_eq(accept_all(fds + 1, 63), 0, "a connection after the proof");
    close(fds[0]);
    stop_sender(p);
}

Test(memory_peer, a_receiver_that_never_sends_its_nonce_is_left_for_a_new_connection) {
    memory_peer_t *p = start_sender();
    run_for(200);
    int fds[64];
    cr_assert_eq(accept_all(fds, 64), 1);
    run_for(CHALLENGE_MS + RETRY_MS + 300);
    uint8_t byte;
    cr_assert_eq(recv(fds[0], &byte, 1, MSG_DONTWAIT), 0, "the first connection is still open");
    int n = accept_all(fds + 1, 63);
    cr_assert_eq(n, 1, "%d connections after the first was given up", n);
    close(fds[0]), close(fds[1]);
    stop_sender(p);
}

/* A connection to p's own listener (the receiving side), as another node's sender makes. */
static int connect_to_receiver(memory_peer_t *p) {
    const char *host;
    uint16_t port;
    memory_peer_address(p, &host, &port);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "%s", strerror(errno));
    return fd;
}

/* The receiving side: a connection that takes the nonce and never proves the secret is closed
 * after PROOF_MS (it would hold a descriptor and a 64 KiB buffer for good). */
Test(memory_peer, a_sender_that_never_proves_the_secret_is_closed) {
    memory_peer_t *p = start_sender();
    int fd = connect_to_receiver(p);
    run_for(200);
    uint8_t nonce[STORE_AUTH_NONCE_BYTES + 1];
    cr_assert_eq(recv(fd, nonce, sizeof nonce, MSG_DONTWAIT), STORE_AUTH_NONCE_BYTES);
    run_for(PROOF_MS - 1000);
    cr_assert_eq(recv(fd, nonce, 1, MSG_DONTWAIT), -1, "closed before its time");
    run_for(1300);
    cr_assert_eq(recv(fd, nonce, 1, MSG_DONTWAIT), 0, "still open after %d ms", PROOF_MS + 500);
    close(fd);
    int fds[64];
    for (int i = 0, n = accept_all(fds, 64); i < n && i < 64; i++)
        close(fds[i]);
    stop_sender(p);
}

/* The receiving side without a secret: frames of another run id (an agent of another job that
 * took over the port of one of this job's) write nothing; this job's are kept, and another
 * origin's copies go only where they are older than the one received. */

/* A sealed snapshot header of step (what the receiver verifies). */
static snapshot_header_t sealed_header(uint64_t step) {
    snapshot_header_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, SNAPSHOT_MAGIC, sizeof h.magic);
    h.version = SNAPSHOT_VERSION;
    h.header_bytes = sizeof h;
    h.step = step;
    h.header_checksum = XXH3_64bits(&h, HEADER_CHECKED);
    return h;
}

static void write_file(const char *name, const void *bytes, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    cr_assert_eq(write(fd, bytes, n), (ssize_t)n);
    close(fd);
}

static bool has_file(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* Connect to p's listener and send one frame of origin's generation of step (header only), tagged
 * with run id's tag; returns the connection. */
static int send_copy(memory_peer_t *p, const char *run_id, uint32_t origin, uint64_t step) {
    int fd = connect_to_receiver(p);
    snapshot_header_t h = sealed_header(step);
    uint8_t frame[FRAME_BYTES];
    uint32_t tag = (uint32_t)XXH3_64bits(run_id, strlen(run_id));
    uint64_t n = sizeof h, reached = step;
    memcpy(frame, MEMORY_PEER_MAGIC, 8);
    memcpy(frame + 8, &origin, 4);
    memcpy(frame + 12, &tag, 4);
    memcpy(frame + 16, &step, 8);
    memcpy(frame + 24, &n, 8);
    memcpy(frame + 32, &reached, 8);
    cr_assert_eq(write(fd, frame, sizeof frame), (ssize_t)sizeof frame);
    cr_assert_eq(write(fd, &h, sizeof h), (ssize_t)sizeof h);
    run_for(300);
    return fd;
}

static void drain_receiver(void) {
    int fds[64];
    for (int i = 0, n = accept_all(fds, 64); i < n && i < 64; i++)
        close(fds[i]);
}

Test(memory_peer, a_copy_from_an_agent_of_another_run_id_is_refused) {
    opts.store_secret.is_set = false;
    memory_peer_t *p = start_sender();
    int fd = send_copy(p, "another-job", 7, 50);
    uint8_t byte;
    cr_assert_eq(recv(fd, &byte, 1, MSG_DONTWAIT), 0, "the connection stays open");
    cr_assert_not(has_file("peer-7-0.ddps") || has_file("peer-7-1.ddps"), "a copy was written");
    close(fd);
    fd = send_copy(p, opts.rdzv_id, 7, 50);
    cr_assert_eq(recv(fd, &byte, 1, MSG_DONTWAIT), -1, "this job's sender was closed");
    cr_assert(has_file("peer-7-0.ddps"), "this job's copy was not written");
    cr_assert(has_file("peer-7-progress"));
    close(fd);
    drain_receiver();
    stop_sender(p);
}

Test(memory_peer, another_origins_newer_copy_stays_when_an_older_step_arrives) {
    opts.store_secret.is_set = false;
    memory_peer_t *p = start_sender();
    snapshot_header_t newer = sealed_header(100), older = sealed_header(10);
    uint64_t progress[2] = {100, ~(uint64_t)100};
    write_file("peer-5-0.ddps", &newer, sizeof newer);
    write_file("peer-5-progress", progress, sizeof progress);
    write_file("peer-4-0.ddps", &older, sizeof older);
    write_file("peer-4-1.ddps", "torn", 4);
    write_file("peer-4-progress", progress, sizeof progress);
    int fd = send_copy(p, opts.rdzv_id, 7, 50);
    cr_assert(has_file("peer-7-0.ddps"), "the copy was not written");
    cr_assert(has_file("peer-5-0.ddps") && has_file("peer-5-progress"),
              "a copy of a newer step was deleted");
    cr_assert_not(has_file("peer-4-0.ddps") || has_file("peer-4-1.ddps") ||
                      has_file("peer-4-progress"),
                  "an older origin's copies stay");
    close(fd);
    drain_receiver();
    stop_sender(p);
}
