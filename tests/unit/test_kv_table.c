/* Unit tests of launcher/store/kv_table: PyTorch TCPStore semantics (SET GET COMPARE_SET ADD APPEND
 * DELETE CHECK, queues), WAIT registrations and who wakes them, the byte budget, and the hash
 * table under growth and backward-shift deletion (checked against a plain reference model). */
#include <criterion/criterion.h>
#include <errno.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/kv_table.h"

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

/* ---- plain operations --------------------------------------------------------------------- */

Test(kv_table, set_get_delete_num_keys) {
    size_t n = 99;
    cr_assert_null(kv_table_get(t, S("a"), &n), "GET of a missing key is NULL");
    cr_assert_eq(n, 0);
    cr_assert_eq(kv_table_num_keys(t), 0);
    cr_assert_eq(kv_table_set(t, S("a"), S("1")), 0);
    cr_assert_eq(kv_table_set(t, S("b"), S("")), 0);
    cr_assert(value_is("a", "1"));
    cr_assert_not_null(kv_table_get(t, S("b"), &n), "an empty value is still a value");
    cr_assert_eq(n, 0);
    cr_assert_eq(kv_table_num_keys(t), 2);
    cr_assert_eq(kv_table_set(t, S("a"), S("longer value")), 0);
    cr_assert(value_is("a", "longer value"));
    cr_assert_eq(kv_table_num_keys(t), 2, "overwriting does not add a key");
    cr_assert_eq(kv_table_delete(t, S("a")), 1);
    cr_assert_eq(kv_table_delete(t, S("a")), 0);
    cr_assert_eq(kv_table_delete(t, S("never")), 0);
    cr_assert_null(kv_table_get(t, S("a"), &n));
    cr_assert_eq(kv_table_num_keys(t), 1);
    cr_assert_eq(kv_table_delete(t, S("b")), 1);
    cr_assert_eq(kv_table_num_keys(t), 0);
    cr_assert_eq(kv_table_bytes(t), 0, "an empty table holds no bytes");
}

Test(kv_table, binary_keys_and_values) {
    const uint8_t k1[] = {0, 1, 2}, k2[] = {0, 1, 3}, v[] = {0xff, 0, 0x7f};
    cr_assert_eq(kv_table_set(t, k1, 3, v, 3), 0);
    size_t n;
    cr_assert_null(kv_table_get(t, k2, 3, &n));
    cr_assert_null(kv_table_get(t, k1, 2, &n), "a prefix is another key");
    const uint8_t *got = kv_table_get(t, k1, 3, &n);
    cr_assert(got && n == 3 && memcmp(got, v, 3) == 0);
    cr_assert_eq(kv_table_set(t, "", 0, "empty key", 9), 0);
    cr_assert(value_is("", "empty key"));
}

Test(kv_table, compare_set_as_pytorch) {
    const uint8_t *r;
    size_t n;
    /* missing + non-empty expected: nothing created, the expected value comes back */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S("x"), S("y"), &r, &n), 0);
    cr_assert(n == 1 && r[0] == 'x');
    cr_assert_not(kv_table_check(t, S("k")));
    cr_assert_null(kv_table_get(t, S("k"), &n));
    cr_assert_eq(kv_table_num_keys(t), 0);
    cr_assert_eq(kv_table_bytes(t), 0, "a refused COMPARE_SET leaves no entry behind");
    /* missing + empty expected: created */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S(""), S("v1"), &r, &n), 0);
    cr_assert(n == 2 && memcmp(r, "v1", 2) == 0);
    cr_assert(value_is("k", "v1"));
    cr_assert_eq(kv_table_num_keys(t), 1);
    /* present and equal: replaced */
    cr_assert_eq(kv_table_compare_set(t, S("k"), S("v1"), S("v2-longer"), &r, &n), 0);
    cr_assert(value_is("k", "v2-longer") && n == 9 && memcmp(r, "v2-longer", 9) == 0);
    /* present, not equal (a prefix, a longer string, empty): unchanged, current value comes back */
    const char *wrong[] = {"zz", "v2", "v2-longer!", ""};
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(kv_table_compare_set(t, S("k"), S(wrong[i]), S("v3"), &r, &n), 0);
        cr_assert(value_is("k", "v2-longer"), "expected '%s' replaced the value", wrong[i]);
        cr_assert(n == 9 && memcmp(r, "v2-longer", 9) == 0);
    }
    /* present and empty: empty expected matches */
    kv_table_set(t, S("e"), S(""));
    cr_assert_eq(kv_table_compare_set(t, S("e"), S(""), S("filled"), &r, &n), 0);
    cr_assert(value_is("e", "filled"));
}

Test(kv_table, add_parses_like_stoll_and_wraps) {
    int64_t v = 0;
    cr_assert_eq(kv_table_add(t, S("c"), 5, &v), 0, "ADD on a missing key starts at 0");
    cr_assert_eq(v, 5);
    cr_assert(value_is("c", "5"));
    cr_assert_eq(kv_table_add(t, S("c"), -7, &v), 0);
    cr_assert_eq(v, -2);
    cr_assert(value_is("c", "-2"));
    cr_assert_eq(kv_table_add(t, S("c"), 0, &v), 0);
    cr_assert_eq(v, -2);

    /* std::stoll: leading white space, a sign, digits; trailing bytes ignored */
    const struct {
        const char *text;
        int64_t want;
    } ok[] = {{"  12abc", 12}, {"+7", 7}, {"\t\n-3", -3}, {"007", 7}, {"42 ", 42}};
    for (int i = 0; i < 5; i++) {
        kv_table_set(t, S("d"), S(ok[i].text));
        cr_assert_eq(kv_table_add(t, S("d"), 1, &v), 0, "'%s'", ok[i].text);
        cr_assert_eq(v, ok[i].want + 1, "'%s'", ok[i].text);
    }

    const char *not_int[] = {"abc", "", " ", "-", "+-1", "x1", "0x10"};
    for (int i = 0; i < 7; i++) {
        kv_table_set(t, S("e"), S(not_int[i]));
        int rc = kv_table_add(t, S("e"), 1, &v);
        if (strcmp(not_int[i], "0x10") == 0) {
            cr_assert_eq(rc, 0, "'0x10' reads as 0 like stoll");
            cr_assert_eq(v, 1);
        } else {
            cr_assert_eq(rc, -EINVAL, "'%s': %d", not_int[i], rc);
            cr_assert(value_is("e", not_int[i]), "a failed ADD changes nothing");
        }
    }

    const char *too_big[] = {"99999999999999999999", "9223372036854775808", "-9223372036854775809"};
    for (int i = 0; i < 3; i++) {
        kv_table_set(t, S("f"), S(too_big[i]));
        cr_assert_eq(kv_table_add(t, S("f"), 1, &v), -ERANGE, "'%s'", too_big[i]);
        cr_assert(value_is("f", too_big[i]));
    }

    kv_table_set(t, S("g"), S("9223372036854775807"));
    cr_assert_eq(kv_table_add(t, S("g"), 1, &v), 0);
    cr_assert_eq(v, INT64_MIN, "wraps like int64 arithmetic in PyTorch");
    cr_assert(value_is("g", "-9223372036854775808"));
    cr_assert_eq(kv_table_add(t, S("g"), -1, &v), 0);
    cr_assert_eq(v, INT64_MAX);
    kv_table_set(t, S("h"), S("-9223372036854775808"));
    cr_assert_eq(kv_table_add(t, S("h"), 0, &v), 0);
    cr_assert_eq(v, INT64_MIN);
    cr_assert_eq(kv_table_add(t, S("i"), INT64_MIN, &v), 0);
    cr_assert(value_is("i", "-9223372036854775808"));
}

Test(kv_table, append_and_check) {
    cr_assert_eq(kv_table_append(t, S("ap"), S("ab")), 0, "APPEND creates the key");
    cr_assert_eq(kv_table_append(t, S("ap"), S("cd")), 0);
    cr_assert_eq(kv_table_append(t, S("ap"), S("")), 0);
    char big[1000];
    memset(big, 'z', sizeof big);
    cr_assert_eq(kv_table_append(t, S("ap"), big, sizeof big), 0);
    size_t n;
    const uint8_t *v = kv_table_get(t, S("ap"), &n);
    cr_assert(v && n == 1004 && memcmp(v, "abcd", 4) == 0 && v[1003] == 'z');
    cr_assert_eq(kv_table_num_keys(t), 1);
    cr_assert(kv_table_check(t, S("ap")));
    cr_assert_not(kv_table_check(t, S("nope")));
    kv_table_set(t, S("empty"), S(""));
    cr_assert(kv_table_check(t, S("empty")), "an empty value is present");
}

/* ---- queues ------------------------------------------------------------------------------- */

Test(kv_table, queues_fifo_len_check) {
    int64_t before;
    uint8_t *item;
    size_t n;
    cr_assert_eq(kv_table_queue_len(t, S("q")), 0);
    cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
    cr_assert(before == 0 && item == NULL && n == 0, "pop of a missing queue");
    const char *items[] = {"first", "", "third"};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(kv_table_queue_push(t, S("q"), S(items[i])), 0);
    cr_assert_eq(kv_table_queue_len(t, S("q")), 3);
    cr_assert(kv_table_check(t, S("q")), "a non-empty queue counts as present");
    cr_assert_eq(kv_table_num_keys(t), 0, "queues are not keys");
    size_t cursor = 0, kl;
    const uint8_t *key;
    cr_assert_not(kv_table_next_key(t, &cursor, &key, &kl), "LIST_KEYS skips queues");
    /* a key and a queue of the same name live side by side */
    kv_table_set(t, S("q"), S("value"));
    cr_assert_eq(kv_table_num_keys(t), 1);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
        cr_assert_eq(before, 3 - i);
        cr_assert(item && n == strlen(items[i]) && memcmp(item, items[i], n) == 0, "item %d", i);
        free(item);
    }
    cr_assert_eq(kv_table_queue_pop(t, S("q"), &before, &item, &n), 0);
    cr_assert(before == 0 && item == NULL);
    cr_assert(value_is("q", "value"), "popping does not touch the key");
    cr_assert_eq(kv_table_delete(t, S("q")), 1);
    cr_assert_not(kv_table_check(t, S("q")));
    cr_assert_eq(kv_table_bytes(t), 0);
}

Test(kv_table, delete_keeps_the_queue_of_that_name) {
    kv_table_queue_push(t, S("k"), S("item"));
    kv_table_set(t, S("k"), S("v"));
    cr_assert_eq(kv_table_delete(t, S("k")), 1);
    cr_assert(kv_table_check(t, S("k")), "the queue is still there");
    cr_assert_eq(kv_table_queue_len(t, S("k")), 1);
    size_t n;
    cr_assert_null(kv_table_get(t, S("k"), &n));
    cr_assert_eq(kv_table_num_keys(t), 0);
}

/* ---- WAIT --------------------------------------------------------------------------------- */

static int woken[16];

static void on_wake(void *owner) {
    woken[(intptr_t)owner]++;
}

/* Register a WAIT on keys; returns commit's result (the waiter in *out when 0). */
static int wait_for(const char *const *keys, int n, intptr_t id, kv_waiter_t **out) {
    kv_waiter_t *w;
    cr_assert_eq(kv_table_wait_begin(t, (uint64_t)n, on_wake, (void *)id, &w), 0);
    for (int i = 0; i < n; i++)
        cr_assert_eq(kv_table_wait_add_key(t, w, S(keys[i])), 0);
    int rc = kv_table_wait_commit(t, w);
    if (out) *out = rc == 0 ? w : NULL;
    return rc;
}

Test(kv_table, wait_on_present_keys_is_ready_at_once) {
    memset(woken, 0, sizeof woken);
    kv_table_set(t, S("x"), S("1"));
    kv_table_set(t, S("y"), S(""));
    kv_table_queue_push(t, S("q"), S("item"));
    const char *present[] = {"x", "y", "q"};
    cr_assert_eq(wait_for(present, 3, 0, NULL), 1);
    cr_assert_eq(wait_for(NULL, 0, 0, NULL), 1, "a WAIT on no keys is ready");
    kv_table_set(t, S("x"), S("2"));
    cr_assert_eq(woken[0], 0, "a ready wait never calls back");
}

Test(kv_table, wait_fires_once_after_the_last_key) {
    memset(woken, 0, sizeof woken);
    kv_table_set(t, S("x"), S("1"));
    const char *keys[] = {"x", "y", "z", "w"};
    cr_assert_eq(wait_for(keys, 4, 1, NULL), 0);
    kv_table_set(t, S("y"), S("1"));
    cr_assert_eq(woken[1], 0);
    kv_table_set(t, S("y"), S("again"));
    cr_assert_eq(woken[1], 0, "setting one key twice does not count twice");
    int64_t v;
    kv_table_add(t, S("z"), 1, &v);
    cr_assert_eq(woken[1], 0);
    kv_table_append(t, S("w"), S("x"));
    cr_assert_eq(woken[1], 1, "woken once the last missing key appears");
    kv_table_set(t, S("z"), S("again"));
    kv_table_set(t, S("w"), S("again"));
    cr_assert_eq(woken[1], 1, "exactly once");
}

Test(kv_table, wait_on_the_same_key_twice) {
    memset(woken, 0, sizeof woken);
    const char *keys[] = {"dup", "dup"};
    cr_assert_eq(wait_for(keys, 2, 2, NULL), 0);
    kv_table_set(t, S("dup"), S("1"));
    cr_assert_eq(woken[2], 1);
}

Test(kv_table, several_waiters_on_one_key_all_wake) {
    memset(woken, 0, sizeof woken);
    const char *k[] = {"shared"};
    for (intptr_t id = 0; id < 5; id++)
        cr_assert_eq(wait_for(k, 1, id, NULL), 0);
    kv_table_set(t, S("shared"), S("go"));
    for (int id = 0; id < 5; id++)
        cr_assert_eq(woken[id], 1, "waiter %d", id);
}

Test(kv_table, who_wakes_a_waiter) {
    memset(woken, 0, sizeof woken);
    const char *a[] = {"a"}, *b[] = {"b"}, *c[] = {"c"}, *d[] = {"d"}, *e[] = {"e"}, *f[] = {"f"};
    wait_for(a, 1, 0, NULL);
    wait_for(b, 1, 1, NULL);
    wait_for(c, 1, 2, NULL);
    wait_for(d, 1, 3, NULL);
    wait_for(e, 1, 4, NULL);
    wait_for(f, 1, 5, NULL);
    int64_t v;
    kv_table_add(t, S("a"), 3, &v);
    cr_assert_eq(woken[0], 1, "ADD wakes");
    kv_table_append(t, S("b"), S("x"));
    cr_assert_eq(woken[1], 1, "APPEND wakes");
    const uint8_t *r;
    size_t n;
    kv_table_compare_set(t, S("c"), S(""), S("v"), &r, &n);
    cr_assert_eq(woken[2], 1, "COMPARE_SET that creates wakes");
    kv_table_compare_set(t, S("d"), S("nonempty"), S("v"), &r, &n);
    cr_assert_eq(woken[3], 1, "PyTorch wakes waiters on every COMPARE_SET, even one that fails");
    cr_assert_not(kv_table_check(t, S("d")));
    kv_table_queue_push(t, S("e"), S("item"));
    cr_assert_eq(woken[4], 1, "QUEUE_PUSH wakes");
    kv_table_delete(t, S("f"));
    cr_assert_eq(woken[5], 0, "DELETE does not wake");
    kv_table_set(t, S("f"), S("1"));
    kv_table_delete(t, S("f"));
    cr_assert_eq(woken[5], 1);
    /* COMPARE_SET on present keys (equal and not) wakes too */
    kv_table_set(t, S("g"), S("1"));
    kv_table_set(t, S("h"), S("1"));
    woken[6] = woken[7] = 0;
    kv_waiter_t *w1, *w2;
    kv_table_wait_begin(t, 2, on_wake, (void *)6, &w1);
    kv_table_wait_add_key(t, w1, S("g"));
    kv_table_wait_add_key(t, w1, S("g-missing"));
    cr_assert_eq(kv_table_wait_commit(t, w1), 0);
    kv_table_compare_set(t, S("g-missing"), S(""), S("now"), &r, &n);
    cr_assert_eq(woken[6], 1);
    kv_table_wait_begin(t, 1, on_wake, (void *)7, &w2);
    kv_table_wait_add_key(t, w2, S("h-missing"));
    cr_assert_eq(kv_table_wait_commit(t, w2), 0);
    kv_table_set(t, S("h-missing"), S("x"));
    cr_assert_eq(woken[7], 1);
}

Test(kv_table, cancel_prevents_the_callback_and_frees_entries) {
    memset(woken, 0, sizeof woken);
    const char *keys[] = {"p", "q", "r"};
    kv_waiter_t *w;
    cr_assert_eq(wait_for(keys, 3, 3, &w), 0);
    cr_assert_gt(kv_table_bytes(t), 0, "registrations are charged");
    kv_table_set(t, S("p"), S("1"));
    kv_table_wait_cancel(t, w);
    kv_table_set(t, S("q"), S("1"));
    kv_table_set(t, S("r"), S("1"));
    cr_assert_eq(woken[3], 0, "a cancelled waiter is never called");
    cr_assert_eq(kv_table_num_keys(t), 3);
    kv_table_delete(t, S("p"));
    kv_table_delete(t, S("q"));
    kv_table_delete(t, S("r"));
    cr_assert_eq(kv_table_bytes(t), 0);

    cr_assert_eq(wait_for(keys, 3, 3, &w), 0);
    kv_table_wait_cancel(t, w);
    cr_assert_eq(kv_table_bytes(t), 0, "the entries a cancelled WAIT created are gone");
    size_t cursor = 0, n;
    const uint8_t *key;
    cr_assert_not(kv_table_next_key(t, &cursor, &key, &n));
}

Test(kv_table, wait_key_limit) {
    kv_waiter_t *w;
    cr_assert_eq(kv_table_wait_begin(t, 2, on_wake, NULL, &w), 0);
    cr_assert_eq(kv_table_wait_add_key(t, w, S("m1")), 0);
    cr_assert_eq(kv_table_wait_add_key(t, w, S("m2")), 0);
    cr_assert_eq(kv_table_wait_add_key(t, w, S("m3")), -EINVAL, "past max_keys");
    kv_table_wait_cancel(t, w);
    cr_assert_eq(kv_table_bytes(t), 0);
}

Test(kv_table, queue_push_wakes_only_one_waiter) {
    memset(woken, 0, sizeof woken);
    const char *q[] = {"q"};
    wait_for(q, 1, 4, NULL);
    wait_for(q, 1, 5, NULL);
    wait_for(q, 1, 6, NULL);
    cr_assert_eq(kv_table_queue_push(t, S("q"), S("first")), 0);
    cr_assert_eq(woken[4] + woken[5] + woken[6], 1, "one push wakes one waiter");
    cr_assert_eq(woken[4], 1, "the first to arrive");
    cr_assert_eq(kv_table_queue_push(t, S("q"), S("second")), 0);
    cr_assert(woken[5] == 1 && woken[6] == 0);
    /* a SET of the same name wakes every remaining waiter */
    kv_table_set(t, S("q"), S("v"));
    cr_assert_eq(woken[6], 1);
}

Test(kv_table, destroy_with_pending_waiters_is_clean) {
    memset(woken, 0, sizeof woken);
    const char *keys[] = {"m", "n"}, *one[] = {"m"};
    wait_for(keys, 2, 0, NULL);
    wait_for(one, 1, 1, NULL);
    kv_table_queue_push(t, S("q"), S("x"));
    kv_table_set(t, S("n"), S("1"));
    /* teardown destroys: the sanitizer build reports a leak or a double free here */
}

/* ---- BARRIER and LIST_KEYS ---------------------------------------------------------------- */

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
    bool seen[2] = {false, false};
    while (kv_table_next_key(t, &cursor, &key, &n)) {
        bool is_one = n == 3 && memcmp(key, "one", 3) == 0;
        bool is_two = n == 3 && memcmp(key, "two", 3) == 0;
        cr_assert(is_one || is_two, "unexpected key '%.*s'", (int)n, key);
        seen[is_two] = true;
        count++;
    }
    cr_assert(count == 2 && seen[0] && seen[1]);
    kv_table_wait_cancel(t, w);
}

/* ---- the byte budget ---------------------------------------------------------------------- */

Test(kv_table, byte_budget_refuses_without_damage) {
    kv_table_t *small;
    cr_assert_eq(kv_table_create(4096, &small), 0);
    char big[4096];
    memset(big, 'x', sizeof big);
    big[0] = 'A';
    cr_assert_eq(kv_table_set(small, S("a"), big, 2048), 0);
    size_t used = kv_table_bytes(small);
    cr_assert_geq(used, 2048 + 1, "key and value are charged");

    cr_assert_eq(kv_table_set(small, S("b"), big, 2048), -ENOSPC, "a new key past the budget");
    size_t n;
    cr_assert_null(kv_table_get(small, S("b"), &n), "and nothing was created");
    cr_assert_not(kv_table_check(small, S("b")));
    cr_assert_eq(kv_table_num_keys(small), 1);
    cr_assert_eq(kv_table_bytes(small), used);

    cr_assert_eq(kv_table_set(small, S("a"), big + 1, 4096 - 1), -ENOSPC, "a bigger value");
    const uint8_t *v = kv_table_get(small, S("a"), &n);
    cr_assert(v && n == 2048 && v[0] == 'A', "the old value is intact");
    cr_assert_eq(kv_table_bytes(small), used);

    cr_assert_eq(kv_table_append(small, S("a"), big, 2048), -ENOSPC);
    v = kv_table_get(small, S("a"), &n);
    cr_assert(v && n == 2048 && v[0] == 'A', "APPEND refused, value intact");
    cr_assert_eq(kv_table_queue_push(small, S("q"), big, 2048), -ENOSPC);
    cr_assert_eq(kv_table_queue_len(small, S("q")), 0);
    const uint8_t *r;
    cr_assert_eq(kv_table_compare_set(small, S("a"), big, 2048, big, 4090, &r, &n), -ENOSPC);
    v = kv_table_get(small, S("a"), &n);
    cr_assert(v && n == 2048 && v[0] == 'A', "COMPARE_SET refused, value intact");
    cr_assert_eq(kv_table_compare_set(small, S("c"), "", 0, big, 3000, &r, &n), -ENOSPC);
    cr_assert_null(kv_table_get(small, S("c"), &n));
    cr_assert_eq(kv_table_bytes(small), used, "every refusal changed nothing");

    cr_assert_eq(kv_table_set(small, S("a"), big, 3000), 0, "growing within the budget works");
    cr_assert_eq(kv_table_set(small, S("a"), big, 10), 0, "shrinking works");
    cr_assert_eq(kv_table_set(small, S("b"), big, 2048), 0, "and frees room for others");
    cr_assert_eq(kv_table_delete(small, S("a")), 1);
    cr_assert_eq(kv_table_delete(small, S("b")), 1);
    cr_assert_eq(kv_table_bytes(small), 0, "everything released");
    kv_table_destroy(small);
}

Test(kv_table, many_empty_keys_are_bounded_too) {
    kv_table_t *small;
    cr_assert_eq(kv_table_create(64 * 1024, &small), 0);
    char key[32];
    int i, rc = 0;
    for (i = 0; i < 100000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        if ((rc = kv_table_set(small, S(key), "", 0)) < 0) break;
    }
    cr_assert_eq(rc, -ENOSPC, "empty keys are charged: the budget ends a flood of them");
    cr_assert_lt(i, 64 * 1024 / 8, "charged at least a few bytes each (%d keys fit)", i);
    cr_assert_leq(kv_table_bytes(small), 64 * 1024);
    kv_table_destroy(small);
}

Test(kv_table, a_barrier_on_a_new_key_the_table_has_no_room_for_is_refused) {
    kv_table_t *small;
    cr_assert_eq(kv_table_create(4096, &small), 0);
    char big[4096] = {0};
    size_t n = 1;
    while (kv_table_set(small, S("fill"), big, n) == 0)
        n++; /* the table full to the byte */
    size_t used = kv_table_bytes(small);
    kv_waiter_t *w = NULL;
    cr_assert_eq(kv_table_barrier(small, S("new barrier key"), 2, on_wake, NULL, &w), -ENOSPC);
    cr_assert_null(w);
    cr_assert_not(kv_table_check(small, S("new barrier key")));
    cr_assert_eq(kv_table_bytes(small), used, "the refusal changed nothing");
    kv_table_destroy(small);
}

Test(kv_table, waits_are_charged_to_the_budget) {
    kv_table_t *small;
    cr_assert_eq(kv_table_create(64 * 1024, &small), 0);
    kv_waiter_t *w = NULL;
    /* 16384 keys' links are a quarter of a MiB or more: past this budget, refused up front */
    cr_assert_eq(kv_table_wait_begin(small, 16384, on_wake, NULL, &w), -ENOSPC);
    cr_assert_eq(kv_table_bytes(small), 0);
    cr_assert_eq(kv_table_wait_begin(small, 1, on_wake, (void *)3, &w), 0);
    cr_assert_eq(kv_table_wait_add_key(small, w, S("awaited")), 0);
    cr_assert_eq(kv_table_wait_commit(small, w), 0);
    cr_assert_gt(kv_table_bytes(small), 0);
    memset(woken, 0, sizeof woken);
    cr_assert_eq(kv_table_set(small, S("awaited"), S("x")), 0);
    cr_assert_eq(woken[3], 1);
    cr_assert_eq(kv_table_delete(small, S("awaited")), 1);
    cr_assert_eq(kv_table_bytes(small), 0, "the fired waiter's charge is released");
    kv_table_destroy(small);
}

/* Heap bytes in use. Under AddressSanitizer (every CI build) malloc is the sanitizer's, which
 * mallinfo2 does not see: its own counter, which counts a freed block as freed even while it waits
 * in quarantine. */
#if defined(__SANITIZE_ADDRESS__)
/* sanitizer/allocator_interface.h's declaration: GCC ships the function, not always the header */
size_t __sanitizer_get_current_allocated_bytes(void);
static size_t heap_in_use(void) {
    return __sanitizer_get_current_allocated_bytes();
}
#else
static size_t heap_in_use(void) {
    struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
}
#endif

/* The budget bounds memory, not just the byte count: a value that shrinks or is deleted must not
 * leave its old buffer behind uncharged. */
Test(kv_table, memory_held_follows_the_budget) {
    const size_t big = 1u << 20;
    char *v = calloc(1, big);
    char key[32];
    size_t h0 = heap_in_use();
    for (int i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "shrunk/%d", i);
        cr_assert_eq(kv_table_set(t, S(key), v, big), 0);
        cr_assert_eq(kv_table_set(t, S(key), S("small")), 0);
    }
    for (int i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "deleted/%d", i);
        cr_assert_eq(kv_table_queue_push(t, S(key), S("keeps the entry alive")), 0);
        cr_assert_eq(kv_table_set(t, S(key), v, big), 0);
        cr_assert_eq(kv_table_delete(t, S(key)), 1);
    }
    size_t held = heap_in_use() - h0, charged = kv_table_bytes(t);
    cr_assert_lt(charged, 64 * 1024);
    cr_assert_lt(held, 4 * charged + (1u << 20),
                 "the table holds %zu bytes of heap but charges %zu", held, charged);
    free(v);
}

/* Many small keys and values: the charge covers what they hold (entries, values, slots), so that
 * the budget bounds the heap (2.3 times less was charged before). */
Test(kv_table, small_keys_cost_no_more_heap_than_charged) {
    char key[32];
    size_t h0 = heap_in_use(), c0 = kv_table_bytes(t);
    for (int i = 0; i < 20000; i++) {
        snprintf(key, sizeof key, "k%05d", i);
        cr_assert_eq(kv_table_set(t, S(key), "x", 1), 0);
    }
    size_t held = heap_in_use() - h0, charged = kv_table_bytes(t) - c0;
    cr_assert_leq(held, charged, "the table holds %zu bytes of heap but charges %zu", held,
                  charged);
    for (int i = 0; i < 20000; i++) {
        snprintf(key, sizeof key, "k%05d", i);
        cr_assert_eq(kv_table_delete(t, S(key)), 1);
    }
    cr_assert_eq(kv_table_bytes(t), c0);
    cr_assert_lt(heap_in_use() - h0, 64 * 1024, "the slots of 20000 keys stay after them");
}

/* ---- the hash table ----------------------------------------------------------------------- */

Test(kv_table, many_keys_survive_growth_and_deletion, .timeout = 60) {
    char key[32];
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "key/%d", i);
        cr_assert_eq(kv_table_set(t, S(key), key, strlen(key)), 0);
    }
    cr_assert_eq(kv_table_num_keys(t), n);
    /* delete two of every three, so that runs of neighbours leave the table */
    for (int i = 0; i < n; i++) {
        if (i % 3 == 0) continue;
        snprintf(key, sizeof key, "key/%d", i);
        cr_assert_eq(kv_table_delete(t, S(key)), 1, "%s", key);
    }
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "key/%d", i);
        size_t len;
        const uint8_t *v = kv_table_get(t, S(key), &len);
        if (i % 3 == 0)
            cr_assert(v && len == strlen(key) && memcmp(v, key, len) == 0, "%s lost", key);
        else
            cr_assert_null(v, "%s not deleted", key);
    }
    cr_assert_eq(kv_table_num_keys(t), (n + 2) / 3);
    size_t cursor = 0, kl, listed = 0;
    const uint8_t *k;
    while (kv_table_next_key(t, &cursor, &k, &kl))
        listed++;
    cr_assert_eq(listed, (size_t)(n + 2) / 3);
    /* delete the rest; the table is empty again */
    for (int i = 0; i < n; i += 3) {
        snprintf(key, sizeof key, "key/%d", i);
        cr_assert_eq(kv_table_delete(t, S(key)), 1, "%s", key);
    }
    cr_assert_eq(kv_table_num_keys(t), 0);
    cr_assert_eq(kv_table_bytes(t), 0);
}

/* Random SET/DELETE/GET against a plain array: every probe chain must survive the shifts. */
Test(kv_table, random_operations_match_a_reference, .timeout = 60) {
    enum { N_KEYS = 3000, N_OPS = 300000 };
    static int ref[N_KEYS]; /* -1: absent; else the value's number */
    for (int i = 0; i < N_KEYS; i++)
        ref[i] = -1;
    uint64_t rng = 0x9E3779B97F4A7C15u;
    int64_t n_set = 0;
    char key[32], val[32];
    for (int op = 0; op < N_OPS; op++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        int k = (int)(rng % N_KEYS), what = (int)((rng >> 32) % 3);
        snprintf(key, sizeof key, "r%d", k);
        if (what == 0) {
            snprintf(val, sizeof val, "%d", op);
            cr_assert_eq(kv_table_set(t, S(key), S(val)), 0);
            if (ref[k] < 0) n_set++;
            ref[k] = op;
        } else if (what == 1) {
            cr_assert_eq(kv_table_delete(t, S(key)), ref[k] >= 0, "op %d delete %s", op, key);
            if (ref[k] >= 0) n_set--;
            ref[k] = -1;
        } else {
            size_t len;
            const uint8_t *v = kv_table_get(t, S(key), &len);
            if (ref[k] < 0) {
                cr_assert_null(v, "op %d: %s should be absent", op, key);
            } else {
                snprintf(val, sizeof val, "%d", ref[k]);
                cr_assert(v && len == strlen(val) && memcmp(v, val, len) == 0,
                          "op %d: %s lost or wrong", op, key);
            }
        }
    }
    cr_assert_eq(kv_table_num_keys(t), n_set);
    for (int k = 0; k < N_KEYS; k++) {
        snprintf(key, sizeof key, "r%d", k);
        cr_assert_eq(kv_table_check(t, S(key)), ref[k] >= 0, "%s", key);
    }
}
