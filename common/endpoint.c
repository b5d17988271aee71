/* endpoint: see endpoint.h. */
#include "endpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int parse_u64(const char *text, uint64_t min, uint64_t max, uint64_t *out) {
    if (!text || *text < '0' || *text > '9') return -EINVAL;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (*end != '\0') return -EINVAL;
    if (errno == ERANGE || v < min || v > max) return -ERANGE;
    *out = v;
    return 0;
}

int endpoint_parse(const char *text, uint16_t default_port, char *host, size_t host_len,
                   uint16_t *port, char *err, size_t err_len) {
    const char *h = text, *p = NULL;
    size_t h_len;
    if (!text || !*text) {
        snprintf(err, err_len, "empty endpoint; expected host[:port]");
        return -EINVAL;
    }
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (!close || close == text + 1 || (close[1] != '\0' && close[1] != ':')) {
            snprintf(err, err_len, "bad endpoint '%s'; expected [ipv6]:port", text);
            return -EINVAL;
        }
        h = text + 1;
        h_len = (size_t)(close - h);
        if (close[1] == ':') p = close + 2;
    } else {
        const char *colon = strchr(text, ':');
        if (colon && strchr(colon + 1, ':')) {
            h_len = strlen(text); /* bare IPv6 literal */
        } else {
            h_len = colon ? (size_t)(colon - text) : strlen(text);
            if (colon) p = colon + 1;
        }
    }
    if (h_len == 0 || h_len >= host_len) {
        snprintf(err, err_len, "bad host in endpoint '%s'", text);
        return -EINVAL;
    }
    memcpy(host, h, h_len);
    host[h_len] = '\0';
    *port = default_port;
    if (p) {
        uint64_t v;
        if (parse_u64(p, 0, 65535, &v) < 0) {
            snprintf(err, err_len, "bad port '%s' in endpoint '%s'; expected 0-65535", p, text);
            return -EINVAL;
        }
        *port = (uint16_t)v;
    }
    return 0;
}
