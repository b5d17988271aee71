/* resolve: getaddrinfo(3) that gives up at a deadline or when a wake fd becomes readable. The
 * system's resolver has no deadline of its own (a DNS server that never answers holds a lookup
 * for its timeout times its attempts times its servers: 10 s and more with resolv.conf's
 * defaults), and a store client must keep its connect deadline and hear an interrupt. A name
 * that is a numeric address is converted at once; any other is looked up on a thread of its own,
 * which, when given up on, finishes and frees its lookup alone (16 such at most in a process; past
 * them a lookup fails with EAI_AGAIN, as when no thread or descriptor can be had). */
#ifndef DDP_COMMON_RESOLVE_H
#define DDP_COMMON_RESOLVE_H

#include <netdb.h>
#include <stdint.h>

/* Beside getaddrinfo's own codes (all nonzero): */
#define RESOLVE_TIMED_OUT   (-1000) /* the deadline passed first */
#define RESOLVE_INTERRUPTED (-1001) /* wake_fd became readable first (it is not drained) */

/* As getaddrinfo(host, service, hints, res) (0: *res to freeaddrinfo), bounded by deadline_ms
 * (clock.h; CLOCK_NEVER: none) and by wake_fd (-1: none). Blocks the calling thread. */
int resolve_within(const char *host, const char *service, const struct addrinfo *hints,
                   uint64_t deadline_ms, int wake_fd, struct addrinfo **res);
/* getaddrinfo's text for code, and ours for the two above. */
const char *resolve_strerror(int code);

#endif
