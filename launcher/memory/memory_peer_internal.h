/* memory_peer_internal: what memory_peer.c (the successor, start and stop), memory_peer_recv.c
 * (peers' generations into this node's region) and memory_peer_send.c (this node's generations to
 * the next node) share: the state, and the functions one file calls in another. Loop thread. */
#ifndef DDP_LAUNCHER_MEMORY_PEER_INTERNAL_H
#define DDP_LAUNCHER_MEMORY_PEER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "memory/memory_peer.h"
#include "snapshot_format.h"
#include "store_auth.h"

#define POLL_MS      10
#define RETRY_MS     500
#define CHALLENGE_MS 5000 /* a connected receiver's nonce (with a secret) is this late at most */
#define PROOF_MS     5000 /* and a connected sender's proof */
/* the sender's proof (store_auth_mac): its own role, so that no store proof passes for it */
#define MEMORY_PEER_ROLE "ddprun-memory-peer"
#define FRAME_BYTES      40
#define HEADER_CHECKED   offsetof(snapshot_header_t, header_checksum)

typedef struct conn conn_t;
struct conn {
    uv_tcp_t tcp;
    memory_peer_t *p;
    conn_t *next;
    /* with the store's secret: our nonce, then the sender's nonce and MAC before any frame */
    bool is_authed;
    uint8_t nonce[STORE_AUTH_NONCE_BYTES];
    uint8_t proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES];
    size_t proof_got;
    double proof_by; /* when the proof is overdue (the connection then goes) */
    uv_write_t nonce_req;
    uint8_t frame[FRAME_BYTES];
    size_t frame_got;
    uint32_t origin;
    uint64_t n_bytes, got, reached;
    uint8_t *map;           /* the slot being received, NULL between frames */
    snapshot_header_t head; /* the payload's header, written last */
    char rbuf[1 << 16];
};

struct memory_peer {
    uv_loop_t *loop;
    const ddprun_opts_t *o;
    char dir[1200], host[256];
    uint16_t port;
    uv_tcp_t listener;
    uv_timer_t poll;
    store_secret_t secret; /* the store's (DDPRUN_STORE_SECRET...): peers prove it */
    uint32_t job_tag;      /* of the run id, in every frame: another job's frames are refused */
    int open_handles;
    bool is_stopping;
    conn_t *conns;
    int round; /* the newest round */
    /* sending to the next node's agent (its address from the round's records) */
    bool has_next;
    char next_host[300];
    uint16_t next_port;
    uint32_t origin; /* our group rank in the round being sent for */
    uv_tcp_t *out;
    bool is_connected, is_connecting;
    bool is_resolving; /* resolve_req is out (the successor as it was then: resolving) */
    uv_getaddrinfo_t resolve_req;
    char resolving[300];
    uint16_t resolving_port;
    double retry_at;
    uv_connect_t connect_req;
    uv_work_t read_work;
    bool is_reading, is_writing, is_read_ok;
    uv_write_t write_req;
    uint8_t *buf;
    size_t buf_cap, buf_len;
    int read_slot;
    int64_t read_step, sent_step;
    uint64_t reached; /* the sender's progress file when its slot was read */
    uint8_t frame[FRAME_BYTES];
    uint8_t challenge[STORE_AUTH_NONCE_BYTES], challenge_buf[64];
    size_t challenge_got;
    double challenge_by; /* when p->out's challenge is overdue */
    uint8_t proof[STORE_AUTH_NONCE_BYTES + STORE_AUTH_MAC_BYTES];
    uv_write_t proof_req;
};

/* Free p once it is stopping and nothing of it is open or in flight. */
void memory_peer__maybe_free(memory_peer_t *p);
/* A sealed header's step (its checksum verifies), else -1; file_step: of the file at path. */
int64_t memory_peer__header_step(const snapshot_header_t *h);
int64_t memory_peer__file_step(const char *path);
/* Receiving (memory_peer_recv.c): the listener's callback; closing a connection (a copy cut
 * short stays invalid). */
void memory_peer__on_connection(uv_stream_t *server, int status);
void memory_peer__conn_close(conn_t *c);
/* Close the connections whose sender has not proven the secret in time (the poll's). */
void memory_peer__drop_unproven(memory_peer_t *p);
/* Keepalive probes and a bound on unacknowledged data for a connection of either side: a peer
 * whose host vanished (no FIN, no RST) closes it within about half a minute instead of holding
 * its descriptor, buffer and mapped slot for good. */
void memory_peer__keep_alive(uv_tcp_t *t);
/* Sending (memory_peer_send.c): drop the connection to the next node (retried after RETRY_MS);
 * the poll timer's callback, which sends the newest sealed generation not sent yet. */
void memory_peer__drop_out(memory_peer_t *p);
void memory_peer__on_poll(uv_timer_t *t);

#endif
