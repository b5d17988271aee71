/* rdzv_kv: the backend named by the options (see rdzv_kv.h). */
#include "rdzv/rdzv_kv.h"

#include <stdio.h>
#include <string.h>

#include "ddp_error.h"
#include "rdzv/rdzv_kv_impl.h"

#ifdef DDP_HAVE_ETCD
#include "http.h"

int rdzv_kv_etcd_check(char *err, size_t err_len) {
    int rc = http_load();
    if (rc < 0) snprintf(err, err_len, "%s", http_load_error());
    return rc;
}
#else
int rdzv_kv_etcd_check(char *err, size_t err_len) {
    snprintf(err, err_len, "this ddprun was built without libcurl, so without etcd");
    return -ENOTSUP;
}

rdzv_lease_t *rdzv_lease_new(int64_t ttl_s) {
    (void)ttl_s;
    return NULL;
}
void rdzv_lease_free(rdzv_lease_t *l) {
    (void)l;
}
#endif

int rdzv_kv_connect(const ddprun_opts_t *o, rdzv_lease_t *lease, int64_t connect_timeout_ms,
                    int64_t op_timeout_ms, rdzv_kv_t **out) {
    __atomic_store_n(out, NULL, __ATOMIC_RELEASE); /* another thread may read it to interrupt */
    if (strcmp(o->rdzv_backend, "etcd") != 0)
        return rdzv_kv_store_connect(o, connect_timeout_ms, op_timeout_ms, out);
#ifdef DDP_HAVE_ETCD
    return rdzv_kv_etcd_connect(o, lease, connect_timeout_ms, op_timeout_ms, out);
#else
    (void)lease;
    return -ENOTSUP;
#endif
}
