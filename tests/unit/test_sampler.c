/* Unit tests of worker/sampler: DistributedSampler's contract and the global cursor. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"

/* How often each dataset index is taken by all ranks of one epoch resumed at cursor. */
static void count_epoch(int64_t n, int world, uint64_t seed, int64_t epoch, int64_t cursor,
                        int *counts) {
    memset(counts, 0, (size_t)n * sizeof *counts);
    for (int r = 0; r < world; r++) {
        sampler_t s;
        cr_assert_eq(sampler_init(&s, n, world, r, seed, true), 0);
        sampler_set_epoch(&s, epoch);
        int64_t k = sampler_rank_count(&s, cursor);
        for (int64_t i = 0; i < k; i++)
            counts[sampler_index(&s, cursor, i)]++;
        sampler_free(&s);
    }
}

Test(sampler, shards_are_disjoint_and_cover_everything) {
    int counts[1000];
    count_epoch(1000, 4, 7, 0, 0, counts);
    for (int i = 0; i < 1000; i++)
        cr_assert_eq(counts[i], 1, "index %d taken %d times", i, counts[i]);
}

Test(sampler, padding_gives_every_rank_the_same_count) {
    int counts[10];
    count_epoch(10, 4, 1, 0, 0, counts); /* 12 positions: two samples repeat */
    int total = 0, twice = 0;
    for (int i = 0; i < 10; i++) {
        cr_assert(counts[i] == 1 || counts[i] == 2);
        total += counts[i];
        twice += counts[i] == 2;
    }
    cr_assert(total == 12 && twice == 2);
    for (int r = 0; r < 4; r++) {
        sampler_t s;
        sampler_init(&s, 10, 4, r, 1, true);
        cr_assert_eq(sampler_rank_count(&s, 0), 3);
        sampler_free(&s);
    }
}

Test(sampler, order_depends_on_seed_and_epoch_only) {
    sampler_t a, b;
    sampler_init(&a, 500, 1, 0, 42, true);
    sampler_init(&b, 500, 1, 0, 42, true);
    sampler_set_epoch(&a, 3);
    sampler_set_epoch(&b, 3);
    cr_assert_eq(memcmp(a.perm, b.perm, 500 * sizeof *a.perm), 0, "same seed and epoch");
    sampler_set_epoch(&b, 4);
    cr_assert_neq(memcmp(a.perm, b.perm, 500 * sizeof *a.perm), 0, "another epoch");
    sampler_t c;
    sampler_init(&c, 500, 1, 0, 43, true);
    sampler_set_epoch(&c, 3);
    cr_assert_neq(memcmp(a.perm, c.perm, 500 * sizeof *a.perm), 0, "another seed");
    int64_t fixed = 0;
    for (int i = 0; i < 500; i++)
        fixed += a.perm[i] == i;
    cr_assert_lt(fixed, 20, "shuffled");
    sampler_free(&a);
    sampler_free(&b);
    sampler_free(&c);
    sampler_t plain;
    sampler_init(&plain, 5, 2, 1, 0, false);
    cr_assert(sampler_index(&plain, 0, 0) == 1 && sampler_index(&plain, 0, 1) == 3);
    sampler_free(&plain);
}

Test(sampler, two_ranks_by_b_cover_one_rank_by_2b) {
    /* step s of 2 ranks x batch B takes the same samples as step s of 1 rank x batch 2B */
    const int64_t n = 96, B = 8;
    sampler_t one, r0, r1;
    sampler_init(&one, n, 1, 0, 5, true);
    sampler_init(&r0, n, 2, 0, 5, true);
    sampler_init(&r1, n, 2, 1, 5, true);
    for (int64_t step = 0; step < n / (2 * B); step++) {
        int seen[96] = {0};
        for (int64_t j = 0; j < 2 * B; j++)
            seen[sampler_index(&one, 0, step * 2 * B + j)]++;
        for (int64_t j = 0; j < B; j++) {
            seen[sampler_index(&r0, 0, step * B + j)]--;
            seen[sampler_index(&r1, 0, step * B + j)]--;
        }
        for (int i = 0; i < 96; i++)
            cr_assert_eq(seen[i], 0, "step %lld index %d", (long long)step, i);
    }
    sampler_free(&one);
    sampler_free(&r0);
    sampler_free(&r1);
}

Test(sampler, resume_at_the_cursor_with_another_world_size) {
    const int64_t n = 120;
    /* 4 ranks consumed 40 global positions; the job resumes with 3 ranks at cursor 40 */
    int before[120] = {0}, after[120];
    for (int r = 0; r < 4; r++) {
        sampler_t s;
        sampler_init(&s, n, 4, r, 9, true);
        for (int64_t i = 0; i < 10; i++)
            before[sampler_index(&s, 0, i)]++;
        sampler_free(&s);
    }
    count_epoch(n, 3, 9, 0, 40, after);
    /* every sample once; the 80 positions left do not split in 3, so as many as 2 are padding
     * (a sample seen twice) to keep every rank's count equal */
    int extra = 0;
    for (int i = 0; i < n; i++) {
        cr_assert_geq(before[i] + after[i], 1, "index %d never seen", i);
        extra += before[i] + after[i] - 1;
    }
    cr_assert_leq(extra, 2);
}

Test(sampler, bad_arguments) {
    sampler_t s;
    cr_assert_eq(sampler_init(&s, 0, 1, 0, 0, true), -EINVAL);
    cr_assert_eq(sampler_init(&s, 10, 2, 2, 0, true), -EINVAL);
    cr_assert_eq(sampler_init(&s, 10, 0, 0, 0, true), -EINVAL);
}

Test(sampler, every_rank_gets_the_same_count_after_a_resume_with_another_world) {
    /* 1000 samples, 2 ranks consumed 402 positions; the job resumes with 3 ranks */
    sampler_t s[3];
    for (int r = 0; r < 3; r++)
        cr_assert_eq(sampler_init(&s[r], 1000, 3, r, 5, true), 0);
    int64_t count = sampler_rank_count(&s[0], 402);
    for (int r = 1; r < 3; r++)
        cr_assert_eq(sampler_rank_count(&s[r], 402), count, "rank %d", r);
    cr_assert_eq(count, (1002 - 402 + 2) / 3);
    /* together they cover every remaining position of the epoch */
    bool seen[1000] = {0};
    for (int r = 0; r < 3; r++)
        for (int64_t i = 0; i < count; i++)
            seen[sampler_index(&s[r], 402, i)] = true;
    for (int64_t p = 402; p < 1000; p++)
        cr_assert(seen[s[0].perm[p]], "position %lld", (long long)p);
    for (int r = 0; r < 3; r++)
        sampler_free(&s[r]);
}
