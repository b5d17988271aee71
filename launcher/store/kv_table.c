/* kv_table: open-addressing hash table (linear probing, backward-shift deletion) of heap entries.
 * An entry exists while it holds a value, waiters or queue items; entry pointers are stable, so
 * wait links can point at them across table growth. See kv_table.h for the semantics. */
#include "store/kv_table.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sodium.h>
#include <xxhash.h>

/* What the budget charges on top of payloads, so that it bounds the heap the table holds, not just
 * the bytes peers sent (a flood of empty keys, of 1-byte values, of WAITs on many keys): an
 * entry's struct, malloc's header and its share of the slot array (at most 4 pointers: the load
 * stays between 1/8 and 1/2); a value's malloc header and smallest chunk; a queue item's struct
 * and header; a waiter's struct, header and links. */
#define MALLOC_OVERHEAD 16u
#define ENTRY_OVERHEAD  (sizeof(kv_entry_t) + MALLOC_OVERHEAD + 4 * sizeof(kv_entry_t *))
#define VALUE_OVERHEAD  32u
#define ITEM_OVERHEAD   (sizeof(queue_item_t) + MALLOC_OVERHEAD)
#define MIN_SLOTS       64u

typedef struct kv_entry kv_entry_t;

typedef struct wait_link {
    kv_entry_t *entry; /* NULL once unlinked */
    struct wait_link *prev, *next;
    kv_waiter_t *waiter;
} wait_link_t;

struct kv_waiter {
    kv_table_t *t; /* whose budget holds waiter_charge(max_links) for it */
    kv_wake_cb cb;
    void *owner;
    uint64_t max_links;
    uint64_t n_links;
    uint64_t remaining; /* links still registered */
    bool is_ready_now;  /* every key checked so far was present */
    wait_link_t links[];
};

typedef struct queue_item {
    struct queue_item *next;
    size_t len;
    uint8_t data[];
} queue_item_t;

struct kv_entry {
    uint64_t hash;
    uint8_t *val;
    size_t val_len, val_cap;
    bool is_set;
    wait_link_t *wait_head, *wait_tail;
    queue_item_t *q_head, *q_tail;
    int64_t q_len;
    size_t key_len;
    uint8_t key[];
};

struct kv_table {
    kv_entry_t **slots;
    size_t cap; /* power of two */
    size_t n_entries;
    int64_t n_set;
    size_t bytes, max_bytes;
    uint64_t seed;
};

int kv_table_create(size_t max_bytes, kv_table_t **out) {
    kv_table_t *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    t->cap = MIN_SLOTS;
    t->slots = calloc(t->cap, sizeof *t->slots);
    if (!t->slots) {
        free(t);
        return -ENOMEM;
    }
    t->max_bytes = max_bytes;
    randombytes_buf(&t->seed, sizeof t->seed);
    *out = t;
    return 0;
}

static void queue_clear(kv_entry_t *e) {
    while (e->q_head) {
        queue_item_t *next = e->q_head->next;
        free(e->q_head);
        e->q_head = next;
    }
}

void kv_table_destroy(kv_table_t *t) {
    if (!t) return;
    for (size_t i = 0; i < t->cap; i++) {
        kv_entry_t *e = t->slots[i];
        if (!e) continue;
        /* A waiter may span several entries: unlink from all before freeing any waiter. */
        for (wait_link_t *l = e->wait_head; l; l = l->next)
            l->entry = NULL;
    }
    for (size_t i = 0; i < t->cap; i++) {
        kv_entry_t *e = t->slots[i];
        if (!e) continue;
        for (wait_link_t *l = e->wait_head, *next; l; l = next) {
            next = l->next;
            if (--l->waiter->remaining == 0) free(l->waiter);
        }
        queue_clear(e);
        free(e->val);
        free(e);
    }
    free(t->slots);
    free(t);
}

static uint64_t hash_key(const kv_table_t *t, const void *key, size_t len) {
    return XXH3_64bits_withSeed(key, len, t->seed);
}

static size_t find_slot(const kv_table_t *t, const void *key, size_t len, uint64_t h) {
    size_t mask = t->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        kv_entry_t *e = t->slots[i];
        if (!e || (e->hash == h && e->key_len == len && memcmp(e->key, key, len) == 0)) return i;
    }
}

static kv_entry_t *find(const kv_table_t *t, const void *key, size_t len) {
    return t->slots[find_slot(t, key, len, hash_key(t, key, len))];
}

static int resize(kv_table_t *t, size_t new_cap) {
    kv_entry_t **slots = calloc(new_cap, sizeof *slots);
    if (!slots) return -ENOMEM;
    for (size_t i = 0; i < t->cap; i++) {
        kv_entry_t *e = t->slots[i];
        if (!e) continue;
        size_t j = e->hash & (new_cap - 1);
        while (slots[j])
            j = (j + 1) & (new_cap - 1);
        slots[j] = e;
    }
    free(t->slots);
    t->slots = slots;
    t->cap = new_cap;
    return 0;
}

static bool would_exceed(const kv_table_t *t, size_t add) {
    return add > t->max_bytes || t->bytes > t->max_bytes - add;
}

/* The entry for key, created empty if absent. extra_bytes: what the caller will add, checked
 * together with the new entry's cost so that a refused write creates nothing. */
static int get_or_create(kv_table_t *t, const void *key, size_t len, size_t extra_bytes,
                         kv_entry_t **out) {
    uint64_t h = hash_key(t, key, len);
    size_t i = find_slot(t, key, len, h);
    if (t->slots[i]) {
        if (would_exceed(t, extra_bytes)) return -ENOSPC;
        *out = t->slots[i];
        return 0;
    }
    size_t cost = len + ENTRY_OVERHEAD;
    if (extra_bytes > SIZE_MAX - cost || would_exceed(t, cost + extra_bytes)) return -ENOSPC;
    if ((t->n_entries + 1) * 2 > t->cap) {
        int rc = resize(t, t->cap * 2);
        if (rc < 0) return rc;
        i = find_slot(t, key, len, h);
    }
    kv_entry_t *e = calloc(1, sizeof *e + len);
    if (!e) return -ENOMEM;
    e->hash = h;
    e->key_len = len;
    if (len) memcpy(e->key, key, len);
    t->slots[i] = e;
    t->n_entries++;
    t->bytes += cost;
    *out = e;
    return 0;
}

/* Remove an entry that holds nothing any more (backward-shift deletion keeps probes short). */
static void maybe_remove(kv_table_t *t, kv_entry_t *e) {
    if (e->is_set || e->wait_head || e->q_head) return;
    size_t mask = t->cap - 1;
    size_t i = find_slot(t, e->key, e->key_len, e->hash);
    t->slots[i] = NULL;
    for (size_t j = (i + 1) & mask; t->slots[j]; j = (j + 1) & mask) {
        size_t home = t->slots[j]->hash & mask;
        /* Move slot j into the hole at i unless its home lies cyclically in (i, j]. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->slots[i] = t->slots[j];
            t->slots[j] = NULL;
            i = j;
        }
    }
    t->n_entries--;
    t->bytes -= e->key_len + ENTRY_OVERHEAD;
    free(e->val);
    free(e);
    /* a table emptied of most of its keys gives the slots back (what the budget charges them) */
    if (t->cap > MIN_SLOTS && t->n_entries * 8 < t->cap) resize(t, t->cap / 2);
}

static void link_waiter(kv_waiter_t *w, kv_entry_t *e);

/* The heap a waiter with max_links links holds, as its table's budget charges it. */
static size_t waiter_charge(uint64_t max_links) {
    return sizeof(kv_waiter_t) + (size_t)max_links * sizeof(wait_link_t) + MALLOC_OVERHEAD;
}

static void waiter_free(kv_waiter_t *w) {
    w->t->bytes -= waiter_charge(w->max_links);
    free(w);
}

static void fire(kv_waiter_t *w) {
    w->cb(w->owner);
    waiter_free(w);
}

static void unlink_wait(kv_entry_t *e, wait_link_t *l) {
    if (l->prev)
        l->prev->next = l->next;
    else
        e->wait_head = l->next;
    if (l->next)
        l->next->prev = l->prev;
    else
        e->wait_tail = l->prev;
    l->entry = NULL;
    l->prev = l->next = NULL;
}

static void wake_all(kv_entry_t *e) {
    wait_link_t *l = e->wait_head;
    e->wait_head = e->wait_tail = NULL;
    while (l) {
        wait_link_t *next = l->next;
        kv_waiter_t *w = l->waiter;
        l->entry = NULL;
        if (--w->remaining == 0) fire(w);
        l = next;
    }
}

/* Queue pushes wake waiters in arrival order until one becomes ready, as PyTorch does. */
static void wake_one(kv_entry_t *e) {
    while (e->wait_head) {
        wait_link_t *l = e->wait_head;
        kv_waiter_t *w = l->waiter;
        unlink_wait(e, l);
        if (--w->remaining == 0) {
            fire(w);
            return;
        }
    }
}

/* What the budget holds for e's value buffer. */
static size_t value_charge(const kv_entry_t *e) {
    return e && e->val ? e->val_cap + VALUE_OVERHEAD : 0;
}

static int store_value(kv_table_t *t, kv_entry_t *e, const void *val, size_t len) {
    size_t before = value_charge(e);
    /* a buffer much larger than its value (left by a bigger one) is not kept */
    if (len > e->val_cap || len < e->val_cap / 2 || !e->val) {
        uint8_t *p = malloc(len ? len : 1);
        if (!p) return -ENOMEM;
        free(e->val);
        e->val = p;
        e->val_cap = len;
    }
    if (len) memcpy(e->val, val, len);
    if (!e->is_set) t->n_set++;
    t->bytes = t->bytes - before + value_charge(e);
    e->val_len = len;
    e->is_set = true;
    return 0;
}

/* What storing a value of new_len bytes into e (NULL: a new entry) adds to the budget at most. */
static size_t value_delta(const kv_entry_t *e, size_t new_len) {
    size_t after = new_len + VALUE_OVERHEAD, before = value_charge(e);
    return after > before ? after - before : 0;
}

int kv_table_set(kv_table_t *t, const void *key, size_t key_len, const void *val, size_t val_len) {
    kv_entry_t *e = find(t, key, key_len);
    int rc = get_or_create(t, key, key_len, value_delta(e, val_len), &e);
    if (rc < 0) return rc;
    rc = store_value(t, e, val, val_len);
    if (rc < 0) {
        maybe_remove(t, e);
        return rc;
    }
    wake_all(e);
    return 0;
}

const uint8_t *kv_table_get(kv_table_t *t, const void *key, size_t key_len, size_t *val_len) {
    kv_entry_t *e = find(t, key, key_len);
    if (!e || !e->is_set) {
        *val_len = 0;
        return NULL;
    }
    *val_len = e->val_len;
    return e->val ? e->val : (const uint8_t *)"";
}

int kv_table_compare_set(kv_table_t *t, const void *key, size_t key_len, const void *expected,
                         size_t expected_len, const void *desired, size_t desired_len,
                         const uint8_t **reply, size_t *reply_len) {
    kv_entry_t *e = find(t, key, key_len);
    if (!e || !e->is_set) {
        if (expected_len != 0) {
            /* PyTorch "lies" here and answers with the expected value, waking waiters anyway. */
            *reply = expected;
            *reply_len = expected_len;
            if (e) {
                wake_all(e);
                maybe_remove(t, e);
            }
            return 0;
        }
        int rc = kv_table_set(t, key, key_len, desired, desired_len);
        if (rc < 0) return rc;
        *reply = kv_table_get(t, key, key_len, reply_len);
        return 0;
    }
    if (e->val_len == expected_len && memcmp(e->val, expected, expected_len) == 0) {
        if (would_exceed(t, value_delta(e, desired_len))) return -ENOSPC;
        int rc = store_value(t, e, desired, desired_len);
        if (rc < 0) return rc;
    }
    wake_all(e);
    *reply = e->val;
    *reply_len = e->val_len;
    return 0;
}

/* std::stoll's reading: leading space, sign, decimal digits; trailing bytes ignored. */
static int parse_int64(const uint8_t *p, size_t n, int64_t *out) {
    size_t i = 0;
    while (i < n && (p[i] == ' ' || (p[i] >= '\t' && p[i] <= '\r')))
        i++;
    bool is_neg = false;
    if (i < n && (p[i] == '+' || p[i] == '-')) is_neg = p[i++] == '-';
    if (i >= n || p[i] < '0' || p[i] > '9') return -EINVAL;
    uint64_t limit = is_neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    uint64_t v = 0;
    for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) {
        unsigned d = (unsigned)(p[i] - '0');
        if (v > (limit - d) / 10) return -ERANGE;
        v = v * 10 + d;
    }
    *out = is_neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

int kv_table_add(kv_table_t *t, const void *key, size_t key_len, int64_t delta, int64_t *result) {
    kv_entry_t *e = find(t, key, key_len);
    int64_t base = 0;
    if (e && e->is_set) {
        int rc = parse_int64(e->val, e->val_len, &base);
        if (rc < 0) return rc;
    }
    int64_t sum = (int64_t)((uint64_t)base + (uint64_t)delta);
    char text[24];
    int n = snprintf(text, sizeof text, "%lld", (long long)sum);
    int rc = kv_table_set(t, key, key_len, text, (size_t)n);
    if (rc == 0) *result = sum;
    return rc;
}

int kv_table_append(kv_table_t *t, const void *key, size_t key_len, const void *val,
                    size_t val_len) {
    kv_entry_t *e = find(t, key, key_len);
    if (!e || !e->is_set) return kv_table_set(t, key, key_len, val, val_len);
    size_t total = e->val_len + val_len;
    if (total > e->val_cap) {
        size_t cap = e->val_cap * 2 > total ? e->val_cap * 2 : total;
        if (would_exceed(t, cap - e->val_cap)) return -ENOSPC;
        uint8_t *p = realloc(e->val, cap);
        if (!p) return -ENOMEM;
        e->val = p;
        t->bytes += cap - e->val_cap;
        e->val_cap = cap;
    }
    if (val_len) memcpy(e->val + e->val_len, val, val_len);
    e->val_len = total;
    wake_all(e);
    return 0;
}

int kv_table_delete(kv_table_t *t, const void *key, size_t key_len) {
    kv_entry_t *e = find(t, key, key_len);
    if (!e || !e->is_set) return 0;
    t->bytes -= value_charge(e);
    t->n_set--;
    e->is_set = false;
    e->val_len = 0;
    /* The entry may live on (a queue, waiters): its buffer is no longer charged, so free it. */
    free(e->val);
    e->val = NULL;
    e->val_cap = 0;
    maybe_remove(t, e);
    return 1;
}

bool kv_table_check(kv_table_t *t, const void *key, size_t key_len) {
    kv_entry_t *e = find(t, key, key_len);
    return e && (e->is_set || e->q_head);
}

int64_t kv_table_num_keys(const kv_table_t *t) {
    return t->n_set;
}

size_t kv_table_bytes(const kv_table_t *t) {
    return t->bytes;
}

int kv_table_queue_push(kv_table_t *t, const void *key, size_t key_len, const void *val,
                        size_t val_len) {
    kv_entry_t *e;
    size_t cost = val_len + ITEM_OVERHEAD;
    int rc = get_or_create(t, key, key_len, cost, &e);
    if (rc < 0) return rc;
    queue_item_t *item = malloc(sizeof *item + val_len);
    if (!item) {
        maybe_remove(t, e);
        return -ENOMEM;
    }
    item->next = NULL;
    item->len = val_len;
    if (val_len) memcpy(item->data, val, val_len);
    if (e->q_tail)
        e->q_tail->next = item;
    else
        e->q_head = item;
    e->q_tail = item;
    e->q_len++;
    t->bytes += cost;
    wake_one(e);
    return 0;
}

int kv_table_queue_pop(kv_table_t *t, const void *key, size_t key_len, int64_t *len_before,
                       uint8_t **item_out, size_t *item_len) {
    kv_entry_t *e = find(t, key, key_len);
    *len_before = e ? e->q_len : 0;
    *item_out = NULL;
    *item_len = 0;
    if (!e || !e->q_head) return 0;
    queue_item_t *item = e->q_head;
    uint8_t *copy = malloc(item->len ? item->len : 1);
    if (!copy) return -ENOMEM;
    memcpy(copy, item->data, item->len);
    *item_out = copy;
    *item_len = item->len;
    e->q_head = item->next;
    if (!e->q_head) e->q_tail = NULL;
    e->q_len--;
    t->bytes -= item->len + ITEM_OVERHEAD;
    free(item);
    maybe_remove(t, e);
    return 0;
}

int64_t kv_table_queue_len(kv_table_t *t, const void *key, size_t key_len) {
    kv_entry_t *e = find(t, key, key_len);
    return e ? e->q_len : 0;
}

int kv_table_wait_begin(kv_table_t *t, uint64_t max_keys, kv_wake_cb cb, void *owner,
                        kv_waiter_t **out) {
    if (max_keys > (SIZE_MAX - sizeof(kv_waiter_t) - MALLOC_OVERHEAD) / sizeof(wait_link_t))
        return -ENOMEM;
    if (would_exceed(t, waiter_charge(max_keys))) return -ENOSPC;
    kv_waiter_t *w = calloc(1, sizeof *w + (size_t)max_keys * sizeof(wait_link_t));
    if (!w) return -ENOMEM;
    w->t = t;
    t->bytes += waiter_charge(max_keys);
    w->cb = cb;
    w->owner = owner;
    w->max_links = max_keys;
    w->is_ready_now = true;
    *out = w;
    return 0;
}

int kv_table_wait_add_key(kv_table_t *t, kv_waiter_t *w, const void *key, size_t key_len) {
    if (kv_table_check(t, key, key_len)) return 0;
    w->is_ready_now = false;
    if (w->n_links >= w->max_links) return -EINVAL;
    kv_entry_t *e;
    int rc = get_or_create(t, key, key_len, 0, &e);
    if (rc < 0) return rc;
    link_waiter(w, e);
    return 0;
}

void kv_table_wait_cancel(kv_table_t *t, kv_waiter_t *w) {
    for (uint64_t i = 0; i < w->n_links; i++) {
        wait_link_t *l = &w->links[i];
        kv_entry_t *e = l->entry;
        if (!e) continue;
        unlink_wait(e, l);
        maybe_remove(t, e);
    }
    waiter_free(w);
}

int kv_table_wait_commit(kv_table_t *t, kv_waiter_t *w) {
    /* As PyTorch: ready only if every key is present when the request arrives. */
    if (w->is_ready_now) {
        kv_table_wait_cancel(t, w);
        return 1;
    }
    return 0;
}

bool kv_table_next_key(const kv_table_t *t, size_t *cursor, const uint8_t **key, size_t *key_len) {
    for (; *cursor < t->cap; (*cursor)++) {
        const kv_entry_t *e = t->slots[*cursor];
        if (e && e->is_set) {
            *key = e->key;
            *key_len = e->key_len;
            (*cursor)++;
            return true;
        }
    }
    return false;
}

static void link_waiter(kv_waiter_t *w, kv_entry_t *e) {
    wait_link_t *l = &w->links[w->n_links++];
    l->entry = e;
    l->waiter = w;
    l->next = NULL;
    l->prev = e->wait_tail;
    if (e->wait_tail)
        e->wait_tail->next = l;
    else
        e->wait_head = l;
    e->wait_tail = l;
    w->remaining++;
}

int kv_table_barrier(kv_table_t *t, const void *key, size_t key_len, int64_t world_size,
                     kv_wake_cb cb, void *owner, kv_waiter_t **out) {
    kv_entry_t *e = find(t, key, key_len);
    int64_t count = 0;
    if (e && e->is_set) {
        int rc = parse_int64(e->val, e->val_len, &count);
        if (rc < 0) return rc;
    }
    count = (int64_t)((uint64_t)count + 1u);
    char text[24];
    int n = snprintf(text, sizeof text, "%lld", (long long)count);
    kv_waiter_t *w = NULL;
    if (count < world_size) {
        int rc = kv_table_wait_begin(t, 1, cb, owner, &w);
        if (rc < 0) return rc;
    }
    int rc = get_or_create(t, key, key_len, value_delta(e, (size_t)n), &e);
    if (rc == 0) rc = store_value(t, e, text, (size_t)n);
    if (rc < 0) {
        if (w) waiter_free(w);
        if (e) maybe_remove(t, e); /* NULL: a new key the table had no room for */
        return rc;
    }
    if (!w) {
        wake_all(e);
        return 1;
    }
    link_waiter(w, e);
    *out = w;
    return 0;
}
