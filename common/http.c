/* http: see http.h. */
#include "http.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#include "ddp_error.h"

#define DEFAULT_MAX_RESPONSE (16u << 20)

struct http {
    CURL *curl;
    http_opts_t opts;
    atomic_bool is_interrupted;
    char error[CURL_ERROR_SIZE + 256];
};

typedef struct {
    http_t *h;
    const http_request_t *req;
    char *buf;
    size_t len, cap;
    bool is_too_long, is_stopped;
} transfer_t;

static pthread_once_t global_once = PTHREAD_ONCE_INIT;
static void global_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

int http_create(const http_opts_t *opts, http_t **out) {
    pthread_once(&global_once, global_init);
    http_t *h = calloc(1, sizeof *h);
    if (!h) return -ENOMEM;
    h->opts = *opts;
    if (!h->opts.max_response_bytes) h->opts.max_response_bytes = DEFAULT_MAX_RESPONSE;
    h->curl = curl_easy_init();
    if (!h->curl) {
        free(h);
        return -ENOMEM;
    }
    *out = h;
    return 0;
}

void http_destroy(http_t *h) {
    if (!h) return;
    curl_easy_cleanup(h->curl);
    free(h);
}

void http_interrupt(http_t *h) { atomic_store(&h->is_interrupted, true); }

const char *http_error(const http_t *h) { return h->error; }

static size_t on_write(char *data, size_t size, size_t nmemb, void *arg) {
    transfer_t *t = arg;
    size_t n = size * nmemb;
    if (t->req->on_chunk) {
        if (!t->req->on_chunk(t->req->arg, data, n)) {
            t->is_stopped = true;
            return 0; /* ends the transfer: CURLE_WRITE_ERROR, which is no error here */
        }
        return n;
    }
    if (t->len + n + 1 > t->h->opts.max_response_bytes) {
        t->is_too_long = true;
        return 0;
    }
    if (t->len + n + 1 > t->cap) {
        size_t cap = (t->len + n + 1) * 2;
        char *b = realloc(t->buf, cap);
        if (!b) return 0;
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, data, n);
    t->len += n;
    t->buf[t->len] = '\0';
    return n;
}

/* libcurl calls this often during a transfer and about once a second while it idles (a watch):
 * the bound on how long an interrupt takes. */
static int on_progress(void *arg, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    (void)a, (void)b, (void)c, (void)d;
    transfer_t *t = arg;
    return atomic_load(&t->h->is_interrupted) ? 1 : 0;
}

int http_post(http_t *h, const http_request_t *req, long *status, char **response) {
    *status = 0;
    if (response) *response = NULL;
    h->error[0] = '\0';
    if (atomic_exchange(&h->is_interrupted, false)) {
        snprintf(h->error, sizeof h->error, "%s: interrupted", req->url);
        return DDP_ECLOSED;
    }
    transfer_t t = {.h = h, .req = req};
    char curl_err[CURL_ERROR_SIZE] = "";
    struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
    if (req->auth_header) headers = curl_slist_append(headers, req->auth_header);
    CURL *c = h->curl;
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, req->url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, req->body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &t);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, curl_err);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* threads: no SIGALRM for DNS timeouts */
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(req->timeout_ms > 0 ? req->timeout_ms : 1));
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)(h->opts.connect_timeout_ms > 0 ? h->opts.connect_timeout_ms : 5000));
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    if (h->opts.cacert) curl_easy_setopt(c, CURLOPT_CAINFO, h->opts.cacert);
    if (h->opts.cert) curl_easy_setopt(c, CURLOPT_SSLCERT, h->opts.cert);
    if (h->opts.key) curl_easy_setopt(c, CURLOPT_SSLKEY, h->opts.key);
    CURLcode cc = curl_easy_perform(c);
    curl_slist_free_all(headers);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    int rc = 0;
    if (cc == CURLE_OK || (cc == CURLE_WRITE_ERROR && t.is_stopped)) {
        rc = 0;
    } else if (cc == CURLE_ABORTED_BY_CALLBACK) {
        snprintf(h->error, sizeof h->error, "%s: interrupted", req->url);
        atomic_store(&h->is_interrupted, false);
        rc = DDP_ECLOSED;
    } else if (cc == CURLE_OPERATION_TIMEDOUT) {
        snprintf(h->error, sizeof h->error, "%s: no answer within %lld ms", req->url,
                 (long long)req->timeout_ms);
        rc = DDP_ETIMEOUT;
    } else if (t.is_too_long) {
        snprintf(h->error, sizeof h->error, "%s: response over %zu bytes", req->url,
                 h->opts.max_response_bytes);
        rc = -EMSGSIZE;
    } else {
        snprintf(h->error, sizeof h->error, "%s: %s", req->url,
                 curl_err[0] ? curl_err : curl_easy_strerror(cc));
        rc = cc == CURLE_COULDNT_CONNECT ? -ECONNREFUSED : -EIO;
    }
    if (rc == 0 && response) {
        *response = t.buf ? t.buf : strdup("");
        t.buf = NULL;
        if (!*response) rc = -ENOMEM;
    }
    free(t.buf);
    return rc;
}
