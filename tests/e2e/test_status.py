"""`ddprun status` against a running two-node ddpworker job on loopback (c10d): the round, the
nodes with their hosts and ranks, restarts used and left, each rank's progress as ddpworker
publishes it, and, after a worker is killed, the last failure (node, rank, signal, time)."""
import json
import os
import signal
import socket
import subprocess
import time

from conftest import clean_env, free_port, wait_until

CONF = """[model]
name = mlp
width = 16
[data]
kind = synthetic
height = 8
width = 8
channels = 1
train_limit = 4096
test_limit = 64
[train]
batch_size = 8
epochs = 1000
max_steps = 100000
log_interval = 5
collective_timeout = 10
"""


def status(ddprun, port, *extra):
    r = subprocess.run([ddprun, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                        "st", *extra], capture_output=True, text=True, timeout=30, env=clean_env())
    return r


def test_status_of_a_running_job_and_its_last_failure(ddprun, tmp_path):
    conf = tmp_path / "st.conf"
    conf.write_text(CONF)
    port = free_port()
    agents = []
    for _ in range(2):
        agents.append(subprocess.Popen(
            [ddprun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "st", "--max-restarts", "3",
             str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(),
            start_new_session=True))
        time.sleep(0.1)
    try:
        def progress():
            r = status(ddprun, port, "--json")
            s = json.loads(r.stdout) if r.returncode == 0 else {}
            return s if len(s.get("ranks", [])) == 4 and all(x["step"] >= 5 for x in s["ranks"]) else None
        s = wait_until(progress, timeout=60)
        assert s, status(ddprun, port, "--json").stdout
        assert s["state"] == "running" and s["round"] == 0
        assert s["restarts"] == {"used": 0, "left": 3}
        assert s["job"]["min_nodes"] == 2 and s["job"]["nproc_per_node"] == 2
        hosts = {n["host"] for n in s["nodes"]}
        assert hosts == {socket.gethostname()}
        assert sorted((n["node"], n["first_rank"], n["nproc"]) for n in s["nodes"]) == [(0, 0, 2), (1, 2, 2)]
        assert all(x["img_per_s"] > 0 and x["time"].endswith("Z") for x in s["ranks"])
        assert "last_failure" not in s
        table = status(ddprun, port).stdout
        assert "job st: round 0, running; restarts used 0, left 3" in table, table
        # kill a worker of node 1: the job restarts, and status names the failure
        r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {conf}"], capture_output=True,
                           text=True)
        pids = sorted(int(p) for p in r.stdout.split())
        assert len(pids) == 4
        os.kill(pids[-1], signal.SIGKILL)
        # the killed worker's node reports it; its peers' "peer failure" may reach the store a
        # moment sooner, and status prefers the root cause once it is there
        s = wait_until(lambda: (lambda x: x if x.get("round", 0) >= 1 and
                                x.get("last_failure", {}).get("signal") else None)(
                                    json.loads(status(ddprun, port, "--json").stdout or "{}")),
                       timeout=60)
        assert s, status(ddprun, port, "--json").stdout
        f = s["last_failure"]
        assert f["round"] == 0 and f.get("signal") == 9 and f["time"].endswith("Z"), s
        assert s["restarts"]["used"] == 1 and s["restarts"]["left"] == 2
        table = status(ddprun, port).stdout
        assert "last failure: round 0" in table, table
        below = table.split("last failure: round 0", 1)[1].splitlines()[1:]
        assert below and all(line.strip() for line in below), "no empty line under it:\n" + table
    finally:
        for a in agents:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    # the job has ended: its store is gone, and status says so at once (no --timeout needed)
    start = time.monotonic()
    r = status(ddprun, port)
    took = time.monotonic() - start
    assert r.returncode == 1 and f"the job's store at 127.0.0.1:{port} is gone" in r.stderr, r.stderr
    assert "job 'st' has ended, or its host is down" in r.stderr, r.stderr
    assert "Connection refused" not in r.stderr and took < 2, (took, r.stderr)


def test_status_usage_errors(ddprun):
    r = subprocess.run([ddprun, "status", "--rdzv-id", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "--rdzv-endpoint" in r.stderr
