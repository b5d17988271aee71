/* comm_agree: a yes/no question every rank answers through the store, where all must agree on the
 * outcome before a collective exists (e.g. "can every rank use NCCL?": nodes differ in GPUs). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"

int comm_agree_all(store_client_t *store, const char *prefix, const char *question, int rank,
                   int world, bool is_yes, bool *all_yes, char *err, size_t err_len) {
    char **keys = calloc((size_t)world, sizeof *keys);
    uint8_t **vals = calloc((size_t)world, sizeof *vals);
    size_t *lens = calloc((size_t)world, sizeof *lens);
    int rc = keys && vals && lens ? 0 : -ENOMEM;
    for (int r = 0; r < world && rc == 0; r++) {
        size_t len = strlen(prefix) + strlen(question) + 16;
        keys[r] = malloc(len);
        if (!keys[r])
            rc = -ENOMEM;
        else
            snprintf(keys[r], len, "%s%s/%d", prefix, question, r);
    }
    if (rc < 0) snprintf(err, err_len, "out of memory");
    if (rc == 0 && store_client_set(store, keys[rank], is_yes ? "1" : "0", 1) < 0) rc = -EIO;
    if (rc == 0 && store_client_wait(store, (const char *const *)keys, (size_t)world, -1) < 0)
        rc = -EIO;
    if (rc == 0 &&
        store_client_multi_get(store, (const char *const *)keys, (size_t)world, vals, lens) < 0)
        rc = -EIO;
    if (rc == -EIO) snprintf(err, err_len, "%s: %s", question, store_client_error(store));
    *all_yes = rc == 0;
    for (int r = 0; r < world && rc == 0; r++) {
        if (lens[r] != 1 || (vals[r][0] != '0' && vals[r][0] != '1')) {
            snprintf(err, err_len, "%s: the store holds %zu bytes that are not 0 or 1", keys[r],
                     lens[r]);
            rc = -EPROTO;
        } else if (vals[r][0] == '0') {
            *all_yes = false;
        }
    }
    for (int r = 0; r < world; r++) {
        if (keys) free(keys[r]);
        if (vals) free(vals[r]);
    }
    free(keys);
    free(vals);
    free(lens);
    if (rc < 0) *all_yes = false;
    return rc;
}
