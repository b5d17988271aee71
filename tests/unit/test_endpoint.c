/* Unit tests of common/endpoint: host[:port] parsing (IPv4, names, IPv6) and strict numbers. */
#include <criterion/criterion.h>
#include <errno.h>

#include "endpoint.h"

static int parse(const char *text, char *host, uint16_t *port) {
    char err[256];
    return endpoint_parse(text, 29400, host, 256, port, err, sizeof err);
}

Test(endpoint, host_and_port_forms) {
    char host[256];
    uint16_t port;
    cr_assert_eq(parse("master:1234", host, &port), 0);
    cr_assert_str_eq(host, "master");
    cr_assert_eq(port, 1234);
    cr_assert_eq(parse("10.0.0.1", host, &port), 0);
    cr_assert_str_eq(host, "10.0.0.1");
    cr_assert_eq(port, 29400);
    cr_assert_eq(parse("[::1]:29500", host, &port), 0);
    cr_assert_str_eq(host, "::1");
    cr_assert_eq(port, 29500);
    cr_assert_eq(parse("[fe80::1]", host, &port), 0);
    cr_assert_str_eq(host, "fe80::1");
    cr_assert_eq(port, 29400);
    cr_assert_eq(parse("fe80::2", host, &port), 0);
    cr_assert_str_eq(host, "fe80::2");
    cr_assert_eq(parse("h:0", host, &port), 0);
    cr_assert_eq(port, 0);
}

Test(endpoint, bad_endpoints_say_what) {
    char host[256], err[256];
    uint16_t port;
    const char *bad[] = {"", ":80", "h:70000", "h:abc", "h:", "[::1", "[]:1", "[::1]x", "h:-1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        cr_assert_eq(endpoint_parse(bad[i], 29400, host, sizeof host, &port, err, sizeof err),
                     -EINVAL, "'%s' accepted", bad[i]);
        cr_assert_neq(err[0], '\0', "no message for '%s'", bad[i]);
    }
    char tiny[4];
    cr_assert_eq(endpoint_parse("longhost:1", 1, tiny, sizeof tiny, &port, err, sizeof err), -EINVAL);
}

Test(endpoint, strict_numbers) {
    uint64_t v;
    cr_assert_eq(parse_u64("42", 0, 100, &v), 0);
    cr_assert_eq(v, 42);
    cr_assert_eq(parse_u64("101", 0, 100, &v), -ERANGE);
    cr_assert_eq(parse_u64("4x", 0, 100, &v), -EINVAL);
    cr_assert_eq(parse_u64("-1", 0, 100, &v), -EINVAL);
    cr_assert_eq(parse_u64(" 1", 0, 100, &v), -EINVAL);
    cr_assert_eq(parse_u64("", 0, 100, &v), -EINVAL);
    cr_assert_eq(parse_u64("99999999999999999999999", 0, UINT64_MAX, &v), -ERANGE);
}
