/* ddp_error: see ddp_error.h. */
#include "ddp_error.h"

#include <stdarg.h>
#include <stdio.h>

#include <string.h>

const char *ddp_strerror(int rc) {
    switch (rc) {
    case 0:
        return "success";
    case DDP_EPROTO:
        return "protocol violation by the peer";
    case DDP_EAUTH:
        return "shared-secret authentication failed";
    case DDP_ENOSECRET:
        return "the store requires a shared secret";
    case DDP_ETIMEOUT:
        return "timed out";
    case DDP_ECLOSED:
        return "connection closed by the peer";
    case DDP_ELEASE:
        return "the etcd lease expired";
    case DDP_ELOST:
        return "a peer lost its etcd lease before it did its part";
    default:
        return rc < 0 && rc > -DDP_EBASE ? strerror(-rc) : "unknown error";
    }
}

int ddp_errf(char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    return -1;
}
