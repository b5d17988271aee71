/* libFuzzer harness over the Slurm node-list parser (launcher/slurm): SLURM_JOB_NODELIST comes
 * from the environment, so any bytes. Checks that parsing never crashes, never reads past the
 * string, writes only whole hosts within the buffer, and that the hosts it returns are names
 * (host characters only) and as many as it counted while they fit. */
#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "slurm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    char *list = malloc(size + 1); /* exactly the string: ASan sees any read past it */
    memcpy(list, data, size);
    list[size] = '\0';
    static char out[1 << 12];
    char err[256];
    long n = -1;
    int rc = slurm_hostlist_expand(list, out, sizeof out, &n, err, sizeof err);
    assert(rc == 0 || rc == -EINVAL);
    if (rc == 0) {
        assert(n >= 1 && n <= SLURM_MAX_HOSTS);
        long lines = 0;
        for (const char *p = out; *p; p++) {
            if (*p == '\n')
                lines++;
            else
                assert(isalnum((unsigned char)*p) || *p == '-' || *p == '.' || *p == '_');
        }
        assert(lines <= n && (lines == n || strlen(out) + SLURM_HOST_MAX_BYTES + 1 > sizeof out));
    } else {
        assert(err[0]);
    }
    free(list);
    return 0;
}
