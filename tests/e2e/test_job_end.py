"""The end of a job, as an agent that waits for its round sees it: when the members' exit barrier
completes, the last count marks the round's restart key "finished" (docs/protocol.md), and a node
still waiting (a spare of the full job, or a later submission with the same --rdzv-id on etcd,
whose records outlive the job for status_ttl) leaves with 0, saying so. Before, a c10d spare saw
the members' heartbeats stop, asked for the next round and failed on the vanished store; on etcd a
resubmission waited as a spare of the finished round for status_ttl (an hour), then ran the program
again alone."""
import os
import subprocess
import sys
import time

from conftest import clean_env, free_port, wait_until

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402

FINISHED = "the job finished in round 0 without this node: leaving"


def agent(ddprun, tmp_path, name, args, seconds):
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([ddprun, "--nnodes", "2", "--nproc-per-node", "1", *args,
                             "--no-python", "/bin/sh", "-c", f"sleep {seconds}"],
                            stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
                            start_new_session=True)
    proc.log_path = tmp_path / f"{name}.log"
    return proc


def text(proc):
    return proc.log_path.read_text(errors="replace")


def finish_all(procs, timeout):
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def test_a_spare_of_a_full_job_leaves_with_0_when_the_job_ends(ddprun, tmp_path):
    port = free_port()
    args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "end",
            "--rdzv-conf", "last_call_timeout=0.1,keep_alive_interval=0.5,heartbeat_timeout=3"]
    members = [agent(ddprun, tmp_path, f"n{i}", args, 4) for i in range(2)]
    assert wait_until(lambda: all("round 0: node" in text(m) for m in members), 30), \
        "\n".join(text(m) for m in members)
    spare = agent(ddprun, tmp_path, "spare", args, 4)
    try:
        assert wait_until(lambda: "without this one" in text(spare), 30), text(spare)
        codes = finish_all(members + [spare], 60)
    finally:
        finish_all(members + [spare], 1)
    assert codes == [0, 0, 0], "\n----\n".join(text(p) for p in members + [spare])
    assert FINISHED in text(spare), text(spare)
    assert "round 1" not in text(spare), text(spare)


def test_a_resubmission_on_etcd_says_the_job_finished_instead_of_waiting(ddprun, tmp_path):
    with etcd_cluster_or_skip(tmp_path / "etcd", members=1) as etcd:
        args = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "again",
                "--rdzv-conf", "last_call_timeout=0.1,keep_alive_interval=0.3,lease_ttl=3"]
        first = [agent(ddprun, tmp_path, f"first{i}", args, 0) for i in range(2)]
        assert finish_all(first, 60) == [0, 0], "\n----\n".join(text(p) for p in first)
        t0 = time.monotonic()
        again = agent(ddprun, tmp_path, "again", args, 0)
        code = finish_all([again], 60)[0]
        assert code == 0, text(again)
        assert FINISHED in text(again), text(again)
        assert time.monotonic() - t0 < 30, text(again)


REFUND_WORKER = r"""#!/bin/sh
i=0
while [ $i -lt 60 ]; do
    if [ "$RANK" = 0 ] && [ -e "$FLAG" ]; then rm -f "$FLAG"; exit 75; fi
    sleep 0.2; i=$((i+1))
done
"""


def test_a_spare_and_the_members_agree_that_a_lost_node_costs_no_restart(ddprun, tmp_path,
                                                                         start_store):
    """Three members and a spare, --nnodes 2:3 --max-restarts 0: two members are killed and
    rank 0 fails with a peer failure. The next round has a node fewer than the last: a lost node,
    not a restart. The former spare learns the ended round's size from the restart record and
    judges so too (it counted no nodes of its own: it took the job for failed, exit 75, and the
    survivor then waited out join_timeout and failed)."""
    store = start_store()
    worker = tmp_path / "worker.sh"
    worker.write_text(REFUND_WORKER)
    worker.chmod(0o755)
    flag = tmp_path / "flag"
    procs = []
    for i in range(4):
        log = open(tmp_path / f"a{i}.log", "w")
        p = subprocess.Popen(
            [ddprun, "--nnodes", "2:3", "--max-restarts", "0", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", store.endpoint, "--rdzv-id", "refund",
             "--rdzv-conf", "join_timeout=30,keep_alive_interval=0.3,heartbeat_timeout=3,"
             "last_call_timeout=0.5", "--no-python", str(worker)],
            stdout=log, stderr=subprocess.STDOUT, env=clean_env(FLAG=str(flag)),
            start_new_session=True)
        p.log_path = tmp_path / f"a{i}.log"
        procs.append(p)
        if i == 2:
            assert wait_until(lambda: all("round 0: node" in text(q) for q in procs), 30), \
                "\n".join(text(q) for q in procs)
    # the survivor is node 0 (its worker, rank 0, fails on the flag): on an outside store the
    # nodes are numbered in the order they joined, which the three starts do not fix
    survivor = next(p for p in procs[:3] if "round 0: node 0 of 3" in text(p))
    try:
        assert wait_until(lambda: "without this one" in text(procs[3]), 30), text(procs[3])
        for p in procs[:3]:
            if p is not survivor:
                os.killpg(p.pid, 9)
        flag.write_text("")
        codes = finish_all([survivor, procs[3]], 90)
    finally:
        finish_all(procs, 1)
    logs = "\n----\n".join(text(p) for p in (survivor, procs[3]))
    assert codes == [0, 0], logs
    for p in (survivor, procs[3]):
        assert "does not count against --max-restarts" in text(p), logs
