"""SIGTERM and SIGINT end an agent in every state, as Kubernetes and Slurm expect: an agent without
workers exits at once with 128+signal (143, 130), one with workers once they ended, within
--shutdown-timeout. States: joining with nothing listening (the join's connect retries), waiting in
a rendezvous for a second node, workers running (a worker that ignores SIGTERM is SIGKILLed after
--shutdown-timeout), in the exit barrier (its workers succeeded: 0), restarting (joining the next
round while the other node still stops its workers).

"At once" is checked two ways: the exit comes within AT_ONCE_S of the signal, and the agent did not
need its last resort (the forced exit after a signal, which says "exiting now")."""
import os
import signal
import subprocess
import time

import pytest

from conftest import clean_env, free_port, wait_until

AT_ONCE_S = 1.5  # a loaded 2-core machine running the sanitizer build
CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

# GROUP_RANK 0 ends at once (or fails once, FAIL0), the others sleep; IGNORE_TERM: deaf to SIGTERM
WORKER = r"""#!/bin/sh
[ -n "$IGNORE_TERM" ] && trap '' TERM
touch "$OUT_DIR/started.$GROUP_RANK.$TORCHELASTIC_RESTART_COUNT"
if [ "$GROUP_RANK" = 0 ]; then
    [ -n "$FAIL0" ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && exit 3
    [ -n "$SLEEP0" ] && sleep "$SLEEP0"
    exit 0
fi
i=0
while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


class Agent:
    def __init__(self, ddprun, tmp_path, name, args, env=None):
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([ddprun] + args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=clean_env(OUT_DIR=str(tmp_path), **(env or {})),
                                     start_new_session=True)

    def text(self):
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_log(self, needle, timeout=30):
        assert wait_until(lambda: needle in self.text() or self.proc.poll() is not None,
                          timeout), f"no {needle!r} within {timeout} s:\n{self.text()}"
        assert needle in self.text(), f"exited {self.proc.returncode}:\n{self.text()}"

    def signal_and_time(self, signum, timeout=60):
        """Send signum; (exit code, seconds until the exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            text = self.text()
            self.kill()
            raise AssertionError(f"still alive {timeout} s after {signum.name}:\n{text}")
        return rc, time.monotonic() - t0

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def agents(ddprun, tmp_path):
    started = []
    worker = tmp_path / "worker.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)

    def start(name, args, env=None):
        a = Agent(ddprun, tmp_path, name, args + [str(worker)], env)
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()


def job_args(port, *conf, nnodes="2"):
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "sig", "--monitor-interval", "0.1",
            "--rdzv-conf", ",".join(("join_timeout=120", "last_call_timeout=0.1") + conf)]


def assert_at_once(a, rc, took, want):
    assert rc == want, f"exit {rc}, want {want}:\n{a.text()}"
    assert took < AT_ONCE_S, f"{took:.2f} s after the signal, want < {AT_ONCE_S} s:\n{a.text()}"
    assert "exiting now" not in a.text(), "it needed the forced exit:\n" + a.text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_joining_with_nothing_listening(agents, signum):
    port = free_port()
    a = agents("joining", job_args(port, "is_host=false"))
    a.wait_log(f"store at 127.0.0.1 port {port}")
    time.sleep(0.5)  # inside the join's connect retries
    rc, took = a.signal_and_time(signum)
    assert_at_once(a, rc, took, CODES[signum])
    assert "while joining a round: leaving" in a.text()


def test_waiting_in_a_rendezvous_for_a_second_node(agents):
    port = free_port()
    a = agents("host", job_args(port))
    a.wait_log("store hosted on")
    time.sleep(0.5)  # its join waits for the round to close
    rc, took = a.signal_and_time(signal.SIGTERM)
    assert_at_once(a, rc, took, 143)
    assert wait_until(lambda: subprocess.run(["ss", "-ltnH", f"sport = :{port}"],
                                             capture_output=True, text=True).stdout.strip() == "",
                      5), f"port {port} still listening after the store host left"


@pytest.mark.parametrize("deaf", [False, True], ids=["worker-exits", "worker-ignores-term"])
def test_workers_running(agents, tmp_path, deaf):
    port = free_port()
    env = {"IGNORE_TERM": "1"} if deaf else {}
    a = agents("n0", job_args(port) + ["--shutdown-timeout", "2"], {**env, "SLEEP0": "60"})
    a.wait_log("store hosted on")
    b = agents("n1", job_args(port) + ["--shutdown-timeout", "2"], env)
    assert wait_until(lambda: (tmp_path / "started.0.0").exists() and
                      (tmp_path / "started.1.0").exists(), 30), a.text() + b.text()
    time.sleep(0.3)
    rc, took = a.signal_and_time(signal.SIGTERM)
    assert rc == 143, a.text()
    limit = 2 + AT_ONCE_S if deaf else AT_ONCE_S  # --shutdown-timeout, then SIGKILL
    assert took < limit, f"{took:.2f} s, want < {limit}:\n{a.text()}"
    if deaf:
        assert took >= 1.8, f"the worker had --shutdown-timeout to end: {took:.2f} s"
    # the other node is told (the report) and leaves too, as under torchrun
    rc_b = b.proc.wait(timeout=30)
    assert rc_b != 0, b.text()


def test_in_the_exit_barrier(agents, tmp_path):
    port = free_port()
    a = agents("n0", job_args(port))
    a.wait_log("store hosted on")
    b = agents("n1", job_args(port))
    # node 0's worker succeeded at once; node 1's runs: node 0 waits in the exit barrier
    assert wait_until(lambda: (tmp_path / "started.1.0").exists(), 30), a.text() + b.text()
    time.sleep(1.0)
    assert a.proc.poll() is None, a.text()
    rc, took = a.signal_and_time(signal.SIGTERM)
    assert_at_once(a, rc, took, 0)  # its workers succeeded
    assert "in the exit barrier" in a.text()


def test_restarting(agents, tmp_path):
    """Node 0's worker fails once; node 0 joins the next round while node 1's worker, deaf to
    SIGTERM, still has --shutdown-timeout to go: SIGTERM to node 0 then."""
    port = free_port()
    a = agents("n0", job_args(port) + ["--max-restarts", "3"], {"FAIL0": "1"})
    a.wait_log("store hosted on")
    b = agents("n1", job_args(port) + ["--shutdown-timeout", "30"], {"IGNORE_TERM": "1"})
    a.wait_log("restarting every worker (restart 1 of 3)")
    time.sleep(0.5)
    assert not (tmp_path / "started.0.1").exists(), "round 1 should wait for node 1"
    rc, took = a.signal_and_time(signal.SIGTERM)
    assert_at_once(a, rc, took, 143)


def test_a_spare_leaves_without_ending_the_members_round(agents, tmp_path):
    """A third node of a full 2-node job waits as a spare; a signal makes it leave at once and
    the members run on (its 143 report used to end every node's job, which torchrun's running
    group does not do when a waiting node leaves)."""
    port = free_port()
    a = agents("n0", job_args(port), {"SLEEP0": "60"})
    a.wait_log("store hosted on")
    b = agents("n1", job_args(port))
    assert wait_until(lambda: (tmp_path / "started.0.0").exists() and
                      (tmp_path / "started.1.0").exists(), 30), a.text() + b.text()
    spare = agents("spare", job_args(port))
    spare.wait_log("without this one")
    rc, took = spare.signal_and_time(signal.SIGTERM)
    assert_at_once(spare, rc, took, 143)
    assert "waiting for the next round: leaving" in spare.text()
    time.sleep(2)
    for member in (a, b):
        assert member.proc.poll() is None, member.text()
        assert "ends" not in member.text() and "failed" not in member.text(), member.text()
    assert not (tmp_path / "started.0.1").exists(), "the members' workers were restarted"


def test_a_silent_store_makes_the_agents_leave_within_the_heartbeat_timeout(agents, tmp_path,
                                                                               start_store):
    """The job's store freezes (SIGSTOP): each agent leaves after heartbeat_timeout and a beat
    or so, not after twice it (a beat waited the whole timeout, and two failures decide: 2.25 x
    heartbeat_timeout measured by a review)."""
    store = start_store()
    conf = ("keep_alive_interval=0.5", "heartbeat_timeout=6")
    # on an outside store either agent may be node 0, whose worker ends at once without SLEEP0
    # (its node then waits in the exit barrier, where a silent store is no failure): both sleep
    a = agents("n0", job_args(store.port, *conf), {"SLEEP0": "60"})
    b = agents("n1", job_args(store.port, *conf), {"SLEEP0": "60"})
    assert wait_until(lambda: (tmp_path / "started.0.0").exists() and
                      (tmp_path / "started.1.0").exists(), 30), a.text() + b.text()
    time.sleep(1)
    store.proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    said = "took no heartbeat for 6 s: leaving the job"
    try:
        assert wait_until(lambda: said in a.text() and said in b.text(), 60, 0.05), \
            a.text() + b.text()
        took = time.monotonic() - t0
        codes = [x.proc.wait(timeout=60) for x in (a, b)]
    finally:
        store.proc.send_signal(signal.SIGCONT)
    assert codes == [75, 75], a.text() + b.text()
    assert took < 6 + 3, f"the agents decided to leave {took:.1f} s after the store froze"


def test_a_silent_store_ends_the_exit_barrier_with_the_heartbeat_timeout(agents, tmp_path,
                                                                         start_store):
    """Node 0's workers succeeded and it waits in the exit barrier when the store freezes: it
    leaves with 0 (its workers succeeded, as torchrun's agent does when its barrier fails) as soon
    as the heartbeats find the store silent, and says so once. It used to wait out the barrier's
    cancel of its WAIT and then a 10 s handshake with the frozen store (an interrupt taken for a
    timeout), saying "took no heartbeat" every 3.5 s meanwhile."""
    store = start_store()
    conf = ("keep_alive_interval=0.5", "heartbeat_timeout=6")
    a = agents("n0", job_args(store.port, *conf))
    b = agents("n1", job_args(store.port, *conf))
    assert wait_until(lambda: (tmp_path / "started.0.0").exists() and
                      (tmp_path / "started.1.0").exists(), 30), a.text() + b.text()
    time.sleep(1)  # the node whose group rank is 0 is in the exit barrier now
    store.proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        codes = [x.proc.wait(timeout=60) for x in (a, b)]
        took = time.monotonic() - t0
    finally:
        store.proc.send_signal(signal.SIGCONT)
    finished, failed = (a, b) if "node 0 of 2" in a.text() else (b, a)
    assert sorted(codes) == [0, 75], a.text() + b.text()
    assert finished.proc.returncode == 0 and failed.proc.returncode == 75
    assert finished.text().count("took no heartbeat") == 1, finished.text()
    assert "not every node confirmed the end of the job (its store is silent)" in finished.text()
    assert took < 6 + 3, f"the agents left {took:.1f} s after the store froze"
