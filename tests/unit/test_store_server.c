/* Unit tests of the store server (launcher/store_server + store_ops) through the blocking client
 * (common/store_client): every operation end to end, both numberings, WAIT wake-up and timeout,
 * the auth extension, and connect retry. The server runs on its own loop in a second thread. */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "ddp_error.h"
#include "store_client.h"
#include "store_server.h"

typedef struct {
    uv_loop_t loop;
    uv_async_t stop;
    store_server_t *srv;
    store_server_opts_t opts;
    pthread_t thread;
    uint16_t port;
    int start_rc;
    int start_delay_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool is_started;
} server_t;

static void on_stop(uv_async_t *a) {
    server_t *s = a->data;
    store_server_stop(s->srv, NULL, NULL);
    uv_close((uv_handle_t *)a, NULL);
}

static void *server_main(void *arg) {
    server_t *s = arg;
    if (s->start_delay_ms) usleep((useconds_t)s->start_delay_ms * 1000);
    uv_loop_init(&s->loop);
    char err[256];
    s->start_rc = store_server_start(&s->loop, &s->opts, &s->srv, err, sizeof err);
    uv_async_init(&s->loop, &s->stop, on_stop);
    s->stop.data = s;
    pthread_mutex_lock(&s->mu);
    s->port = s->start_rc == 0 ? store_server_port(s->srv) : 0;
    s->is_started = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->start_rc != 0) uv_close((uv_handle_t *)&s->stop, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return NULL;
}

static server_t *server_start_on(uint16_t port, const char *secret, int delay_ms) {
    server_t *s = calloc(1, sizeof *s);
    store_limits_default(&s->opts.limits);
    s->opts.host = "127.0.0.1";
    s->opts.port = port;
    s->start_delay_ms = delay_ms;
    cr_assert_eq(store_auth_init(), 0);
    if (secret) {
        char err[256];
        cr_assert_eq(store_secret_from_text(secret, strlen(secret), "test", &s->opts.secret, err,
                                            sizeof err), 0, "%s", err);
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, server_main, s);
    if (delay_ms) return s;
    pthread_mutex_lock(&s->mu);
    while (!s->is_started) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    cr_assert_eq(s->start_rc, 0);
    return s;
}

static server_t *server_start(const char *secret) {
    return server_start_on(0, secret, 0);
}

static void server_stop(server_t *s) {
    if (s->start_rc == 0) uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    free(s);
}

static store_client_t *client_for(uint16_t port, store_dialect_t d, const store_secret_t *secret,
                                  int *rc) {
    store_client_opts_t o = {.host = "127.0.0.1", .port = port, .dialect = d, .secret = secret,
                             .connect_timeout_ms = 5000, .op_timeout_ms = 5000};
    store_client_t *c = NULL;
    *rc = store_client_connect(&o, &c);
    return c;
}

static store_client_t *client(server_t *s, store_dialect_t d) {
    int rc;
    store_client_t *c = client_for(s->port, d, NULL, &rc);
    cr_assert_eq(rc, 0, "%s", store_client_error(c));
    return c;
}

static void expect_get(store_client_t *c, const char *key, const char *want) {
    uint8_t *v;
    size_t n;
    cr_assert_eq(store_client_get(c, key, &v, &n), 0, "%s", store_client_error(c));
    cr_assert(n == strlen(want) && memcmp(v, want, n) == 0, "%s: got '%.*s'", key, (int)n, v);
    free(v);
}

static void exercise_common_ops(store_client_t *c) {
    cr_assert_eq(store_client_set(c, "k", "v1", 2), 0);
    expect_get(c, "k", "v1");
    int64_t v;
    cr_assert_eq(store_client_add(c, "n", 40, &v), 0);
    cr_assert_eq(store_client_add(c, "n", 2, &v), 0);
    cr_assert_eq(v, 42);
    expect_get(c, "n", "42");
    uint8_t *cur;
    size_t cur_n;
    cr_assert_eq(store_client_compare_set(c, "k", "v1", 2, "v2", 2, &cur, &cur_n), 0);
    cr_assert(cur_n == 2 && memcmp(cur, "v2", 2) == 0);
    free(cur);
    cr_assert_eq(store_client_compare_set(c, "missing", "x", 1, "y", 1, &cur, &cur_n), 0);
    cr_assert(cur_n == 1 && cur[0] == 'x');
    free(cur);
    bool ok;
    const char *keys[] = {"k", "n"};
    cr_assert_eq(store_client_check(c, keys, 2, &ok), 0);
    cr_assert(ok);
    const char *missing[] = {"k", "missing"};
    cr_assert_eq(store_client_check(c, missing, 2, &ok), 0);
    cr_assert_not(ok);
    cr_assert_eq(store_client_wait(c, keys, 2, 1000), 0);
    int64_t n;
    cr_assert_eq(store_client_num_keys(c, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_eq(store_client_delete_key(c, "k", &ok), 0);
    cr_assert(ok);
    cr_assert_eq(store_client_delete_key(c, "k", &ok), 0);
    cr_assert_not(ok);
    cr_assert_eq(store_client_append(c, "ap", "ab", 2), 0);
    cr_assert_eq(store_client_append(c, "ap", "cd", 2), 0);
    expect_get(c, "ap", "abcd");
    const char *mk[] = {"m1", "m2"};
    const void *mv[] = {"x", ""};
    size_t ml[] = {1, 0};
    cr_assert_eq(store_client_multi_set(c, mk, mv, ml, 2), 0);
    const char *gk[] = {"m1", "m2", "nope"};
    uint8_t *vals[3];
    size_t lens[3];
    cr_assert_eq(store_client_multi_get(c, gk, 3, vals, lens), 0);
    cr_assert(lens[0] == 1 && vals[0][0] == 'x' && lens[1] == 0 && lens[2] == 0);
    for (int i = 0; i < 3; i++) free(vals[i]);
    /* binary values round-trip */
    uint8_t bin[300];
    for (int i = 0; i < 300; i++) bin[i] = (uint8_t)i;
    cr_assert_eq(store_client_set(c, "bin", bin, sizeof bin), 0);
    uint8_t *got;
    size_t got_n;
    cr_assert_eq(store_client_get(c, "bin", &got, &got_n), 0);
    cr_assert(got_n == sizeof bin && memcmp(got, bin, sizeof bin) == 0);
    free(got);
}

Test(store_server, every_operation_current_numbering, .timeout = 60) {
    server_t *s = server_start(NULL);
    store_client_t *c = client(s, STORE_DIALECT_CURRENT);
    exercise_common_ops(c);
    uint64_t rtt;
    cr_assert_eq(store_client_ping(c, &rtt), 0);
    cr_assert_eq(store_client_queue_push(c, "q", "a", 1), 0);
    cr_assert_eq(store_client_queue_push(c, "q", "b", 1), 0);
    int64_t n;
    cr_assert_eq(store_client_queue_len(c, "q", &n), 0);
    cr_assert_eq(n, 2);
    uint8_t *v;
    size_t vn;
    cr_assert_eq(store_client_queue_pop(c, "q", 1000, &v, &vn), 0);
    cr_assert(vn == 1 && v[0] == 'a');
    free(v);
    char **keys;
    size_t nk;
    cr_assert_eq(store_client_list_keys(c, &keys, &nk), 0);
    int64_t num;
    store_client_num_keys(c, &num);
    cr_assert_eq((int64_t)nk, num);
    for (size_t i = 0; i < nk; i++) free(keys[i]);
    free(keys);
    cr_assert_eq(store_client_barrier(c, "solo", 1, 1000), 0, "a barrier of one releases at once");
    store_client_destroy(c);
    server_stop(s);
}

Test(store_server, every_operation_legacy_numbering, .timeout = 60) {
    server_t *s = server_start(NULL);
    store_client_t *c = client(s, STORE_DIALECT_LEGACY);
    exercise_common_ops(c);
    cr_assert_eq(store_client_ping(c, NULL), -ENOTSUP, "legacy numbering has no PING");
    /* the same table is visible to a current-numbering client */
    store_client_t *c2 = client(s, STORE_DIALECT_CURRENT);
    expect_get(c2, "n", "42");
    store_client_destroy(c2);
    store_client_destroy(c);
    server_stop(s);
}

typedef struct {
    uint16_t port;
    const char *key;
    int delay_ms;
    store_dialect_t dialect;
} setter_t;

static void *delayed_set(void *arg) {
    setter_t *st = arg;
    usleep((useconds_t)st->delay_ms * 1000);
    int rc;
    store_client_t *c = client_for(st->port, st->dialect, NULL, &rc);
    if (rc == 0) store_client_set(c, st->key, "ok", 2);
    store_client_destroy(c);
    return NULL;
}

Test(store_server, wait_wakes_and_times_out, .timeout = 60) {
    server_t *s = server_start(NULL);
    store_dialect_t dialects[] = {STORE_DIALECT_CURRENT, STORE_DIALECT_LEGACY};
    for (int i = 0; i < 2; i++) {
        store_client_t *c = client(s, dialects[i]);
        char key[32];
        snprintf(key, sizeof key, "late/%d", i);
        setter_t st = {.port = s->port, .key = key, .delay_ms = 200, .dialect = dialects[i]};
        pthread_t th;
        pthread_create(&th, NULL, delayed_set, &st);
        uint64_t t0 = clock_now_ms();
        expect_get(c, key, "ok"); /* GET blocks until another client sets the key */
        uint64_t waited = clock_now_ms() - t0;
        pthread_join(th, NULL);
        cr_assert(waited >= 150 && waited < 3000, "waited %llu ms", (unsigned long long)waited);

        const char *never[] = {"never"};
        t0 = clock_now_ms();
        cr_assert_eq(store_client_wait(c, never, 1, 300), DDP_ETIMEOUT);
        waited = clock_now_ms() - t0;
        cr_assert(waited >= 290 && waited < 2000, "timeout took %llu ms", (unsigned long long)waited);
        cr_assert(strstr(store_client_error(c), "timed out"), "%s", store_client_error(c));
        /* still usable: CANCEL_WAIT (or a reconnect on the legacy numbering) cleaned up */
        cr_assert_eq(store_client_set(c, "after", "1", 1), 0, "%s", store_client_error(c));
        expect_get(c, "after", "1");
        store_client_destroy(c);
    }
    server_stop(s);
}

Test(store_server, shared_secret, .timeout = 60) {
    const char *secret_text = "correct horse battery staple";
    server_t *s = server_start(secret_text);
    store_secret_t good, bad;
    char err[256];
    cr_assert_eq(store_secret_from_text(secret_text, strlen(secret_text), "t", &good, err, 256), 0);
    cr_assert_eq(store_secret_from_text("a different secret!", 19, "t", &bad, err, 256), 0);
    cr_assert_eq(store_secret_from_text("short", 5, "t", &bad, err, 256), -EINVAL);
    cr_assert(strstr(err, "at least"), "%s", err);
    cr_assert_eq(store_secret_from_text("a different secret!", 19, "t", &bad, err, 256), 0);

    int rc;
    store_client_t *c = client_for(s->port, STORE_DIALECT_CURRENT, &good, &rc);
    cr_assert_eq(rc, 0, "%s", store_client_error(c));
    exercise_common_ops(c);
    store_client_destroy(c);

    c = client_for(s->port, STORE_DIALECT_CURRENT, NULL, &rc);
    cr_assert_eq(rc, DDP_ENOSECRET);
    cr_assert(strstr(store_client_error(c), "requires a shared secret"), "%s",
              store_client_error(c));
    store_client_destroy(c);

    c = client_for(s->port, STORE_DIALECT_CURRENT, &bad, &rc);
    cr_assert_eq(rc, DDP_EAUTH);
    cr_assert(strstr(store_client_error(c), "rejected our shared secret"), "%s",
              store_client_error(c));
    store_client_destroy(c);

    c = client_for(s->port, STORE_DIALECT_LEGACY, NULL, &rc);
    cr_assert_eq(rc, 0, "the legacy numbering has no handshake: refusal comes with the first op");
    int64_t nk;
    cr_assert_lt(store_client_num_keys(c, &nk), 0, "a legacy client got past a secret");
    store_client_destroy(c);
    server_stop(s);

    server_t *open = server_start(NULL);
    c = client_for(open->port, STORE_DIALECT_CURRENT, &good, &rc);
    cr_assert_eq(rc, DDP_EAUTH, "a client holding a secret refuses an open store");
    cr_assert(strstr(store_client_error(c), "without a shared secret"), "%s", store_client_error(c));
    store_client_destroy(c);
    server_stop(open);
}

static uint16_t free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&a, sizeof a);
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

Test(store_server, connect_retries_until_the_server_listens, .timeout = 60) {
    uint16_t port = free_port();
    server_t *s = server_start_on(port, NULL, 500);
    int rc;
    uint64_t t0 = clock_now_ms();
    store_client_t *c = client_for(port, STORE_DIALECT_CURRENT, NULL, &rc);
    cr_assert_eq(rc, 0, "%s", store_client_error(c));
    cr_assert_geq(clock_now_ms() - t0, 300);
    cr_assert_eq(store_client_set(c, "up", "1", 1), 0);
    store_client_destroy(c);
    server_stop(s);

    uint16_t dead = free_port();
    store_client_opts_t o = {.host = "127.0.0.1", .port = dead, .connect_timeout_ms = 400};
    t0 = clock_now_ms();
    rc = store_client_connect(&o, &c);
    uint64_t took = clock_now_ms() - t0;
    cr_assert_eq(rc, DDP_ETIMEOUT);
    cr_assert(took >= 380 && took < 3000, "gave up after %llu ms", (unsigned long long)took);
    cr_assert(strstr(store_client_error(c), "could not connect"), "%s", store_client_error(c));
    store_client_destroy(c);
}
