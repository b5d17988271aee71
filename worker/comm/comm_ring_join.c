/* comm_ring_join: joining the ring (comm_ring_create). Each rank listens on its advertised address,
 * publishes it (numeric, so no peer's name lookup can stall) under the round's key prefix, connects
 * to next and accepts prev. Every connection opens with a handshake, acceptor first:
 *     acceptor -> challenge (magic, whether it holds the store's secret, nonce Ns)
 *     connector -> hello (magic, job hash, rank, world, nonce Nc, HMAC over Ns Nc and the rest)
 *     acceptor -> verdict (accepted, or why not; HMAC over Ns Nc and the verdict)
 * With the job's store secret (DDPRUN_STORE_SECRET[_FILE]) both sides prove it, so nobody without
 * it can join the ring and feed it gradients, and a recorded handshake cannot be replayed; without
 * one the MACs are zero and the handshake still tells the connector whether it was taken. Strays
 * (a scanner, another job's rank on a reused port, a rank of an older round) are refused and
 * named if prev never comes. Blocking, bounded by the ring's timeout_ms; the calling thread. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "comm_ring_internal.h"
#include "ddp_error.h"
#include "store_auth.h"

#define RING_MAGIC               0x444450524e473032ull /* "DDPRNG02": with the handshake */
#define RING_SOCKET_BUFFER_BYTES (4 << 20)
#define RING_HELLO_MS            5000 /* what a connection gets to say who it is */

/* The wire structs are in host byte order: the ranks of one job run the same build. */
typedef struct {
    uint64_t magic;
    uint32_t has_secret, reserved;
    uint8_t nonce[STORE_AUTH_NONCE_BYTES];
} ring_challenge_t;

typedef struct {
    uint64_t magic, job_hash;
    uint32_t rank, world;
    uint8_t nonce[STORE_AUTH_NONCE_BYTES];
    uint8_t mac[STORE_AUTH_MAC_BYTES]; /* zero without a secret */
} ring_hello_t;

enum { RING_ACCEPTED = 1, RING_NOT_THIS_JOB, RING_BAD_PROOF, RING_WRONG_RANK };

typedef struct {
    uint64_t magic;
    uint32_t verdict, reserved;
    uint8_t mac[STORE_AUTH_MAC_BYTES]; /* zero without a secret */
} ring_verdict_t;

/* The handshake's state on either side. */
typedef struct {
    const store_secret_t *secret; /* NULL or unset: none */
    ring_challenge_t challenge;
    ring_hello_t hello;
} handshake_t;

static bool has_secret(const store_secret_t *s) {
    return s && s->is_set;
}

static void hello_mac(const handshake_t *h, uint8_t mac[STORE_AUTH_MAC_BYTES]) {
    const ring_hello_t *m = &h->hello;
    uint64_t bound[3] = {m->job_hash, m->rank, m->world};
    store_auth_mac(h->secret, "ddprun-ring-hello", h->challenge.nonce, m->nonce, bound,
                   sizeof bound, mac);
}

static void verdict_mac(const handshake_t *h, uint32_t verdict, uint8_t mac[STORE_AUTH_MAC_BYTES]) {
    store_auth_mac(h->secret, "ddprun-ring-verdict", h->challenge.nonce, h->hello.nonce, &verdict,
                   sizeof verdict, mac);
}

static uint64_t hash_text(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static void tune_socket(int fd) {
    int one = 1, size = RING_SOCKET_BUFFER_BYTES;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

/* This host's address as seen on the route to the store (no packet is sent). */
static int route_address(const char *store_host, char *out, size_t out_len) {
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_DGRAM}, *ai = NULL;
    if (getaddrinfo(store_host, "9", &hints, &ai) != 0 || !ai) return -EHOSTUNREACH;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in local;
    socklen_t len = sizeof local;
    int rc = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                     getsockname(fd, (struct sockaddr *)&local, &len) == 0
                 ? 0
                 : -errno;
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
    if (rc == 0 && !inet_ntop(AF_INET, &local.sin_addr, out, (socklen_t)out_len)) rc = -EINVAL;
    return rc;
}

static int wait_fd(int fd, short events, int64_t deadline_ms) {
    for (;;) {
        int64_t left = deadline_ms - (int64_t)clock_now_ms();
        if (left <= 0) return DDP_ETIMEOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, (int)(left > 1000000 ? 1000000 : left));
        if (rc > 0) return 0;
        if (rc < 0 && errno != EINTR) return -errno;
    }
}

/* Blocking full write/read on a non-blocking socket, bounded by deadline_ms. */
static int io_all(int fd, void *buf, size_t len, bool is_write, int64_t deadline_ms) {
    uint8_t *p = buf;
    while (len) {
        int rc = wait_fd(fd, is_write ? POLLOUT : POLLIN, deadline_ms);
        if (rc < 0) return rc;
        ssize_t k = is_write ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                             : recv(fd, p, len, MSG_DONTWAIT);
        if (k == 0) return DDP_ECLOSED;
        if (k < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            return -errno;
        }
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

static int split_address(const char *text, size_t len, char *host, size_t host_len, char *port,
                         size_t port_len) {
    const char *colon = memrchr(text, ':', len);
    if (!colon || (size_t)(colon - text) >= host_len ||
        len - (size_t)(colon - text) - 1 >= port_len || colon == text ||
        (size_t)(colon - text) + 1 == len)
        return -EINVAL;
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = '\0';
    memcpy(port, colon + 1, len - (size_t)(colon - text) - 1);
    port[len - (size_t)(colon - text) - 1] = '\0';
    return 0;
}

/* The connector's half on a connected fd: answer next's challenge with our hello, read its
 * verdict. 0 (taken), a failure recorded on r (next refused us, or is not a rank of this ring), or
 * a negative code without one (the connection broke: the caller may try again). */
static int introduce_to_next(ring_t *r, int fd, const store_secret_t *secret,
                             const ring_hello_t *hello, int64_t deadline_ms) {
    handshake_t h = {.secret = secret, .hello = *hello};
    int rc = io_all(fd, &h.challenge, sizeof h.challenge, false, deadline_ms);
    if (rc < 0) return rc;
    if (h.challenge.magic != RING_MAGIC)
        return comm_ring__fail(r, DDP_EPROTO,
                               "rank %d's address %s answered as something other than a rank "
                               "of this ring (another program on that port?)",
                               next_rank(r), r->next_addr);
    if (!!h.challenge.has_secret != has_secret(secret))
        return comm_ring__fail(r, DDP_EAUTH,
                               "rank %d at %s %s the store's shared secret and this rank %s: "
                               "give every node the same DDPRUN_STORE_SECRET[_FILE]",
                               next_rank(r), r->next_addr,
                               h.challenge.has_secret ? "requires" : "does not hold",
                               has_secret(secret) ? "does" : "holds none");
    store_auth_random_nonce(h.hello.nonce);
    if (has_secret(secret)) hello_mac(&h, h.hello.mac);
    rc = io_all(fd, &h.hello, sizeof h.hello, true, deadline_ms);
    ring_verdict_t v;
    if (rc == 0) rc = io_all(fd, &v, sizeof v, false, deadline_ms);
    if (rc < 0) return rc;
    /* only a taking is proved: a refusal ends this rank either way, and under another secret
     * its proof could not be checked */
    uint8_t expect[STORE_AUTH_MAC_BYTES];
    if (has_secret(secret)) verdict_mac(&h, v.verdict, expect);
    if (v.magic != RING_MAGIC ||
        (v.verdict == RING_ACCEPTED && has_secret(secret) && !store_auth_mac_equal(expect, v.mac)))
        return comm_ring__fail(r, DDP_EAUTH,
                               "rank %d at %s did not prove the store's shared secret "
                               "(an impostor on its port?)",
                               next_rank(r), r->next_addr);
    switch (v.verdict) {
    case RING_ACCEPTED:
        return 0;
    case RING_NOT_THIS_JOB:
        return comm_ring__fail(r, DDP_EPROTO,
                               "rank %d's address %s belongs to another job's ring, which "
                               "refused this one",
                               next_rank(r), r->next_addr);
    case RING_BAD_PROOF:
        return comm_ring__fail(r, DDP_EAUTH,
                               "rank %d at %s refused this rank's proof of the store's shared "
                               "secret: the nodes hold different secrets",
                               next_rank(r), r->next_addr);
    default:
        return comm_ring__fail(r, DDP_EPROTO,
                               "rank %d at %s expects another rank than %d of %d: are two rounds "
                               "sharing the prefix?",
                               next_rank(r), r->next_addr, r->base.rank, r->base.world);
    }
}

/* Connect to next (retrying while the connection cannot be made) and be taken by it. */
static int connect_next(ring_t *r, const char *host, const char *port, const store_secret_t *secret,
                        const ring_hello_t *hello, int64_t deadline_ms) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV},
                    *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0)
        return comm_ring__fail(r, -EHOSTUNREACH, "rank %d's address %s: %s", next_rank(r),
                               r->next_addr, gai_strerror(rc));
    int delay_ms = 10;
    for (;;) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            rc = -errno;
            break;
        }
        tune_socket(fd);
        rc = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS ? 0 : -errno;
        if (rc == 0) rc = wait_fd(fd, POLLOUT, deadline_ms);
        int so_error = 0;
        socklen_t len = sizeof so_error;
        if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error)
            rc = -so_error;
        if (rc == 0) rc = introduce_to_next(r, fd, secret, hello, deadline_ms);
        if (rc == 0) {
            r->next_fd = fd;
            break;
        }
        close(fd);
        if (r->failed_rc) { /* refused: trying again would be refused again */
            freeaddrinfo(ai);
            return rc;
        }
        if (rc == DDP_ETIMEOUT || (int64_t)clock_now_ms() + delay_ms >= deadline_ms) {
            rc = DDP_ETIMEOUT;
            break;
        }
        usleep((useconds_t)delay_ms * 1000);
        delay_ms = delay_ms < 500 ? delay_ms * 2 : 1000;
    }
    freeaddrinfo(ai);
    if (rc < 0)
        return comm_ring__fail(r, rc, "cannot connect to rank %d at %s: %s", next_rank(r),
                               r->next_addr, ddp_strerror(rc));
    return 0;
}

/* The acceptor's half on an accepted fd: challenge, hello, verdict. Returns the verdict sent (0
 * when the connection said nothing in time, or broke); describes a refusal in stray. */
static uint32_t judge_connection(ring_t *r, int fd, const char *from_host,
                                 const store_secret_t *secret, uint64_t job_hash,
                                 int64_t deadline_ms, char *stray, size_t stray_len) {
    handshake_t h = {.secret = secret,
                     .challenge = {.magic = RING_MAGIC, .has_secret = has_secret(secret)}};
    store_auth_random_nonce(h.challenge.nonce);
    int rc = io_all(fd, &h.challenge, sizeof h.challenge, true, deadline_ms);
    if (rc == 0) rc = io_all(fd, &h.hello, sizeof h.hello, false, deadline_ms);
    if (rc < 0) {
        snprintf(stray, stray_len, "a connection from %s sent no hello (%s)", from_host,
                 ddp_strerror(rc));
        return 0;
    }
    uint8_t expect[STORE_AUTH_MAC_BYTES];
    if (has_secret(secret)) hello_mac(&h, expect);
    uint32_t verdict = RING_ACCEPTED;
    if (h.hello.magic != RING_MAGIC || h.hello.job_hash != job_hash) {
        verdict = RING_NOT_THIS_JOB;
        snprintf(stray, stray_len, "a connection from %s was not from this job's ring", from_host);
    } else if (has_secret(secret) && !store_auth_mac_equal(expect, h.hello.mac)) {
        verdict = RING_BAD_PROOF;
        snprintf(stray, stray_len,
                 "a connection from %s failed the proof of the store's shared secret", from_host);
    } else if (h.hello.world != (uint32_t)r->base.world || h.hello.rank != (uint32_t)prev_rank(r)) {
        verdict = RING_WRONG_RANK;
    }
    ring_verdict_t v = {.magic = RING_MAGIC, .verdict = verdict};
    if (has_secret(secret)) verdict_mac(&h, verdict, v.mac);
    rc = io_all(fd, &v, sizeof v, true, deadline_ms);
    if (rc < 0 && verdict == RING_ACCEPTED) {
        snprintf(stray, stray_len, "rank %d's connection from %s broke in its handshake (%s)",
                 prev_rank(r), from_host, ddp_strerror(rc));
        return 0;
    }
    if (verdict == RING_WRONG_RANK)
        comm_ring__fail(r, DDP_EPROTO,
                        "a peer at %s joined this job's ring as rank %u of %u, but this is "
                        "rank %d of %d and expects rank %d: are two rounds sharing the prefix?",
                        from_host, h.hello.rank, h.hello.world, r->base.rank, r->base.world,
                        prev_rank(r));
    return verdict;
}

/* Accept until the connection from prev arrives with a hello for this job; strays are refused
 * and the last one is named if prev never comes; a hello of this job with the wrong rank or world
 * fails at once. */
static int accept_prev(ring_t *r, int listen_fd, const store_secret_t *secret, uint64_t job_hash,
                       int64_t deadline_ms) {
    char stray[192] = "";
    for (;;) {
        int rc = wait_fd(listen_fd, POLLIN, deadline_ms);
        if (rc < 0)
            return comm_ring__fail(r, rc, "rank %d (%s) did not connect within %lld ms%s%s",
                                   prev_rank(r), r->prev_addr, (long long)r->timeout_ms,
                                   stray[0] ? "; refused meanwhile: " : "", stray);
        struct sockaddr_storage from;
        socklen_t from_len = sizeof from;
        int fd =
            accept4(listen_fd, (struct sockaddr *)&from, &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) { /* out of descriptors, say: named if prev never comes, and no spin */
            snprintf(stray, sizeof stray, "accepting a connection failed: %s", strerror(errno));
            usleep(10 * 1000);
            continue;
        }
        char from_host[64] = "?";
        if (from.ss_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)&from)->sin_addr, from_host,
                      sizeof from_host);
        else if (from.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&from)->sin6_addr, from_host,
                      sizeof from_host);
        tune_socket(fd);
        int64_t hello_deadline = (int64_t)clock_now_ms() + RING_HELLO_MS < deadline_ms
                                     ? (int64_t)clock_now_ms() + RING_HELLO_MS
                                     : deadline_ms;
        uint32_t verdict = judge_connection(r, fd, from_host, secret, job_hash, hello_deadline,
                                            stray, sizeof stray);
        if (verdict == RING_ACCEPTED) {
            r->prev_fd = fd;
            return 0;
        }
        close(fd);
        if (verdict == RING_WRONG_RANK) return r->failed_rc;
    }
}

/* Publish this rank's address, then wait for both neighbours' within what is left of the ring's
 * deadline: one WAIT on the two keys (one after the other, each bounded by the whole timeout, took
 * up to twice collective_timeout and left the connect no time). */
static int publish_and_lookup(ring_t *r, const comm_ring_opts_t *o, const char *self_addr,
                              int64_t deadline_ms) {
    char key[600];
    snprintf(key, sizeof key, "%sring/%d", o->key_prefix, o->rank);
    if (store_client_set(o->store, key, self_addr, strlen(self_addr)) < 0)
        return comm_ring__fail(r, DDP_ECLOSED, "cannot publish this rank's address: %s",
                               store_client_error(o->store));
    int peers[2] = {next_rank(r), prev_rank(r)};
    char *outs[2] = {r->next_addr, r->prev_addr};
    char keys[2][600];
    const char *key_list[2] = {keys[0], keys[1]};
    for (int i = 0; i < 2; i++)
        snprintf(keys[i], sizeof keys[i], "%sring/%d", o->key_prefix, peers[i]);
    int64_t left = deadline_ms - (int64_t)clock_now_ms();
    int rc = store_client_wait(o->store, key_list, 2, left > 0 ? left : 1);
    uint8_t *vals[2] = {NULL, NULL};
    size_t lens[2] = {0, 0};
    if (rc == 0) rc = store_client_multi_get(o->store, key_list, 2, vals, lens);
    if (rc == DDP_ETIMEOUT) { /* which of the two is missing */
        int missing = peers[0];
        if (store_client_multi_get(o->store, key_list, 2, vals, lens) == 0 && lens[0] > 0)
            missing = peers[1];
        for (int i = 0; i < 2; i++)
            free(vals[i]);
        return comm_ring__fail(r, DDP_ETIMEOUT,
                               "rank %d never published its address within %lld ms (the "
                               "collective's timeout)",
                               missing, (long long)r->timeout_ms);
    }
    if (rc < 0)
        return comm_ring__fail(r, rc, "cannot read the neighbours' addresses: %s",
                               store_client_error(o->store));
    for (int i = 0; i < 2; i++) {
        size_t len = lens[i] < sizeof r->next_addr ? lens[i] : sizeof r->next_addr - 1;
        memcpy(outs[i], vals[i], len);
        outs[i][len] = '\0';
        free(vals[i]);
    }
    return 0;
}

/* Listen on host's address; out: "a.b.c.d:port" as peers dial it. The listening fd, or -1 with
 * the failure recorded on r. */
static int listen_on(ring_t *r, const char *host, char *out, size_t out_len) {
    /* on the advertised address only, as the store: not every interface of the host */
    struct sockaddr_in addr = {.sin_family = AF_INET};
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, NULL, &hints, &ai) != 0 || !ai) {
        comm_ring__fail(r, -EADDRNOTAVAIL, "cannot resolve this host's address %s", host);
        return -1;
    }
    addr.sin_addr = ((struct sockaddr_in *)ai->ai_addr)->sin_addr;
    freeaddrinfo(ai);
    socklen_t len = sizeof addr;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    char numeric[INET_ADDRSTRLEN];
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 16) < 0 ||
        getsockname(fd, (struct sockaddr *)&addr, &len) < 0 ||
        !inet_ntop(AF_INET, &addr.sin_addr, numeric, sizeof numeric)) {
        comm_ring__fail(r, -errno, "cannot listen on %s for rank %d: %s", host, prev_rank(r),
                        strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    snprintf(out, out_len, "%s:%u", numeric, ntohs(addr.sin_port));
    return fd;
}

int comm_ring_create(const comm_ring_opts_t *o, comm_t **out, char *err, size_t err_len) {
    *out = NULL;
    if (o->world < 1 || o->rank < 0 || o->rank >= o->world) {
        snprintf(err, err_len, "ring: rank %d is outside a world of %d", o->rank, o->world);
        return -EINVAL;
    }
    if (has_secret(o->secret) && store_auth_init() < 0) {
        snprintf(err, err_len, "ring: libsodium failed to start");
        return -EIO;
    }
    ring_t *r = calloc(1, sizeof *r);
    if (r) r->scratch = malloc(RING_PIECE_BYTES);
    if (!r || !r->scratch) {
        free(r);
        snprintf(err, err_len, "ring: out of memory");
        return -ENOMEM;
    }
    r->base = (comm_t){.ops = &comm_ring__ops, .rank = o->rank, .world = o->world};
    r->next_fd = r->prev_fd = -1;
    r->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 300000;
    int64_t deadline_ms = (int64_t)clock_now_ms() + r->timeout_ms;
    int listen_fd = -1, rc = 0;
    char host[64] = "127.0.0.1";
    if (o->advertise_host)
        snprintf(host, sizeof host, "%s", o->advertise_host);
    else if (o->store_host && route_address(o->store_host, host, sizeof host) < 0)
        snprintf(host, sizeof host, "127.0.0.1");
    if (o->world > 1) {
        char self_addr[96], peer_host[64], peer_port[16];
        listen_fd = listen_on(r, host, self_addr, sizeof self_addr);
        if (listen_fd < 0) {
            rc = r->failed_rc;
            goto done;
        }
        rc = publish_and_lookup(r, o, self_addr, deadline_ms);
        if (rc < 0) goto done;
        if (split_address(r->next_addr, strlen(r->next_addr), peer_host, sizeof peer_host,
                          peer_port, sizeof peer_port) < 0) {
            rc = comm_ring__fail(r, DDP_EPROTO, "rank %d published a malformed address '%s'",
                                 next_rank(r), r->next_addr);
            goto done;
        }
        uint64_t job_hash = hash_text(o->key_prefix);
        ring_hello_t hello = {.magic = RING_MAGIC,
                              .job_hash = job_hash,
                              .rank = (uint32_t)o->rank,
                              .world = (uint32_t)o->world};
        /* Each side of a connection waits for the other's handshake, so not every rank may
         * connect first (each would wait for a next that is connecting too): even ranks connect
         * then accept, odd ranks accept then connect, and no wait closes a circle. */
        if (o->rank % 2 == 0) {
            rc = connect_next(r, peer_host, peer_port, o->secret, &hello, deadline_ms);
            if (rc == 0) rc = accept_prev(r, listen_fd, o->secret, job_hash, deadline_ms);
        } else {
            rc = accept_prev(r, listen_fd, o->secret, job_hash, deadline_ms);
            if (rc == 0) rc = connect_next(r, peer_host, peer_port, o->secret, &hello, deadline_ms);
        }
    }
done:
    if (listen_fd >= 0) close(listen_fd);
    if (rc < 0) {
        snprintf(err, err_len, "%s", r->base.err);
        comm_ring__ops.destroy(&r->base);
        return rc;
    }
    *out = &r->base;
    return 0;
}
