"""On etcd an agent's lease must outlive a long join: with hundreds of agents contending for the
round's counter a join can take longer than lease_ttl, and an agent that refreshed its lease only
once its round ran lost it while joining (its alive key vanished, the round saw it lost: 40 of 192
agents in bench_scale.py). Here one agent waits 3 lease TTLs for the second node."""
import os
import subprocess
import sys
import time

from conftest import clean_env

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402

TTL_S = 2


def test_a_join_longer_than_the_lease_keeps_the_lease(ddprun, tmp_path):
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        run_two_agents(ddprun, etcd)


def run_two_agents(ddprun, etcd):
    args = [ddprun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "lease",
            "--rdzv-conf", f"join_timeout=60,last_call_timeout=0.1,lease_ttl={TTL_S},"
                           "keep_alive_interval=0.3", "--no-python", "/bin/sh", "-c", "sleep 1"]
    first = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
    time.sleep(3 * TTL_S)  # the first agent joins alone for three lease TTLs
    second = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
    errs = [p.communicate(timeout=90)[1] for p in (first, second)]
    for p, err in zip((first, second), errs):
        assert p.returncode == 0, err
        assert "lost its etcd lease" not in err and "expired" not in err, err
    assert "round 0: node" in errs[0] and "round 0: node" in errs[1], errs
