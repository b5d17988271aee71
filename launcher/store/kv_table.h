/* kv_table: the store's in-memory key/value table, its named queues and its WAIT registrations,
 * with PyTorch TCPStore semantics. Knows nothing of sockets: a waiter is an opaque owner plus a
 * callback. Single-threaded (the store's loop). Keys are hashed with a per-table random seed so
 * a peer cannot choose colliding keys.
 *
 * Memory held for keys, values, queue items and WAIT registrations is accounted (with what malloc
 * and the slots add) and bounded by max_bytes: writes and waits that would cross it fail with
 * -ENOSPC and change nothing.
 */
#ifndef DDP_LAUNCHER_KV_TABLE_H
#define DDP_LAUNCHER_KV_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kv_table kv_table_t;
typedef struct kv_waiter kv_waiter_t;

/* Called when every key of a waiter is present; the table frees the waiter right after. */
typedef void (*kv_wake_cb)(void *owner);

/* Returns 0 or -ENOMEM. */
int kv_table_create(size_t max_bytes, kv_table_t **out);
/* Frees everything, waiters included, without calling their callbacks. */
void kv_table_destroy(kv_table_t *t);

/* SET: replace the value; wakes every waiter on key. 0 or -ENOSPC/-ENOMEM. */
int kv_table_set(kv_table_t *t, const void *key, size_t key_len, const void *val, size_t val_len);
/* GET: the value, or NULL when missing (PyTorch then replies an empty value). Borrowed until the
 * next table call. */
const uint8_t *kv_table_get(kv_table_t *t, const void *key, size_t key_len, size_t *val_len);
/* COMPARE_SET as PyTorch: missing key + empty expected -> set desired; missing + non-empty expected
 * -> nothing, the reply is `expected`; present and equal -> replaced. Wakes waiters in every case.
 * *reply / *reply_len: what to send back (borrowed until the next table call). */
int kv_table_compare_set(kv_table_t *t, const void *key, size_t key_len, const void *expected,
                         size_t expected_len, const void *desired, size_t desired_len,
                         const uint8_t **reply, size_t *reply_len);
/* ADD: the stored decimal text plus delta (wrapping like int64 in PyTorch). -EINVAL if the
 * stored value does not start with an integer, -ERANGE if it does not fit int64. */
int kv_table_add(kv_table_t *t, const void *key, size_t key_len, int64_t delta, int64_t *result);
/* APPEND: concatenate (creates the key); wakes waiters. */
int kv_table_append(kv_table_t *t, const void *key, size_t key_len, const void *val,
                    size_t val_len);
/* DELETE_KEY: 1 if a value was removed, else 0. Waiters are not woken (as PyTorch). */
int kv_table_delete(kv_table_t *t, const void *key, size_t key_len);
/* CHECK of one key: a value is set, or a queue of that name is non-empty. */
bool kv_table_check(kv_table_t *t, const void *key, size_t key_len);
/* GETNUMKEYS: keys holding a value (queues are not keys). */
int64_t kv_table_num_keys(const kv_table_t *t);
size_t kv_table_bytes(const kv_table_t *t);

/* QUEUE_PUSH: append an item; wakes one waiter of that name. */
int kv_table_queue_push(kv_table_t *t, const void *key, size_t key_len, const void *val,
                        size_t val_len);
/* QUEUE_POP: *len_before = queue length before the pop; when > 0 the popped item is copied to a
 * malloc'd *item (caller frees). Returns 0 or -ENOMEM. */
int kv_table_queue_pop(kv_table_t *t, const void *key, size_t key_len, int64_t *len_before,
                       uint8_t **item, size_t *item_len);
int64_t kv_table_queue_len(kv_table_t *t, const void *key, size_t key_len);

/* LIST_KEYS: walk the keys holding a value; *cursor starts at 0. The key is borrowed until the
 * next table call that changes the table. Returns false when done. */
bool kv_table_next_key(const kv_table_t *t, size_t *cursor, const uint8_t **key, size_t *key_len);

/* BARRIER as PyTorch: add 1 to the decimal counter at key without waking anyone; once it reaches
 * world_size wake every waiter of key and return 1; else register a waiter on key (cb fires when
 * key is next written, i.e. by the last arrival) and return 0 with *out set. -EINVAL/-ERANGE when
 * the value is not an integer; -ENOSPC/-ENOMEM as SET. */
int kv_table_barrier(kv_table_t *t, const void *key, size_t key_len, int64_t world_size,
                     kv_wake_cb cb, void *owner, kv_waiter_t **out);

/* WAIT: begin(max_keys: the keys missing now, whose links it holds; -ENOSPC when the budget has no
 * room for them), add each key, then commit. commit returns 1 when all keys are already
 * present (waiter freed, cb not called), 0 when registered (cb fires later), or a negative code
 * (waiter freed). A registered waiter is cancelled with kv_table_wait_cancel (no cb); so is one
 * whose add_key failed (-ENOSPC, -ENOMEM, -EINVAL past max_keys). */
int kv_table_wait_begin(kv_table_t *t, uint64_t max_keys, kv_wake_cb cb, void *owner,
                        kv_waiter_t **out);
int kv_table_wait_add_key(kv_table_t *t, kv_waiter_t *w, const void *key, size_t key_len);
int kv_table_wait_commit(kv_table_t *t, kv_waiter_t *w);
void kv_table_wait_cancel(kv_table_t *t, kv_waiter_t *w);

#endif
