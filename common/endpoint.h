/* endpoint: "host[:port]" text as torchrun's --rdzv-endpoint takes it, IPv6 in brackets
 * ("[::1]:29400"), plus the strict number parsing every command line here uses. Pure. */
#ifndef DDP_COMMON_ENDPOINT_H
#define DDP_COMMON_ENDPOINT_H

#include <stddef.h>
#include <stdint.h>

#define DDP_DEFAULT_STORE_PORT 29400u

/* Split text into host and port (default_port when absent). A bare IPv6 literal without brackets
 * is accepted as a host. Returns 0, or -EINVAL with a message in err. */
int endpoint_parse(const char *text, uint16_t default_port, char *host, size_t host_len,
                   uint16_t *port, char *err, size_t err_len);
/* Whole-string unsigned decimal in [min, max]; returns 0 or -EINVAL / -ERANGE. */
int parse_u64(const char *text, uint64_t min, uint64_t max, uint64_t *out);

#endif
