/* http: see http.h. libcurl is loaded at the first client (dlopen), not linked: it brings some
 * thirty libraries (TLS, HTTP/2, Kerberos, LDAP, ...) that only an agent on etcd needs, and every
 * other ddprun (a one-node job, a c10d agent, the tools) would pay for loading them at start. */
#include "http.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CURL_DISABLE_TYPECHECK /* calls go through the table below, not the macros */
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

/* The part of libcurl's API this file uses, from the loaded library. */
static struct {
    CURLcode (*global_init)(long flags);
    CURL *(*easy_init)(void);
    void (*easy_cleanup)(CURL *c);
    void (*easy_reset)(CURL *c);
    CURLcode (*easy_setopt)(CURL *c, CURLoption option, ...);
    CURLcode (*easy_perform)(CURL *c);
    CURLcode (*easy_getinfo)(CURL *c, CURLINFO info, ...);
    const char *(*easy_strerror)(CURLcode code);
    struct curl_slist *(*slist_append)(struct curl_slist *list, const char *text);
    void (*slist_free_all)(struct curl_slist *list);
} api;
static char load_error[512];

static pthread_once_t global_once = PTHREAD_ONCE_INIT;

static void global_init(void) {
    /* DDPRUN_LIBCURL: a libcurl somewhere the loader does not look (and the tests' missing one) */
    const char *env = getenv("DDPRUN_LIBCURL");
    const char *names[] = {env && *env ? env : "libcurl.so.4", env && *env ? NULL : "libcurl.so"};
    void *lib = NULL;
    for (size_t i = 0; !lib && i < sizeof names / sizeof names[0] && names[i]; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(load_error, sizeof load_error,
                 "libcurl (%s) cannot be loaded (%s): install "
                 "libcurl4 (Debian, Ubuntu) or libcurl (Fedora), or name it in DDPRUN_LIBCURL",
                 names[0], dlerror());
        return;
    }
    struct {
        void **fn;
        const char *name;
    } syms[] = {{(void **)&api.global_init, "curl_global_init"},
                {(void **)&api.easy_init, "curl_easy_init"},
                {(void **)&api.easy_cleanup, "curl_easy_cleanup"},
                {(void **)&api.easy_reset, "curl_easy_reset"},
                {(void **)&api.easy_setopt, "curl_easy_setopt"},
                {(void **)&api.easy_perform, "curl_easy_perform"},
                {(void **)&api.easy_getinfo, "curl_easy_getinfo"},
                {(void **)&api.easy_strerror, "curl_easy_strerror"},
                {(void **)&api.slist_append, "curl_slist_append"},
                {(void **)&api.slist_free_all, "curl_slist_free_all"}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        if ((*syms[i].fn = dlsym(lib, syms[i].name))) continue;
        snprintf(load_error, sizeof load_error,
                 "the libcurl found lacks %s: too old (7.85 or "
                 "later is needed)",
                 syms[i].name);
        api.easy_init = NULL;
        return;
    }
    api.global_init(CURL_GLOBAL_DEFAULT);
}

int http_load(void) {
    pthread_once(&global_once, global_init);
    return api.easy_init ? 0 : -ELIBACC;
}

const char *http_load_error(void) {
    return load_error;
}

int http_create(const http_opts_t *opts, http_t **out) {
    TRY(http_load());
    http_t *h = calloc(1, sizeof *h);
    if (!h) return -ENOMEM;
    h->opts = *opts;
    if (!h->opts.max_response_bytes) h->opts.max_response_bytes = DEFAULT_MAX_RESPONSE;
    h->curl = api.easy_init();
    if (!h->curl) {
        free(h);
        return -ENOMEM;
    }
    *out = h;
    return 0;
}

void http_destroy(http_t *h) {
    if (!h) return;
    api.easy_cleanup(h->curl);
    free(h);
}

void http_interrupt(http_t *h) {
    atomic_store(&h->is_interrupted, true);
}

const char *http_error(const http_t *h) {
    return h->error;
}

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
    struct curl_slist *headers = api.slist_append(NULL, "Content-Type: application/json");
    if (req->auth_header) headers = api.slist_append(headers, req->auth_header);
    CURL *c = h->curl;
    api.easy_reset(c);
    api.easy_setopt(c, CURLOPT_URL, req->url);
    api.easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    api.easy_setopt(c, CURLOPT_POSTFIELDS, req->body);
    api.easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
    api.easy_setopt(c, CURLOPT_WRITEDATA, &t);
    api.easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    api.easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    api.easy_setopt(c, CURLOPT_XFERINFODATA, &t);
    api.easy_setopt(c, CURLOPT_ERRORBUFFER, curl_err);
    api.easy_setopt(c, CURLOPT_NOSIGNAL, 1L); /* threads: no SIGALRM for DNS timeouts */
    api.easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(req->timeout_ms > 0 ? req->timeout_ms : 1));
    api.easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS,
                    (long)(h->opts.connect_timeout_ms > 0 ? h->opts.connect_timeout_ms : 5000));
    api.easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    api.easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    if (h->opts.cacert) api.easy_setopt(c, CURLOPT_CAINFO, h->opts.cacert);
    if (h->opts.cert) api.easy_setopt(c, CURLOPT_SSLCERT, h->opts.cert);
    if (h->opts.key) api.easy_setopt(c, CURLOPT_SSLKEY, h->opts.key);
    CURLcode cc = api.easy_perform(c);
    api.slist_free_all(headers);
    api.easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
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
                 curl_err[0] ? curl_err : api.easy_strerror(cc));
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
