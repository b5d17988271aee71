/* store_auth: see store_auth.h. */
#include "store_auth.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sodium.h>

int store_auth_init(void) {
    return sodium_init() < 0 ? -EIO : 0;
}

int store_secret_from_text(const char *text, size_t len, const char *origin, store_secret_t *out,
                           char *err, size_t err_len) {
    while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' '))
        len--;
    if (len < STORE_SECRET_MIN_BYTES) {
        snprintf(err, err_len, "store secret from %s is %zu bytes; at least %u are required",
                 origin, len, STORE_SECRET_MIN_BYTES);
        return -EINVAL;
    }
    crypto_hash_sha256(out->key, (const unsigned char *)text, len);
    out->is_set = true;
    return 0;
}

int store_secret_load_file(const char *path, store_secret_t *out, char *err, size_t err_len) {
    char buf[4096];
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        snprintf(err, err_len, "cannot read store secret file %s: %s", path, strerror(e));
        return -e;
    }
    size_t n = fread(buf, 1, sizeof buf, f);
    int is_too_big = !feof(f) && !ferror(f);
    int is_error = ferror(f);
    fclose(f);
    if (is_error) {
        snprintf(err, err_len, "cannot read store secret file %s: I/O error", path);
        return -EIO;
    }
    if (is_too_big) {
        snprintf(err, err_len, "store secret file %s is larger than %zu bytes", path,
                 sizeof buf - 1);
        return -EFBIG;
    }
    int rc = store_secret_from_text(buf, n, path, out, err, err_len);
    sodium_memzero(buf, sizeof buf);
    return rc;
}

int store_secret_from_env(store_secret_t *out, char *err, size_t err_len) {
    out->is_set = false;
    const char *text = getenv(STORE_SECRET_ENV);
    if (text && *text)
        return store_secret_from_text(text, strlen(text), "$" STORE_SECRET_ENV, out, err, err_len);
    const char *path = getenv(STORE_SECRET_FILE_ENV);
    if (path && *path) return store_secret_load_file(path, out, err, err_len);
    return 0;
}

int store_secret_load(const char *path, store_secret_t *out, char *err, size_t err_len) {
    return path ? store_secret_load_file(path, out, err, err_len)
                : store_secret_from_env(out, err, err_len);
}

void store_auth_random_nonce(uint8_t nonce[STORE_AUTH_NONCE_BYTES]) {
    randombytes_buf(nonce, STORE_AUTH_NONCE_BYTES);
}

void store_auth_mac(const store_secret_t *s, const char *role, const uint8_t *server_nonce,
                    const uint8_t *client_nonce, const void *bound, size_t bound_len,
                    uint8_t mac[STORE_AUTH_MAC_BYTES]) {
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, s->key, sizeof s->key);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)role, strlen(role) + 1);
    crypto_auth_hmacsha256_update(&st, server_nonce, STORE_AUTH_NONCE_BYTES);
    crypto_auth_hmacsha256_update(&st, client_nonce, STORE_AUTH_NONCE_BYTES);
    if (bound_len) crypto_auth_hmacsha256_update(&st, bound, bound_len);
    crypto_auth_hmacsha256_final(&st, mac);
}

void store_auth_client_mac(const store_secret_t *s, const uint8_t *server_nonce,
                           const uint8_t *client_nonce, uint8_t mac[STORE_AUTH_MAC_BYTES]) {
    store_auth_mac(s, "ddprun-store-client", server_nonce, client_nonce, NULL, 0, mac);
}

void store_auth_server_mac(const store_secret_t *s, const uint8_t *server_nonce,
                           const uint8_t *client_nonce, uint8_t mac[STORE_AUTH_MAC_BYTES]) {
    store_auth_mac(s, "ddprun-store-server", server_nonce, client_nonce, NULL, 0, mac);
}

bool store_auth_mac_equal(const uint8_t *a, const uint8_t *b) {
    return sodium_memcmp(a, b, STORE_AUTH_MAC_BYTES) == 0;
}
