"""A round of many agents on a real 3-member etcd (tests/tools/etcd_cluster.py), through
tests/bench/bench_rdzv_agents (N agents' joins as N threads with a client each, then a restart and
every agent joins the next round): every join finishes, and the raft proposals per agent and round
stay a handful. A join's index is a ticket (one txn that creates the agent's own key under
r<R>/joined/ and counts them); it was an ADD, a compare-and-swap on one counter that the N joining
agents retried, every try a raft proposal, some N^2/2 a round (256 agents did not finish in 70 s)."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402

AGENTS = 64


def raft_index(etcd):
    r = etcd.etcdctl("endpoint", "status", "-w", "json")
    assert r.returncode == 0, r.stderr
    return max(int(e["Status"]["raftIndex"]) for e in json.loads(r.stdout))


def test_a_round_of_many_on_etcd_costs_a_few_proposals_per_agent(build_dir, tmp_path):
    bench = os.path.join(build_dir, "tests", "bench", "bench_rdzv_agents")
    if not os.access(bench, os.X_OK):
        pytest.skip(f"{bench} is not built")
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        before = raft_index(etcd)
        r = subprocess.run([bench, "etcd", etcd.endpoints, str(AGENTS)], capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        row = json.loads(r.stdout.strip().splitlines()[-1])
        assert row["errors"] == 0, row
        per_agent_round = (raft_index(etcd) - before) / (2 * AGENTS)
        # a ticket, the alive key, the node record, half a lease grant; the round's close, its
        # ranks and its restart once per round
        assert per_agent_round <= 6, f"{per_agent_round:.1f} raft proposals per agent and round"
