/* store_client: see store_client.h. Plain blocking sockets plus poll(2) for every deadline. */
#include "store_client.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "ddp_error.h"
#include "resolve.h"

#define DEFAULT_CONNECT_TIMEOUT_MS 30000
#define DEFAULT_OP_TIMEOUT_MS      300000
#define BACKOFF_FIRST_MS           10
#define BACKOFF_MAX_MS             1000
/* A store answers the auth hello at once; a program that accepts and stays silent is not one. */
#define HANDSHAKE_TIMEOUT_MS 10000

struct store_client {
    store_client_opts_t opts;
    char host[256];
    store_secret_t secret;
    store_limits_t limits;
    int fd;
    bool is_plain; /* peer is not a ddprun store: no auth hello (torch's own server) */
    uint8_t *rbuf;
    size_t r_len, r_pos, r_cap;
    uint8_t *wbuf;
    size_t w_cap;
    uint64_t deadline_ms;  /* of the op in progress */
    int64_t op_timeout_ms; /* its bound, and its request (for a timeout's message) */
    store_op_t op;
    int wake[2];         /* store_client_interrupt writes here; every wait polls it too */
    bool is_interrupted; /* the wake fired: a connect in progress gives up instead of retrying */
    char err[512];
};

static int fail(store_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(store_client_t *c, int rc, const char *fmt, ...) {
    int n = snprintf(c->err, sizeof c->err, "store %s:%u: ", c->host, c->opts.port);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err + n, sizeof c->err - (size_t)n, fmt, ap);
    va_end(ap);
    return rc;
}

const char *store_client_error(const store_client_t *c) {
    return c->err;
}

static void disconnect(store_client_t *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->r_len = c->r_pos = 0;
}

/* ---- socket I/O under c->deadline_ms ------------------------------------------------------ */

static int wait_fd(store_client_t *c, short events) {
    for (;;) {
        struct pollfd p[2] = {{.fd = c->fd, .events = events},
                              {.fd = c->wake[0], .events = POLLIN}};
        int n = poll(p, 2, clock_remaining_ms(c->deadline_ms));
        if (n > 0 && (p[1].revents & POLLIN)) {
            char drain[64];
            while (read(c->wake[0], drain, sizeof drain) > 0) {
            }
            disconnect(c);
            c->is_interrupted = true;
            return fail(c, DDP_ECLOSED, "interrupted: the answer is no longer needed");
        }
        if (n > 0) return 0;
        if (n == 0) return DDP_ETIMEOUT;
        if (errno != EINTR) return -errno;
    }
}

static int send_all(store_client_t *c, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = send(c->fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            b += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_fd(c, POLLOUT);
            if (rc < 0) {
                /* part of the frame may be out: the next request on this connection would be
                 * read as its rest */
                disconnect(c);
                return c->is_interrupted ? rc : fail(c, rc, "sending: %s", ddp_strerror(rc));
            }
            continue;
        }
        int e = errno;
        disconnect(c);
        return fail(c, e == EPIPE || e == ECONNRESET ? DDP_ECLOSED : -e, "sending: %s",
                    strerror(e));
    }
    return 0;
}

/* Read until a reply of this kind is complete; it points into rbuf until the next read. */
static int read_reply(store_client_t *c, store_reply_kind_t kind, store_reply_t *out) {
    for (;;) {
        int rc = store_proto_decode_reply(kind, &c->limits, c->rbuf + c->r_pos, c->r_len - c->r_pos,
                                          out);
        if (rc > 0) {
            c->r_pos += (size_t)rc;
            return 0;
        }
        if (rc < 0) {
            disconnect(c);
            return fail(c, DDP_EPROTO, "malformed reply: %s", store_proto_strerror(rc));
        }
        if (c->r_pos > 0 && c->r_pos == c->r_len) c->r_pos = c->r_len = 0;
        if (c->r_cap - c->r_len < 4096) {
            size_t cap = c->r_cap * 2 < c->limits.max_frame_bytes ? c->r_cap * 2 : c->r_cap + 4096;
            uint8_t *p = realloc(c->rbuf, cap);
            if (!p) return fail(c, -ENOMEM, "out of memory reading a reply");
            c->rbuf = p;
            c->r_cap = cap;
        }
        ssize_t n = recv(c->fd, c->rbuf + c->r_len, c->r_cap - c->r_len, MSG_DONTWAIT);
        if (n > 0) {
            c->r_len += (size_t)n;
            continue;
        }
        if (n == 0) {
            disconnect(c);
            return fail(c, DDP_ECLOSED, "connection closed by the store");
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            int e = errno;
            disconnect(c);
            return fail(c, e == ECONNRESET ? DDP_ECLOSED : -e, "receiving: %s", strerror(e));
        }
        rc = wait_fd(c, POLLIN);
        if (rc < 0)
            return rc == DDP_ETIMEOUT || c->is_interrupted
                       ? rc
                       : fail(c, rc, "receiving: %s", ddp_strerror(rc));
    }
}

/* read_reply that gives up the connection on a timeout: a reply arriving later would be taken for
 * the next operation's. (A timed-out WAIT is the exception: it is cancelled instead.) */
static int recv_reply(store_client_t *c, store_reply_kind_t kind, store_reply_t *out) {
    int rc = read_reply(c, kind, out);
    if (rc != DDP_ETIMEOUT) return rc;
    disconnect(c);
    return fail(c, rc, "%s timed out after %lld ms (no answer)", store_op_name(c->op),
                (long long)c->op_timeout_ms);
}

/* ---- framing of requests ------------------------------------------------------------------ */

/* A writer over c->wbuf with room for need bytes. */
static int begin(store_client_t *c, store_op_t op, size_t need, store_writer_t *w) {
    c->op = op; /* for a timeout's message */
    int wire = store_proto_wire_opcode(c->opts.dialect, op);
    if (wire < 0)
        return fail(c, -ENOTSUP, "%s is not part of the %s protocol numbering", store_op_name(op),
                    c->opts.dialect == STORE_DIALECT_LEGACY ? "legacy" : "current");
    need += 1;
    if (need > c->w_cap) {
        uint8_t *p = realloc(c->wbuf, need);
        if (!p) return fail(c, -ENOMEM, "out of memory building a %zu-byte request", need);
        c->wbuf = p;
        c->w_cap = need;
    }
    store_writer_init(w, c->wbuf, c->w_cap);
    store_put_u8(w, (uint8_t)wire);
    return 0;
}

static int reconnect(store_client_t *c);

/* Start an op: reconnect if a previous failure closed the connection, arm the deadline. */
static int start_op(store_client_t *c, int64_t timeout_ms) {
    if (c->fd < 0) TRY(reconnect(c));
    c->op_timeout_ms = timeout_ms < 0 ? c->opts.op_timeout_ms : timeout_ms;
    c->deadline_ms = clock_deadline_ms(c->op_timeout_ms);
    return 0;
}

static size_t str_cost(const char *s) {
    return 8 + strlen(s);
}

static int check_key(store_client_t *c, const char *key) {
    if (strlen(key) > c->limits.max_key_bytes)
        return fail(c, -EINVAL, "key of %zu bytes is above the %zu-byte limit", strlen(key),
                    c->limits.max_key_bytes);
    return 0;
}

/* The store drops a connection that sends a longer value (it has no error reply for it): refuse
 * to send one, with the limit named, instead of having the caller see "connection reset". */
static int check_value(store_client_t *c, const char *key, size_t n_bytes) {
    if (n_bytes > c->limits.max_value_bytes)
        return fail(c, -EMSGSIZE,
                    "a value of %zu bytes for '%s' is over the store's limit of %zu "
                    "bytes (ddprun --store-max-value, ddprun store --max-value-bytes)",
                    n_bytes, key, c->limits.max_value_bytes);
    return 0;
}

/* One request with a key and up to two values; reply decoded into *r (if a reply exists). */
static int key_op(store_client_t *c, store_op_t op, const char *key, const void *v1, size_t n1,
                  const void *v2, size_t n2, int has_v, store_reply_t *r) {
    TRY(check_key(c, key));
    if (has_v >= 1) TRY(check_value(c, key, n1));
    if (has_v >= 2) TRY(check_value(c, key, n2));
    TRY(start_op(c, -1));
    store_writer_t w;
    TRY(begin(c, op, str_cost(key) + (has_v >= 1 ? 8 + n1 : 0) + (has_v >= 2 ? 8 + n2 : 0), &w));
    store_put_bytes(&w, key, strlen(key));
    if (has_v >= 1) store_put_bytes(&w, v1, n1);
    if (has_v >= 2) store_put_bytes(&w, v2, n2);
    TRY(send_all(c, w.data, w.len));
    store_reply_kind_t kind = store_proto_reply_kind(op);
    if (kind == STORE_REPLY_NONE) return 0;
    int rc = recv_reply(c, kind, r);
    return rc == DDP_ETIMEOUT ? fail(c, rc, "%s '%s' timed out", store_op_name(op), key) : rc;
}

static int copy_out(store_client_t *c, const store_bytes_t *b, uint8_t **val, size_t *len) {
    uint8_t *p = malloc(b->len ? b->len : 1);
    if (!p) return fail(c, -ENOMEM, "out of memory copying a %zu-byte value", b->len);
    if (b->len) memcpy(p, b->ptr, b->len);
    *val = p;
    *len = b->len;
    return 0;
}

/* ---- connecting --------------------------------------------------------------------------- */

static int connect_once(store_client_t *c, struct addrinfo *ai) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -errno;
    if (c->opts.source_addr) {
        struct addrinfo hints = {.ai_family = ai->ai_family, .ai_flags = AI_NUMERICHOST}, *src;
        if (getaddrinfo(c->opts.source_addr, NULL, &hints, &src) == 0) {
            int rc = bind(fd, src->ai_addr, src->ai_addrlen);
            freeaddrinfo(src);
            if (rc < 0) {
                int e = errno;
                close(fd);
                return -e;
            }
        }
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return 0;
    if (errno != EINPROGRESS) {
        int e = errno;
        disconnect(c);
        return -e;
    }
    int rc = wait_fd(c, POLLOUT);
    if (rc == 0) {
        int soerr = 0;
        socklen_t len = sizeof soerr;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        rc = -soerr;
    }
    if (rc < 0) disconnect(c);
    return rc;
}

static int auth_exchange(store_client_t *c) {
    store_writer_t w;
    store_reply_t r;
    TRY(begin(c, STORE_OP_AUTH_HELLO, 1, &w));
    store_put_u8(&w, STORE_AUTH_VERSION);
    TRY(send_all(c, w.data, w.len));
    int rc = recv_reply(c, STORE_REPLY_AUTH_HELLO, &r);
    if (rc == DDP_ECLOSED && !c->secret.is_set && !c->is_interrupted) {
        c->is_plain = true; /* torch's server closes on our hello: it is not a ddprun store */
        return rc;
    }
    if (rc == DDP_ECLOSED)
        return fail(c, DDP_EAUTH,
                    "the store closed the connection at the auth hello: it is not a "
                    "ddprun store, so it cannot check our shared secret");
    if (rc < 0) return rc;
    bool has = c->secret.is_set;
    if (r.u8 == STORE_AUTH_OPEN) {
        if (!has) return 0;
        disconnect(c);
        return fail(c, DDP_EAUTH,
                    "the store runs without a shared secret but we hold one; refusing "
                    "(start the store with the same --secret-file)");
    }
    if (!has) {
        disconnect(c);
        return fail(c, DDP_ENOSECRET,
                    "the store requires a shared secret; set %s or %s (or pass "
                    "--store-secret-file)",
                    STORE_SECRET_FILE_ENV, STORE_SECRET_ENV);
    }
    uint8_t server_nonce[STORE_AUTH_NONCE_BYTES], client_nonce[STORE_AUTH_NONCE_BYTES];
    memcpy(server_nonce, r.bytes.ptr, sizeof server_nonce);
    store_auth_random_nonce(client_nonce);
    TRY(begin(c, STORE_OP_AUTH_PROOF, STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES, &w));
    uint8_t mac[STORE_AUTH_MAC_BYTES];
    store_auth_client_mac(&c->secret, server_nonce, client_nonce, mac);
    store_put_raw(&w, client_nonce, sizeof client_nonce);
    store_put_raw(&w, mac, sizeof mac);
    TRY(send_all(c, w.data, w.len));
    rc = recv_reply(c, STORE_REPLY_AUTH_PROOF, &r);
    if (rc == 0 && r.u8 == STORE_AUTH_DENIED) rc = DDP_EAUTH;
    if (rc == DDP_EAUTH || rc == DDP_ECLOSED) {
        disconnect(c);
        return fail(c, DDP_EAUTH,
                    "the store rejected our shared secret (it holds a different one)");
    }
    if (rc < 0) return rc;
    store_auth_server_mac(&c->secret, server_nonce, client_nonce, mac);
    if (!store_auth_mac_equal(mac, r.bytes.ptr)) {
        disconnect(c);
        return fail(c, DDP_EAUTH, "the store's proof does not match our shared secret (impostor?)");
    }
    return 0;
}

static int handshake(store_client_t *c) {
    if (c->opts.dialect == STORE_DIALECT_LEGACY) return 0;
    store_writer_t w;
    TRY(begin(c, STORE_OP_VALIDATE, 4, &w));
    store_put_u32(&w, STORE_PROTO_MAGIC);
    TRY(send_all(c, w.data, w.len));
    if (c->is_plain) return 0;
    return auth_exchange(c);
}

static int keys_op(store_client_t *c, store_op_t op, const char *const *keys, size_t n,
                   const void *const *vals, const size_t *val_lens, int64_t timeout_ms);

/* After a handshake that got no answer: does the store answer a request of the legacy numbering
 * (torch <= 2.1, which reads our VALIDATE as the start of a SET and then waits for its bytes)? A
 * CHECK of no keys answers at once there. Leaves c disconnected in the current numbering. */
static bool is_legacy_store(store_client_t *c, struct addrinfo *ai, uint64_t deadline_ms) {
    store_dialect_t dialect = c->opts.dialect;
    c->opts.dialect = STORE_DIALECT_LEGACY;
    c->deadline_ms = deadline_ms;
    bool is_legacy = false;
    if (connect_once(c, ai) == 0) {
        int left = clock_remaining_ms(deadline_ms);
        store_reply_t r;
        is_legacy = keys_op(c, STORE_OP_CHECK, NULL, 0, NULL, NULL, left < 0 ? 1000 : left) == 0 &&
                    recv_reply(c, STORE_REPLY_U8, &r) == 0;
    }
    disconnect(c);
    c->opts.dialect = dialect;
    return is_legacy;
}

static bool is_retryable(int rc) {
    return rc == -ECONNREFUSED || rc == -ECONNRESET || rc == -ENETUNREACH || rc == -EHOSTUNREACH ||
           rc == -ECONNABORTED || rc == DDP_ETIMEOUT || rc == DDP_ECLOSED || rc == -EAGAIN ||
           rc == -EADDRNOTAVAIL;
}

static int reconnect(store_client_t *c) {
    uint64_t connect_deadline = clock_deadline_ms(c->opts.connect_timeout_ms);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    char port[8];
    snprintf(port, sizeof port, "%u", c->opts.port);
    int backoff_ms = BACKOFF_FIRST_MS, rc = 0;
    c->is_interrupted = false;
    for (;;) {
        struct addrinfo *res = NULL;
        /* bounded by the connect deadline and the interrupt: the system's resolver is not */
        int gai = resolve_within(c->host, port, &hints, connect_deadline, c->wake[0], &res);
        if (gai == RESOLVE_INTERRUPTED) {
            char drain[64];
            while (read(c->wake[0], drain, sizeof drain) > 0) {
            }
            c->is_interrupted = true;
            return fail(c, DDP_ECLOSED, "connecting was interrupted");
        }
        if (gai == RESOLVE_TIMED_OUT)
            return fail(c, DDP_ETIMEOUT, "could not resolve the host within %lld ms (%s)",
                        (long long)c->opts.connect_timeout_ms, resolve_strerror(gai));
        if (gai != 0 && gai != EAI_AGAIN)
            return fail(c, -EINVAL, "cannot resolve host: %s", resolve_strerror(gai));
        rc = gai != 0 ? -EAGAIN : -ECONNREFUSED;
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            c->deadline_ms = connect_deadline;
            rc = connect_once(c, ai);
            if (c->is_interrupted) break; /* its ECLOSED is no answer of the store's */
            if (rc < 0) continue;
            /* the handshake gets the shortest of its own bound and the caller's: half of what
             * is left, so that a store of the legacy numbering can still be recognised */
            int64_t wait_ms = HANDSHAKE_TIMEOUT_MS;
            if (c->opts.op_timeout_ms > 0 && c->opts.op_timeout_ms < wait_ms)
                wait_ms = c->opts.op_timeout_ms;
            int left = clock_remaining_ms(connect_deadline);
            if (left >= 0 && left < wait_ms) wait_ms = left;
            uint64_t handshake_deadline = clock_deadline_ms(wait_ms / 2 > 0 ? wait_ms / 2 : 1);
            if (handshake_deadline < c->deadline_ms) c->deadline_ms = handshake_deadline;
            rc = handshake(c);
            if (rc == DDP_ETIMEOUT) {
                disconnect(c);
                bool is_legacy =
                    is_legacy_store(c, ai, clock_deadline_ms(wait_ms / 2 > 0 ? wait_ms / 2 : 1));
                if (c->is_interrupted) break;
                if (is_legacy)
                    rc = fail(c, DDP_EPROTO,
                              "the store speaks the legacy numbering of PyTorch "
                              "<= 2.1 (it answers a legacy request, not our "
                              "handshake): use the legacy dialect (store-client "
                              "--legacy)");
                else
                    rc = fail(c, DDP_EPROTO,
                              "accepted the connection but did not answer the "
                              "handshake within %lld ms: is another program using "
                              "this port?",
                              (long long)wait_ms);
                break;
            }
            if (c->is_interrupted) break;
            if (rc == DDP_ECLOSED && c->is_plain) {
                disconnect(c); /* reconnect without the hello, at once */
                rc = connect_once(c, ai);
                if (rc == 0) rc = handshake(c);
            }
            if (rc == 0) break;
            disconnect(c);
            if (!is_retryable(rc)) break;
        }
        if (res) freeaddrinfo(res);
        if (rc == 0) return 0;
        if (c->is_interrupted) return fail(c, DDP_ECLOSED, "connecting was interrupted");
        if (!is_retryable(rc)) return rc; /* the message is already in c->err */
        int left = clock_remaining_ms(connect_deadline);
        if (left == 0)
            return fail(c, rc == DDP_ETIMEOUT ? rc : DDP_ETIMEOUT,
                        "could not connect within %lld ms (last error: %s)",
                        (long long)c->opts.connect_timeout_ms, ddp_strerror(rc));
        int sleep_ms = backoff_ms / 2 + rand() % (backoff_ms / 2 + 1);
        if (left >= 0 && sleep_ms > left) sleep_ms = left;
        /* the pause between tries listens to the wake too: an interrupt ends the retries */
        struct pollfd p = {.fd = c->wake[0], .events = POLLIN};
        if (poll(&p, 1, sleep_ms) > 0 && (p.revents & POLLIN)) {
            char drain[64];
            while (read(c->wake[0], drain, sizeof drain) > 0) {
            }
            return fail(c, DDP_ECLOSED, "connecting was interrupted");
        }
        backoff_ms = backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff_ms * 2;
    }
}

int store_client_connect(const store_client_opts_t *opts, store_client_t **out) {
    int rc = store_client_new(opts, out);
    return rc < 0 ? rc : store_client_open(*out);
}

int store_client_open(store_client_t *c) {
    return c->fd >= 0 ? 0 : reconnect(c);
}

int store_client_new(const store_client_opts_t *opts, store_client_t **out) {
    store_client_t *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    *out = c;
    c->opts = *opts;
    c->fd = -1;
    c->wake[0] = c->wake[1] = -1;
    snprintf(c->host, sizeof c->host, "%s", opts->host ? opts->host : "127.0.0.1");
    c->opts.host = c->host;
    if (c->opts.dialect == STORE_DIALECT_UNKNOWN) c->opts.dialect = STORE_DIALECT_CURRENT;
    if (c->opts.connect_timeout_ms == 0) c->opts.connect_timeout_ms = DEFAULT_CONNECT_TIMEOUT_MS;
    if (c->opts.op_timeout_ms == 0) c->opts.op_timeout_ms = DEFAULT_OP_TIMEOUT_MS;
    if (opts->secret) c->secret = *opts->secret;
    c->opts.secret = NULL;
    store_limits_default(&c->limits);
    if (opts->max_value_bytes) c->limits.max_value_bytes = opts->max_value_bytes;
    c->r_cap = 4096;
    c->rbuf = malloc(c->r_cap);
    if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        c->wake[0] = c->wake[1] = -1;
        return fail(c, -errno, "cannot create a pipe: %s", strerror(errno));
    }
    if (!c->rbuf) return fail(c, -ENOMEM, "out of memory");
    if (c->secret.is_set && store_auth_init() < 0)
        return fail(c, -EIO, "libsodium failed to start");
    return 0;
}

void store_client_interrupt(store_client_t *c) {
    ssize_t w = write(c->wake[1], "x", 1); /* wakes the poll(2) of the blocked operation */
    (void)w;
}

void store_client_destroy(store_client_t *c) {
    if (!c) return;
    disconnect(c);
    if (c->wake[0] >= 0) close(c->wake[0]);
    if (c->wake[1] >= 0) close(c->wake[1]);
    free(c->rbuf);
    free(c->wbuf);
    free(c);
}

/* ---- operations --------------------------------------------------------------------------- */

int store_client_set(store_client_t *c, const char *key, const void *val, size_t val_len) {
    return key_op(c, STORE_OP_SET, key, val, val_len, NULL, 0, 1, NULL);
}

/* Frame "u64 n, then n keys (and values)" for the multi-key operations. */
static int keys_op(store_client_t *c, store_op_t op, const char *const *keys, size_t n,
                   const void *const *vals, const size_t *val_lens, int64_t timeout_ms) {
    if (n > c->limits.max_keys_per_op)
        return fail(c, -EINVAL, "%zu keys in one %s, above the limit of %llu", n, store_op_name(op),
                    (unsigned long long)c->limits.max_keys_per_op);
    size_t need = 8;
    for (size_t i = 0; i < n; i++) {
        TRY(check_key(c, keys[i]));
        if (vals) TRY(check_value(c, keys[i], val_lens[i]));
        need += str_cost(keys[i]) + (vals ? 8 + val_lens[i] : 0);
    }
    TRY(start_op(c, timeout_ms));
    store_writer_t w;
    TRY(begin(c, op, need, &w));
    store_put_u64(&w, n);
    for (size_t i = 0; i < n; i++) {
        store_put_bytes(&w, keys[i], strlen(keys[i]));
        if (vals) store_put_bytes(&w, vals[i], val_lens[i]);
    }
    return send_all(c, w.data, w.len);
}

/* An op without arguments (GETNUMKEYS, LIST_KEYS): send it and read its first reply. */
static int bare_op(store_client_t *c, store_op_t op, store_reply_kind_t kind, store_reply_t *r) {
    TRY(start_op(c, -1));
    store_writer_t w;
    TRY(begin(c, op, 0, &w));
    TRY(send_all(c, w.data, w.len));
    return recv_reply(c, kind, r);
}

/* Read the deferred STOP_WAITING of a WAIT or BARRIER; on timeout cancel it on the server. */
static int await_stop_waiting(store_client_t *c, int64_t timeout_ms, const char *what,
                              const char *key) {
    store_reply_t r;
    int rc = read_reply(c, STORE_REPLY_U8, &r);
    if (rc == 0)
        return r.u8 == STORE_WAIT_STOP_WAITING
                   ? 0
                   : fail(c, DDP_EPROTO, "unexpected %s reply %u", what, r.u8);
    if (rc != DDP_ETIMEOUT) return rc;
    int64_t waited = timeout_ms < 0 ? c->opts.op_timeout_ms : timeout_ms;
    if (c->opts.dialect == STORE_DIALECT_LEGACY) {
        disconnect(c); /* torch 1.13 cannot cancel a WAIT: drop the connection instead */
    } else {
        /* The server may have answered STOP_WAITING just before our cancel: accept both. */
        store_writer_t w;
        c->deadline_ms = clock_deadline_ms(10000);
        rc = begin(c, STORE_OP_CANCEL_WAIT, 0, &w);
        if (rc == 0) rc = send_all(c, w.data, w.len);
        if (rc == 0) rc = recv_reply(c, STORE_REPLY_U8, &r);
        if (rc == 0 && r.u8 == STORE_WAIT_STOP_WAITING) rc = recv_reply(c, STORE_REPLY_U8, &r);
        if (rc < 0 || r.u8 != STORE_WAIT_CANCELED) disconnect(c);
        /* a silent store's cancel may be what an interrupt ends: say that, not the timeout (the
         * caller goes on after a timeout and would connect again) */
        if (rc == DDP_ECLOSED && c->is_interrupted) return rc;
    }
    return fail(c, DDP_ETIMEOUT, "%s on '%s' timed out after %lld ms", what, key,
                (long long)waited);
}

int store_client_wait(store_client_t *c, const char *const *keys, size_t n_keys,
                      int64_t timeout_ms) {
    TRY(keys_op(c, STORE_OP_WAIT, keys, n_keys, NULL, NULL, timeout_ms));
    return await_stop_waiting(c, timeout_ms, "WAIT", n_keys ? keys[0] : "");
}

int store_client_barrier(store_client_t *c, const char *key, int64_t world_size,
                         int64_t timeout_ms) {
    TRY(check_key(c, key));
    TRY(start_op(c, timeout_ms));
    store_writer_t w;
    TRY(begin(c, STORE_OP_BARRIER, str_cost(key) + 8, &w));
    store_put_bytes(&w, key, strlen(key));
    store_put_i64(&w, world_size);
    TRY(send_all(c, w.data, w.len));
    return await_stop_waiting(c, timeout_ms, "BARRIER", key);
}

int store_client_list_keys(store_client_t *c, char ***keys, size_t *n_keys) {
    store_reply_t r;
    TRY(bare_op(c, STORE_OP_LIST_KEYS, STORE_REPLY_KEY_COUNT, &r));
    int rc = 0;
    if (r.i64 < 0 || (uint64_t)r.i64 > c->limits.max_store_bytes / 8) {
        disconnect(c);
        return fail(c, DDP_EPROTO, "LIST_KEYS reply claims %lld keys", (long long)r.i64);
    }
    size_t n = (size_t)r.i64, i = 0;
    char **out = calloc(n + 1, sizeof *out);
    if (!out) return fail(c, -ENOMEM, "out of memory for %zu keys", n);
    for (; i < n; i++) {
        rc = recv_reply(c, STORE_REPLY_BYTES, &r);
        if (rc == 0 && r.bytes.len > c->limits.max_key_bytes) rc = DDP_EPROTO;
        if (rc == 0 && !(out[i] = malloc(r.bytes.len + 1))) rc = -ENOMEM;
        if (rc < 0) break;
        memcpy(out[i], r.bytes.ptr, r.bytes.len);
        out[i][r.bytes.len] = '\0';
    }
    if (rc < 0) {
        while (i-- > 0)
            free(out[i]);
        free(out);
        disconnect(c);
        return rc == DDP_EPROTO ? fail(c, rc, "LIST_KEYS reply holds an over-long key") : rc;
    }
    *keys = out;
    *n_keys = n;
    return 0;
}

int store_client_get(store_client_t *c, const char *key, uint8_t **val, size_t *val_len) {
    TRY(store_client_wait(c, &key, 1, -1));
    store_reply_t r;
    TRY(key_op(c, STORE_OP_GET, key, NULL, 0, NULL, 0, 0, &r));
    return copy_out(c, &r.bytes, val, val_len);
}

int store_client_compare_set(store_client_t *c, const char *key, const void *expected,
                             size_t expected_len, const void *desired, size_t desired_len,
                             uint8_t **current, size_t *current_len) {
    store_reply_t r;
    TRY(key_op(c, STORE_OP_COMPARE_SET, key, expected, expected_len, desired, desired_len, 2, &r));
    return copy_out(c, &r.bytes, current, current_len);
}

int store_client_add(store_client_t *c, const char *key, int64_t delta, int64_t *result) {
    TRY(check_key(c, key));
    TRY(start_op(c, -1));
    store_writer_t w;
    TRY(begin(c, STORE_OP_ADD, str_cost(key) + 8, &w));
    store_put_bytes(&w, key, strlen(key));
    store_put_i64(&w, delta);
    TRY(send_all(c, w.data, w.len));
    store_reply_t r;
    int rc = recv_reply(c, STORE_REPLY_I64, &r);
    if (rc == 0 && result) *result = r.i64;
    return rc;
}

int store_client_check(store_client_t *c, const char *const *keys, size_t n_keys, bool *is_ready) {
    TRY(keys_op(c, STORE_OP_CHECK, keys, n_keys, NULL, NULL, -1));
    store_reply_t r;
    int rc = recv_reply(c, STORE_REPLY_U8, &r);
    if (rc == 0) *is_ready = r.u8 == STORE_CHECK_READY;
    return rc;
}

int store_client_num_keys(store_client_t *c, int64_t *n) {
    store_reply_t r;
    TRY(bare_op(c, STORE_OP_GETNUMKEYS, STORE_REPLY_I64, &r));
    *n = r.i64;
    return 0;
}

int store_client_delete_key(store_client_t *c, const char *key, bool *was_deleted) {
    store_reply_t r;
    TRY(key_op(c, STORE_OP_DELETE_KEY, key, NULL, 0, NULL, 0, 0, &r));
    if (was_deleted) *was_deleted = r.i64 > 0;
    return 0;
}

int store_client_append(store_client_t *c, const char *key, const void *val, size_t val_len) {
    return key_op(c, STORE_OP_APPEND, key, val, val_len, NULL, 0, 1, NULL);
}

int store_client_multi_get(store_client_t *c, const char *const *keys, size_t n_keys,
                           uint8_t **vals, size_t *val_lens) {
    TRY(keys_op(c, STORE_OP_MULTI_GET, keys, n_keys, NULL, NULL, -1));
    size_t i = 0;
    int rc = 0;
    for (; i < n_keys && rc == 0; i++) {
        store_reply_t r;
        rc = recv_reply(c, STORE_REPLY_BYTES, &r);
        if (rc == 0) rc = copy_out(c, &r.bytes, &vals[i], &val_lens[i]);
        if (rc < 0) break;
    }
    if (rc < 0) /* what was got is freed, and not left for the caller to free again */
        while (i-- > 0) {
            free(vals[i]);
            vals[i] = NULL;
        }
    return rc;
}

int store_client_multi_set(store_client_t *c, const char *const *keys, const void *const *vals,
                           const size_t *val_lens, size_t n_keys) {
    return keys_op(c, STORE_OP_MULTI_SET, keys, n_keys, vals, val_lens, -1);
}

int store_client_ping(store_client_t *c, uint64_t *rtt_us) {
    TRY(start_op(c, -1));
    double t0 = clock_now_s();
    uint32_t nonce = (uint32_t)rand();
    store_writer_t w;
    TRY(begin(c, STORE_OP_PING, 4, &w));
    store_put_u32(&w, nonce);
    TRY(send_all(c, w.data, w.len));
    store_reply_t r;
    TRY(recv_reply(c, STORE_REPLY_U32, &r));
    if (r.u32 != nonce) return fail(c, DDP_EPROTO, "PING echoed %u, sent %u", r.u32, nonce);
    if (rtt_us) *rtt_us = (uint64_t)((clock_now_s() - t0) * 1e6);
    return 0;
}

int store_client_queue_push(store_client_t *c, const char *key, const void *val, size_t val_len) {
    return key_op(c, STORE_OP_QUEUE_PUSH, key, val, val_len, NULL, 0, 1, NULL);
}

int store_client_queue_pop(store_client_t *c, const char *key, int64_t timeout_ms, uint8_t **val,
                           size_t *val_len) {
    TRY(store_client_wait(c, &key, 1, timeout_ms));
    store_reply_t r;
    TRY(key_op(c, STORE_OP_QUEUE_POP, key, NULL, 0, NULL, 0, 0, &r));
    if (r.i64 <= 0) return fail(c, -EAGAIN, "queue '%s' was emptied by another client", key);
    return copy_out(c, &r.bytes, val, val_len);
}

int store_client_queue_len(store_client_t *c, const char *key, int64_t *n) {
    store_reply_t r;
    TRY(key_op(c, STORE_OP_QUEUE_LEN, key, NULL, 0, NULL, 0, 0, &r));
    *n = r.i64;
    return 0;
}
