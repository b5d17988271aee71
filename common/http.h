/* http: JSON POSTs over libcurl for the etcd client (the project's only libcurl user), which is
 * loaded at the first use, not linked (http_load). One client
 * is one easy handle (keeps its connections alive between requests) used by one thread at a time;
 * http_interrupt may come from any thread. TLS: an optional CA bundle and client certificate. */
#ifndef DDP_COMMON_HTTP_H
#define DDP_COMMON_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *cacert;         /* PEM file of the CA to trust (NULL: the system's) */
    const char *cert, *key;     /* client certificate and key (NULL: none) */
    int64_t connect_timeout_ms; /* per connection attempt */
    size_t max_response_bytes;  /* a longer response fails (-EMSGSIZE); 0: 16 MiB */
} http_opts_t;

typedef struct http http_t;

/* Feeds a streamed response as it arrives; returning false ends the transfer (not an error). */
typedef bool (*http_chunk_fn)(void *arg, const char *data, size_t n);

typedef struct {
    const char *url;
    const char *body;        /* JSON */
    const char *auth_header; /* "Authorization: ..." or NULL */
    int64_t timeout_ms;      /* the whole request, streaming included */
    http_chunk_fn on_chunk;  /* NULL: collect the response into *response */
    void *arg;
} http_request_t;

/* Load libcurl (once, any thread): 0, or -ELIBACC with the reason in http_load_error() (where it
 * is missing, or too old). http_create loads it too. */
int http_load(void);
const char *http_load_error(void);
/* 0, -ELIBACC (libcurl cannot be loaded: http_load_error()) or -ENOMEM. */
int http_create(const http_opts_t *opts, http_t **out);
void http_destroy(http_t *h);
/* POST; *status gets the HTTP status (0 if none came). Without on_chunk, *response gets the body,
 * NUL-terminated and malloc'd (the caller frees), also for an error status. Returns 0 once a
 * response came (whatever its status), DDP_ETIMEOUT, DDP_ECLOSED after http_interrupt, or
 * -ECONNREFUSED / -EIO for transport failures, with the reason in http_error(). */
int http_post(http_t *h, const http_request_t *req, long *status, char **response);
/* From any thread: the request in flight (or the next one) ends with DDP_ECLOSED. */
void http_interrupt(http_t *h);
const char *http_error(const http_t *h);

#endif
