/* etcd_kv_probe: one agent's etcd kv (launcher/etcd/rdzv_kv_etcd.c) driven step by step from
 * stdin, for tests/e2e/test_etcd_kv.py: a join's ticket with its look at the round's closed key,
 * then the GET of closed and of a rank record written after it, each after the test says "go"
 * (one line), so that the test can change etcd in between (compact its history).
 *
 *   etcd_kv_probe ENDPOINTS PREFIX
 *   etcd_kv_probe ENDPOINTS KEY add DELTA     (one ADD, as a lost node's refund makes)
 *
 * Prints "ticket I", "closed VALUE", "rank VALUE" as each step ends (or "add RESULT"); exit 0, or
 * 1 with the kv's error on stderr. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "rdzv/rdzv_kv.h"

static int go(void) {
    char line[64];
    return fgets(line, sizeof line, stdin) ? 0 : -1;
}

static int print_get(rdzv_kv_t *kv, const char *name, const char *k) {
    uint8_t *v;
    size_t n;
    int rc = kv->ops->get(kv, k, &v, &n);
    if (rc < 0) return rc;
    printf("%s %.*s\n", name, (int)n, (const char *)v);
    fflush(stdout);
    free(v);
    return 0;
}

static int add(rdzv_kv_t *kv, const char *key, const char *delta) {
    int64_t result;
    int rc = kv->ops->add(kv, key, strtoll(delta, NULL, 10), &result);
    if (rc == 0) printf("add %lld\n", (long long)result);
    return rc;
}

int main(int argc, char **argv) {
    bool is_add = argc == 5 && strcmp(argv[3], "add") == 0;
    if (argc != 3 && !is_add) {
        fprintf(stderr, "usage: etcd_kv_probe ENDPOINTS PREFIX | ENDPOINTS KEY add DELTA\n");
        return 2;
    }
    static ddprun_opts_t o;
    snprintf(o.rdzv_backend, sizeof o.rdzv_backend, "etcd");
    snprintf(o.rdzv_endpoints, sizeof o.rdzv_endpoints, "%s", argv[1]);
    o.lease_ttl_s = 30;
    char joined[256], closed[256], rank[256];
    snprintf(joined, sizeof joined, "%s/joined", argv[2]);
    snprintf(closed, sizeof closed, "%s/closed", argv[2]);
    snprintf(rank, sizeof rank, "%s/rank/0", argv[2]);
    rdzv_lease_t *lease = rdzv_lease_new(30);
    rdzv_kv_t *kv = NULL;
    int64_t ticket = -1;
    int rc = rdzv_kv_connect(&o, lease, 10000, 20000, &kv);
    if (rc == 0 && is_add) {
        rc = add(kv, argv[2], argv[4]);
    } else if (rc == 0) {
        if ((rc = kv->ops->take_ticket(kv, joined, closed, &ticket)) == 0) {
            printf("ticket %lld\n", (long long)ticket);
            fflush(stdout);
        }
        if (rc == 0 && (rc = go()) == 0) rc = print_get(kv, "closed", closed);
        if (rc == 0) kv->ops->expect_absent(kv, rank, kv->ops->read_revision(kv, closed));
        if (rc == 0 && (rc = go()) == 0) rc = print_get(kv, "rank", rank);
    }
    if (rc < 0) fprintf(stderr, "etcd_kv_probe: %s\n", kv ? kv->ops->error(kv) : "no kv");
    rdzv_kv_destroy(kv);
    rdzv_lease_free(lease);
    return rc < 0 ? 1 : 0;
}
