/* store_cmd: `ddprun store`, the standalone store server: options, secret, signals, the loop.
 * Runs until SIGTERM/SIGINT, then closes every connection and exits 0. Owns nothing that the
 * agent's embedded store needs: that one calls store_server_start on its own loop. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "commands.h"
#include "ddp_error.h"
#include "endpoint.h"
#include "log.h"
#include "store/store_server.h"

static const char store_usage[] =
    "usage: ddprun store [--host H] [--port P] [--secret-file F] [options]\n"
    "\n"
    "Run a TCPStore-protocol key/value store (PyTorch's c10d TCPStore wire protocol, current and\n"
    "legacy numbering) until SIGTERM or SIGINT.\n"
    "\n"
    "  --host H                  address to bind (default: this host's name resolved; give\n"
    "                            0.0.0.0 or :: to listen on every interface)\n"
    "  --port P                  port (default 29400; 0 picks a free one)\n"
    "  --port-file F             write the bound port to F once listening\n"
    "  --secret-file F           require ddprun's HMAC challenge with the secret in F\n"
    "                            (also --store-secret-file, $DDPRUN_STORE_SECRET_FILE,\n"
    "                            $DDPRUN_STORE_SECRET); PyTorch's own clients cannot then connect\n"
    "  --max-key-bytes N         (8192)       --max-value-bytes N        (8388608)\n"
    "  --max-keys-per-op N       (16384)      --max-frame-bytes N        (67108864)\n"
    "  --max-output-bytes N      (67108864)   --max-total-buffer-bytes N (1073741824)\n"
    "  --max-store-bytes N       (2147483648) --max-connections N        (16384)\n"
    "  --max-connections-per-peer N (4096)\n"
    "  --frame-timeout-ms N      (30000)      --validate-timeout-ms N    (10000)\n"
    "  --log-level L             debug, info, warn or error (default info)\n"
    "  -h, --help                this text\n";

enum {
    OPT_HOST = 256,
    OPT_PORT,
    OPT_PORT_FILE,
    OPT_SECRET_FILE,
    OPT_LOG_LEVEL,
    OPT_MAX_KEY,
    OPT_MAX_VALUE,
    OPT_MAX_KEYS_OP,
    OPT_MAX_FRAME,
    OPT_MAX_OUTPUT,
    OPT_MAX_TOTAL,
    OPT_MAX_STORE,
    OPT_MAX_CONNS,
    OPT_MAX_CONNS_PEER,
    OPT_FRAME_TIMEOUT,
    OPT_VALIDATE_TIMEOUT,
};

static const struct option store_options[] = {
    {"host", required_argument, NULL, OPT_HOST},
    {"port", required_argument, NULL, OPT_PORT},
    {"port-file", required_argument, NULL, OPT_PORT_FILE},
    {"secret-file", required_argument, NULL, OPT_SECRET_FILE},
    {"store-secret-file", required_argument, NULL, OPT_SECRET_FILE},
    {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
    {"max-key-bytes", required_argument, NULL, OPT_MAX_KEY},
    {"max-value-bytes", required_argument, NULL, OPT_MAX_VALUE},
    {"max-keys-per-op", required_argument, NULL, OPT_MAX_KEYS_OP},
    {"max-frame-bytes", required_argument, NULL, OPT_MAX_FRAME},
    {"max-output-bytes", required_argument, NULL, OPT_MAX_OUTPUT},
    {"max-total-buffer-bytes", required_argument, NULL, OPT_MAX_TOTAL},
    {"max-store-bytes", required_argument, NULL, OPT_MAX_STORE},
    {"max-connections", required_argument, NULL, OPT_MAX_CONNS},
    {"max-connections-per-peer", required_argument, NULL, OPT_MAX_CONNS_PEER},
    {"frame-timeout-ms", required_argument, NULL, OPT_FRAME_TIMEOUT},
    {"validate-timeout-ms", required_argument, NULL, OPT_VALIDATE_TIMEOUT},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ddprun store: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see ddprun store --help)\n");
    va_end(ap);
    return 2;
}

/* A numeric option into a field of the limits, range-checked. */
static int set_limit(const char *name, const char *text, uint64_t min, uint64_t max, void *field,
                     size_t field_size) {
    uint64_t v;
    if (parse_u64(text, min, max, &v) < 0) {
        fprintf(stderr, "ddprun store: --%s: '%s' is not a whole number in [%llu, %llu]\n", name,
                text, (unsigned long long)min, (unsigned long long)max);
        return 2;
    }
    if (field_size == sizeof(uint64_t))
        *(uint64_t *)field = v;
    else
        *(uint32_t *)field = (uint32_t)v;
    return 0;
}

static void default_host(char *out, size_t len) {
    /* The advertised host, as torchrun's c10d backend uses: this machine's name. */
    if (gethostname(out, len) != 0 || out[0] == '\0') snprintf(out, len, "127.0.0.1");
    out[len - 1] = '\0';
}

static int write_port_file(const char *path, uint16_t port) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -errno;
    fprintf(f, "%u\n", port);
    if (fclose(f) != 0) return -errno;
    if (rename(tmp, path) != 0) return -errno;
    return 0;
}

static void raise_fd_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

typedef struct {
    uv_signal_t term, intr;
    store_server_t *srv;
} stop_signals_t;

static void on_signal(uv_signal_t *h, int signum) {
    stop_signals_t *sg = h->data;
    if (uv_is_closing((uv_handle_t *)&sg->term)) return;
    store_server_stats_t st;
    store_server_stats(sg->srv, &st);
    LOG_INFO("store: %s received: stopping (%llu requests served, %llu clients dropped)",
             strsignal(signum), (unsigned long long)st.n_requests,
             (unsigned long long)st.n_dropped);
    store_server_stop(sg->srv, NULL, NULL);
    uv_close((uv_handle_t *)&sg->term, NULL);
    uv_close((uv_handle_t *)&sg->intr, NULL);
}

int store_cmd_main(int argc, char **argv) {
    store_server_opts_t opts = {0};
    store_limits_default(&opts.limits);
    store_limits_t *lim = &opts.limits;
    char host[256] = "";
    const char *port_file = NULL, *secret_file = NULL;
    uint64_t port = DDP_DEFAULT_STORE_PORT;
    int opt, rc = 0;
    optind = 1;
    opterr = 0;
    while ((opt = getopt_long(argc, argv, ":h", store_options, NULL)) != -1) {
        const char *name = optind > 0 && optind <= argc ? argv[optind - 1] : "";
        switch (opt) {
        case 'h':
            fputs(store_usage, stdout);
            return 0;
        case OPT_HOST:
            snprintf(host, sizeof host, "%s", optarg);
            break;
        case OPT_PORT:
            if (parse_u64(optarg, 0, 65535, &port) < 0)
                return usage_error("--port: '%s' is not a port number (0-65535)", optarg);
            break;
        case OPT_PORT_FILE:
            port_file = optarg;
            break;
        case OPT_SECRET_FILE:
            secret_file = optarg;
            break;
        case OPT_LOG_LEVEL: {
            int level = log_level_parse(optarg);
            if (level < 0)
                return usage_error("--log-level: '%s' is not one of debug, info, warn, error",
                                   optarg);
            log_init("ddprun", (log_level_t)level);
            break;
        }
        case OPT_MAX_KEY:
            rc = set_limit("max-key-bytes", optarg, 1, 1u << 24, &lim->max_key_bytes, 8);
            break;
        case OPT_MAX_VALUE:
            rc = set_limit("max-value-bytes", optarg, 1, 1u << 30, &lim->max_value_bytes, 8);
            break;
        case OPT_MAX_KEYS_OP:
            rc = set_limit("max-keys-per-op", optarg, 1, 1u << 24, &lim->max_keys_per_op, 8);
            break;
        case OPT_MAX_FRAME:
            rc = set_limit("max-frame-bytes", optarg, 64, 0x7fffffffu /* frame lengths are int */,
                           &lim->max_frame_bytes, 8);
            break;
        case OPT_MAX_OUTPUT:
            rc = set_limit("max-output-bytes", optarg, 64, 0x7fffffffu, &lim->max_output_bytes, 8);
            break;
        case OPT_MAX_TOTAL:
            rc = set_limit("max-total-buffer-bytes", optarg, 4096, 1ull << 40,
                           &lim->max_total_buffer_bytes, 8);
            break;
        case OPT_MAX_STORE:
            rc = set_limit("max-store-bytes", optarg, 4096, 1ull << 42, &lim->max_store_bytes, 8);
            break;
        case OPT_MAX_CONNS:
            rc = set_limit("max-connections", optarg, 1, 1u << 24, &lim->max_connections, 4);
            break;
        case OPT_MAX_CONNS_PEER:
            rc = set_limit("max-connections-per-peer", optarg, 1, 1u << 24,
                           &lim->max_connections_per_peer, 4);
            break;
        case OPT_FRAME_TIMEOUT:
            rc = set_limit("frame-timeout-ms", optarg, 1, 86400000, &lim->frame_timeout_ms, 4);
            break;
        case OPT_VALIDATE_TIMEOUT:
            rc =
                set_limit("validate-timeout-ms", optarg, 1, 86400000, &lim->validate_timeout_ms, 4);
            break;
        case ':':
            return usage_error("option %s needs a value", name);
        default:
            return usage_error("unknown option %s", name);
        }
        if (rc) return rc;
    }
    if (optind < argc) return usage_error("unexpected argument '%s'", argv[optind]);
    if (lim->max_frame_bytes < lim->max_key_bytes + lim->max_value_bytes + 32)
        return usage_error("--max-frame-bytes must hold one key and one value "
                           "(max-key-bytes + max-value-bytes + 32)");

    char err[512];
    if (store_auth_init() < 0) {
        LOG_ERROR("store: libsodium failed to initialise");
        return 1;
    }
    int src = store_secret_load(secret_file, &opts.secret, err, sizeof err);
    if (src < 0) {
        fprintf(stderr, "ddprun store: %s\n", err);
        return 2;
    }
    if (!host[0]) default_host(host, sizeof host);
    opts.host = host;
    opts.port = (uint16_t)port;
    raise_fd_limit();
    signal(SIGPIPE, SIG_IGN);

    uv_loop_t *loop = uv_default_loop();
    store_server_t *srv;
    rc = store_server_start(loop, &opts, &srv, err, sizeof err);
    if (rc < 0) {
        fprintf(stderr, "ddprun store: %s\n", err);
        return 1;
    }
    LOG_INFO("store: listening on %s port %u%s", host, store_server_port(srv),
             opts.secret.is_set ? " (shared secret required)" : "");
    if (port_file && (rc = write_port_file(port_file, store_server_port(srv))) < 0) {
        fprintf(stderr, "ddprun store: cannot write --port-file %s: %s\n", port_file,
                strerror(-rc));
        store_server_stop(srv, NULL, NULL);
        uv_run(loop, UV_RUN_DEFAULT);
        return 1;
    }
    stop_signals_t sg = {.srv = srv};
    uv_signal_init(loop, &sg.term);
    uv_signal_init(loop, &sg.intr);
    sg.term.data = sg.intr.data = &sg;
    uv_signal_start(&sg.term, on_signal, SIGTERM);
    uv_signal_start(&sg.intr, on_signal, SIGINT);
    uv_run(loop, UV_RUN_DEFAULT);
    uv_loop_close(loop);
    return 0;
}
