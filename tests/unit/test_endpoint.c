/* Unit tests of common/endpoint: host[:port] parsing (IPv4, names, bracketed and bare IPv6, the
 * default port), every rejected form with its message, and strict number parsing. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "endpoint.h"

static int parse(const char *text, char *host, uint16_t *port) {
    char err[256] = "";
    int rc = endpoint_parse(text, DDP_DEFAULT_STORE_PORT, host, 256, port, err, sizeof err);
    if (rc == 0) cr_assert_str_empty(err, "a message on success: %s", err);
    return rc;
}

Test(endpoint, host_and_port_forms) {
    const struct {
        const char *text, *host;
        uint16_t port;
    } ok[] = {
        {"master:1234", "master", 1234},
        {"10.0.0.1:29500", "10.0.0.1", 29500},
        {"10.0.0.1", "10.0.0.1", DDP_DEFAULT_STORE_PORT},
        {"node-7.cluster.local", "node-7.cluster.local", DDP_DEFAULT_STORE_PORT},
        {"[::1]:29400", "::1", 29400},
        {"[::1]:29500", "::1", 29500},
        {"[fe80::1]", "fe80::1", DDP_DEFAULT_STORE_PORT},
        {"[2001:db8::2]:1", "2001:db8::2", 1},
        {"::1", "::1", DDP_DEFAULT_STORE_PORT},
        {"fe80::2", "fe80::2", DDP_DEFAULT_STORE_PORT},
        {"h:0", "h", 0},
        {"h:65535", "h", 65535},
        {"h:00080", "h", 80},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char host[256];
        uint16_t port = 7;
        cr_assert_eq(parse(ok[i].text, host, &port), 0, "'%s' refused", ok[i].text);
        cr_assert_str_eq(host, ok[i].host, "'%s'", ok[i].text);
        cr_assert_eq(port, ok[i].port, "'%s': port %u", ok[i].text, port);
    }
}

Test(endpoint, default_port_is_the_callers) {
    char host[256], err[64];
    uint16_t port;
    cr_assert_eq(endpoint_parse("h", 1234, host, sizeof host, &port, err, sizeof err), 0);
    cr_assert_eq(port, 1234);
    cr_assert_eq(endpoint_parse("[::1]", 4321, host, sizeof host, &port, err, sizeof err), 0);
    cr_assert_eq(port, 4321);
}

Test(endpoint, bad_endpoints_say_what) {
    char host[256], err[256];
    uint16_t port;
    const struct {
        const char *text, *says; /* the message quotes this */
    } bad[] = {
        {"", "empty"},        {":80", "host"},      {"h:70000", "70000"}, {"h:65536", "65536"},
        {"h:abc", "abc"},     {"h:", "port"},       {"h:-1", "-1"},       {"h:+80", "+80"},
        {"h: 80", "port"},    {"h:80x", "80x"},     {"[::1", "[ipv6]"},   {"[]:1", "[ipv6]"},
        {"[]", "[ipv6]"},     {"[::1]x", "[ipv6]"}, {"[::1]:", "port"},   {"[::1]:70000", "70000"},
        {"[::1]:abc", "abc"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        strcpy(err, "");
        cr_assert_eq(endpoint_parse(bad[i].text, 29400, host, sizeof host, &port, err, sizeof err),
                     -EINVAL, "'%s' accepted", bad[i].text);
        cr_assert(strstr(err, bad[i].says), "'%s': message '%s' does not mention '%s'", bad[i].text,
                  err, bad[i].says);
    }
    cr_assert_eq(endpoint_parse(NULL, 1, host, sizeof host, &port, err, sizeof err), -EINVAL);
}

Test(endpoint, host_buffer_bound) {
    char tiny[5], err[128];
    uint16_t port;
    cr_assert_eq(endpoint_parse("abcd:1", 1, tiny, sizeof tiny, &port, err, sizeof err), 0);
    cr_assert_str_eq(tiny, "abcd");
    cr_assert_eq(endpoint_parse("abcde:1", 1, tiny, sizeof tiny, &port, err, sizeof err), -EINVAL,
                 "a host that does not fit is refused, not cut");
    cr_assert(strstr(err, "abcde"), "%s", err);
}

Test(endpoint, strict_numbers) {
    uint64_t v = 0;
    cr_assert_eq(parse_u64("42", 0, 100, &v), 0);
    cr_assert_eq(v, 42);
    cr_assert_eq(parse_u64("0", 0, 100, &v), 0);
    cr_assert_eq(v, 0);
    cr_assert_eq(parse_u64("100", 0, 100, &v), 0, "max is inclusive");
    cr_assert_eq(parse_u64("5", 5, 100, &v), 0, "min is inclusive");
    cr_assert_eq(parse_u64("4", 5, 100, &v), -ERANGE);
    cr_assert_eq(parse_u64("101", 0, 100, &v), -ERANGE);
    cr_assert_eq(parse_u64("18446744073709551615", 0, UINT64_MAX, &v), 0);
    cr_assert_eq(v, UINT64_MAX);
    cr_assert_eq(parse_u64("18446744073709551616", 0, UINT64_MAX, &v), -ERANGE);
    cr_assert_eq(parse_u64("99999999999999999999999", 0, UINT64_MAX, &v), -ERANGE);
    v = 7;
    const char *bad[] = {"4x", "-1", " 1", "1 ", "", "+1", "0x10", "1e3", "abc"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(parse_u64(bad[i], 0, UINT64_MAX, &v), -EINVAL, "'%s'", bad[i]);
    cr_assert_eq(parse_u64(NULL, 0, 1, &v), -EINVAL);
    cr_assert_eq(v, 7, "a refused number leaves the output alone");
}
