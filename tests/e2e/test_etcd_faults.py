"""etcd faults an agent must ride out (found by tests/chaos/run.py --rdzv-backend etcd, seed 7, with
lease_ttl=3), each on a real 3-member etcd (tests/tools/etcd_cluster.py):

- a member frozen (SIGSTOP) longer than the lease TTL: a lease refresh stuck on it must give up
  within the TTL and go to another member, so the lease lives and the round goes on (a frozen
  leader may revoke every lease as it wakes, an etcd bug: then the agents renew and go on);
- an agent frozen longer than its lease TTL: its lease is gone when it wakes; it must take a new one
  (its keys put again under it), follow the next round its peers opened, and finish the job;
- a member that died in its join after its ticket (before its node record, its lease-bound mark
  of life, or as node 0 right after it): the other members must end that round within a few lease
  TTLs, not wait out join_timeout + read_timeout in a GET;
- a ticket's answer lost (the connection closed after etcd took the txn): the txn sent again
  must give the same ticket, not a second one;
- a member killed while the others wait in the exit barrier: they count it done once its lease
  expires, not wait out the barrier's timeout.
"""
from base64 import b64decode
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import clean_env

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402
from lossy_proxy import LossyProxy  # noqa: E402


class Agent:
    """A ddprun agent whose stderr is read as it comes."""

    def __init__(self, args):
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def err(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout):
        deadline = time.monotonic() + timeout
        while text not in self.err:
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"no '{text}' within {timeout} s:\n{self.err}"
            time.sleep(0.05)

    def finish(self, timeout):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)
        return self.proc.returncode


def agent_args(ddprun, etcd, rdzv_id, conf, worker, endpoints=None):
    return [ddprun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", endpoints or etcd.endpoints, "--rdzv-id", rdzv_id,
            "--max-restarts", "0",
            "--rdzv-conf", "last_call_timeout=0.1,keep_alive_interval=0.3," + conf,
            "--no-python", "/bin/sh", "-c", worker]


def freeze(etcd, member, seconds):
    etcd.procs[member].send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        etcd.procs[member].send_signal(signal.SIGCONT)


def two_agents_asking_first(ddprun, etcd, rdzv_id, ttl_s, member):
    """Two agents of a 2-node job whose first endpoint is etcd member `member`, once both are in
    round 0 (their workers sleep 10 s)."""
    order = [member] + [i for i in range(etcd.members) if i != member]
    args = agent_args(ddprun, etcd, rdzv_id, f"lease_ttl={ttl_s},join_timeout=30", "sleep 10",
                      endpoints=",".join(etcd.urls[i] for i in order))
    agents = [Agent(args), Agent(args)]
    for a in agents:
        a.wait_for("round 0: node", 30)
    return agents


def test_a_follower_frozen_past_the_lease_ttl_leaves_the_leases_alive(ddprun, tmp_path):
    """Both agents talk to a follower first (the first endpoint); it freezes for 3 lease TTLs:
    refreshes stuck on it go to another member within the TTL, and nothing notices."""
    ttl_s = 2
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        leader = etcd.wait_leader()
        follower = (leader + 1) % etcd.members
        agents = two_agents_asking_first(ddprun, etcd, "frozen-follower", ttl_s, follower)
        assert etcd.leader() == leader, "the leader changed before the freeze"
        freeze(etcd, follower, 3 * ttl_s)
        codes = [a.finish(60) for a in agents]
        for a, code in zip(agents, codes):
            assert code == 0, a.err
            for bad in ("expired", "lost", "leaving", "round 1"):
                assert bad not in a.err, a.err


def test_a_leader_frozen_past_the_lease_ttl_costs_at_most_a_round(ddprun, tmp_path):
    """The leader freezes for 3 lease TTLs while both agents talk to it first. The others elect a
    new leader that takes the refreshes; but etcd 3.4.23 (Debian's) may revoke every lease as the
    old leader wakes: its lessor still thinks it leads and forwards the revokes to the new leader
    (etcd-io/etcd#15247, fixed upstream by #16822). Either way the job goes on: the leases live,
    or both agents renew theirs, say so, and finish in the next round."""
    ttl_s = 2
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        leader = etcd.wait_leader()
        agents = two_agents_asking_first(ddprun, etcd, "frozen-leader", ttl_s, leader)
        freeze(etcd, leader, 3 * ttl_s)
        codes = [a.finish(60) for a in agents]
        errs = "\n----\n".join(a.err for a in agents)
        assert codes == [0, 0], errs
        assert "leaving" not in errs, errs
        if "round 1" in errs:  # the revokes came through: every agent renewed and followed
            for a in agents:
                assert "round 1: node" in a.err, errs
            assert "under lease" in errs, errs


def test_an_agent_frozen_past_its_lease_takes_a_new_one(ddprun, tmp_path):
    """Agent B stops (SIGSTOP, its worker runs on) for 3 lease TTLs: A ends round 0 without it;
    B wakes with its lease gone, renews it, and both finish in round 1."""
    ttl_s = 2
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        args = agent_args(ddprun, etcd, "frozen-agent", f"lease_ttl={ttl_s},join_timeout=20",
                          "sleep 12")
        a, b = Agent(args), Agent(args)
        for x in (a, b):
            x.wait_for("round 0: node", 30)
        b.proc.send_signal(signal.SIGSTOP)
        try:
            a.wait_for("lost its etcd lease", 4 * ttl_s)
            time.sleep(ttl_s)
        finally:
            b.proc.send_signal(signal.SIGCONT)
        codes = [x.finish(60) for x in (a, b)]
        assert codes == [0, 0], a.err + "\n----\n" + b.err
        assert "under lease" in b.err, b.err  # it renewed, it did not leave
        for x in (a, b):
            assert "round 1: node" in x.err, x.err


# node 0's record: its store (nobody listens on port 1), which the round's workers would use
NODE_RECORD = '{"nproc":1,"hint":-1,"host":false,"store":"127.0.0.1:1"}'


@pytest.mark.parametrize("died", ["before_record", "after_record"])
def test_a_member_that_died_in_its_join_ends_the_round(ddprun, tmp_path, died):
    """Round 0 already holds a member #0 that died in its join (the keys it left are written
    here); two agents join it as #1 and #2. #1 is a member waiting for #0's record: it must end
    the round once #0's lease is gone. Or #0 died right after its record (node 0 of the round,
    whose store the workers would use, is dead): #1 closes the round with it, and ends it when
    #0's lease expires. Both agents finish in round 1."""
    ttl_s = 2
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        prefix = f"/ddprun/died-{died}/r0"
        etcd.put(f"{prefix}/joined/0000000000000000", "1")  # its ticket: join index 0
        if died == "after_record":  # its record, under its lease (its mark of life)
            r = etcd.etcdctl("lease", "grant", "5")
            assert r.returncode == 0, r.stderr
            lease = r.stdout.split()[1]  # "lease 694d... granted with TTL(5s)"
            r = etcd.etcdctl("put", "--lease", lease, f"{prefix}/node/0", NODE_RECORD)
            assert r.returncode == 0, r.stderr
        # after_record: #1's worker must outlive #0's lease (5 s), so that #0's loss ends a round
        # that runs (a worker done before it would leave #1 in the exit barrier with #0)
        args = agent_args(ddprun, etcd, f"died-{died}",
                          f"lease_ttl={ttl_s},join_timeout=60,read_timeout=60",
                          "sleep 8" if died == "after_record" else "sleep 1")
        start = time.monotonic()
        agents = [Agent(args)]
        deadline = time.monotonic() + 20
        while etcd.get(f"{prefix}/closed") is None:  # closed by #1 with #0: #2 comes after
            assert time.monotonic() < deadline, agents[0].err
            time.sleep(0.1)
        agents.append(Agent(args))
        codes = [x.finish(45) for x in agents]
        took = time.monotonic() - start
        assert codes == [0, 0], agents[0].err + "\n----\n" + agents[1].err
        assert took < 30, f"{took:.1f} s"
        if died != "after_record":
            assert "lost its etcd lease before it wrote" in agents[0].err, agents[0].err
        for x in agents:
            assert "round 1: node" in x.err, x.err


def test_a_member_lost_before_its_record_ends_the_round_for_every_member(ddprun, tmp_path):
    """Round 0 holds a member #0 that died before its node record; two agents join it as #1 and
    #2 (--nnodes 2:3: #2 closes it at 3). Only the round's last member (#2) reads the records and
    finds #0 lost; #1 waits for its rank record, which must tell it so (not leave it waiting out
    join_timeout + read_timeout): both end round 0 and finish in round 1."""
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        prefix = "/ddprun/lost-before-record/r0"
        etcd.put(f"{prefix}/joined/0000000000000000", "1")  # #0's ticket, and nothing more
        args = agent_args(ddprun, etcd, "lost-before-record",
                          "lease_ttl=2,join_timeout=60,read_timeout=60,last_call_timeout=3",
                          "sleep 1")
        args[args.index("--nnodes") + 1] = "2:3"
        start = time.monotonic()
        agents = [Agent(args), Agent(args)]
        codes = [x.finish(50) for x in agents]
        took = time.monotonic() - start
        assert codes == [0, 0], agents[0].err + "\n----\n" + agents[1].err
        assert took < 35, f"{took:.1f} s"
        for x in agents:
            assert "lost its etcd lease before it wrote" in x.err, x.err
            assert "round 1: node" in x.err, x.err


def ticket_txn(what):
    """For LossyProxy: whether a request is a txn that takes a ticket r<R>/<what>/<16 hex>."""
    pattern = re.compile(r"/ddprun/.+/r[0-9]+/" + what + r"/[0-9a-f]{16}")

    def is_ticket(path, body):
        if path != "/v3/kv/txn":
            return False
        try:
            key = b64decode(json.loads(body)["success"][0]["request_put"]["key"]).decode()
        except (ValueError, KeyError, IndexError, TypeError):
            return False
        return pattern.fullmatch(key) is not None
    return is_ticket


@pytest.mark.parametrize("what,times", [("joined", 1), ("joined", 2), ("done", 1)])
def test_a_ticket_whose_answer_was_lost_is_taken_once(ddprun, tmp_path, what, times):
    """Member 0 sits behind a proxy that passes the first ticket txn under r0/<what>/ (a join, or
    the exit barrier) on to it and closes the agent's connection once etcd answered: etcd took
    the ticket, the agent did not hear. The agent sends the same txn again (libcurl once on a
    fresh connection when the lost one was reused; times=2 loses that answer too, so the client
    sends it to the next member); it must find its ticket taken and get the same index, not take
    a second one: both agents in round 0 as nodes 0 and 1, two tickets, no round 1."""
    rdzv_id = f"lost-{what}-{times}"
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        with LossyProxy(etcd.host, etcd.client_ports[0], ticket_txn(what), times) as proxy:
            endpoints = ",".join([proxy.endpoint] + etcd.endpoints.split(",")[1:])
            args = agent_args(ddprun, etcd, rdzv_id, "lease_ttl=5,join_timeout=30", "sleep 1",
                              endpoints=endpoints)
            agents = [Agent(args), Agent(args)]
            codes = [a.finish(60) for a in agents]
        errs = "\n----\n".join(a.err for a in agents)
        assert codes == [0, 0], errs
        assert proxy.lost, f"no answer lost: {proxy.seen}\n{errs}"
        nodes = sorted(re.findall(r"round ([0-9]+): node ([0-9]+) of 2", errs))
        assert nodes == [("0", "0"), ("0", "1")], errs
        tickets = etcd.get_prefix(f"/ddprun/{rdzv_id}/r0/{what}/")
        assert len(tickets) == 2, tickets
        assert etcd.get_prefix(f"/ddprun/{rdzv_id}/r1/") == {}


@pytest.mark.parametrize("n_lost", [1, 2])
def test_a_member_lost_while_the_others_are_in_the_exit_barrier_does_not_hold_them(ddprun,
                                                                                    tmp_path,
                                                                                    n_lost):
    """Two agents' workers succeed; the others (one, or two at once) are killed (agent and worker)
    while the two wait in the exit barrier (join_timeout=120 bounds it). Their leases expire (2 s)
    and a judge counts each done: both leave at once with 0. (With two lost, the second was never
    counted: the liveness watch ended at the first.)"""
    ttl_s = 2
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        def args(worker):
            return [ddprun, "--nnodes", str(2 + n_lost), "--nproc-per-node", "1",
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
                    "--rdzv-id", "barrier-lost",
                    "--rdzv-conf", f"last_call_timeout=0.1,keep_alive_interval=0.3,"
                    f"lease_ttl={ttl_s},join_timeout=120", "--no-python", "/bin/sh", "-c", worker]
        done = [Agent(args("exit 0")), Agent(args("exit 0"))]
        lost = [Agent(args("sleep 60")) for _ in range(n_lost)]
        for a in done + lost:
            a.wait_for("round 0: node", 30)
        time.sleep(1.0)  # the two are in the barrier by now
        assert all(a.proc.poll() is None for a in done), "the barrier waits for the others"
        t0 = time.monotonic()
        for a in lost:
            a.proc.kill()
        for a in lost:
            a.finish(5)
        codes = [a.finish(60) for a in done]
        took = time.monotonic() - t0
        errs = "\n----\n".join(a.err for a in done)
        assert codes == [0, 0], errs
        assert took < 20, f"{took:.1f} s: they waited for the barrier's timeout\n{errs}"
        assert "counting it done" in errs, errs
        assert "not every node confirmed" not in errs, errs


def test_a_member_stopped_gracefully_is_left_for_another(ddprun, tmp_path):
    """Both agents talk to one member first; it is stopped with SIGTERM (a rolling restart, a
    node drained), which ends each watch on it with an in-stream error ("transport is closing",
    gRPC 14) rather than a cut connection. The watches go on from another member and the job
    ends well; before, each agent took the error for a lost store and left with 75."""
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        leader = etcd.wait_leader()
        follower = (leader + 1) % etcd.members
        agents = two_agents_asking_first(ddprun, etcd, "graceful-stop", 6, follower)
        time.sleep(1)  # both watch the restart key on it
        etcd.stop(follower)
        codes = [a.finish(60) for a in agents]
        errs = "\n----\n".join(a.err for a in agents)
        assert codes == [0, 0], errs
        for bad in ("lost the job's store", "leaving", "round 1"):
            assert bad not in errs, errs
