/* Unit tests of proto/spare_handoff: the message that hands a warm spare its round. The header
 * round-trips; a wrong magic, version, descriptor count or an over-limit length is refused; the
 * environment block is accepted only as NUL-ended KEY=VALUE entries, and errors name the offset. */
#include <criterion/criterion.h>
#include <string.h>

#include "spare_handoff.h"

Test(spare_handoff, header_round_trips) {
    uint8_t h[DDP_SPARE_HEADER_BYTES];
    spare_handoff_header_encode(h, 1234);
    uint32_t bytes = 0;
    char err[256];
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), 0, "%s", err);
    cr_assert_eq(bytes, 1234);
    /* little-endian on the wire whatever the host */
    cr_assert_eq(h[0], 0x53); /* 'S' */
    cr_assert_eq(h[8], 1234 & 0xff);
    cr_assert_eq(h[9], 1234 >> 8);
}

Test(spare_handoff, foreign_headers_are_refused) {
    uint8_t h[DDP_SPARE_HEADER_BYTES];
    uint32_t bytes = 7;
    char err[256];
    spare_handoff_header_encode(h, 10);
    h[0] ^= 1;
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), -1);
    cr_assert(strstr(err, "magic"), "%s", err);
    spare_handoff_header_encode(h, 10);
    h[4] = 2; /* version 2 */
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), -1);
    cr_assert(strstr(err, "version 2"), "%s", err);
    spare_handoff_header_encode(h, 10);
    h[12] = 3; /* three descriptors */
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), -1);
    cr_assert(strstr(err, "3 descriptors"), "%s", err);
    cr_assert_eq(bytes, 7, "a refused header leaves the length alone");
}

Test(spare_handoff, lengths_over_the_limit_are_refused_before_anything_is_read) {
    uint8_t h[DDP_SPARE_HEADER_BYTES];
    uint32_t bytes;
    char err[256];
    spare_handoff_header_encode(h, DDP_SPARE_ENV_MAX_BYTES);
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), 0);
    spare_handoff_header_encode(h, DDP_SPARE_ENV_MAX_BYTES + 1);
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), -1);
    cr_assert(strstr(err, "over the limit"), "%s", err);
    spare_handoff_header_encode(h, UINT32_MAX);
    cr_assert_eq(spare_handoff_header_decode(h, &bytes, err, sizeof err), -1);
}

Test(spare_handoff, environment_blocks) {
    char err[256];
    static const char good[] = "RANK=3\0WORLD_SIZE=8\0EMPTY=\0A=b=c";
    cr_assert_eq(spare_handoff_env_check(good, sizeof good, err, sizeof err), 4, "%s", err);
    cr_assert_eq(spare_handoff_env_check("", 0, err, sizeof err), 0);
    static const char unterminated[] = {'R', 'A', 'N', 'K', '=', '1'};
    cr_assert_eq(spare_handoff_env_check(unterminated, sizeof unterminated, err, sizeof err), -1);
    cr_assert(strstr(err, "byte 0") && strstr(err, "NUL"), "%s", err);
    static const char no_equals[] = "A=1\0JUSTAWORD";
    cr_assert_eq(spare_handoff_env_check(no_equals, sizeof no_equals, err, sizeof err), -1);
    cr_assert(strstr(err, "byte 4") && strstr(err, "KEY=VALUE"), "%s", err);
    static const char empty_key[] = "=value";
    cr_assert_eq(spare_handoff_env_check(empty_key, sizeof empty_key, err, sizeof err), -1);
    static const char empty_entry[] = "A=1\0\0B=2";
    cr_assert_eq(spare_handoff_env_check(empty_entry, sizeof empty_entry, err, sizeof err), -1);
}

Test(spare_handoff, too_many_entries) {
    size_t n = DDP_SPARE_ENV_MAX_VARS + 1, len = n * 4;
    char *block = malloc(len);
    for (size_t i = 0; i < n; i++)
        memcpy(block + 4 * i, "A=1", 4);
    char err[256];
    cr_assert_eq(spare_handoff_env_check(block, len - 4, err, sizeof err), DDP_SPARE_ENV_MAX_VARS);
    cr_assert_eq(spare_handoff_env_check(block, len, err, sizeof err), -1);
    cr_assert(strstr(err, "more than"), "%s", err);
    free(block);
}
