/* store_server: listener, connections, framing and every limit of the store (store_server.h).
 * A decoded request goes to store_ops.c, which returns what to send, whom to wake and whether to
 * drop the peer; this file carries that out. Loop thread only.
 *
 * Memory per connection is bounded before it is spent: the input buffer grows only to the length
 * the codec has proven a frame needs (<= max_frame_bytes), replies queued for a peer that does
 * not read are capped by max_output_bytes, and all buffers together by max_total_buffer_bytes. */
#include "store/store_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "clock.h"
#include "ddp_error.h"
#include "store/kv_table.h"
#include "log.h"
#include "store/store_ops.h"
#include "store_proto.h"

#define SWEEP_INTERVAL_MS   250u
#define INPUT_CHUNK_BYTES   (64u * 1024u)
#define INPUT_INITIAL_BYTES 4096u
#define DROP_LOGS_PER_SEC   20u

typedef struct store_peer {
    struct store_peer *next;
    uint8_t addr[16]; /* IPv4 mapped into IPv6 form */
    unsigned n_conns;
} store_peer_t;

#define STORE_PEER_BUCKETS 1024u

typedef struct store_conn {
    uv_tcp_t tcp;
    store_server_t *srv;
    struct store_conn *prev, *next;
    store_peer_t *peer;
    char peer_name[64];      /* "addr:port" for log lines */
    store_session_t session; /* the protocol state: store_ops.c's */
    bool is_closing;
    uint8_t *in;
    size_t in_len, in_cap, in_need;
    store_proto_resume_t in_resume; /* how far the frame at in[0] was checked */
    uint64_t accepted_ms;
    uint64_t first_byte_ms;    /* 0 until the peer sends something */
    uint64_t frame_started_ms; /* 0 when no partial frame is buffered */
    size_t out_queued;         /* reply bytes handed to libuv, not yet written */
} store_conn_t;

struct store_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_timer_t sweep_timer;
    store_limits_t limits;
    store_secret_t secret;
    kv_table_t *table;
    store_ops_t ops;
    store_conn_t *conns;
    store_peer_t *peers[STORE_PEER_BUCKETS];
    unsigned n_conns;
    unsigned fd_budget; /* connections that fit in RLIMIT_NOFILE, leaving a reserve */
    unsigned n_open_handles;
    uint16_t port;
    size_t buffered_bytes;
    uint64_t n_requests, n_dropped;
    uint64_t drop_log_window_ms;
    unsigned drop_log_count, drop_log_suppressed;
    void (*done_cb)(void *);
    void *done_arg;
    bool is_stopping;
};

static void conn_close(store_conn_t *c);
static void on_server_handle_closed(uv_handle_t *h);

/* Close callback of handles that never became connections (refused or failed at accept). */
static void free_handle(uv_handle_t *h) {
    free(h);
}

/* ---- peers -------------------------------------------------------------------------------- */

static void peer_key(const struct sockaddr_storage *ss, uint8_t out[16]) {
    memset(out, 0, 16);
    if (ss->ss_family == AF_INET6) {
        memcpy(out, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
    } else {
        out[10] = out[11] = 0xff;
        memcpy(out + 12, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    }
}

static store_peer_t *peer_acquire(store_server_t *s, const uint8_t addr[16]) {
    unsigned h = 2166136261u;
    for (int i = 0; i < 16; i++)
        h = (h ^ addr[i]) * 16777619u;
    store_peer_t **bucket = &s->peers[h % STORE_PEER_BUCKETS];
    for (store_peer_t *p = *bucket; p; p = p->next)
        if (memcmp(p->addr, addr, 16) == 0) return p;
    store_peer_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    memcpy(p->addr, addr, 16);
    p->next = *bucket;
    *bucket = p;
    return p;
}

static void peer_release(store_server_t *s, store_peer_t *peer) {
    if (--peer->n_conns > 0) return;
    unsigned h = 2166136261u;
    for (int i = 0; i < 16; i++)
        h = (h ^ peer->addr[i]) * 16777619u;
    for (store_peer_t **pp = &s->peers[h % STORE_PEER_BUCKETS]; *pp; pp = &(*pp)->next) {
        if (*pp == peer) {
            *pp = peer->next;
            free(peer);
            return;
        }
    }
}

static void format_peer(const struct sockaddr_storage *ss, char *out, size_t len) {
    char ip[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
        port = ntohs(a->sin6_port);
        snprintf(out, len, "[%s]:%u", ip, port);
    } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
        port = ntohs(a->sin_port);
        snprintf(out, len, "%s:%u", ip, port);
    }
}

/* ---- logging of dropped peers ------------------------------------------------------------- */

/* A flood of bad peers must not turn into a flood of log lines. */
static bool drop_log_allowed(store_server_t *s) {
    uint64_t now = clock_now_ms();
    if (now - s->drop_log_window_ms >= 1000) {
        if (s->drop_log_suppressed)
            LOG_WARN("store: %u more dropped-connection messages suppressed",
                     s->drop_log_suppressed);
        s->drop_log_window_ms = now;
        s->drop_log_count = 0;
        s->drop_log_suppressed = 0;
    }
    if (s->drop_log_count < DROP_LOGS_PER_SEC) {
        s->drop_log_count++;
        return true;
    }
    s->drop_log_suppressed++;
    return false;
}

/* Log why and close: the only way a peer's misbehaviour ends. Rate-limited log lines. */
__attribute__((format(printf, 2, 3))) static void conn_drop(store_conn_t *c, const char *fmt, ...) {
    if (c->is_closing) return;
    store_server_t *s = c->srv;
    s->n_dropped++;
    if (drop_log_allowed(s)) {
        char why[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, sizeof why, fmt, ap);
        va_end(ap);
        LOG_WARN("store: dropping client %s: %s", c->peer_name, why);
    }
    conn_close(c);
}

/* ---- output ------------------------------------------------------------------------------- */

typedef struct {
    uv_write_t req;
    store_conn_t *conn;
    size_t len;
    uint8_t data[];
} write_req_t;

static void on_write(uv_write_t *req, int status) {
    write_req_t *w = (write_req_t *)req;
    store_conn_t *c = w->conn;
    c->out_queued -= w->len;
    c->srv->buffered_bytes -= w->len;
    free(w);
    if (status < 0 && status != UV_ECANCELED && !c->is_closing) {
        LOG_DEBUG("store: write to %s failed: %s", c->peer_name, uv_strerror(status));
        conn_close(c);
    }
}

/* Queue reply bytes (head then body, either may be empty). Drops c past max_output_bytes. */
static void conn_send(store_conn_t *c, const void *head, size_t head_len, const void *body,
                      size_t body_len) {
    if (c->is_closing) return;
    uv_buf_t bufs[2] = {uv_buf_init((char *)(uintptr_t)head, (unsigned)head_len),
                        uv_buf_init((char *)(uintptr_t)body, (unsigned)body_len)};
    size_t total = head_len + body_len, done = 0;
    int n = uv_try_write((uv_stream_t *)&c->tcp, bufs, body_len ? 2 : 1);
    if (n > 0)
        done = (size_t)n;
    else if (n < 0 && n != UV_EAGAIN) {
        LOG_DEBUG("store: write to %s failed: %s", c->peer_name, uv_strerror(n));
        conn_close(c);
        return;
    }
    if (done == total) return;
    size_t rest = total - done;
    store_limits_t *lim = &c->srv->limits;
    if (c->out_queued + rest > lim->max_output_bytes) {
        conn_drop(c, "%zu reply bytes unread, above the output limit of %zu bytes",
                  c->out_queued + rest, lim->max_output_bytes);
        return;
    }
    if (c->srv->buffered_bytes + rest > lim->max_total_buffer_bytes) {
        conn_drop(c, "all connections together buffer more than %zu bytes",
                  lim->max_total_buffer_bytes);
        return;
    }
    write_req_t *w = malloc(sizeof *w + rest);
    if (!w) {
        conn_drop(c, "out of memory queueing a %zu-byte reply", rest);
        return;
    }
    w->conn = c;
    w->len = rest;
    size_t off = 0;
    if (done < head_len) {
        memcpy(w->data, (const uint8_t *)head + done, head_len - done);
        off = head_len - done;
        done = 0;
    } else {
        done -= head_len;
    }
    if (body_len > done) memcpy(w->data + off, (const uint8_t *)body + done, body_len - done);
    uv_buf_t b = uv_buf_init((char *)w->data, (unsigned)rest);
    int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (rc < 0) {
        free(w);
        LOG_DEBUG("store: write to %s failed: %s", c->peer_name, uv_strerror(rc));
        conn_close(c);
        return;
    }
    c->out_queued += rest;
    c->srv->buffered_bytes += rest;
}

/* ---- lifecycle ---------------------------------------------------------------------------- */

static void release_input(store_conn_t *c) {
    c->srv->buffered_bytes -= c->in_cap;
    free(c->in);
    c->in = NULL;
    c->in_cap = c->in_len = 0;
}

static void on_handle_closed(store_server_t *s) {
    if (--s->n_open_handles > 0 || !s->is_stopping) return;
    kv_table_destroy(s->table);
    for (unsigned i = 0; i < STORE_PEER_BUCKETS; i++) {
        while (s->peers[i]) {
            store_peer_t *next = s->peers[i]->next;
            free(s->peers[i]);
            s->peers[i] = next;
        }
    }
    void (*cb)(void *) = s->done_cb;
    void *arg = s->done_arg;
    free(s);
    if (cb) cb(arg);
}

static void on_conn_closed(uv_handle_t *h) {
    store_conn_t *c = h->data;
    store_server_t *s = c->srv;
    release_input(c);
    free(c);
    on_handle_closed(s);
}

static void conn_close(store_conn_t *c) {
    if (c->is_closing) return;
    store_server_t *s = c->srv;
    c->is_closing = true;
    store_ops_forget_waiter(&c->session);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    if (c->peer) peer_release(s, c->peer);
    c->peer = NULL;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

/* ---- input -------------------------------------------------------------------------------- */

/* Whether the buffer budget has room for add more bytes of c's input. When it has not, the
 * connection holding the most input (more than c would) is dropped to make it: whoever holds the
 * budget goes, not whoever asks next. */
static bool make_room(store_server_t *s, store_conn_t *c, size_t add) {
    size_t most = s->limits.max_total_buffer_bytes;
    while (s->buffered_bytes + add > most) {
        store_conn_t *big = NULL;
        for (store_conn_t *x = s->conns; x; x = x->next)
            if (x != c && (!big || x->in_cap > big->in_cap)) big = x;
        if (!big || big->in_cap <= c->in_cap) return false; /* c holds the most itself */
        conn_drop(big,
                  "it holds the most buffered input (%zu bytes) and all connections together "
                  "reached the limit of %zu bytes",
                  big->in_cap, most);
        release_input(big); /* now: its close completes later */
    }
    return true;
}

/* c's input buffer: what it holds, grown only once it is full or the frame being read is known to
 * be larger, and then by what arrived (doubling, at least a chunk), up to the frame: a peer holds
 * the budget with bytes it sent, not with a length it claims. */
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    store_conn_t *c = h->data;
    store_server_t *s = c->srv;
    *buf = uv_buf_init(NULL, 0);
    if (c->is_closing) return;
    size_t want = c->in_cap ? c->in_cap : INPUT_INITIAL_BYTES;
    if (c->in_len >= want || c->in_need > want) {
        want = c->in_len + (c->in_len > INPUT_CHUNK_BYTES ? c->in_len : INPUT_CHUNK_BYTES);
        if (c->in_need > c->in_len && c->in_need < want) want = c->in_need;
    }
    if (want > s->limits.max_frame_bytes) want = s->limits.max_frame_bytes;
    if (want > c->in_cap) {
        size_t grow = want - c->in_cap;
        if (!make_room(s, c, grow)) return; /* -> ENOBUFS */
        uint8_t *p = realloc(c->in, want);
        if (!p) return;
        c->in = p;
        c->in_cap = want;
        s->buffered_bytes += grow;
    }
    if (c->in_cap > c->in_len)
        *buf = uv_buf_init((char *)c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
}

static store_conn_t *conn_of(store_session_t *session) {
    return (store_conn_t *)((char *)session - offsetof(store_conn_t, session));
}

/* What store_ops decided, in its order: wake, reply, drop. */
static void apply_result(store_conn_t *c, store_ops_result_t *r) {
    for (store_session_t *w = r->woken, *next; w; w = next) {
        next = w->next_woken;
        uint8_t stop = STORE_WAIT_STOP_WAITING;
        conn_send(conn_of(w), &stop, 1, NULL, 0);
    }
    if (r->head_len)
        conn_send(c, r->head, r->head_len, r->body, r->body_len);
    else if (r->body_len)
        conn_send(c, r->body, r->body_len, NULL, 0);
    if (r->drop[0]) conn_drop(c, "%s", r->drop);
    store_ops_result_free(r);
}

/* Decide what the connection speaks from its first bytes. Returns false to wait for more. */
static bool detect_dialect(store_conn_t *c) {
    c->session.dialect = store_proto_detect_dialect(c->in, c->in_len);
    if (c->session.dialect == STORE_DIALECT_UNKNOWN) return false;
    if (c->session.dialect == STORE_DIALECT_LEGACY) {
        if (c->srv->secret.is_set) {
            conn_drop(c, "legacy-numbering client (torch <= 2.1) refused: this store "
                         "requires ddprun's shared-secret authentication");
            return false;
        }
        c->session.is_validated = true;
    }
    return true;
}

static void process_input(store_conn_t *c) {
    store_server_t *s = c->srv;
    size_t off = 0;
    while (!c->is_closing && off < c->in_len) {
        if (c->session.dialect == STORE_DIALECT_UNKNOWN) {
            if (off != 0) break; /* cannot happen: detection precedes the first frame */
            if (!detect_dialect(c)) break;
        }
        store_request_t req;
        size_t need = 0;
        int rc = store_proto_decode_request_resume(c->session.dialect, &s->limits, c->in + off,
                                                   c->in_len - off, &req, &need, &c->in_resume);
        if (rc == STORE_PROTO_NEED_MORE) {
            c->in_need = need;
            break;
        }
        if (rc < 0) {
            conn_drop(c, "%s (limits: key %zu B, value %zu B, %llu keys/op, frame %zu B)",
                      store_proto_strerror(rc), s->limits.max_key_bytes, s->limits.max_value_bytes,
                      (unsigned long long)s->limits.max_keys_per_op, s->limits.max_frame_bytes);
            return;
        }
        if (!c->session.is_validated && req.op != STORE_OP_VALIDATE) {
            conn_drop(c, "%s", store_proto_strerror(STORE_PROTO_E_NOT_VALIDATED));
            return;
        }
        s->n_requests++;
        store_ops_result_t res;
        store_ops_handle(&s->ops, &c->session, &req, &res);
        apply_result(c, &res);
        off += (size_t)rc;
        c->in_need = 0;
        c->in_resume = (store_proto_resume_t){0};
        c->frame_started_ms = 0;
    }
    if (c->is_closing) return;
    if (off > 0) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    if (c->in_len > 0 && c->frame_started_ms == 0) c->frame_started_ms = clock_now_ms();
    /* A big frame leaves a big buffer behind: give it back once it is drained. */
    if (c->in_len == 0 && c->in_cap > INPUT_INITIAL_BYTES) release_input(c);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
    (void)buf;
    store_conn_t *c = stream->data;
    if (c->is_closing) return;
    if (nread == UV_ENOBUFS) {
        conn_drop(c, "all connections together buffer more than %zu bytes",
                  c->srv->limits.max_total_buffer_bytes);
        return;
    }
    if (nread < 0) {
        if (nread != UV_EOF)
            LOG_DEBUG("store: read from %s failed: %s", c->peer_name, uv_strerror((int)nread));
        conn_close(c);
        return;
    }
    if (nread == 0) return;
    if (c->first_byte_ms == 0) c->first_byte_ms = clock_now_ms();
    c->in_len += (size_t)nread;
    /* the frame is known to need more: decoding it again now would only walk what it walked (a
     * frame of 16384 keys sent a byte at a time: seconds of the loop's time) */
    if (c->in_need > c->in_len) return;
    process_input(c);
}

static void refuse(store_server_t *s, uv_tcp_t *tcp, const char *peer, const char *why,
                   unsigned limit) {
    s->n_dropped++;
    if (drop_log_allowed(s))
        LOG_WARN("store: refusing connection from %s: %s (%u)", peer, why, limit);
    uv_close((uv_handle_t *)tcp, free_handle);
}

static void on_connection(uv_stream_t *server, int status) {
    store_server_t *s = server->data;
    if (status == UV_EMFILE || status == UV_ENFILE) {
        /* libuv accepted and closed the waiting connection(s) with its reserve descriptor */
        s->n_dropped++;
        if (drop_log_allowed(s))
            LOG_WARN("store: out of file descriptors (%s) with %u clients connected: a new "
                     "connection was dropped; raise `ulimit -n`",
                     uv_strerror(status), s->n_conns);
        return;
    }
    if (status < 0) {
        s->n_dropped++;
        LOG_WARN("store: accept failed: %s", uv_strerror(status));
        return;
    }
    store_conn_t *c = calloc(1, sizeof *c);
    if (!c) return;
    uv_tcp_init(s->loop, &c->tcp);
    int accept_rc = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (accept_rc < 0) {
        s->n_dropped++;
        if (drop_log_allowed(s)) LOG_WARN("store: accept failed: %s", uv_strerror(accept_rc));
        uv_close((uv_handle_t *)&c->tcp, free_handle);
        return;
    }
    struct sockaddr_storage ss;
    int ss_len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &ss_len);
    format_peer(&ss, c->peer_name, sizeof c->peer_name);
    if (s->is_stopping) {
        uv_close((uv_handle_t *)&c->tcp, free_handle);
        return;
    }
    if (s->n_conns >= s->limits.max_connections) {
        refuse(s, &c->tcp, c->peer_name, "connection limit reached", s->limits.max_connections);
        return;
    }
    /* refused while descriptors remain, so the connected keep working and the refusal is seen */
    if (s->n_conns >= s->fd_budget) {
        refuse(s, &c->tcp, c->peer_name, "file descriptors nearly used up (raise `ulimit -n`)",
               s->fd_budget);
        return;
    }
    uint8_t key[16];
    peer_key(&ss, key);
    store_peer_t *peer = peer_acquire(s, key);
    if (!peer || peer->n_conns >= s->limits.max_connections_per_peer) {
        if (peer && peer->n_conns == 0) {
            peer->n_conns = 1;
            peer_release(s, peer);
        }
        refuse(s, &c->tcp, c->peer_name, "per-address connection limit reached",
               s->limits.max_connections_per_peer);
        return;
    }
    peer->n_conns++;
    c->peer = peer;
    c->srv = s;
    c->tcp.data = c;
    store_ops_session_init(&s->ops, &c->session);
    c->accepted_ms = clock_now_ms();
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    s->n_open_handles++;
    uv_tcp_nodelay(&c->tcp, 1);
    int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (rc < 0) {
        LOG_WARN("store: cannot read from %s: %s", c->peer_name, uv_strerror(rc));
        conn_close(c);
    }
}

/* Slow or silent peers: partial frames and unfinished handshakes expire. */
static void on_sweep(uv_timer_t *t) {
    store_server_t *s = t->data;
    uint64_t now = clock_now_ms();
    const store_limits_t *lim = &s->limits;
    for (store_conn_t *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->frame_started_ms && now - c->frame_started_ms > lim->frame_timeout_ms) {
            conn_drop(c, "partial frame (%zu of %zu bytes) held longer than %u ms", c->in_len,
                      c->in_need, lim->frame_timeout_ms);
        } else if (c->first_byte_ms && !c->session.is_validated &&
                   now - c->first_byte_ms > lim->validate_timeout_ms) {
            conn_drop(c, "not validated within %u ms", lim->validate_timeout_ms);
        } else if (!c->session.is_authed && now - c->accepted_ms > lim->validate_timeout_ms) {
            conn_drop(c,
                      "not authenticated within %u ms (this store requires the "
                      "shared secret)",
                      lim->validate_timeout_ms);
        }
    }
}

/* ---- server ------------------------------------------------------------------------------- */

static int resolve_bind(const char *host, uint16_t port, struct sockaddr_storage *out, char *err,
                        size_t err_len) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char port_text[8];
    snprintf(port_text, sizeof port_text, "%u", port);
    int rc = getaddrinfo(host, port_text, &hints, &res);
    if (rc != 0) {
        snprintf(err, err_len, "cannot resolve store address '%s': %s", host ? host : "(any)",
                 gai_strerror(rc));
        return -EINVAL;
    }
    memcpy(out, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

/* Descriptors kept back from clients: the loop's own, log files, worker pipes of an agent. */
#define FD_RESERVE 256

/* How many client connections RLIMIT_NOFILE allows: the soft limit is raised to the hard one
 * first (as servers commonly do), then a reserve is kept for everything else. */
static unsigned fd_budget(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0) return UINT32_MAX;
    if (rl.rlim_cur < rl.rlim_max) {
        struct rlimit raised = {.rlim_cur = rl.rlim_max, .rlim_max = rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > UINT32_MAX) return UINT32_MAX;
    unsigned limit = (unsigned)rl.rlim_cur;
    return limit > 2 * FD_RESERVE ? limit - FD_RESERVE : limit / 2;
}

int store_server_start(uv_loop_t *loop, const store_server_opts_t *opts, store_server_t **out,
                       char *err, size_t err_len) {
    struct sockaddr_storage addr;
    TRY(resolve_bind(opts->host, opts->port, &addr, err, err_len));
    store_server_t *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->loop = loop;
    s->limits = opts->limits;
    s->secret = opts->secret;
    s->fd_budget = fd_budget();
    int rc = kv_table_create(s->limits.max_store_bytes, &s->table);
    if (rc < 0) {
        free(s);
        snprintf(err, err_len, "cannot create the store table: %s", strerror(-rc));
        return rc;
    }
    store_ops_init(&s->ops, s->table, &s->limits, &s->secret);
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    s->n_open_handles = 1;
    rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&s->listener, 4096, on_connection);
    if (rc < 0) {
        snprintf(err, err_len, "cannot listen on %s port %u: %s%s", opts->host ? opts->host : "*",
                 opts->port, uv_strerror(rc),
                 rc == UV_EADDRINUSE ? " (another process holds this port; pick another or 0)"
                                     : "");
        /* The listener is freed with the server once the loop has closed it. */
        s->is_stopping = true;
        uv_close((uv_handle_t *)&s->listener, on_server_handle_closed);
        return rc;
    }
    struct sockaddr_storage bound;
    int bound_len = sizeof bound;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&bound, &bound_len);
    s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    uv_timer_init(loop, &s->sweep_timer);
    s->sweep_timer.data = s;
    s->n_open_handles++;
    uv_timer_start(&s->sweep_timer, on_sweep, SWEEP_INTERVAL_MS, SWEEP_INTERVAL_MS);
    *out = s;
    return 0;
}

uint16_t store_server_port(const store_server_t *s) {
    return s->port;
}

void store_server_stats(const store_server_t *s, store_server_stats_t *out) {
    out->n_connections = s->n_conns;
    out->n_requests = s->n_requests;
    out->n_dropped = s->n_dropped;
    out->buffered_bytes = s->buffered_bytes;
    out->table_bytes = kv_table_bytes(s->table);
}

static void on_server_handle_closed(uv_handle_t *h) {
    on_handle_closed(h->data);
}

void store_server_stop(store_server_t *s, void (*done_cb)(void *arg), void *arg) {
    if (s->is_stopping) return;
    s->is_stopping = true;
    s->done_cb = done_cb;
    s->done_arg = arg;
    while (s->conns)
        conn_close(s->conns);
    uv_close((uv_handle_t *)&s->sweep_timer, on_server_handle_closed);
    uv_close((uv_handle_t *)&s->listener, on_server_handle_closed);
}
