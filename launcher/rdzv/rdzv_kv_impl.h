/* rdzv_kv_impl: the backends' constructors, for rdzv_kv.c's dispatch only. */
#ifndef DDP_LAUNCHER_RDZV_KV_IMPL_H
#define DDP_LAUNCHER_RDZV_KV_IMPL_H

#include "rdzv/rdzv_kv.h"

int rdzv_kv_store_connect(const ddprun_opts_t *o, int64_t connect_timeout_ms, int64_t op_timeout_ms,
                          rdzv_kv_t **out);
int rdzv_kv_etcd_connect(const ddprun_opts_t *o, rdzv_lease_t *lease, int64_t connect_timeout_ms,
                         int64_t op_timeout_ms, rdzv_kv_t **out);

#endif
