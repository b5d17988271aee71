/* Unit tests of launcher/kv_table: PyTorch TCPStore semantics, waiters, queues, byte budget,
 * and the hash table under growth and deletion. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_table.h"

static kv_table_t *t;

static void setup(void) {
    cr_assert_eq(kv_table_create(64u << 20, &t), 0);
}

static void teardown(void) {
    kv_table_destroy(t);
}

TestSuite(kv_table, .init = setup, .fini = teardown);

#define S(s) (s), strlen(s)

static bool value_is(const char *key, const char *want) {
    size_t n;
    const uint8_t *v = kv_table_get(t, S(key), &n);
    return v && n == strlen(want) && memcmp(v, want, n) == 0;
}

Test(kv_table, set_get_delete_num_keys) {
    size_t n;
    cr_assert_null(kv_table_get(t, S("a"), &n));
    cr_assert_eq(kv_table_set(t, S("a"), S("1")), 0);
    cr_assert_eq(kv_table_set(t, S("b"), S("")), 0);
    cr_assert(value_is("a", "1"));
    cr_assert_not_null(kv_table_get(t, S("b"), &n), "an empty value is still a value");
    cr_assert_eq(n, 0);
    cr_assert_eq(kv_table_num_keys(t), 2);
    cr_assert_eq(kv_table_set(t, S("a"), S("longer value")), 0);
    cr_assert(value_is("a", "longer value"));
    cr_assert_eq(kv_table_delete(t, S("a")), 1);
    cr_assert_eq(kv_table_delete(t, S("a")), 0);
    cr_assert_null(kv_table_get(t, S("a"), &n));
    cr_assert_eq(kv_table_num_keys(t), 1);
}

Test(kv_table, compare_set_as_pytorch) {
    const uint8_t *r;
    size_t n;
    /* missing + non-empty expected: nothing created, the expected value comes back */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S("x"), S("y"), &r, &n), 0);
    cr_assert(n == 1 && r[0] == 'x');
    cr_assert_not(kv_table_check(t, S("k")));
    /* missing + empty expected: created */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S(""), S("v1"), &r, &n), 0);
    cr_assert(n == 2 && memcmp(r, "v1", 2) == 0);
    cr_assert(value_is("k", "v1"));
    /* present and equal: replaced */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S("v1"), S("v2"), &r, &n), 0);
    cr_assert(value_is("k", "v2") && n == 2 && memcmp(r, "v2", 2) == 0);
    /* present, not equal: unchanged, current value comes back */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S("zz"), S("v3"), &r, &n), 0);
    cr_assert(value_is("k", "v2") && memcmp(r, "v2", 2) == 0);
}

Test(kv_table, add_parses_like_stoll) {
    int64_t v;
    cr_assert_eq(kv_table_add(t, S("c"), 5, &v), 0);
    cr_assert_eq(v, 5);
    cr_assert_eq(kv_table_add(t, S("c"), -7, &v), 0);
    cr_assert_eq(v, -2);
    cr_assert(value_is("c", "-2"));
    kv_table_set(t, S("d"), S("  12abc"));
    cr_assert_eq(kv_table_add(t, S("d"), 1, &v), 0);
    cr_assert_eq(v, 13);
    kv_table_set(t, S("e"), S("abc"));
    cr_assert_eq(kv_table_add(t, S("e"), 1, &v), -EINVAL);
    cr_assert(value_is("e", "abc"), "a failed ADD changes nothing");
    kv_table_set(t, S("f"), S("99999999999999999999"));
    cr_assert_eq(kv_table_add(t, S("f"), 1, &v), -ERANGE);
    kv_table_set(t, S("g"), S("9223372036854775807"));
    cr_assert_eq(kv_table_add(t, S("g"), 1, &v), 0);
    cr_assert_eq(v, INT64_MIN, "wraps like int64 arithmetic in PyTorch");
    kv_table_set(t, S("h"), S("-9223372036854775808"));
    cr_assert_eq(kv_table_add(t, S("h"), 0, &v), 0);
    cr_assert_eq(v, INT64_MIN);
}

Test(kv_table, append_and_check) {
    cr_assert_eq(kv_table_append(t, S("ap"), S("ab")), 0);
    cr_assert_eq(kv_table_append(t, S("ap"), S("cd")), 0);
    cr_assert(value_is("ap", "abcd"));
    cr_assert(kv_table_check(t, S("ap")));
    cr_assert_not(kv_table_check(t, S("nope")));
}

static int woken[8];

static void on_wake(void *owner) {
    woken[(intptr_t)owner]++;
}

static kv_waiter_t *wait_for(const char **keys, int n, intptr_t id, int *rc) {
    kv_waiter_t *w;
    cr_assert_eq(kv_table_wait_begin(t, (uint64_t)n, on_wake, (void *)id, &w), 0);
    for (int i = 0; i < n; i++) cr_assert_eq(kv_table_wait_add_key(t, w, S(keys[i])), 0);
    *rc = kv_table_wait_commit(t, w);
    return w;
}

Test(kv_table, wait_ready_now_and_after_every_key) {
    memset(woken, 0, sizeof woken);
    int rc;
    kv_table_set(t, S("x"), S("1"));
    const char *present[] = {"x"};
    wait_for(present, 1, 0, &rc);
    cr_assert_eq(rc, 1);
    cr_assert_eq(woken[0], 0, "a ready wait does not call back");

    const char *keys[] = {"x", "y", "z"};
    wait_for(keys, 3, 1, &rc);
    cr_assert_eq(rc, 0);
    kv_table_set(t, S("y"), S("1"));
    cr_assert_eq(woken[1], 0);
    int64_t v;
    kv_table_add(t, S("z"), 1, &v);
    cr_assert_eq(woken[1], 1, "woken once the last missing key appears");
    kv_table_set(t, S("z"), S("again"));
    cr_assert_eq(woken[1], 1, "exactly once");
}

Test(kv_table, wake_by_append_and_compare_set_not_by_delete) {
    memset(woken, 0, sizeof woken);
    int rc;
    const char *a[] = {"a"}, *b[] = {"b"}, *c[] = {"c"};
    wait_for(a, 1, 0, &rc);
    wait_for(b, 1, 1, &rc);
    wait_for(c, 1, 2, &rc);
    kv_table_append(t, S("a"), S("x"));
    cr_assert_eq(woken[0], 1);
    const uint8_t *r;
    size_t n;
    kv_table_compare_set(t, S("b"), S("nonempty"), S("v"), &r, &n);
    cr_assert_eq(woken[1], 1, "PyTorch wakes waiters on every COMPARE_SET");
    kv_table_delete(t, S("c"));
    cr_assert_eq(woken[2], 0);
    kv_table_set(t, S("c"), S("v"));
    cr_assert_eq(woken[2], 1);
}

Test(kv_table, cancel_prevents_callback) {
    memset(woken, 0, sizeof woken);
    int rc;
    const char *keys[] = {"p", "q"};
    kv_waiter_t *w = wait_for(keys, 2, 3, &rc);
    cr_assert_eq(rc, 0);
    kv_table_set(t, S("p"), S("1"));
    kv_table_wait_cancel(t, w);
    kv_table_set(t, S("q"), S("1"));
    cr_assert_eq(woken[3], 0);
    cr_assert_eq(kv_table_num_keys(t), 2);
}

Test(kv_table, queues_and_one_waiter_per_push) {
    memset(woken, 0, sizeof woken);
    int rc;
    const char *q[] = {"q"};
    wait_for(q, 1, 4, &rc);
    wait_for(q, 1, 5, &rc);
    cr_assert_eq(kv_table_queue_push(t, S("q"), S("first")), 0);
    cr_assert_eq(woken[4] + woken[5], 1, "one push wakes one waiter");
    cr_assert_eq(woken[4], 1, "in arrival order");
    cr_assert_eq(kv_table_queue_push(t, S("q"), S("second")), 0);
    cr_assert_eq(woken[5], 1);
    cr_assert(kv_table_check(t, S("q")), "a non-empty queue counts as present");
    cr_assert_eq(kv_table_num_keys(t), 0, "queues are not keys");
    cr_assert_eq(kv_table_queue_len(t, S("q")), 2);
    int64_t before;
    uint8_t *item;
    size_t n;
    cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
    cr_assert(before == 2 && n == 5 && memcmp(item, "first", 5) == 0);
    free(item);
    cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
    free(item);
    cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
    cr_assert(before == 0 && item == NULL);
    cr_assert_not(kv_table_check(t, S("q")));
}

Test(kv_table, barrier_releases_at_world_size) {
    memset(woken, 0, sizeof woken);
    kv_waiter_t *w;
    cr_assert_eq(kv_table_barrier(t, S("bar"), 3, on_wake, (void *)6, &w), 0);
    cr_assert_eq(kv_table_barrier(t, S("bar"), 3, on_wake, (void *)7, &w), 0);
    cr_assert_eq(woken[6] + woken[7], 0);
    cr_assert(value_is("bar", "2"));
    cr_assert_eq(kv_table_barrier(t, S("bar"), 3, on_wake, (void *)0, &w), 1);
    cr_assert(woken[6] == 1 && woken[7] == 1);
    kv_table_set(t, S("junk"), S("x"));
    cr_assert_eq(kv_table_barrier(t, S("junk"), 2, on_wake, (void *)0, &w), -EINVAL);
}

Test(kv_table, list_keys_holds_exactly_the_set_keys) {
    kv_table_set(t, S("one"), S("1"));
    kv_table_set(t, S("two"), S("2"));
    kv_table_queue_push(t, S("queue"), S("x"));
    kv_waiter_t *w;
    kv_table_wait_begin(t, 1, on_wake, NULL, &w);
    kv_table_wait_add_key(t, w, S("awaited"));
    size_t cursor = 0, n, count = 0;
    const uint8_t *key;
    while (kv_table_next_key(t, &cursor, &key, &n)) {
        cr_assert((n == 3 && memcmp(key, "one", 3) == 0) || (n == 3 && memcmp(key, "two", 3) == 0));
        count++;
    }
    cr_assert_eq(count, 2);
    kv_table_wait_cancel(t, w);
}

Test(kv_table, byte_budget_refuses_without_damage) {
    kv_table_t *small;
    cr_assert_eq(kv_table_create(4096, &small), 0);
    char big[4096];
    memset(big, 'x', sizeof big);
    cr_assert_eq(kv_table_set(small, S("a"), big, 2048), 0);
    cr_assert_eq(kv_table_set(small, S("b"), big, 2048), -ENOSPC);
    cr_assert_eq(kv_table_set(small, S("a"), big, 4096), -ENOSPC);
    size_t n;
    const uint8_t *v = kv_table_get(small, S("a"), &n);
    cr_assert(v && n == 2048, "the old value is intact");
    cr_assert_eq(kv_table_num_keys(small), 1);
    cr_assert_eq(kv_table_append(small, S("a"), big, 2048), -ENOSPC);
    cr_assert_eq(kv_table_queue_push(small, S("q"), big, 2048), -ENOSPC);
    cr_assert_eq(kv_table_set(small, S("a"), big, 3000), 0, "growing within the budget works");
    cr_assert_eq(kv_table_delete(small, S("a")), 1);
    cr_assert_eq(kv_table_bytes(small), 0, "everything released");
    cr_assert_eq(kv_table_set(small, S("b"), big, 2048), 0);
    kv_table_destroy(small);
}

Test(kv_table, many_keys_survive_growth_and_deletion) {
    char key[32];
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "key/%d", i);
        cr_assert_eq(kv_table_set(t, S(key), key, strlen(key)), 0);
    }
    cr_assert_eq(kv_table_num_keys(t), n);
    for (int i = 0; i < n; i += 2) {
        snprintf(key, sizeof key, "key/%d", i);
        cr_assert_eq(kv_table_delete(t, S(key)), 1);
    }
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "key/%d", i);
        size_t len;
        const uint8_t *v = kv_table_get(t, S(key), &len);
        if (i % 2) cr_assert(v && len == strlen(key) && memcmp(v, key, len) == 0, "%s lost", key);
        else cr_assert_null(v, "%s not deleted", key);
    }
    cr_assert_eq(kv_table_num_keys(t), n / 2);
}

Test(kv_table, destroy_with_pending_waiters_is_clean) {
    int rc;
    const char *keys[] = {"m", "n"};
    wait_for(keys, 2, 0, &rc);
    kv_table_queue_push(t, S("q"), S("x"));
    /* teardown destroys: ASan/valgrind would report a leak or a double free here */
}
