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


def set_keys(ddprun, endpoint, pairs):
    args = [ddprun, "store-client", "--endpoint", endpoint, "multi-set"]
    for k, v in pairs.items():
        args += [k, v]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 0, r.stderr


class Proxy:
    """127.0.0.1:port -> the store. It closes every connection once the client's bytes contain
    cut (None: never), and holds each reply of the store back for delay_s."""

    def __init__(self, target_port, cut=None, delay_s=0.0):
        import threading
        self.target_port, self.cut, self.delay_s = target_port, cut, delay_s
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.socks = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        import threading
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks += [c, s]
            threading.Thread(target=self.pump, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(s, c, False), daemon=True).start()

    def pump(self, src, dst, is_request):
        seen = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if is_request and self.cut is not None:
                    seen += data
                    if self.cut in seen:
                        break
                if not is_request and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        for x in self.socks:
            x.close()


def a_job(ddprun, store, job="J"):
    set_keys(ddprun, store.endpoint, {
        f"/ddprun/{job}/round": "1", f"/ddprun/{job}/job": '{"max_restarts": 3, "min_nodes": 1}',
        f"/ddprun/{job}/failures": "0", f"/ddprun/{job}/r1/closed": "1",
        f"/ddprun/{job}/r1/member/0": '{"node": 0, "host": "h0", "first_rank": 0, "nproc": 1, '
                                      '"world_size": 1, "agent_pid": 7}',
        f"/ddprun/{job}/progress/0": '{"step": 12, "epoch": 0}'})


def status_of(ddprun, port, job="J", *extra):
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
                        *extra], capture_output=True, text=True, timeout=60, env=clean_env())
    return r, time.monotonic() - t0


def test_status_of_a_job_in_a_plain_store(ddprun, store):
    a_job(ddprun, store)
    r, _ = status_of(ddprun, store.port, "J", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["state"] == "running" and s["round"] == 1 and s["restarts"] == {"used": 0, "left": 3}
    assert [n["host"] for n in s["nodes"]] == ["h0"] and s["ranks"][0]["step"] == 12


def test_a_failed_round_whose_next_has_no_members_yet_is_restarting(ddprun, store):
    """Round 1 failed (exit 3) and round 2 has not closed: restarting, with round 1's failure
    (the failure's record was taken for last_failure before the state was read: "running")."""
    a_job(ddprun, store)
    set_keys(ddprun, store.endpoint, {
        "/ddprun/J/round": "2",
        "/ddprun/J/r1/restart": '{"code":3,"permanent":false,"failures":1,"node":0,"rank":0}'})
    r, _ = status_of(ddprun, store.port, "J", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["state"] == "restarting" and s["last_failure"]["code"] == 3, s


def test_records_of_any_shape_cannot_crash_the_status(ddprun, store):
    """The store is anyone's: a member's negative world_size and a failure's huge node are
    bounded before use (they indexed before the status's arrays)."""
    a_job(ddprun, store)
    set_keys(ddprun, store.endpoint, {
        "/ddprun/J/r1/member/0": '{"node": 0, "host": "h0", "first_rank": 0, "nproc": 1, '
                                 '"world_size": -2, "agent_pid": 7}',
        "/ddprun/J/r1/restart": '{"code":3,"permanent":false,"failures":1,"node":2147483647,'
                                '"rank":0}'})
    r, _ = status_of(ddprun, store.port, "J", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["nodes"][0]["host"] == "h0"


def test_a_store_that_drops_the_connection_fails_the_status(ddprun, store):
    a_job(ddprun, store)
    for cut in (b"/ddprun/J/job", b"/closed", b"/member/0", b"/progress/0"):
        proxy = Proxy(store.port, cut=cut)
        try:
            r, _ = status_of(ddprun, proxy.port)
        finally:
            proxy.close()
        assert r.returncode == 1, (cut, r.stdout, r.stderr)
        assert r.stdout == "", (cut, "no partial status")
        assert f"the store at 127.0.0.1:{proxy.port}" in r.stderr, (cut, r.stderr)
        assert "no job" not in r.stderr, (cut, r.stderr)


def test_status_is_bounded_by_its_timeout(ddprun, store):
    a_job(ddprun, store)
    set_keys(ddprun, store.endpoint, {"/ddprun/J/round": "2000000000"})
    r, took = status_of(ddprun, store.port, "J", "--timeout", "2000", "--json")
    assert took < 5, took
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "joining", "none of the newest 64 rounds closed"
    proxy = Proxy(store.port, delay_s=0.4)  # every reply late: more requests than the time allows
    try:
        a_job(ddprun, store)
        r, took = status_of(ddprun, proxy.port, "J", "--timeout", "1000")
    finally:
        proxy.close()
    assert r.returncode == 1 and "within --timeout" in r.stderr, r.stderr
    assert took < 2.5, took
    for bad in ("99999999999", "-3", "1.5", '"x"'):
        set_keys(ddprun, store.endpoint, {"/ddprun/J/round": bad})
        r, _ = status_of(ddprun, store.port)
        assert r.returncode == 1 and "/ddprun/J/round" in r.stderr and "not a round" in r.stderr, \
            (bad, r.stderr)


def test_status_timeout_and_port_are_parsed_strictly(ddprun):
    for bad in ("abc", "2s", "0", "-5", "99999999999999999999999"):
        r, _ = status_of(ddprun, 1, "J", "--timeout", bad)
        assert r.returncode == 2 and f"--timeout {bad} is not milliseconds" in r.stderr, r.stderr
    # a static job's store is at its MASTER_PORT, 29500 unless given
    r = subprocess.run([ddprun, "status", "--rdzv-backend", "static", "--rdzv-endpoint",
                        "127.0.0.1", "--rdzv-id", "J", "--timeout", "500"], capture_output=True,
                       text=True, timeout=30, env=clean_env())
    assert r.returncode == 1 and "127.0.0.1:29500" in r.stderr, r.stderr
