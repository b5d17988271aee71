/* store_auth: the shared secret of a store and the HMAC-SHA256 proofs of ddprun's auth extension
 * (docs/protocol.md, "Authentication"). Used by the store server and the blocking client; libsodium
 * is its only crypto. No I/O except reading the secret file. */
#ifndef DDP_COMMON_STORE_AUTH_H
#define DDP_COMMON_STORE_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store_proto.h"

#define STORE_SECRET_MIN_BYTES 16u
#define STORE_SECRET_ENV       "DDPRUN_STORE_SECRET"
#define STORE_SECRET_FILE_ENV  "DDPRUN_STORE_SECRET_FILE"

typedef struct {
    uint8_t key[32]; /* SHA-256 of the secret text: a fixed-size HMAC key */
    bool is_set;
} store_secret_t;

/* Initialise libsodium; returns 0 or -EIO. Safe to call more than once. */
int store_auth_init(void);

/* Load a secret from a file: trailing newlines/spaces stripped, at least STORE_SECRET_MIN_BYTES.
 * Returns 0, or a negative code with a message naming the file in err. */
int store_secret_load_file(const char *path, store_secret_t *out, char *err, size_t err_len);
/* Secret from text (e.g. DDPRUN_STORE_SECRET); same rules. */
int store_secret_from_text(const char *text, size_t len, const char *origin, store_secret_t *out,
                           char *err, size_t err_len);
/* DDPRUN_STORE_SECRET, else DDPRUN_STORE_SECRET_FILE, else none (out->is_set = false, returns 0).
 */
int store_secret_from_env(store_secret_t *out, char *err, size_t err_len);
/* The secret of a --secret-file when path is given (non-NULL), else the environment's
 * (store_secret_from_env): the one rule of every command that takes both. */
int store_secret_load(const char *path, store_secret_t *out, char *err, size_t err_len);

void store_auth_random_nonce(uint8_t nonce[STORE_AUTH_NONCE_BYTES]);
/* HMAC(key, role NUL, server_nonce, client_nonce, bound): a proof of the secret that binds both
 * nonces (no replay) and bound (what the proof vouches for; NULL, 0: nothing more). role names the
 * protocol and direction, so that no proof passes for another's. */
void store_auth_mac(const store_secret_t *s, const char *role, const uint8_t *server_nonce,
                    const uint8_t *client_nonce, const void *bound, size_t bound_len,
                    uint8_t mac[STORE_AUTH_MAC_BYTES]);
/* The store's MACs (store_auth_mac with the store's roles): both directions differ. */
void store_auth_client_mac(const store_secret_t *s, const uint8_t *server_nonce,
                           const uint8_t *client_nonce, uint8_t mac[STORE_AUTH_MAC_BYTES]);
void store_auth_server_mac(const store_secret_t *s, const uint8_t *server_nonce,
                           const uint8_t *client_nonce, uint8_t mac[STORE_AUTH_MAC_BYTES]);
/* Constant-time comparison of two MACs. */
bool store_auth_mac_equal(const uint8_t *a, const uint8_t *b);

#endif
