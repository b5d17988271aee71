/* resolve: see resolve.h. */
#include "resolve.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"

/* Lookups given up on still hold their thread until the resolver's own timeouts end them: a dead
 * DNS server and a client that retries every beat would pile them up. Past this many at once a
 * lookup is refused as a temporary failure (the caller's retry comes later). */
#define MAX_IN_FLIGHT 16
static atomic_int in_flight;

/* One lookup, shared by the caller and the thread that makes it; the last to let go frees it. */
typedef struct {
    char *host, *service;
    struct addrinfo hints;
    struct addrinfo *res;
    int rc;
    int done[2]; /* the thread writes a byte once rc and res are set */
    atomic_int refs;
} lookup_t;

static void release(lookup_t *l) {
    if (atomic_fetch_sub(&l->refs, 1) != 1) return;
    if (l->res) freeaddrinfo(l->res);
    close(l->done[0]);
    close(l->done[1]);
    free(l->host);
    free(l->service);
    free(l);
}

static void *look_up(void *arg) {
    lookup_t *l = arg;
    l->rc = getaddrinfo(l->host, l->service, &l->hints, &l->res);
    atomic_fetch_sub(&in_flight, 1);
    ssize_t w = write(l->done[1], "x", 1); /* the caller reads it before rc and res */
    (void)w;
    release(l);
    return NULL;
}

int resolve_within(const char *host, const char *service, const struct addrinfo *hints,
                   uint64_t deadline_ms, int wake_fd, struct addrinfo **res) {
    *res = NULL;
    struct addrinfo numeric = *hints;
    numeric.ai_flags |= AI_NUMERICHOST; /* no resolver: answers at once */
    int rc = getaddrinfo(host, service, &numeric, res);
    if (rc != EAI_NONAME) return rc;
    lookup_t *l = calloc(1, sizeof *l);
    if (!l) return EAI_MEMORY;
    l->host = strdup(host);
    l->service = service ? strdup(service) : NULL;
    l->hints = *hints;
    atomic_init(&l->refs, 2);
    if (!l->host || (service && !l->service) || pipe2(l->done, O_CLOEXEC) < 0) {
        free(l->host);
        free(l->service);
        free(l);
        return EAI_AGAIN; /* out of memory or descriptors now: a later try may have them */
    }
    if (atomic_fetch_add(&in_flight, 1) >= MAX_IN_FLIGHT) {
        atomic_fetch_sub(&in_flight, 1);
        atomic_store(&l->refs, 1);
        release(l);
        return EAI_AGAIN;
    }
    pthread_attr_t attr;
    pthread_t thread;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&thread, &attr, look_up, l);
    pthread_attr_destroy(&attr);
    if (e != 0) {
        atomic_fetch_sub(&in_flight, 1);
        atomic_store(&l->refs, 1);
        release(l);
        return EAI_AGAIN; /* no thread now: a later try may have one */
    }
    for (;;) {
        struct pollfd p[2] = {{.fd = l->done[0], .events = POLLIN},
                              {.fd = wake_fd, .events = POLLIN}};
        int n = poll(p, wake_fd >= 0 ? 2 : 1, clock_remaining_ms(deadline_ms));
        if (n < 0 && errno == EINTR) continue;
        if (n > 0 && (p[0].revents & POLLIN)) {
            char byte;
            ssize_t r = read(l->done[0], &byte, 1); /* after the thread's write: its rc and res */
            (void)r;
            rc = l->rc;
            *res = l->res;
            l->res = NULL;
            break;
        }
        rc = n > 0 ? RESOLVE_INTERRUPTED : n == 0 ? RESOLVE_TIMED_OUT : EAI_SYSTEM;
        break; /* the thread finishes the lookup and frees it */
    }
    release(l);
    return rc;
}

const char *resolve_strerror(int code) {
    if (code == RESOLVE_TIMED_OUT) return "no answer from the resolver before the deadline";
    if (code == RESOLVE_INTERRUPTED) return "interrupted";
    return gai_strerror(code);
}
