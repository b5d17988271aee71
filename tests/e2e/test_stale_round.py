"""A closed round whose members all died, on c10d and on etcd (chaos seed 919785934): both agents of
a full job (--nnodes 2) are SIGKILLed while their round runs, the rendezvous outlives them (a
standalone `ddprun store`, or etcd), and the two agents started in their place arrive after the
round closed. They must not wait for it forever: within the liveness timeout (heartbeat_timeout,
lease_ttl) they declare it over, the next round opens with them as its members, and their workers
run (tests/unit/test_rendezvous.c replays the same history over the records)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import clean_env, wait_until

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402

LIVENESS_S = 2
WORKER = """#!/bin/sh
echo "$DDPRUN_ATTEMPT" > "$OUT_DIR/started.$$"
i=0
while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def attempts(tmp_path):
    """The round (DDPRUN_ATTEMPT) of every worker started so far."""
    out = []
    for name in os.listdir(tmp_path):
        if name.startswith("started."):
            text = (tmp_path / name).read_text().strip()
            if text:
                out.append(int(text))
    return out


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_agents_arriving_after_a_round_whose_members_died_open_the_next(
        ddprun, tmp_path, start_store, backend):
    worker = tmp_path / "worker.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)
    conf = f"join_timeout=60,last_call_timeout=0.1,keep_alive_interval=0.2"
    if backend == "c10d":
        store = start_store()
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", store.endpoint,
                "--rdzv-conf", conf + f",heartbeat_timeout={LIVENESS_S},is_host=false"]
    else:
        etcd = etcd_cluster_or_skip(tmp_path / "etcd")
        rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
                "--rdzv-conf", conf + f",lease_ttl={LIVENESS_S}"]
    args = [ddprun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", "stale"] + rdzv + [
        str(worker)]
    env = clean_env(OUT_DIR=str(tmp_path))
    procs, logs = [], []
    cluster = etcd if backend == "etcd" else None

    def start(name):
        log = open(tmp_path / f"{name}.log", "w")
        logs.append(tmp_path / f"{name}.log")
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        log.close()
        return procs[-1]

    def text():
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in logs)

    try:
        first = [start("a0"), start("b0")]
        assert wait_until(lambda: len(attempts(tmp_path)) == 2, 60), text()
        for p in first:  # both members, workers and all
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        t0 = time.monotonic()
        second = [start("a1"), start("b1")]
        assert wait_until(lambda: len(attempts(tmp_path)) == 4, 30), \
            "the agents started in their place never ran:\n" + text()
        took = time.monotonic() - t0
        assert sorted(attempts(tmp_path))[2:] == [1, 1], attempts(tmp_path)  # round 1 runs
        assert "waiting for the next round" in text() and "asking for the next round" in text()
        # within the liveness timeout of their arrival, and the start, join and spawn around it
        assert took < LIVENESS_S + 8, f"{took:.1f} s:\n{text()}"
        for p in second:
            assert p.poll() is None, text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if cluster:
            cluster.close()
