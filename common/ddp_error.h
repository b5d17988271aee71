/* ddp_error: error codes and messages. The launcher's, common/'s and proto/'s functions return 0
 * or a negative errno / DDP_E* code; TRY propagates, TRY_GOTO jumps to the one cleanup label, and
 * ddp_strerror names both kinds. The parsers and loaders of files and flags say what was wrong in
 * a caller's err buffer (ddp_errf), on both sides: the worker's return -1, the launcher's -EINVAL
 * (DDP_ERRF_EINVAL). */
#ifndef DDP_COMMON_DDP_ERROR_H
#define DDP_COMMON_DDP_ERROR_H

#include <stddef.h>

#include <errno.h>

enum {
    DDP_EBASE = 10000,
    DDP_EPROTO = -(DDP_EBASE + 1),    /* the peer broke the wire protocol */
    DDP_EAUTH = -(DDP_EBASE + 2),     /* shared-secret authentication failed */
    DDP_ENOSECRET = -(DDP_EBASE + 3), /* the store requires a secret we do not hold */
    DDP_ETIMEOUT = -(DDP_EBASE + 4),  /* a deadline passed */
    DDP_ECLOSED = -(DDP_EBASE + 5),   /* the peer closed the connection */
    DDP_ELEASE = -(DDP_EBASE + 6),    /* our etcd lease expired: our ephemeral keys are gone */
    DDP_ELOST = -(DDP_EBASE + 7),     /* a peer's etcd lease expired before it did its part */
};

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        int try_rc_ = (expr);                                                                      \
        if (try_rc_ < 0) return try_rc_;                                                           \
    } while (0)

#define TRY_GOTO(rc, expr, label)                                                                  \
    do {                                                                                           \
        (rc) = (expr);                                                                             \
        if ((rc) < 0) goto label;                                                                  \
    } while (0)

/* Message for 0, -errno or DDP_E*; never NULL. */
const char *ddp_strerror(int rc);
/* Format "what and where" into err (err_len bytes, always terminated) and return -1: the one
 * formatter behind every parser's and loader's message, `return ddp_errf(err, err_len, ...)` in
 * the worker's readers (train.conf, datasets, images, weights, snapshots), which return -1. */
int ddp_errf(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* ddp_errf for code under the 0 / -errno convention (options.c's flags, slurm.c's variables and
 * node lists): the message into err, and -EINVAL. */
#define DDP_ERRF_EINVAL(err, err_len, ...) (ddp_errf((err), (err_len), __VA_ARGS__), -EINVAL)

#endif
