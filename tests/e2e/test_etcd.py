"""The etcd rendezvous backend against a real etcd cluster (tests/tools/etcd_cluster.py: three
members on loopback): ddprun nodes rendezvous through etcd's v3 API, a node that dies is found by
its lease expiring, the job outlives the node that served its round's store and etcd's leader,
TLS and auth work, and `ddprun status` reads the job from etcd during and after the run."""
import json
import os
import re
import shutil
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

# threads = 1: the compute threads per worker default to the cores over the node's workers, and
# OpenBLAS sums in another order with another thread count; the survivors (1 worker per node)
# and the 2-rank reference (2 on one node) must compute alike.
CONF = """[model]
name = cnn
width = 8
[data]
kind = synthetic
height = 16
width = 16
channels = 1
classes = 10
train_limit = 3072
test_limit = 128
augment = true
[optim]
lr = 0.05
[train]
batch_size = 8
epochs = 0
max_steps = {steps}
log_interval = 4
collective_timeout = 5
threads = 1
[snapshot]
every = 16
keep = 1000
# the test copies the snapshot resumed from: a disk one (memory ones go with their agent)
every_memory = 0
"""


def write_conf(tmp_path, steps):
    path = tmp_path / "etcd.conf"
    path.write_text(CONF.format(steps=steps))
    return str(path)


def agent(ddprun, cluster, conf_or_program, log, *extra, job="etcdjob", nnodes="2:3",
          rdzv_conf="lease_ttl=2,last_call_timeout=0.5,join_timeout=60"):
    cmd = [ddprun, "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "5",
           "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", job,
           "--rdzv-conf", rdzv_conf, "--local-addr", "127.0.0.1", conf_or_program, *extra]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=clean_env(),
                            start_new_session=True)


def status(ddprun, cluster, job="etcdjob", rdzv_conf=None):
    cmd = [ddprun, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints,
           "--rdzv-id", job, "--json"]
    if rdzv_conf:
        cmd += ["--rdzv-conf", rdzv_conf]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else None, r.stderr


def state_of(ddpworker, path):
    r = subprocess.run([ddpworker, "inspect", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", r.stdout, re.M))
    return fields["state hash"], int(fields["step"].split()[0]), int(fields["world size"])


def newest_snapshot_step(snap):
    steps = [int(m.group(1)) for n in (os.listdir(snap) if snap.exists() else [])
             if (m := re.match(r"snapshot-(\d+)\.ddps$", n))]
    return max(steps, default=0)


def workers_of(conf):
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(conf)}"],
                       capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def test_etcd_v2_is_refused_with_the_reason_and_a_list_is_only_for_etcd(ddprun):
    r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
                        "127.0.0.1:2379", "--rdzv-id", "x", "/bin/true"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "v3" in r.stderr and "etcd-v2" in r.stderr, r.stderr
    r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        "127.0.0.1:1,127.0.0.1:2", "--rdzv-id", "x", "/bin/true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "etcd" in r.stderr, r.stderr
    r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                        "127.0.0.1:2379", "--rdzv-id", "x", "--rdzv-conf", "user=root",
                        "/bin/true"], capture_output=True, text=True, timeout=30,
                       env={**clean_env(), "DDPRUN_ETCD_PASSWORD": ""})
    assert r.returncode == 2 and "password" in r.stderr, r.stderr


def test_an_endpoint_that_is_no_etcd_is_said_at_once(ddprun):
    """A web server at the endpoint answers 200 with a page: every try gets the same, and the agent
    says so and exits, instead of trying again, silently, until join_timeout + read_timeout."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b"<html>not etcd</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                            f"127.0.0.1:{server.server_address[1]}", "--rdzv-id", "page",
                            "--no-python", "/bin/true"], capture_output=True, text=True,
                           timeout=120, env=clean_env())
    finally:
        server.shutdown()
    assert r.returncode != 0 and "the answer is not JSON" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 10, r.stderr


def test_the_job_outlives_its_store_host_and_etcds_leader_with_the_uninterrupted_weights(
        ddprun, ddpworker, tmp_path):
    """Three nodes; kill -9 the node serving the round's store (node 0), then etcd's leader: the two
    survivors finish, and their final weights equal an uninterrupted 2-rank run resumed from the
    snapshot they resumed from."""
    with etcd_cluster_or_skip(tmp_path / "etcd") as cluster:
        conf = write_conf(tmp_path, steps=3000)
        snap = tmp_path / "snap"
        logs = [tmp_path / f"node{i}.log" for i in range(3)]
        jobs = [agent(ddprun, cluster, conf, logs[i], f"snapshot.dir={snap}") for i in range(3)]
        try:
            deadline = time.monotonic() + 120
            while newest_snapshot_step(snap) < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert newest_snapshot_step(snap) >= 32, [log.read_text() for log in logs]
            rc, st, err = status(ddprun, cluster)
            assert rc == 0 and st["state"] == "running" and len(st["nodes"]) == 3, (st, err)
            assert st["ranks"], st  # progress, from the round's store
            host_pid = st["nodes"][0]["agent_pid"]
            host = next(j for j in jobs if j.pid == host_pid)
            os.killpg(host.pid, signal.SIGKILL)
            host.wait()
            time.sleep(0.3)
            leader = cluster.wait_leader()
            cluster.kill(leader)
            survivors = [j for j in jobs if j is not host]
            for j in survivors:
                j.wait(timeout=300)
            outs = [log.read_text() for j, log in zip(jobs, logs) if j is not host]
            assert [j.returncode for j in survivors] == [0, 0], outs
            assert all(re.search(r"round [1-9]\d*: node [01] of 2", o) for o in outs), outs
        finally:
            for j in jobs:
                if j.poll() is None:
                    os.killpg(j.pid, signal.SIGKILL)
        time.sleep(0.5)
        assert workers_of(conf) == [], "no worker outlives the job"
        final = state_of(ddpworker, snap / (snap / "latest").read_text().strip())
        assert final[1] == 3000 and final[2] == 2, final

        # the uninterrupted run from the snapshot the survivors last resumed from
        resumes = re.findall(r"resuming from (\S+): step (\d+).*now (\d+)\)", "".join(outs))
        assert resumes and resumes[-1][2] == "2", outs
        ref = tmp_path / "reference"
        ref.mkdir()
        shutil.copy(resumes[-1][0], ref)
        (ref / "latest").write_text(os.path.basename(resumes[-1][0]) + "\n")
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf,
                            f"snapshot.dir={ref}"], capture_output=True, text=True, timeout=300,
                           env=clean_env())
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"resuming from {ref}" in r.stdout, r.stdout
        assert state_of(ddpworker, ref / (ref / "latest").read_text().strip()) == final

        # after the end: the job's record, with the workers' last progress, under a lease
        rc, st, err = status(ddprun, cluster)
        assert rc == 0 and st["state"] == "finished", (st, err)
        assert len(st["nodes"]) == 2 and len(st["ranks"]) == 2, st
        assert all(p["step"] == 3000 for p in st["ranks"]), st
        assert st["last_failure"], st
        r = cluster.etcdctl("get", "--prefix", "/ddprun/etcdjob/job", "-w", "json")
        assert json.loads(r.stdout)["kvs"][0].get("lease"), r.stdout


def test_tls_and_auth_with_a_password_file_and_a_wrong_password_said_plainly(ddprun, tmp_path):
    with etcd_cluster_or_skip(tmp_path / "etcd", members=1, tls=True,
                              auth_password="s3cret-pw") as cluster:
        tls = f"cacert={cluster.cacert},cert={cluster.cert},key={cluster.key},user=root"
        conf = tls + f",password_file={cluster.password_file},lease_ttl=3,last_call_timeout=0.2"
        program = tmp_path / "w.sh"
        program.write_text("#!/bin/sh\necho rank $RANK of $WORLD_SIZE via $MASTER_ADDR\n")
        program.chmod(0o755)
        logs = [tmp_path / f"n{i}.log" for i in range(2)]
        jobs = [agent(ddprun, cluster, str(program), logs[i], job="tlsjob", nnodes="2",
                      rdzv_conf=conf) for i in range(2)]
        for j in jobs:
            j.wait(timeout=120)
        outs = [log.read_text() for log in logs]
        assert [j.returncode for j in jobs] == [0, 0], outs
        assert "rank 0 of 2" in "".join(outs) and "rank 1 of 2" in "".join(outs), outs
        rc, st, err = status(ddprun, cluster, job="tlsjob", rdzv_conf=conf)
        assert rc == 0 and st["state"] == "finished", (st, err)

        wrong = tmp_path / "wrong"
        wrong.write_text("not-it\n")
        t0 = time.monotonic()
        r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                            cluster.endpoints, "--rdzv-id", "tlsjob2", "--rdzv-conf",
                            tls + f",password_file={wrong}", "/bin/true"],
                           capture_output=True, text=True, timeout=120)
        # the agent's clean exit (1) with the reason, not a crash or a sanitizer abort (134)
        assert r.returncode == 1 and "authentication as 'root' failed" in r.stderr, r.stderr
        assert "not-it" not in r.stdout + r.stderr
        assert time.monotonic() - t0 < 30


# seen.<attempt>.<rank>: group world size, world size, group rank, TORCHELASTIC_RESTART_COUNT; in
# attempt 0 the workers wait FIRST_ROUND_S, rank FAIL_RANK exits 3 in attempts below FAIL_UNTIL.
ELASTIC_WORKER = r"""#!/bin/sh
echo "$GROUP_WORLD_SIZE $WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RESTART_COUNT" > "$OUT_DIR/seen.$DDPRUN_ATTEMPT.$RANK"
[ "$RANK" = "${FAIL_RANK:-none}" ] && [ "$DDPRUN_ATTEMPT" -lt "${FAIL_UNTIL:-0}" ] && exit 3
[ "$DDPRUN_ATTEMPT" = "0" ] && exec sleep "${FIRST_ROUND_S:-0}"
exit 0
"""


def elastic_agents(ddprun, cluster, tmp_path, n, job, env_extra, max_restarts="5"):
    worker = tmp_path / "elastic.sh"
    worker.write_text(ELASTIC_WORKER)
    worker.chmod(0o755)
    env = {**clean_env(), "OUT_DIR": str(tmp_path), **env_extra}
    return [subprocess.Popen(
        [ddprun, "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", max_restarts,
         "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", job,
         "--rdzv-conf", "lease_ttl=3,last_call_timeout=0.3,join_timeout=60",
         "--local-addr", "127.0.0.1", str(worker)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(n)]


def test_elastic_rules_as_on_c10d_scale_up_and_a_job_wide_restart_budget(ddprun, tmp_path):
    """A third node arriving while two run gets a new round of three (not a restart: as torchrun,
    TORCHELASTIC_RESTART_COUNT stays 0); a worker that fails restarts every node, each failure
    counted once against the job-wide --max-restarts, and past it every agent gives up with the
    worker's exit code; the same --rdzv-id started again is then refused."""
    with etcd_cluster_or_skip(tmp_path / "etcd", members=1) as cluster:
        up = tmp_path / "up"
        up.mkdir()
        agents = elastic_agents(ddprun, cluster, up, 2, "upjob", {"FIRST_ROUND_S": "30"})
        deadline = time.monotonic() + 30
        while not ((up / "seen.0.0").exists() and (up / "seen.0.1").exists()):
            assert time.monotonic() < deadline, [a.poll() for a in agents]
            time.sleep(0.02)
        t0 = time.monotonic()
        agents += elastic_agents(ddprun, cluster, up, 1, "upjob", {"FIRST_ROUND_S": "30"})
        errs = [a.communicate(timeout=60)[1] for a in agents]
        assert [a.returncode for a in agents] == [0, 0, 0], errs
        assert time.monotonic() - t0 < 15, "the 30 s first round was cut short by the new round"
        for rank in range(3):
            assert (up / f"seen.1.{rank}").read_text().split() == ["3", "3", str(rank), "0"]
        assert all("restarting" not in e for e in errs), errs

        # failures: rank 1 fails in attempts 0 and 1 with a budget of 1 -> the job fails with 3
        fail = tmp_path / "fail"
        fail.mkdir()
        agents = elastic_agents(ddprun, cluster, fail, 2, "failjob",
                                {"FAIL_RANK": "1", "FAIL_UNTIL": "2"}, max_restarts="1")
        errs = [a.communicate(timeout=90)[1] for a in agents]
        assert [a.returncode for a in agents] == [3, 3], errs
        # the failing rank writes first and always; rank 0 of round 1 may be stopped before its
        # first line (rank 1 fails within milliseconds), and node ranks follow the join order
        seen = (fail / "seen.1.1").read_text().split()
        assert seen[:2] == ["2", "2"] and seen[3] == "1", seen
        assert not (fail / "seen.2.0").exists(), "one restart only: the budget is job-wide"
        assert any("restart 1 of 1" in e for e in errs), errs

        # the same --rdzv-id again: that job gave up, and a new run of it is refused, naming
        # why (it ran a round 2 with the old job's spent budget: one failure ended it)
        again = tmp_path / "again"
        again.mkdir()
        agents = elastic_agents(ddprun, cluster, again, 2, "failjob", {}, max_restarts="1")
        errs = [a.communicate(timeout=60)[1] for a in agents]
        assert [a.returncode for a in agents] == [1, 1], errs
        assert all("the job of --rdzv-id failjob ended in round 1 (exit 3" in e and
                   "a new run of it needs another --rdzv-id" in e for e in errs), errs
        assert not any(again.glob("seen.*")), "no worker ran"


def test_one_node_on_etcd_runs_on_a_store_of_its_own(ddprun, tmp_path):
    """--nnodes 1 meets nobody: the endpoint is etcd's, never an address to bind a store on."""
    program = tmp_path / "w.sh"
    program.write_text("#!/bin/sh\necho rank $RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT\n")
    program.chmod(0o755)
    r = subprocess.run([ddprun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                        "--rdzv-endpoint", "127.0.0.1:1,127.0.0.1:2", "--rdzv-id", "solo",
                        "--local-addr", "127.0.0.1", str(program)],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "rank 1 of 2 at 127.0.0.1:" in r.stdout, r.stdout
