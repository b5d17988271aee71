/* Unit tests of launcher/rdzv/rdzv_record: the rendezvous' JSON records round-trip, and anything
 * else from the store is refused whole. */
#include <cJSON.h>
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "rdzv/rdzv_record.h"

Test(rdzv_record, node_and_why_round_trip) {
    char text[RDZV_RECORD_MAX_BYTES];
    rdzv_node_record_t n = {.nproc = 8, .hint = -1, .is_host = true}, n2;
    cr_assert_gt(rdzv_record_node_format(&n, text, sizeof text), 0);
    cr_assert(rdzv_record_node_parse(text, strlen(text), &n2), "%s", text);
    cr_assert(n2.nproc == 8 && n2.hint == -1 && n2.is_host);
    rdzv_why_t w = {.code = 75, .is_permanent = false, .failures = 3, .node = 1, .rank = 5}, w2;
    cr_assert_gt(rdzv_record_why_format(&w, text, sizeof text), 0);
    cr_assert_str_eq(text,
                     "{\"code\":75,\"permanent\":false,\"failures\":3,\"node\":1,\"rank\":5}");
    cr_assert(rdzv_record_why_parse(text, strlen(text), &w2));
    cr_assert(w2.code == 75 && !w2.is_permanent && w2.failures == 3 && w2.node == 1 &&
              w2.rank == 5);
}

Test(rdzv_record, the_end_of_a_job_round_trips_and_only_with_code_0) {
    char text[RDZV_RECORD_MAX_BYTES];
    rdzv_why_t w = {.node = -1, .rank = -1, .is_finished = true}, w2;
    cr_assert_gt(rdzv_record_why_format(&w, text, sizeof text), 0);
    cr_assert(rdzv_record_why_parse(text, strlen(text), &w2), "%s", text);
    cr_assert(w2.is_finished && w2.code == 0, "%s", text);
    rdzv_record_why_describe(&w2, text, sizeof text);
    cr_assert_str_eq(text, "the job finished");
    rdzv_why_t sized = {.code = 75, .failures = 2, .node = 0, .rank = 1, .nodes = 3};
    cr_assert_gt(rdzv_record_why_format(&sized, text, sizeof text), 0);
    cr_assert(rdzv_record_why_parse(text, strlen(text), &w2) && w2.nodes == 3, "%s", text);
    const char *plain = "{\"code\":0,\"permanent\":false,\"failures\":0,\"node\":-1,\"rank\":-1}";
    cr_assert(rdzv_record_why_parse(plain, strlen(plain), &w2) && !w2.is_finished && !w2.nodes);
    const char *bad[] = {
        "{\"code\":75,\"permanent\":false,\"failures\":1,\"node\":0,\"rank\":0,\"finished\":true}",
        "{\"code\":0,\"permanent\":false,\"failures\":0,\"node\":0,\"rank\":0,\"finished\":1}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_not(rdzv_record_why_parse(bad[i], strlen(bad[i]), &w2), "%s", bad[i]);
}

Test(rdzv_record, malformed_records_are_refused) {
    rdzv_why_t w;
    rdzv_node_record_t n;
    const char *bad_why[] = {
        "",
        "{}",
        "[]",
        "null",
        "code=75 permanent=0 failures=1 node=0 rank=0",
        "{\"code\":75,\"permanent\":false,\"failures\":1,\"node\":0}",                /* no rank */
        "{\"code\":\"75\",\"permanent\":false,\"failures\":1,\"node\":0,\"rank\":0}", /* a string */
        "{\"code\":75.5,\"permanent\":false,\"failures\":1,\"node\":0,\"rank\":0}", /* not whole */
        "{\"code\":300,\"permanent\":false,\"failures\":1,\"node\":0,\"rank\":0}",  /* no exit code
                                                                                     */
        "{\"code\":75,\"permanent\":1,\"failures\":1,\"node\":0,\"rank\":0}",       /* not a bool */
        "{\"code\":75,\"permanent\":false,\"failures\":-1,\"node\":0,\"rank\":0}",
        "{\"code\":75,\"permanent\":false,\"failures\":1e300,\"node\":0,\"rank\":0}",
    };
    for (size_t i = 0; i < sizeof bad_why / sizeof bad_why[0]; i++)
        cr_assert_not(rdzv_record_why_parse(bad_why[i], strlen(bad_why[i]), &w), "%s", bad_why[i]);
    const char *bad_node[] = {"{\"nproc\":0,\"hint\":-1,\"host\":false}",
                              "{\"nproc\":2,\"hint\":-2,\"host\":false}",
                              "{\"nproc\":2,\"hint\":0}", "nproc=2 hint=0 host=1"};
    for (size_t i = 0; i < sizeof bad_node / sizeof bad_node[0]; i++)
        cr_assert_not(rdzv_record_node_parse(bad_node[i], strlen(bad_node[i]), &n), "%s",
                      bad_node[i]);
    /* not NUL-terminated, and never read past n_bytes */
    char cut[] = {'{', '"', 'n', 'p'};
    cr_assert_not(rdzv_record_node_parse(cut, sizeof cut, &n));
    static char huge[RDZV_RECORD_MAX_BYTES + 2];
    memset(huge, ' ', sizeof huge);
    cr_assert_not(rdzv_record_why_parse(huge, sizeof huge, &w));
}

Test(rdzv_record, descriptions_are_for_people) {
    char text[128];
    rdzv_why_t w = {.code = 137, .is_permanent = false, .failures = 2, .node = 1, .rank = 3};
    rdzv_record_why_describe(&w, text, sizeof text);
    cr_assert_str_eq(text, "exit 137 on node 1 rank 3, failure 2 of the job");
    w = (rdzv_why_t){.code = 0, .node = -1, .rank = -1};
    rdzv_record_why_describe(&w, text, sizeof text);
    cr_assert_str_eq(text, "a membership change");
}

Test(rdzv_record, rank_records_round_trip_and_bad_ones_are_refused) {
    char text[RDZV_RECORD_MAX_BYTES];
    rdzv_rank_record_t r = {.group_rank = 3,
                            .rank_offset = 24,
                            .world_size = 8192,
                            .host_join_index = 17},
                       r2;
    cr_assert_gt(rdzv_record_rank_format(&r, text, sizeof text), 0);
    cr_assert_str_eq(text, "{\"node\":3,\"first_rank\":24,\"world_size\":8192,\"node0\":17}");
    cr_assert(rdzv_record_rank_parse(text, strlen(text), &r2), "%s", text);
    cr_assert(r2.group_rank == 3 && r2.rank_offset == 24 && r2.world_size == 8192 &&
              r2.host_join_index == 17 && !r2.error[0]);
    rdzv_rank_record_t e = {.error = "round 2: node record 5 (3 bytes) is malformed"};
    cr_assert_gt(rdzv_record_rank_format(&e, text, sizeof text), 0);
    cr_assert(rdzv_record_rank_parse(text, strlen(text), &r2), "%s", text);
    cr_assert_str_eq(r2.error, e.error);
    cr_assert_not(r2.is_lost);
    const char *bell = "{\"error\":\"a\\u0007b\",\"lost\":true}";
    cr_assert(rdzv_record_rank_parse(bell, strlen(bell), &r2));
    cr_assert_str_eq(r2.error, "a?b", "only printable bytes reach a log");
    cr_assert(r2.is_lost);
    const char *bad[] = {
        "{}",
        "{\"node\":3,\"first_rank\":24,\"world_size\":8192}",               /* no node0 */
        "{\"node\":3,\"first_rank\":8192,\"world_size\":8192,\"node0\":0}", /* past the world */
        "{\"node\":1024,\"first_rank\":0,\"world_size\":8192,\"node0\":0}", /* > RDZV_MAX_NODES */
        "{\"node\":0,\"first_rank\":0,\"world_size\":0,\"node0\":0}",       /* empty world */
        "{\"node\":0,\"first_rank\":0,\"world_size\":1,\"node0\":-1}",
        "{\"error\":\"\"}",
        "{\"error\":7}",
        "{\"error\":\"x\",\"node\":0}", /* both */
        "{\"error\":\"x\"}",            /* lost or not? */
        "{\"error\":\"x\",\"lost\":1}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_not(rdzv_record_rank_parse(bad[i], strlen(bad[i]), &r2), "accepted %s", bad[i]);
}

/* etcd: a node record carries its agent's store, and the rank records node 0's, as "HOST:PORT"
 * (the last ':' splits: an IPv6 address as it is); anything else under "store" is refused. */
Test(rdzv_record, store_addresses_round_trip_and_bad_ones_are_refused) {
    char text[RDZV_RECORD_MAX_BYTES];
    rdzv_node_record_t n = {.nproc = 2, .hint = -1, .store_host = "10.0.0.7", .store_port = 41234},
                       n2;
    cr_assert_gt(rdzv_record_node_format(&n, text, sizeof text), 0);
    cr_assert_str_eq(text, "{\"nproc\":2,\"hint\":-1,\"host\":false,\"store\":\"10.0.0.7:41234\"}");
    cr_assert(rdzv_record_node_parse(text, strlen(text), &n2), "%s", text);
    cr_assert_str_eq(n2.store_host, "10.0.0.7");
    cr_assert_eq(n2.store_port, 41234);
    const char *none = "{\"nproc\":2,\"hint\":-1,\"host\":false}"; /* c10d: no store */
    cr_assert(rdzv_record_node_parse(none, strlen(none), &n2));
    cr_assert(!n2.store_host[0] && n2.store_port == 0);
    rdzv_rank_record_t r = {.world_size = 4, .store_host = "fe80::1", .store_port = 1}, r2;
    cr_assert_gt(rdzv_record_rank_format(&r, text, sizeof text), 0);
    cr_assert(rdzv_record_rank_parse(text, strlen(text), &r2), "%s", text);
    cr_assert_str_eq(r2.store_host, "fe80::1");
    cr_assert_eq(r2.store_port, 1);
    memset(r.store_host, 'h', 255); /* the longest host fits a record */
    r.store_host[255] = '\0';
    r.world_size = INT32_MAX, r.rank_offset = INT32_MAX - 1, r.store_port = 65535;
    cr_assert_gt(rdzv_record_rank_format(&r, text, sizeof text), 0);
    cr_assert(rdzv_record_rank_parse(text, strlen(text), &r2), "%s", text);
    cr_assert_str_eq(r2.store_host, r.store_host);
    const char *bad[] = {
        "h:0",   "h:65536", "h:",      ":80",     "h",     "h:8a",  "h:-1",
        "h: 80", "a b:80",  "a\"b:80", "a\\b:80", "h:+80", "h:1e3", "\x01:80",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        /* the JSON escapes of the bad bytes: the text as JSON must parse, the address not */
        cJSON *s = cJSON_CreateString(bad[i]);
        char *quoted = cJSON_PrintUnformatted(s);
        snprintf(text, sizeof text, "{\"nproc\":2,\"hint\":-1,\"host\":false,\"store\":%s}",
                 quoted);
        cr_assert_not(rdzv_record_node_parse(text, strlen(text), &n2), "accepted %s", text);
        snprintf(text, sizeof text,
                 "{\"node\":0,\"first_rank\":0,\"world_size\":1,\"node0\":0,\"store\":%s}", quoted);
        cr_assert_not(rdzv_record_rank_parse(text, strlen(text), &r2), "accepted %s", text);
        cJSON_free(quoted);
        cJSON_Delete(s);
    }
    const char *not_text = "{\"nproc\":2,\"hint\":-1,\"host\":false,\"store\":8080}";
    cr_assert_not(rdzv_record_node_parse(not_text, strlen(not_text), &n2));
    memset(n.store_host, 'h', sizeof n.store_host); /* 256 characters: one too many */
    snprintf(text, sizeof text, "{\"nproc\":2,\"hint\":-1,\"host\":false,\"store\":\"%.256s:80\"}",
             n.store_host);
    cr_assert_not(rdzv_record_node_parse(text, strlen(text), &n2), "accepted %s", text);
}

/* A node record carries its agent's memory-snapshot listener ("peer"), a rank record the next
 * node's ("next_peer"), parsed as strictly as "store"; both addresses at their longest fit. */
Test(rdzv_record, peer_addresses_round_trip_and_bad_ones_are_refused) {
    char text[RDZV_RECORD_MAX_BYTES];
    rdzv_node_record_t n = {.nproc = 1, .hint = 0, .peer_host = "node3", .peer_port = 40001}, n2;
    cr_assert_gt(rdzv_record_node_format(&n, text, sizeof text), 0);
    cr_assert_str_eq(text, "{\"nproc\":1,\"hint\":0,\"host\":false,\"peer\":\"node3:40001\"}");
    cr_assert(rdzv_record_node_parse(text, strlen(text), &n2), "%s", text);
    cr_assert_str_eq(n2.peer_host, "node3");
    cr_assert_eq(n2.peer_port, 40001);
    cr_assert(!n2.store_host[0]);
    memset(n.store_host, 's', 255);
    n.store_host[255] = '\0';
    memset(n.peer_host, 'p', 255);
    n.peer_host[255] = '\0';
    n.store_port = n.peer_port = 65535;
    cr_assert_gt(rdzv_record_node_format(&n, text, sizeof text), 0, "both longest hosts fit");
    cr_assert(rdzv_record_node_parse(text, strlen(text), &n2), "%s", text);
    cr_assert_str_eq(n2.store_host, n.store_host);
    cr_assert_str_eq(n2.peer_host, n.peer_host);
    rdzv_rank_record_t r = {.world_size = INT32_MAX, .rank_offset = INT32_MAX - 1}, r2;
    memset(r.store_host, 's', 255);
    memset(r.next_peer_host, 'p', 255);
    r.store_port = r.next_peer_port = 65535;
    cr_assert_gt(rdzv_record_rank_format(&r, text, sizeof text), 0, "both longest hosts fit");
    cr_assert(rdzv_record_rank_parse(text, strlen(text), &r2), "%s", text);
    cr_assert_str_eq(r2.next_peer_host, r.next_peer_host);
    cr_assert_eq(r2.next_peer_port, 65535);
    const char *bad[] = {
        "{\"nproc\":1,\"hint\":0,\"host\":false,\"peer\":\"h:0\"}",
        "{\"nproc\":1,\"hint\":0,\"host\":false,\"peer\":\"a b:80\"}",
        "{\"nproc\":1,\"hint\":0,\"host\":false,\"peer\":80}",
        "{\"node\":0,\"first_rank\":0,\"world_size\":1,\"node0\":0,\"next_peer\":\"h:65536\"}",
        "{\"node\":0,\"first_rank\":0,\"world_size\":1,\"node0\":0,\"next_peer\":\":80\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bool is_node = strstr(bad[i], "nproc") != NULL;
        bool is_ok = is_node ? rdzv_record_node_parse(bad[i], strlen(bad[i]), &n2)
                             : rdzv_record_rank_parse(bad[i], strlen(bad[i]), &r2);
        cr_assert_not(is_ok, "accepted %s", bad[i]);
    }
}

/* One rule for what a failed round leads to, the agent's and a resubmission's: a membership change
 * or a failure within --max-restarts restarts; a permanent failure ends, within the budget too; a
 * peer failure past it lets the next round's size decide on several nodes, ends on one; any other
 * failure past it ends. */
Test(rdzv_record, a_failed_round_restarts_ends_or_lets_the_size_decide) {
    const struct {
        rdzv_why_t why;
        bool is_multi;
        rdzv_why_outcome_t want;
    } cases[] = {
        {{.code = 0, .failures = 9}, true, RDZV_WHY_RESTARTS},
        {{.code = 1, .failures = 3}, true, RDZV_WHY_RESTARTS},
        {{.code = 1, .failures = 4}, true, RDZV_WHY_ENDS},
        {{.code = 78, .is_permanent = true, .failures = 1}, true, RDZV_WHY_ENDS},
        {{.code = 75, .failures = 3}, true, RDZV_WHY_RESTARTS},
        {{.code = 75, .failures = 4}, true, RDZV_WHY_SIZE_DECIDES},
        {{.code = 75, .failures = 4}, false, RDZV_WHY_ENDS},
        {{.code = 75, .is_permanent = true, .failures = 1}, true, RDZV_WHY_ENDS},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_assert_eq(rdzv_why_outcome(&cases[i].why, 3, cases[i].is_multi), cases[i].want,
                     "case %zu", i);
}
