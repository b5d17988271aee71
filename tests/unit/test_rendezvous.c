/* Unit tests of launcher/rdzv/rendezvous with the agent's state machine (agent_sm) and liveness
 * judge (liveness): rounds over a real store (the store server on its own loop in a thread, each
 * agent a blocking client, as on the agent's thread pool), the state machine stepped by hand with
 * the results, and a clock of the test's own. The histories are those chaos runs found.
 *
 * Stale round (tests/chaos/run.py --seed 919785934): round 1 closed with two members that were
 * then killed; the two agents started in their place arrive after it closed, and with the job
 * full (--nnodes 2) nobody would ever end round 1. A spare must judge the members' heartbeats and
 * open the next round within the liveness timeout. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "agent/agent_sm.h"
#include "exit_codes.h"
#include "ddp_error.h"
#include "rdzv/liveness.h"
#include "log.h"
#include "rdzv/rdzv_kv.h"
#include "rdzv/rendezvous.h"
#include "store/store_server.h"

static void suite_init(void) {
    signal(SIGPIPE, SIG_IGN);
    log_init("test_rendezvous", LOG_LEVEL_WARN);
}

TestSuite(rendezvous, .init = suite_init, .timeout = 60);
TestSuite(liveness, .timeout = 10);

/* ---- the store in a thread ---------------------------------------------------------------- */

typedef struct {
    uv_loop_t loop;
    uv_async_t stop;
    store_server_t *srv;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int start_rc; /* 1 until started */
    uint16_t port;
    char err[256];
} server_t;

static void on_stop(uv_async_t *h) {
    server_t *s = h->data;
    store_server_stop(s->srv, NULL, NULL);
    uv_close((uv_handle_t *)h, NULL);
}

static void *server_main(void *arg) {
    server_t *s = arg;
    uv_loop_init(&s->loop);
    uv_async_init(&s->loop, &s->stop, on_stop);
    s->stop.data = s;
    store_server_opts_t o = {.host = "127.0.0.1", .port = 0};
    store_limits_default(&o.limits);
    int rc = store_server_start(&s->loop, &o, &s->srv, s->err, sizeof s->err);
    if (rc < 0) uv_close((uv_handle_t *)&s->stop, NULL);
    pthread_mutex_lock(&s->mu);
    s->start_rc = rc;
    s->port = rc == 0 ? store_server_port(s->srv) : 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return NULL;
}

static void server_start(server_t *s) {
    memset(s, 0, sizeof *s);
    s->start_rc = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    cr_assert_eq(pthread_create(&s->thread, NULL, server_main, s), 0);
    pthread_mutex_lock(&s->mu);
    while (s->start_rc == 1)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    cr_assert_eq(s->start_rc, 0, "the store did not start: %s", s->err);
}

static void server_stop(server_t *s) {
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
}

/* ---- agents: a rendezvous and a client each ------------------------------------------------ */

static ddprun_opts_t opts; /* the job's options, as every agent has them */

static void job_options(uint16_t port) {
    memset(&opts, 0, sizeof opts);
    opts.min_nodes = opts.max_nodes = 2; /* --nnodes 2: a late agent finds the job full */
    opts.last_call_timeout_s = 0;
    opts.nproc_per_node = 2;
    opts.node_rank = -1;
    strcpy(opts.rdzv_backend, "c10d");
    strcpy(opts.rdzv_host, "127.0.0.1");
    opts.rdzv_port = port;
    strcpy(opts.rdzv_id, "stale");
    opts.join_timeout_s = 20;
    opts.heartbeat_timeout_s = 3;
}

typedef struct {
    rdzv_t r;
    rdzv_kv_t *kv;
    int round;
    rdzv_result_t out;
    int rc;
    char err[256];
} agent_t;

static void agent_start(agent_t *a, bool is_host) {
    memset(a, 0, sizeof *a);
    rdzv_init(&a->r, &opts, is_host);
    int rc = rdzv_kv_connect(&opts, NULL, 5000, 30000, &a->kv);
    cr_assert_eq(rc, 0, "%s", a->kv ? a->kv->ops->error(a->kv) : ddp_strerror(rc));
}

/* SIGKILL: it says nothing more, its heartbeats stop. */
static void agent_dies(agent_t *a) {
    rdzv_kv_destroy(a->kv);
    a->kv = NULL;
}

/* What the agent's join job does: the current round, or a later one the plan names. */
static void *join_main(void *arg) {
    agent_t *a = arg;
    int current = 0;
    a->rc = rdzv_current_round(&a->r, a->kv, &current, a->err, sizeof a->err);
    if (a->rc == 0)
        a->rc = rdzv_join(&a->r, a->kv, current > a->round ? current : a->round, &a->out, a->err,
                          sizeof a->err);
    return NULL;
}

static void join(agent_t *a, int round) {
    a->round = round;
    join_main(a);
    cr_assert_eq(a->rc, 0, "join: %s", a->err);
}

/* Two agents join together (a join returns once its round closes). */
static void join_both(agent_t *a, agent_t *b, int round) {
    pthread_t t;
    a->round = b->round = round;
    cr_assert_eq(pthread_create(&t, NULL, join_main, a), 0);
    join_main(b);
    pthread_join(t, NULL);
    cr_assert_eq(a->rc, 0, "join: %s", a->err);
    cr_assert_eq(b->rc, 0, "join: %s", b->err);
    cr_assert(a->out.is_member && b->out.is_member);
}

/* m[0..n) join at once, each on a thread of its own (a join returns once its round closes). */
static void join_together(agent_t *m, int n) {
    pthread_t t[RDZV_MAX_NODES];
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, join_main, &m[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

/* A store and three agents of a 3-node job (m[0] the store's host), not joined yet. */
static void start_three(server_t *srv, agent_t *m) {
    server_start(srv);
    job_options(srv->port);
    opts.min_nodes = opts.max_nodes = 3;
    for (int i = 0; i < 3; i++)
        agent_start(&m[i], i == 0);
}

/* The three joined as the round's members: by_rank[g] is node g. */
static void joined_by_rank(agent_t *m, agent_t **by_rank) {
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(m[i].rc, 0, "join: %s", m[i].err);
        cr_assert(m[i].out.is_member && m[i].out.group_world_size == 3);
        by_rank[m[i].out.group_rank] = &m[i];
    }
}

static void beat(agent_t *a) {
    int64_t counters[RDZV_MAX_NODES];
    cr_assert_eq(rdzv_heartbeat(&a->r, a->kv, &a->out, NULL, counters), 0);
}

/* ---- the state machine of one agent -------------------------------------------------------- */

static agent_sm_t sm;
static agent_sm_actions_t acts;

static void step(agent_sm_event_t ev) {
    agent_sm_step(&sm, &ev, &acts);
}

static const agent_sm_action_t *find(agent_sm_action_kind_t kind) {
    for (int i = 0; i < acts.n; i++)
        if (acts.a[i].kind == kind) return &acts.a[i];
    return NULL;
}

static const agent_sm_action_t *must_find(agent_sm_action_kind_t kind) {
    const agent_sm_action_t *a = find(kind);
    cr_assert_not_null(a, "no action of kind %d among %d", (int)kind, acts.n);
    return a;
}

static bool said(const char *text) {
    for (int i = 0; i < acts.n; i++)
        if (acts.a[i].kind == AGENT_ACT_SAY && strstr(acts.a[i].text, text)) return true;
    return false;
}

/* One reading of the members' marks by the spare, judged at now_ms. */
static int judge_at(agent_t *a, liveness_t *l, uint64_t now_ms) {
    int64_t marks[RDZV_MAX_NODES];
    cr_assert_eq(rdzv_read_members(&a->r, a->kv, &a->out, marks), 0, "%s",
                 a->kv->ops->error(a->kv));
    return liveness_judge(l, marks, a->out.is_member ? a->out.group_rank : -1, now_ms);
}

Test(rendezvous, closed_round_whose_members_died_is_ended_by_a_late_agent) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);

    /* round 0: nodes A and B; a worker fails, round 1 opens */
    agent_t a0, b0;
    agent_start(&a0, true);
    agent_start(&b0, false);
    join_both(&a0, &b0, 0);
    rdzv_why_t failed = {.code = 1, .failures = 0, .node = 0, .rank = 1};
    cr_assert_eq(rdzv_request_restart(&a0.r, a0.kv, 0, &failed), 0);
    /* round 1 closes with two agents that beat once and are killed; the store stays */
    agent_t a1, b1;
    agent_start(&a1, false);
    agent_start(&b1, false);
    join_both(&a1, &b1, 1);
    cr_assert_eq(a1.out.round, 1);
    beat(&a1);
    beat(&b1);
    agent_dies(&a1);
    agent_dies(&b1);
    agent_dies(&a0);
    agent_dies(&b0);

    /* C, started in a killed agent's place, arrives after round 1 closed */
    agent_t c, d;
    agent_start(&c, false);
    agent_start(&d, false);
    agent_sm_config_t cfg = {.is_multi = true,
                             .nproc_per_node = 2,
                             .max_nodes = 2,
                             .max_restarts = 3,
                             .shutdown_timeout_s = 30};
    agent_sm_init(&sm, &cfg);
    step((agent_sm_event_t){.kind = AGENT_EV_START});
    int planned = must_find(AGENT_ACT_JOIN)->plan.round;
    join(&c, planned);
    cr_assert_not(c.out.is_member, "round 1 closed with its two members");
    cr_assert_eq(c.out.round, 1);
    cr_assert_eq(c.out.group_world_size, 2);
    step((agent_sm_event_t){.kind = AGENT_EV_JOIN_DONE, .joined = c.out});
    cr_assert(said("round 1 runs with 2 nodes without this one; waiting for the next round"));
    must_find(AGENT_ACT_WATCH);
    /* the late agent judges the members' heartbeats (without beating itself) */
    const agent_sm_action_t *hb = find(AGENT_ACT_START_HEARTBEATS);
    cr_assert_not_null(hb, "a late agent of a full job must watch the round's members: without "
                           "it nobody ends a round whose members all died");
    cr_assert_eq(hb->round.round, 1);
    cr_assert(agent_sm_is_beating(&sm, 1), "its judgement of the members counts");
    join(&d, 0); /* the other restarted agent: the same story */
    cr_assert_not(d.out.is_member);

    /* the spare's clock: the members' counters stand still */
    liveness_t l;
    uint64_t limit_ms = (uint64_t)(opts.heartbeat_timeout_s * 1000);
    liveness_reset(&l, c.out.group_world_size, limit_ms, 0);
    cr_assert_eq(judge_at(&c, &l, 0), -1);
    cr_assert_eq(judge_at(&c, &l, limit_ms), -1, "not before the liveness timeout");
    int lost = judge_at(&c, &l, limit_ms + 1);
    cr_assert_eq(lost, 0, "member 0 is stale after the liveness timeout (got %d)", lost);
    step((agent_sm_event_t){.kind = AGENT_EV_PEER_SILENT, .node = lost});
    const agent_sm_action_t *rep = must_find(AGENT_ACT_REPORT);
    cr_assert_eq(rep->why.code, 0, "a membership change: it costs no restart");
    cr_assert_eq(rep->round.round, 1);
    cr_assert_eq(rdzv_request_restart(&c.r, c.kv, rep->round.round, &rep->why), 0);
    step((agent_sm_event_t){.kind = AGENT_EV_REPORT_DONE});

    /* every agent's watch of round 1 ends (D's too), and round 2 is the current round */
    char why_text[256];
    cr_assert_eq(d.out.round, 1);
    cr_assert_eq(c.out.round, 1);
    cr_assert_eq(rdzv_wait_restart(&d.r, d.kv, &d.out, why_text, sizeof why_text), 0);
    cr_assert_eq(rdzv_wait_restart(&c.r, c.kv, &c.out, why_text, sizeof why_text), 0);
    agent_sm_event_t seen = {.kind = AGENT_EV_RESTART_SEEN};
    seen.is_valid = rdzv_record_why_parse(why_text, strlen(why_text), &seen.why);
    cr_assert(seen.is_valid, "%s", why_text);
    rdzv_record_why_describe(&seen.why, seen.text, sizeof seen.text);
    step(seen);
    cr_assert(said("membership changes: every node joins round 2"));
    cr_assert_eq(must_find(AGENT_ACT_JOIN)->plan.round, 2);
    int current = -1;
    char err[512];
    cr_assert_eq(rdzv_current_round(&d.r, d.kv, &current, err, sizeof err), 0, "%s", err);
    cr_assert_eq(current, 2, "an agent started now joins round 2");

    /* round 2: C and D are its members and run */
    join_both(&c, &d, 2);
    cr_assert_eq(c.out.round, 2);
    step((agent_sm_event_t){.kind = AGENT_EV_JOIN_DONE, .joined = c.out});
    cr_assert_eq(must_find(AGENT_ACT_START_WORKERS)->round.round, 2);
    cr_assert_eq(sm.failures, 1, "round 0's failure; the membership change spent none");
    agent_dies(&c);
    agent_dies(&d);
    server_stop(&srv);
}

Test(rendezvous, late_agent_leaves_a_living_round_alone) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    agent_t a, b, c;
    agent_start(&a, true);
    agent_start(&b, false);
    join_both(&a, &b, 0);
    agent_start(&c, false);
    join(&c, 0);
    cr_assert_not(c.out.is_member);
    liveness_t l;
    liveness_reset(&l, 2, 3000, 0);
    for (uint64_t t = 0; t <= 10000; t += 1000) { /* the members beat every second */
        beat(&a);
        beat(&b);
        cr_assert_eq(judge_at(&c, &l, t), -1, "at %llu ms", (unsigned long long)t);
    }
    agent_dies(&a);
    agent_dies(&b);
    agent_dies(&c);
    server_stop(&srv);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* --nnodes 2:3: the second agent's last call ends when the third closes the round at the maximum,
 * not after the whole last_call_timeout. A member that learned its round that much later than the
 * others sent no heartbeat meanwhile, and they ended the round without it (found with
 * last_call_timeout 2 s > heartbeat_timeout 1 s in test_a_lost_node_costs_no_restart). */
Test(rendezvous, the_last_call_ends_when_the_round_is_full) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    opts.min_nodes = 2;
    opts.max_nodes = 3;
    opts.last_call_timeout_s = 5;
    agent_t m[3];
    pthread_t t[2];
    for (int i = 0; i < 3; i++)
        agent_start(&m[i], i == 0);
    double t0 = now_s();
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, join_main, &m[i]), 0);
    usleep(300 * 1000); /* both are in, the last call runs */
    join(&m[2], 0);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    double took = now_s() - t0;
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(m[i].rc, 0, "join %d: %s", i, m[i].err);
        cr_assert(m[i].out.is_member && m[i].out.group_world_size == 3);
    }
    cr_assert_lt(took, 4.0, "the joins took %.2f s: the last call ran its full 5 s", took);
    for (int i = 0; i < 3; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

/* Every member beats and judges only the next one around the ring (O(N) for the store, not
 * O(N^2)), and still some living member finds any member's loss. */
Test(rendezvous, a_lost_member_is_found_by_the_one_before_it) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    join_together(m, 3);
    agent_t *by_rank[3];
    joined_by_rank(m, by_rank);
    int64_t counters[RDZV_MAX_NODES];
    liveness_t judges[3];
    for (int g = 0; g < 3; g++)
        liveness_reset(&judges[g], 3, 1000, 0);
    for (int g = 0; g < 3; g++) { /* everyone beats: nobody is stale */
        cr_assert_eq(
            rdzv_heartbeat(&by_rank[g]->r, by_rank[g]->kv, &by_rank[g]->out, NULL, counters), 0);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(counters[i] == LIVENESS_ALIVE, i != (g + 1) % 3, "rank %d reads %d", g, i);
        cr_assert_eq(liveness_judge(&judges[g], counters, g, 0), -1);
    }
    agent_dies(by_rank[2]);
    int found = 0;
    for (uint64_t now = 1500; now <= 3000; now += 1500) { /* the two that live beat on */
        for (int g = 0; g < 2; g++) {
            cr_assert_eq(
                rdzv_heartbeat(&by_rank[g]->r, by_rank[g]->kv, &by_rank[g]->out, NULL, counters),
                0);
            int lost = liveness_judge(&judges[g], counters, g, now);
            if (lost < 0) continue;
            cr_assert_eq(g, 1, "rank %d judged %d: only the one before the dead one does", g, lost);
            cr_assert_eq(lost, 2);
            cr_assert_eq(now, 3000, "its last beat (after 0) changed its counter at 1500");
            found++;
        }
    }
    cr_assert_eq(found, 1, "the member before the dead one finds it");
    for (int g = 0; g < 2; g++)
        agent_dies(by_rank[g]);
    server_stop(&srv);
}

/* Two adjacent members lost (the exit barrier counts each): once the one before them knows the
 * first lost, it judges the one after it too, which nobody else alive would. */
Test(rendezvous, past_a_member_known_lost_the_next_one_is_judged) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    join_together(m, 3);
    agent_t *by_rank[3];
    joined_by_rank(m, by_rank);
    int64_t counters[RDZV_MAX_NODES];
    bool known[RDZV_MAX_NODES] = {false};
    liveness_t judge;
    liveness_reset(&judge, 3, 1000, 0);
    agent_dies(by_rank[1]);
    agent_dies(by_rank[2]);
    int lost = -1;
    uint64_t now = 0;
    for (; now <= 6000 && lost < 0; now += 500) {
        cr_assert_eq(
            rdzv_heartbeat(&by_rank[0]->r, by_rank[0]->kv, &by_rank[0]->out, known, counters), 0);
        lost = liveness_judge(&judge, counters, 0, now);
    }
    cr_assert_eq(lost, 1, "its successor first");
    known[1] = true;
    lost = -1;
    for (uint64_t until = now + 6000; now <= until && lost < 0; now += 500) {
        cr_assert_eq(
            rdzv_heartbeat(&by_rank[0]->r, by_rank[0]->kv, &by_rank[0]->out, known, counters), 0);
        cr_assert_eq(counters[1], LIVENESS_ALIVE, "the known one is not read again");
        lost = liveness_judge(&judge, counters, 0, now);
    }
    cr_assert_eq(lost, 2, "then the one after it");
    known[2] = true;
    cr_assert_eq(rdzv_heartbeat(&by_rank[0]->r, by_rank[0]->kv, &by_rank[0]->out, known, counters),
                 0, "alone: nothing to read");
    agent_dies(by_rank[0]);
    server_stop(&srv);
}

Test(rendezvous, each_member_learns_the_next_nodes_memory_snapshot_listener) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    for (int i = 0; i < 3; i++) {
        char host[32];
        snprintf(host, sizeof host, "agent%d", i);
        if (i != 1) rdzv_set_own_peer(&m[i].r, host, (uint16_t)(4000 + i)); /* 1 keeps none */
    }
    join_together(m, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(m[i].rc, 0, "join: %s", m[i].err);
        int next = -1;
        for (int j = 0; j < 3; j++)
            if (m[j].out.group_rank == (m[i].out.group_rank + 1) % 3) next = j;
        cr_assert_geq(next, 0);
        if (next == 1) {
            cr_assert_eq(m[i].out.next_peer_host[0], '\0', "the next node takes no copies");
            continue;
        }
        char want[32];
        snprintf(want, sizeof want, "agent%d", next);
        cr_assert_str_eq(m[i].out.next_peer_host, want, "join index %d", m[i].out.join_index);
        cr_assert_eq(m[i].out.next_peer_port, 4000 + next);
    }
    for (int i = 0; i < 3; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

static void *finish_main(void *arg) {
    agent_t *a = arg;
    a->rc =
        rdzv_finish(&a->r, a->kv, a->out.round, a->out.group_world_size, a->out.group_rank, 20000);
    return NULL;
}

Test(rendezvous, a_member_lost_before_the_exit_barrier_is_counted_done_once) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    join_together(m, 3);
    agent_t *by_rank[3];
    joined_by_rank(m, by_rank);
    agent_dies(by_rank[1]);
    pthread_t t[2];
    agent_t *done[2] = {by_rank[0], by_rank[2]};
    for (int i = 0; i < 2; i++) {
        done[i]->rc = 1;
        cr_assert_eq(pthread_create(&t[i], NULL, finish_main, done[i]), 0);
    }
    usleep(300 * 1000);
    cr_assert(done[0]->rc == 1 && done[1]->rc == 1, "the barrier waits for the third member");
    /* each judge counts it with a client of its own (the barrier's waits in the first) */
    rdzv_kv_t *side[2];
    int counted = 0;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(rdzv_kv_connect(&opts, NULL, 5000, 30000, &side[i]), 0);
        int rc = rdzv_finish_lost(&done[i]->r, side[i], 0, 3, 1, done[i]->out.group_rank);
        cr_assert_geq(rc, 0);
        counted += rc;
    }
    cr_assert_eq(counted, 1, "one judge counts it, the other finds it counted");
    double t0 = now_s();
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
        cr_assert_eq(done[i]->rc, 0, "the barrier ends");
    }
    cr_assert_lt(now_s() - t0, 5.0, "at once, not at the barrier's timeout");
    for (int i = 0; i < 2; i++) {
        rdzv_kv_destroy(side[i]);
        agent_dies(done[i]);
    }
    server_stop(&srv);
}

/* The member whose done ticket completed the count dies before it marks the round all done: the
 * others find every ticket taken and mark it themselves (they waited the barrier's timeout,
 * join_timeout, before), and the round's restart key says the job finished. */
Test(rendezvous, a_member_that_died_after_the_last_done_ticket_does_not_hold_the_barrier) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    join_together(m, 3);
    agent_t *by_rank[3];
    joined_by_rank(m, by_rank);
    pthread_t t[2];
    agent_t *done[2] = {by_rank[0], by_rank[2]};
    for (int i = 0; i < 2; i++) {
        done[i]->rc = 1;
        cr_assert_eq(pthread_create(&t[i], NULL, finish_main, done[i]), 0);
    }
    usleep(300 * 1000); /* both counted and wait */
    rdzv_kv_t *kv = by_rank[1]->kv;
    uint8_t *cur = NULL;
    size_t cur_n = 0;
    cr_assert_eq(
        kv->ops->compare_set(kv, "/ddprun/stale/r0/done_lost/1", "", 0, "self", 4, &cur, &cur_n),
        0);
    free(cur);
    int64_t ticket;
    cr_assert_eq(kv->ops->take_ticket(kv, "/ddprun/stale/r0/done", NULL, &ticket), 0);
    cr_assert_eq(ticket, 2, "the last ticket");
    agent_dies(by_rank[1]); /* before it set all_done */
    double t0 = now_s();
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
        cr_assert_eq(done[i]->rc, 0, "the barrier ends");
    }
    cr_assert_lt(now_s() - t0, 8.0, "within a slice or two, not the barrier's 20 s");
    uint8_t *why;
    size_t why_n;
    cr_assert_eq(done[0]->kv->ops->get(done[0]->kv, "/ddprun/stale/r0/restart", &why, &why_n), 0);
    rdzv_why_t w;
    cr_assert(rdzv_record_why_parse((const char *)why, why_n, &w) && w.is_finished);
    free(why);
    for (int i = 0; i < 2; i++)
        agent_dies(done[i]);
    server_stop(&srv);
}

/* A member that counted itself done and is then judged lost (killed in the barrier) is not
 * counted again: the barrier still waits for the member that has not finished. */
Test(rendezvous, a_member_lost_after_its_own_count_is_not_counted_twice) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    join_together(m, 3);
    agent_t *by_rank[3];
    joined_by_rank(m, by_rank);
    pthread_t t;
    by_rank[1]->rc = 1;
    cr_assert_eq(pthread_create(&t, NULL, finish_main, by_rank[1]), 0);
    usleep(300 * 1000); /* it counted itself and waits */
    rdzv_kv_t *judge;
    cr_assert_eq(rdzv_kv_connect(&opts, NULL, 5000, 30000, &judge), 0);
    cr_assert_eq(rdzv_finish_lost(&by_rank[0]->r, judge, 0, 3, 1, 0), 0, "counted already");
    by_rank[0]->rc = 1;
    pthread_t t0;
    cr_assert_eq(pthread_create(&t0, NULL, finish_main, by_rank[0]), 0);
    usleep(500 * 1000);
    cr_assert(by_rank[0]->rc == 1 && by_rank[1]->rc == 1, "the barrier waits for rank 2");
    finish_main(by_rank[2]);
    cr_assert_eq(by_rank[2]->rc, 0);
    pthread_join(t, NULL);
    pthread_join(t0, NULL);
    cr_assert_eq(by_rank[0]->rc, 0);
    cr_assert_eq(by_rank[1]->rc, 0);
    rdzv_kv_destroy(judge);
    for (int i = 0; i < 3; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

/* ---- a round of many: what each agent asks of the store ---------------------------------------
 */

/* The agent's kv with a count of its requests and of the keys it reads (GET, WAIT, MULTI_GET). */
typedef struct {
    rdzv_kv_t kv;
    rdzv_kv_t *inner;
    int requests;
    size_t keys_read;
    void (*before_compare_set)(const char *key); /* optional: another agent acts then */
} counting_kv_t;

static rdzv_kv_t *inner(rdzv_kv_t *kv) {
    return ((counting_kv_t *)kv)->inner;
}
static counting_kv_t *counted(rdzv_kv_t *kv, size_t keys_read) {
    counting_kv_t *k = (counting_kv_t *)kv;
    k->requests++;
    k->keys_read += keys_read;
    return k;
}
static int c_set(rdzv_kv_t *kv, const char *key, const void *val, size_t len) {
    counted(kv, 0);
    return inner(kv)->ops->set(inner(kv), key, val, len);
}
static int c_get(rdzv_kv_t *kv, const char *key, uint8_t **val, size_t *len) {
    counted(kv, 1);
    return inner(kv)->ops->get(inner(kv), key, val, len);
}
static int c_add(rdzv_kv_t *kv, const char *key, int64_t delta, int64_t *result) {
    counted(kv, 0);
    return inner(kv)->ops->add(inner(kv), key, delta, result);
}
static int c_compare_set(rdzv_kv_t *kv, const char *key, const void *expected, size_t expected_len,
                         const void *desired, size_t desired_len, uint8_t **current,
                         size_t *current_len) {
    counting_kv_t *k = counted(kv, 0);
    if (k->before_compare_set) k->before_compare_set(key);
    return inner(kv)->ops->compare_set(inner(kv), key, expected, expected_len, desired, desired_len,
                                       current, current_len);
}
static int c_wait(rdzv_kv_t *kv, const char *const *keys, size_t n, int64_t timeout_ms) {
    counted(kv, n);
    return inner(kv)->ops->wait(inner(kv), keys, n, timeout_ms);
}
static int c_multi_get(rdzv_kv_t *kv, const char *const *keys, size_t n, uint8_t **vals,
                       size_t *lens) {
    counted(kv, n);
    return inner(kv)->ops->multi_get(inner(kv), keys, n, vals, lens);
}
static int c_multi_set(rdzv_kv_t *kv, const char *const *keys, const void *const *vals,
                       const size_t *lens, size_t n) {
    counted(kv, 0);
    return inner(kv)->ops->multi_set(inner(kv), keys, vals, lens, n);
}
static int c_take_ticket(rdzv_kv_t *kv, const char *key, const char *look, int64_t *index) {
    counted(kv, 0);
    return inner(kv)->ops->take_ticket(inner(kv), key, look, index);
}
static int c_count_tickets(rdzv_kv_t *kv, const char *key, int64_t *count) {
    counted(kv, 0);
    return inner(kv)->ops->count_tickets(inner(kv), key, count);
}
static void c_interrupt(rdzv_kv_t *kv) {
    inner(kv)->ops->interrupt(inner(kv));
}
static const char *c_error(const rdzv_kv_t *kv) {
    const rdzv_kv_t *in = ((const counting_kv_t *)kv)->inner;
    return in->ops->error(in);
}
static void c_destroy(rdzv_kv_t *kv) {
    rdzv_kv_destroy(inner(kv));
    free(kv);
}
static const rdzv_kv_ops_t counting_ops = {.set = c_set,
                                           .get = c_get,
                                           .add = c_add,
                                           .compare_set = c_compare_set,
                                           .wait = c_wait,
                                           .multi_get = c_multi_get,
                                           .multi_set = c_multi_set,
                                           .take_ticket = c_take_ticket,
                                           .count_tickets = c_count_tickets,
                                           .set_ephemeral = c_set,
                                           .interrupt = c_interrupt,
                                           .error = c_error,
                                           .destroy = c_destroy};

/* 64 agents join one round at once (the store host among them, and one --node-rank hint): the
 * ranks are those of the protocol (host first, then hints, then join order), and each agent's
 * join is a few requests on a few keys, whatever N is; only the round's last member reads every
 * node record, once, to publish the ranks. Before that, every member read all N records (a WAIT
 * and a MULTI_GET of N keys each: N^2 in all, 2 s of a restart at 1024 agents). Each agent also
 * offers its own store, as on etcd: node 0's reaches every member in its rank record, at no
 * request of its own (it was a key of its own, r<R>/store: a WAIT and a GET more, 9 requests). */
Test(rendezvous, a_join_reads_a_few_keys_whatever_the_round_size) {
    enum { N = 64, HOST = 9, HINTED = 20 };
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    opts.min_nodes = opts.max_nodes = N;
    static agent_t m[N];
    for (int i = 0; i < N; i++) {
        agent_start(&m[i], i == HOST);
        if (i == HINTED) m[i].r.node_rank_hint = 1;
        rdzv_set_own_store(&m[i].r, "10.0.0.1", (uint16_t)(30000 + i));
        counting_kv_t *k = calloc(1, sizeof *k);
        cr_assert_not_null(k);
        k->kv.ops = &counting_ops;
        k->inner = m[i].kv;
        m[i].kv = &k->kv;
    }
    join_together(m, N);
    bool is_taken[N] = {false};
    int n_readers_of_all = 0;
    for (int i = 0; i < N; i++) {
        const rdzv_result_t *o = &m[i].out;
        cr_assert_eq(m[i].rc, 0, "agent %d: %s", i, m[i].err);
        cr_assert(o->is_member && o->group_world_size == N && o->world_size == 2 * N);
        cr_assert(o->group_rank >= 0 && o->group_rank < N && !is_taken[o->group_rank]);
        is_taken[o->group_rank] = true;
        cr_assert_eq(o->rank_offset, 2 * o->group_rank, "nproc 2 each");
        if (i == HOST) cr_assert_eq(o->group_rank, 0, "the store host is node 0");
        if (i == HINTED) cr_assert_eq(o->group_rank, 1, "then the --node-rank hint");
        cr_assert_str_eq(o->store_host, "10.0.0.1");
        cr_assert_eq(o->store_port, 30000 + HOST, "agent %d: node 0's store", i);
        const counting_kv_t *k = (const counting_kv_t *)m[i].kv;
        if (o->join_index == N - 1) { /* the last member publishes: it reads every record once */
            cr_assert_geq(k->keys_read, (size_t)N);
            cr_assert_leq(k->keys_read, (size_t)(2 * N + 4));
            n_readers_of_all++;
            continue;
        }
        cr_assert_leq(k->requests, 7, "agent %d (join index %d): %d requests", i, o->join_index,
                      k->requests);
        cr_assert_leq(k->keys_read, 4, "agent %d (join index %d) read %zu keys of a round of %d", i,
                      o->join_index, k->keys_read, N);
    }
    cr_assert_eq(n_readers_of_all, 1);
    /* join order after the host and the hint: the others in the order they joined */
    for (int i = 0; i < N; i++)
        for (int j = 0; j < N; j++)
            if (i != HOST && i != HINTED && j != HOST && j != HINTED &&
                m[i].out.join_index < m[j].out.join_index)
                cr_assert_lt(m[i].out.group_rank, m[j].out.group_rank);
    for (int i = 0; i < N; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

/* A refund (round 0 ended by a lost node) lands while round 1's failure is being reported: the
 * failure counter keeps both, 1 - 1 + 1. The winner of the report wrote back the count it had
 * read before (1 + 1), and the refund was lost: a restart charged to the budget that was none. */
static agent_t refunder;
static void refund_now(const char *key) {
    if (strstr(key, "/r1/restart"))
        cr_assert_eq(rdzv_refund_failure(&refunder.r, refunder.kv), 0, "%s",
                     refunder.kv->ops->error(refunder.kv));
}

Test(rendezvous, a_refund_during_a_failure_report_is_kept) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    agent_t reporter;
    agent_start(&reporter, true);
    agent_start(&refunder, false);
    int64_t failures;
    const char *key = "/ddprun/stale/failures";
    cr_assert_eq(reporter.kv->ops->add(reporter.kv, key, 1, &failures), 0); /* round 0's end */
    counting_kv_t *k = calloc(1, sizeof *k);
    cr_assert_not_null(k);
    k->kv.ops = &counting_ops;
    k->inner = reporter.kv;
    k->before_compare_set = refund_now;
    reporter.kv = &k->kv;
    rdzv_why_t why = {.code = 1};
    cr_assert_eq(rdzv_request_restart(&reporter.r, reporter.kv, 1, &why), 0, "%s",
                 reporter.kv->ops->error(reporter.kv));
    cr_assert_eq(refunder.kv->ops->add(refunder.kv, key, 0, &failures), 0);
    cr_assert_eq(failures, 1, "the failure counter reads %lld", (long long)failures);
    agent_dies(&reporter);
    agent_dies(&refunder);
    server_stop(&srv);
}

/* A first join after the job gave up: which ended rounds end the job (a failure not retried or
 * past --max-restarts) and which do not (a membership change, the job's finish, a failure within
 * the budget, a peer failure past it: the next round's size decides that one). */
Test(rendezvous, a_job_that_gave_up_is_told_apart_from_one_that_goes_on) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    opts.max_restarts = 2;
    agent_t a;
    agent_start(&a, false);
    static const struct {
        rdzv_why_t why;
        int want;
    } cases[] = {
        {{.code = 0, .node = -1, .rank = -1}, 0},
        {{.code = 0, .node = -1, .rank = -1, .is_finished = true}, 0},
        {{.code = 1, .failures = 2, .node = 1, .rank = 2}, 0},
        {{.code = DDP_EXIT_PEER_FAILURE, .failures = 3, .node = 1, .rank = 2}, 0},
        {{.code = 1, .failures = 3, .node = 1, .rank = 2}, 1},
        {{.code = DDP_EXIT_CONFIG, .is_permanent = true, .failures = 1, .node = 1, .rank = 2}, 1},
    };
    char err[512] = "";
    cr_assert_eq(rdzv_job_has_failed(&a.r, a.kv, 0, err, sizeof err), 0, "no round ended yet");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char key[64], text[RDZV_RECORD_MAX_BYTES];
        snprintf(key, sizeof key, "/ddprun/stale/r%zu/restart", i);
        cr_assert_geq(rdzv_record_why_format(&cases[i].why, text, sizeof text), 0);
        cr_assert_eq(a.kv->ops->set(a.kv, key, text, strlen(text)), 0);
        err[0] = '\0';
        int got = rdzv_job_has_failed(&a.r, a.kv, (int)i + 1, err, sizeof err);
        cr_assert_eq(got, cases[i].want, "case %zu (%s): %d, %s", i, text, got, err);
        if (got) cr_assert(strstr(err, "a new run of it needs another --rdzv-id"), "%s", err);
    }
    agent_dies(&a);
    server_stop(&srv);
}

/* A malformed node record: the round cannot start, and every member says so (the last member,
 * which alone reads the records, tells the others through their rank records). */
Test(rendezvous, a_malformed_record_fails_every_member) {
    server_t srv;
    agent_t m[3];
    start_three(&srv, m);
    /* join index 0 is taken by someone who wrote garbage */
    int64_t ticket;
    cr_assert_eq(m[0].kv->ops->take_ticket(m[0].kv, "/ddprun/stale/r0/joined", NULL, &ticket), 0);
    cr_assert_eq(m[0].kv->ops->set(m[0].kv, "/ddprun/stale/r0/node/0", "{\"nproc\":", 9), 0);
    join_together(m, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(m[i].rc, DDP_EPROTO, "agent %d: %d %s", i, m[i].rc, m[i].err);
        cr_assert(strstr(m[i].err, "node record 0 (9 bytes) is malformed"), "%s", m[i].err);
    }
    for (int i = 0; i < 3; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

/* etcd: a round's store is node 0's, from its node record; a node record without one (say, an
 * agent of an older protocol) cannot start the round, and every member says so. */
Test(rendezvous, a_node_record_without_a_store_fails_every_member) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    opts.min_nodes = opts.max_nodes = 3;
    agent_t m[2];
    for (int i = 0; i < 2; i++) {
        agent_start(&m[i], false);
        rdzv_set_own_store(&m[i].r, "127.0.0.1", (uint16_t)(30000 + i));
    }
    int64_t ticket;
    cr_assert_eq(m[0].kv->ops->take_ticket(m[0].kv, "/ddprun/stale/r0/joined", NULL, &ticket), 0);
    const char *record = "{\"nproc\":2,\"hint\":-1,\"host\":false}";
    cr_assert_eq(m[0].kv->ops->set(m[0].kv, "/ddprun/stale/r0/node/0", record, strlen(record)), 0);
    join_together(m, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(m[i].rc, DDP_EPROTO, "agent %d: %d %s", i, m[i].rc, m[i].err);
        cr_assert(strstr(m[i].err, "node record 0 (34 bytes) is malformed (no store address)"),
                  "%s", m[i].err);
    }
    for (int i = 0; i < 2; i++)
        agent_dies(&m[i]);
    server_stop(&srv);
}

/* The store is anyone's: a round counter or a closed count that is no number fails with the key
 * and its value named (a closed count "two" failed with an empty message; a counter past int's
 * range was cut to another round). */
Test(rendezvous, a_counter_or_count_that_is_no_number_is_named) {
    server_t srv;
    server_start(&srv);
    job_options(srv.port);
    agent_t a;
    agent_start(&a, false);
    char err[512] = "";
    int current = -1;
    cr_assert_eq(a.kv->ops->set(a.kv, "/ddprun/stale/round", "99999999999", 11), 0);
    cr_assert_eq(rdzv_current_round(&a.r, a.kv, &current, err, sizeof err), DDP_EPROTO);
    cr_assert(strstr(err, "/ddprun/stale/round holds 99999999999, not a round number"), "%s", err);
    cr_assert_eq(a.kv->ops->set(a.kv, "/ddprun/stale/r0/closed", "two", 3), 0);
    rdzv_result_t out;
    cr_assert_eq(rdzv_join(&a.r, a.kv, 0, &out, err, sizeof err), DDP_EPROTO);
    cr_assert(strstr(err, "/ddprun/stale/r0/closed holds 'two', not a number from 1 to"), "%s",
              err);
    agent_dies(&a);
    server_stop(&srv);
}

/* ---- the judge alone ------------------------------------------------------------------------ */

Test(liveness, counters_that_stand_still) {
    liveness_t l;
    liveness_reset(&l, 3, 1000, 100);
    int64_t m[3] = {0, 0, 0};
    cr_assert_eq(liveness_judge(&l, m, 1, 100), -1);
    m[0] = 1, m[2] = 1;
    cr_assert_eq(liveness_judge(&l, m, 1, 900), -1);
    cr_assert_eq(liveness_judge(&l, m, 1, 1900), -1, "changed at 900: not stale until 1900");
    cr_assert_eq(liveness_judge(&l, m, 1, 1901), 0);
    m[0] = 2;
    cr_assert_eq(liveness_judge(&l, m, 1, 1902), 2);
    cr_assert_eq(liveness_judge(&l, m, 2, 1903), -1, "its own counter is not judged");
}

Test(liveness, keys_that_vanish) {
    liveness_t l;
    liveness_reset(&l, 2, 1000, 0);
    int64_t m[2] = {LIVENESS_GONE, LIVENESS_ALIVE};
    /* a key not there yet (its member between two requests of its join) has the limit's grace */
    cr_assert_eq(liveness_judge(&l, m, -1, 500), -1);
    cr_assert_eq(liveness_judge(&l, m, -1, 1001), 0);
    m[0] = LIVENESS_ALIVE;
    cr_assert_eq(liveness_judge(&l, m, -1, 1500), -1, "present again: alive");
    m[1] = LIVENESS_GONE;
    cr_assert_eq(liveness_judge(&l, m, -1, 2400), -1);
    cr_assert_eq(liveness_judge(&l, m, -1, 2501), 1);
}
