/* port_holder: who holds a local TCP port, from /proc/net/tcp{,6} (the sockets bound to it, their
 * states) and /proc/<pid>/fd (which process owns each socket's inode). For the agent that finds
 * its rendezvous endpoint's port taken: a store of another agent listens there, or something that
 * is no store (a program, a connection that happens to use the port as its own end) holds it and
 * nobody will ever answer. Linux only; best effort: without permission to read another user's
 * /proc/<pid>/fd the process is not named. Blocking, reads /proc only; any thread. */
#ifndef DDP_LAUNCHER_PORT_HOLDER_H
#define DDP_LAUNCHER_PORT_HOLDER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    bool is_found;     /* some socket has the port as its local end */
    bool is_listening; /* one of them listens (a store may answer there) */
    char text[512];    /* for people: "pid 123 (python3), a connection to 127.0.0.1:5000" ... */
} port_holder_t;

/* Describe who holds TCP port `port` on this machine. Never fails: out->is_found false when no
 * socket was seen. */
void port_holder_find(uint16_t port, port_holder_t *out);

#endif
