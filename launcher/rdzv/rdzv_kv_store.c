/* rdzv_kv_store: rdzv_kv over the job's TCP store (store_client). Liveness is agent.c's
 * heartbeat counters, so set_ephemeral is a plain SET and keep_alive / wait_gone are absent. */
#include <errno.h>
#include <stdlib.h>

#include "rdzv/rdzv_kv.h"
#include "rdzv/rdzv_kv_impl.h"
#include "store_client.h"

typedef struct {
    rdzv_kv_t kv;
    store_client_t *c;
} store_kv_t;

static store_client_t *client(rdzv_kv_t *kv) {
    return ((store_kv_t *)kv)->c;
}

static int kv_set(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    return store_client_set(client(kv), key, val, len);
}

static int kv_get(rdzv_kv_t *kv, const char *key, uint8_t **val, size_t *len) {
    return store_client_get(client(kv), key, val, len);
}

static int kv_add(rdzv_kv_t *kv, const char *key, int64_t delta, int64_t *result) {
    return store_client_add(client(kv), key, delta, result);
}

static int kv_compare_set(rdzv_kv_t *kv, const char *key, const void *expected, size_t expected_len,
                          const void *desired, size_t desired_len, uint8_t **current,
                          size_t *current_len) {
    return store_client_compare_set(client(kv), key, expected, expected_len, desired, desired_len,
                                    current, current_len);
}

static int kv_wait(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms) {
    return store_client_wait(client(kv), keys, n, timeout_ms);
}

static int kv_multi_get(rdzv_kv_t *kv, const char *const *keys, size_t n, uint8_t **vals,
                        size_t *lens) {
    return store_client_multi_get(client(kv), keys, n, vals, lens);
}

static int kv_multi_set(rdzv_kv_t *kv, const char *const *keys, const void *const *vals,
                        const size_t *lens, size_t n) {
    return store_client_multi_set(client(kv), keys, vals, lens, n);
}

static int kv_take_ticket(rdzv_kv_t *kv, const char *key, const char *look, int64_t *index) {
    (void)look; /* a WAIT of it costs the same request as a look would */
    int64_t count;
    int rc = store_client_add(client(kv), key, 1, &count);
    *index = count - 1;
    return rc;
}

static int kv_count_tickets(rdzv_kv_t *kv, const char *key, int64_t *count) {
    return store_client_add(client(kv), key, 0, count);
}

static void kv_interrupt(rdzv_kv_t *kv) {
    store_client_interrupt(client(kv));
}

static const char *kv_error(const rdzv_kv_t *kv) {
    return store_client_error(((const store_kv_t *)kv)->c);
}

static void kv_destroy(rdzv_kv_t *kv) {
    store_client_destroy(client(kv));
    free(kv);
}

static const rdzv_kv_ops_t store_ops = {.set = kv_set,
                                        .get = kv_get,
                                        .add = kv_add,
                                        .compare_set = kv_compare_set,
                                        .wait = kv_wait,
                                        .multi_get = kv_multi_get,
                                        .multi_set = kv_multi_set,
                                        .take_ticket = kv_take_ticket,
                                        .count_tickets = kv_count_tickets,
                                        .set_ephemeral = kv_set,
                                        .keep_alive = NULL,
                                        .wait_live = NULL,
                                        .wait_gone = NULL,
                                        .interrupt = kv_interrupt,
                                        .error = kv_error,
                                        .destroy = kv_destroy};

/* *out is published (atomically: another thread may read it to interrupt) once its client
 * exists, before the connect, so that an interrupt ends the connect's retries too. */
int rdzv_kv_store_connect(const ddprun_opts_t *o, int64_t connect_timeout_ms, int64_t op_timeout_ms,
                          rdzv_kv_t **out) {
    __atomic_store_n(out, NULL, __ATOMIC_RELEASE);
    store_kv_t *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->kv.ops = &store_ops;
    store_client_opts_t co = {.host = o->rdzv_host,
                              .port = o->rdzv_port,
                              .connect_timeout_ms = connect_timeout_ms,
                              .op_timeout_ms = op_timeout_ms,
                              .max_value_bytes = o->store_max_value_bytes,
                              .secret = &o->store_secret};
    int rc = store_client_new(&co, &s->c);
    if (!s->c) {
        free(s);
        return rc;
    }
    __atomic_store_n(out, (rdzv_kv_t *)s, __ATOMIC_RELEASE);
    return rc < 0 ? rc : store_client_open(s->c);
}
