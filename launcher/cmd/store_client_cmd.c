/* store_client_cmd: `ddprun store-client`, one store operation from the shell through the blocking
 * client (common/store_client.c): for scripts, operators and the interop tests. Values are
 * printed raw, one per line; errors go to stderr with the store's address. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "ddp_error.h"
#include "endpoint.h"
#include "store_client.h"

static const char cli_usage[] =
    "usage: ddprun store-client [--endpoint HOST[:PORT]] [options] OP [ARGS]\n"
    "\n"
    "  --endpoint E           the store (default 127.0.0.1:29400; IPv6 as [addr]:port)\n"
    "  --legacy               speak the legacy numbering (torch <= 2.1 servers)\n"
    "  --secret-file F        authenticate with the secret in F (or $DDPRUN_STORE_SECRET[_FILE])\n"
    "  --timeout MS           bound of the operation, WAIT included (default 30000)\n"
    "  --connect-timeout MS   keep retrying the connection this long (default 10000)\n"
    "  --max-value-bytes N    the store's value limit: longer values are refused before sending\n"
    "                         (default 8388608, as ddprun's and PyTorch's stores)\n"
    "\n"
    "operations:\n"
    "  set K V | get K | add K N | compare-set K EXPECTED DESIRED | append K V\n"
    "  check K... | wait K... | num-keys | delete K | multi-get K... | multi-set K V [K V]...\n"
    "  ping | queue-push K V | queue-pop K | queue-len K | list-keys | barrier K WORLD_SIZE\n"
    "  (the operations of this last line are not part of the --legacy numbering)\n"
    "\n"
    "exit status: 0 done, 1 the operation failed (message on stderr), 2 usage error;\n"
    "check prints 1 (all keys present) or 0.\n";

static const struct option cli_options[] = {
    {"endpoint", required_argument, NULL, 'e'},
    {"legacy", no_argument, NULL, 'l'},
    {"secret-file", required_argument, NULL, 's'},
    {"store-secret-file", required_argument, NULL, 's'},
    {"timeout", required_argument, NULL, 't'},
    {"connect-timeout", required_argument, NULL, 'c'},
    {"max-value-bytes", required_argument, NULL, 'm'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

typedef struct {
    const char *name;
    int min_args, max_args; /* -1: any number */
    bool is_current_only;   /* absent from the legacy numbering */
} cli_op_t;

static const cli_op_t cli_ops[] = {
    {"set", 2, 2, false},         {"get", 1, 1, false},        {"add", 2, 2, false},
    {"compare-set", 3, 3, false}, {"append", 2, 2, false},     {"check", 1, -1, false},
    {"wait", 1, -1, false},       {"num-keys", 0, 0, false},   {"delete", 1, 1, false},
    {"multi-get", 1, -1, false},  {"multi-set", 2, -1, false}, {"ping", 0, 0, true},
    {"queue-push", 2, 2, true},   {"queue-pop", 1, 1, true},   {"queue-len", 1, 1, true},
    {"list-keys", 0, 0, true},    {"barrier", 2, 2, true},
};

static int usage_error(const char *what, const char *arg) {
    fprintf(stderr, "ddprun store-client: %s%s (see ddprun store-client --help)\n", what, arg);
    return 2;
}

/* A whole decimal int64 argument (add's delta, barrier's world size). */
static bool parse_i64(const char *text, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (*text == '\0' || *end != '\0' || errno == ERANGE) return false;
    *out = v;
    return true;
}

static void print_value(const uint8_t *v, size_t n) {
    fwrite(v, 1, n, stdout);
    fputc('\n', stdout);
}

/* SET, APPEND, MULTI_SET and QUEUE_PUSH have no reply: a store that dropped the connection (a
 * value over its limit) or ignored the request (an op an old server lacks) would look like
 * success. A request that has a reply, on the same connection, proves the write was taken: PING
 * where the numbering has it, else CHECK of the written keys, which must then exist. */
static int confirm_write(store_client_t *c, bool is_legacy, const char *const *keys, size_t n) {
    if (!is_legacy) return store_client_ping(c, NULL);
    bool is_there = false;
    int rc = store_client_check(c, keys, n, &is_there);
    if (rc == 0 && !is_there) {
        fprintf(stderr, "ddprun store-client: the store took the request but did not store it: an "
                        "old server (torch < 2.0) lacks this operation\n");
        return -ENOTSUP;
    }
    return rc;
}

static int run_op(store_client_t *c, bool is_legacy, const char *op, char **a, int n) {
    uint8_t *v = NULL;
    size_t vn = 0;
    int64_t i64 = 0;
    bool flag = false;
    int rc;
    const char *const *keys = (const char *const *)a;
    if (strcmp(op, "set") == 0 || strcmp(op, "append") == 0 || strcmp(op, "queue-push") == 0) {
        if (op[0] == 's')
            rc = store_client_set(c, a[0], a[1], strlen(a[1]));
        else if (op[0] == 'a')
            rc = store_client_append(c, a[0], a[1], strlen(a[1]));
        else
            rc = store_client_queue_push(c, a[0], a[1], strlen(a[1]));
        return rc < 0 ? rc : confirm_write(c, is_legacy, keys, 1);
    }
    if (strcmp(op, "wait") == 0) return store_client_wait(c, keys, (size_t)n, -1);
    if (strcmp(op, "ping") == 0) {
        uint64_t rtt;
        if ((rc = store_client_ping(c, &rtt)) == 0)
            printf("pong %llu us\n", (unsigned long long)rtt);
        return rc;
    }
    if (strcmp(op, "get") == 0 || strcmp(op, "queue-pop") == 0 || strcmp(op, "compare-set") == 0) {
        if (op[0] == 'g')
            rc = store_client_get(c, a[0], &v, &vn);
        else if (op[0] == 'q')
            rc = store_client_queue_pop(c, a[0], -1, &v, &vn);
        else
            rc = store_client_compare_set(c, a[0], a[1], strlen(a[1]), a[2], strlen(a[2]), &v, &vn);
        if (rc == 0) print_value(v, vn);
        free(v);
        return rc;
    }
    if (strcmp(op, "list-keys") == 0) {
        char **list = NULL;
        size_t count = 0;
        if ((rc = store_client_list_keys(c, &list, &count)) < 0) return rc;
        for (size_t i = 0; i < count; i++) {
            puts(list[i]);
            free(list[i]);
        }
        free(list);
        return 0;
    }
    if (strcmp(op, "add") == 0 || strcmp(op, "barrier") == 0) {
        int64_t delta = 0;
        parse_i64(a[1], &delta); /* checked by store_client_cmd_main before connecting */
        if (op[0] == 'b') return store_client_barrier(c, a[0], delta, -1);
        rc = store_client_add(c, a[0], delta, &i64);
    } else if (strcmp(op, "num-keys") == 0) {
        rc = store_client_num_keys(c, &i64);
    } else if (strcmp(op, "queue-len") == 0) {
        rc = store_client_queue_len(c, a[0], &i64);
    } else if (strcmp(op, "delete") == 0) {
        rc = store_client_delete_key(c, a[0], &flag);
        i64 = flag;
    } else if (strcmp(op, "check") == 0) {
        rc = store_client_check(c, keys, (size_t)n, &flag);
        i64 = flag;
    } else if (strcmp(op, "multi-get") == 0) {
        uint8_t **vals = calloc((size_t)n, sizeof *vals);
        size_t *lens = calloc((size_t)n, sizeof *lens);
        rc = vals && lens ? store_client_multi_get(c, keys, (size_t)n, vals, lens) : -ENOMEM;
        for (int i = 0; rc == 0 && i < n; i++)
            print_value(vals[i], lens[i]);
        for (int i = 0; rc == 0 && i < n; i++)
            free(vals[i]);
        free(vals);
        free(lens);
        return rc;
    } else { /* multi-set: pairs checked by store_client_cmd_main */
        size_t pairs = (size_t)n / 2;
        const char **ks = calloc(pairs, sizeof *ks);
        const void **vs = calloc(pairs, sizeof *vs);
        size_t *ls = calloc(pairs, sizeof *ls);
        rc = -ENOMEM;
        if (ks && vs && ls) {
            for (size_t i = 0; i < pairs; i++) {
                ks[i] = a[2 * i];
                vs[i] = a[2 * i + 1];
                ls[i] = strlen(a[2 * i + 1]);
            }
            rc = store_client_multi_set(c, ks, vs, ls, pairs);
            if (rc == 0) rc = confirm_write(c, is_legacy, ks, pairs);
        }
        free(ks);
        free(vs);
        free(ls);
        return rc;
    }
    if (rc == 0) printf("%lld\n", (long long)i64);
    return rc;
}

int store_client_cmd_main(int argc, char **argv) {
    store_client_opts_t opts = {.host = "127.0.0.1",
                                .port = DDP_DEFAULT_STORE_PORT,
                                .connect_timeout_ms = 10000,
                                .op_timeout_ms = 30000};
    char host[256], err[512];
    const char *secret_file = NULL;
    uint64_t v;
    int opt;
    optind = 1;
    opterr = 0;
    while ((opt = getopt_long(argc, argv, "+:h", cli_options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            fputs(cli_usage, stdout);
            return 0;
        case 'e':
            if (endpoint_parse(optarg, DDP_DEFAULT_STORE_PORT, host, sizeof host, &opts.port, err,
                               sizeof err) < 0)
                return usage_error(err, "");
            opts.host = host;
            break;
        case 'l':
            opts.dialect = STORE_DIALECT_LEGACY;
            break;
        case 's':
            secret_file = optarg;
            break;
        case 't':
        case 'c':
            if (parse_u64(optarg, 1, 86400000, &v) < 0)
                return usage_error("timeouts are milliseconds in [1, 86400000], not ", optarg);
            *(opt == 't' ? &opts.op_timeout_ms : &opts.connect_timeout_ms) = (int64_t)v;
            break;
        case 'm':
            if (parse_u64(optarg, 1, (uint64_t)1 << 40, &v) < 0)
                return usage_error("--max-value-bytes is a byte count >= 1, not ", optarg);
            opts.max_value_bytes = (size_t)v;
            break;
        case ':':
            return usage_error("missing value for ", argv[optind - 1]);
        default:
            return usage_error("unknown option ", argv[optind - 1]);
        }
    }
    if (optind >= argc) return usage_error("no operation given", "");
    const char *op = argv[optind];
    int n_args = argc - optind - 1;
    const cli_op_t *spec = NULL;
    for (size_t i = 0; i < sizeof cli_ops / sizeof cli_ops[0]; i++)
        if (strcmp(cli_ops[i].name, op) == 0) spec = &cli_ops[i];
    if (!spec) return usage_error("unknown operation ", op);
    if (n_args < spec->min_args || (spec->max_args >= 0 && n_args > spec->max_args))
        return usage_error("wrong number of arguments for ", op);
    /* queue-pop would otherwise WAIT its whole timeout before finding QUEUE_POP missing. */
    if (spec->is_current_only && opts.dialect == STORE_DIALECT_LEGACY)
        return usage_error(op, " is not part of the legacy protocol numbering; drop --legacy");
    /* Every usage error is found before connecting: a store that is down must not hide it. */
    char **args = argv + optind + 1;
    int64_t number;
    if ((strcmp(op, "add") == 0 || strcmp(op, "barrier") == 0) && !parse_i64(args[1], &number))
        return usage_error("not a 64-bit integer: ", args[1]);
    if (strcmp(op, "multi-set") == 0 && n_args % 2)
        return usage_error("multi-set needs key/value pairs", "");
    /* the legacy numbering has no authentication: the secret would go unproved and a store that
     * requires it would only close the connection */
    if (secret_file && opts.dialect == STORE_DIALECT_LEGACY)
        return usage_error("--secret-file: the legacy numbering (torch <= 2.1) has no "
                           "authentication; drop --legacy or --secret-file",
                           "");

    store_secret_t secret = {0};
    if (store_auth_init() < 0) return usage_error("libsodium failed to initialise", "");
    int rc = store_secret_load(secret_file, &secret, err, sizeof err);
    if (rc < 0) return usage_error(err, "");
    opts.secret = &secret;

    store_client_t *c = NULL;
    rc = store_client_connect(&opts, &c);
    if (rc == 0) rc = run_op(c, opts.dialect == STORE_DIALECT_LEGACY, op, args, n_args);
    /* what was read is only delivered once stdout took it (a full disk, a closed pipe) */
    if (rc == 0 && (fflush(stdout) != 0 || ferror(stdout))) {
        fprintf(stderr, "ddprun store-client: store %s:%u: %s: writing the output failed: %s\n",
                opts.host, opts.port, op, strerror(errno));
        store_client_destroy(c);
        return 1;
    }
    const char *msg = c ? store_client_error(c) : "";
    if (rc < 0 && msg[0])
        fprintf(stderr, "ddprun store-client: %s\n", msg);
    else if (rc == DDP_ETIMEOUT) /* a timeout the client did not word */
        fprintf(stderr, "ddprun store-client: store %s:%u: %s timed out after %lld ms\n", opts.host,
                opts.port, op, (long long)opts.op_timeout_ms);
    else if (rc < 0)
        fprintf(stderr, "ddprun store-client: store %s:%u: %s failed: %s\n", opts.host, opts.port,
                op, ddp_strerror(rc));
    store_client_destroy(c);
    return rc == 0 ? 0 : rc == 2 ? 2 : 1;
}
