"""A node that dies in the middle of its join, on c10d (an outside `ddprun store`): it took its
ticket (the round counts it) but wrote nothing after. Played by the test with `ddprun store-client
add` on the round's ticket counter. The live agents must not wait for it until join_timeout (or
forever): its missing node record ends the round within heartbeat_timeout, and the next round
starts with the live ones.

- a dead member among the records: agent A, the dead ticket, agent B (B closes the round at MAX,
  the round's last member, and waits for the dead one's node record);
- the dead one was to close the round: A waits at MIN = MAX - 1 live nodes, the dead ticket makes
  MAX, and nobody alive joined after it (A closes it itself, the dead member is the round's last,
  the one to publish the ranks; A gives up on them)."""
import os
import subprocess
import time

from conftest import clean_env, wait_until

HEARTBEAT_S = 2
WORKER = """#!/bin/sh
echo "$DDPRUN_ATTEMPT" > "$OUT_DIR/started.$$"
"""


class Job:
    def __init__(self, ddprun, tmp_path, store, nnodes, rdzv_id):
        self.ddprun, self.tmp, self.store, self.rdzv_id = ddprun, tmp_path, store, rdzv_id
        worker = tmp_path / "worker.sh"
        worker.write_text(WORKER)
        worker.chmod(0o755)
        conf = (f"join_timeout=60,last_call_timeout=0.5,keep_alive_interval=0.2,"
                f"heartbeat_timeout={HEARTBEAT_S},is_host=false")
        self.args = [ddprun, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-id", rdzv_id,
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", store.endpoint,
                     "--rdzv-conf", conf, str(worker)]
        self.procs, self.logs = [], []

    def start(self, name):
        path = self.tmp / f"{name}.log"
        self.logs.append(path)
        with open(path, "w") as log:
            self.procs.append(subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                               env=clean_env(OUT_DIR=str(self.tmp)),
                                               start_new_session=True))

    def text(self):
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in self.logs)

    def store_client(self, *args):
        r = subprocess.run([self.ddprun, "store-client", "--endpoint", self.store.endpoint,
                            *args], capture_output=True, text=True, timeout=30,
                           env=clean_env())
        return r

    def has_key(self, key):
        return self.store_client("--timeout", "200", "get", key).returncode == 0

    def dead_ticket(self, round_=0):
        r = self.store_client("add", f"/ddprun/{self.rdzv_id}/r{round_}/joined", "1")
        assert r.returncode == 0, r.stderr

    def started(self):
        return [int(p.read_text().strip() or -1) for p in self.tmp.glob("started.*")]

    def finish(self, timeout=60):
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        return [p.returncode for p in self.procs]


def test_a_member_that_died_after_its_ticket_ends_the_round_not_the_job(ddprun, tmp_path,
                                                                       start_store):
    job = Job(ddprun, tmp_path, start_store(), "2:3", "gap")
    try:
        job.start("a")
        assert wait_until(lambda: job.has_key("/ddprun/gap/r0/node/0"), 30), job.text()
        job.dead_ticket()  # ticket 1: counted, never a record
        t0 = time.monotonic()
        job.start("b")  # ticket 2: MAX, closes the round and waits for node/1
        assert wait_until(lambda: len(job.started()) == 2, 30), job.text()
        took = time.monotonic() - t0
    finally:
        codes = job.finish()
    assert codes == [0, 0], job.text()
    assert "joined it as #1 wrote no /ddprun/gap/r0/node/1" in job.text(), job.text()
    assert sorted(job.started()) == [1, 1], job.text()  # both in the next round
    assert took < 4 * HEARTBEAT_S + 10, f"{took:.1f} s:\n{job.text()}"


def test_a_round_whose_closer_died_after_its_ticket_is_closed_and_ended(ddprun, tmp_path,
                                                                       start_store):
    job = Job(ddprun, tmp_path, start_store(), "2", "closer")
    try:
        job.start("a")
        assert wait_until(lambda: job.has_key("/ddprun/closer/r0/node/0"), 30), job.text()
        job.dead_ticket()  # ticket 1 makes MAX: its holder would have closed the round
        assert wait_until(lambda: "ending the round" in job.text(), 4 * HEARTBEAT_S + 10), \
            job.text()
        assert "joined it as #1 wrote no /ddprun/closer/r0/rank/0" in job.text(), job.text()
        job.start("b")  # the next round gathers A and B
        assert wait_until(lambda: len(job.started()) == 2, 30), job.text()
    finally:
        codes = job.finish()
    assert codes == [0, 0], job.text()
    assert sorted(job.started()) == [1, 1], job.text()
