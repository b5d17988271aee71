"""Warm spares (ddprun --warm-spares 1) with ddpworker on the CPU backend: a spare per local rank,
initialized and waiting, takes the place of a restarted worker. Each test asserts on outcomes: the
final weights (bit for bit those of a run without spares), which process trained (the pid in
ddpworker's "start" event against the spares seen before the fault), the processes left, the exit
code. Which ddpworker processes are waiting spares is read from /proc: a spare's stdout is its
output file under RUN_DIR/spares until a round takes it."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import clean_env, free_port, wait_until
from test_faults import CONF as FAULTS_CONF

# test_faults.py's job, a third epoch longer: room for the spares to get ready before the kill
CONF = FAULTS_CONF.replace("epochs = 2\n", "epochs = 3\n")
assert CONF != FAULTS_CONF


@pytest.fixture
def conf(tmp_path):
    path = tmp_path / "spares.conf"
    path.write_text(CONF)
    return str(path)


def start_job(ddprun, conf, tmp_path, name, *extra, spares=1, nnodes=None, port=None):
    cmd = [ddprun, "--nproc-per-node", "2", "--max-restarts", "5", "--warm-spares", str(spares),
           "--log-dir", str(tmp_path / f"logs-{name}")]
    if nnodes:
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", name]
    else:
        cmd += ["--standalone"]
    cmd += [conf, f"snapshot.dir={tmp_path / ('snap-' + name)}",
            f"train.metrics_file={tmp_path / (name + '.jsonl')}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(), start_new_session=True)


def ddpworkers(conf):
    """pids of the ddpworker processes running conf (not their shims)."""
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(conf)}"],
                       capture_output=True, text=True)
    return {int(p) for p in r.stdout.split()}


def is_waiting_spare(pid):
    try:
        return os.readlink(f"/proc/{pid}/fd/1").endswith("/output.log")
    except OSError:
        return False


def split(conf):
    """(training workers, waiting spares) of conf right now."""
    pids = ddpworkers(conf)
    spares = {p for p in pids if is_waiting_spare(p)}
    return pids - spares, spares


def wait_for_spares(conf, n_training, n_spares, timeout=60):
    """Wait until n_training workers train and n_spares spares are ready; returns both sets."""
    def settled():
        training, spares = split(conf)
        is_settled = (len(training) == n_training and len(spares) == n_spares and
                      all(spare_ready(p) for p in spares))
        return (training, spares) if is_settled else None
    got = wait_until(settled, timeout=timeout)
    assert got, f"not {n_training} workers and {n_spares} ready spares in {timeout} s: {split(conf)}"
    return got


def spare_ready(pid):
    """It has said so in its output file (ddpworker writes the line as it signals the agent)."""
    try:
        with open(os.readlink(f"/proc/{pid}/fd/1")) as f:
            return "warm spare ready" in f.read()
    except OSError:
        return False


def start_events(metrics):
    with open(metrics) as f:
        return [e for e in map(json.loads, f) if e["event"] == "start"]


def state_hash(ddpworker, snap_dir):
    latest = (snap_dir / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap_dir / latest)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return re.search(r"^state hash:\s+(\S+)", r.stdout, re.M).group(1)


def wait_for_snapshot(snap_dir, timeout=60):
    assert wait_until(lambda: snap_dir.exists() and any(n.endswith(".ddps")
                                                        for n in os.listdir(snap_dir)),
                      timeout=timeout), "no snapshot"


def test_a_killed_worker_is_replaced_by_the_warm_spares_and_training_ends_bit_identical(
        ddprun, ddpworker, conf, tmp_path):
    """2 nodes x 2 workers on loopback. The reference runs without spares; the faulty run waits
    until every node has its ready spares, SIGKILLs a random training worker, and every node's new
    round must run in the spares seen before the kill."""
    port = free_port()
    ref = [start_job(ddprun, conf, tmp_path, "ref", spares=0, nnodes=2, port=port)
           for _ in range(2)]
    outs = [j.communicate(timeout=300)[0] for j in ref]
    assert [j.returncode for j in ref] == [0, 0], outs
    want = state_hash(ddpworker, tmp_path / "snap-ref")

    port = free_port()
    jobs = [start_job(ddprun, conf, tmp_path, "spares", nnodes=2, port=port) for _ in range(2)]
    training, spares = wait_for_spares(conf, 4, 4)
    wait_for_snapshot(tmp_path / "snap-spares")
    victim = random.Random(os.getpid()).choice(sorted(training))
    os.kill(victim, signal.SIGKILL)
    outs = [j.communicate(timeout=300)[0] for j in jobs]
    assert [j.returncode for j in jobs] == [0, 0], outs
    assert all("restarting every worker (restart 1 of" in o for o in outs), outs
    starts = start_events(tmp_path / "spares.jsonl")
    assert len(starts) == 2, starts
    assert "warm_spare" not in starts[0] and starts[0]["pid"] in training, starts
    assert starts[1]["warm_spare"] is True and starts[1]["pid"] in spares, (starts, spares)
    assert starts[1]["resumed"] is True
    assert state_hash(ddpworker, tmp_path / "snap-spares") == want
    assert not ddpworkers(conf), "spares or workers outlived their agents"


def test_a_dead_spare_is_replaced_without_touching_the_training(ddprun, conf, tmp_path):
    job = start_job(ddprun, conf, tmp_path, "dead", "train.epochs=1000")
    try:
        training, spares = wait_for_spares(conf, 2, 2)
        victim = min(spares)
        os.kill(victim, signal.SIGKILL)
        # gone first: until its exit the victim is still listed, a "settled" set of the old spares
        assert wait_until(lambda: victim not in ddpworkers(conf), timeout=10), victim
        replaced = wait_for_spares(conf, 2, 2)
        assert replaced[0] == training, "the training workers must not be restarted"
        assert victim not in replaced[1] and len(replaced[1] & spares) == 1, (spares, replaced)
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    assert re.search(rf"warm spare for local rank \d \(pid {victim}\) was killed by signal 9 "
                     r"before a round took it; its output: .*/spares/\d+/output.log", out), out
    assert "restarting every worker" not in out, out
    assert wait_until(lambda: not ddpworkers(conf), timeout=10), "spares outlived their agent"


def test_spares_die_with_their_agent(ddprun, conf, tmp_path):
    job = start_job(ddprun, conf, tmp_path, "agent", "train.epochs=1000")
    wait_for_spares(conf, 2, 2)
    os.kill(job.pid, signal.SIGKILL)  # the agent alone: its workers' and spares' shims must notice
    job.communicate(timeout=30)
    assert wait_until(lambda: not ddpworkers(conf), timeout=10), ddpworkers(conf)


FASHION = "/usr/share/datasets/fashion-mnist"
# steps of ~40 ms (2 cores): a spare starts at the earliest one step after rank 0's start line
FASHION_CONF = """[model]
name = cnn
width = 96
[data]
kind = fashion-mnist
dir = {data}
train_limit = 2048
test_limit = 256
[optim]
lr = 0.02
[train]
batch_size = 16
epochs = 4
log_interval = 16
[snapshot]
every = 16
"""


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="no Debian Fashion-MNIST")
def test_a_spare_that_cannot_load_the_data_ends_the_spares_and_restarts_start_fresh(ddprun,
                                                                                   tmp_path):
    """The data vanish after the first round loaded them: the spares, started once that round
    trains, fail with the data error, which a restart cannot mend, so the agent keeps no more
    spares; once the data are back, a killed worker's round starts fresh and the job ends well."""
    data, hidden = tmp_path / "data", tmp_path / "hidden"
    shutil.copytree(FASHION, data)
    conf = tmp_path / "fashion.conf"
    conf.write_text(FASHION_CONF.format(data=data))
    job = start_job(ddprun, str(conf), tmp_path, "nodata")
    seen, deaths = [], 0
    try:
        for line in job.stdout:
            seen.append(line)
            # rank 0's start line comes after the initial broadcast, so both ranks hold the data,
            # and before any step, so no spare has started (they wait for every rank's progress)
            if "ddpworker: cnn (" in line:
                data.rename(hidden)
            deaths += "before a round took it" in line
            if deaths == 2:
                break
        assert deaths == 2 and any("no more warm spares" in s for s in seen), "".join(seen)
        hidden.rename(data)
        time.sleep(1.5)  # longer than the agent waits before it replaces a spare
        # the kill must find a snapshot to resume from (on a loaded machine the spares can be
        # done with before the job's first snapshot)
        assert wait_until(lambda: (tmp_path / "snap-nodata" / "latest").exists(), timeout=120), \
            "no snapshot in 120 s"
        training, spares = split(str(conf))
        assert len(training) == 2 and not spares, (training, spares)
        os.kill(min(training), signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = "".join(seen) + out
    assert job.returncode == 0, out
    assert re.search(r"the warm spare for local rank \d \(pid \d+\) exited with 65 before a "
                     r"round took it", out), out
    assert "restarting every worker (restart 1 of" in out, out
    starts = start_events(tmp_path / "nodata.jsonl")
    assert len(starts) == 2 and not any("warm_spare" in e for e in starts), starts
    assert starts[1]["resumed"] is True


def test_the_flag(ddprun, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    conf = tmp_path / "x.conf"
    conf.write_text("[model]\nname = mlp\n")

    def dry(*args, gpus):
        r = subprocess.run([ddprun, "--dry-run", *args], capture_output=True, text=True,
                           env=clean_env(CUDA_VISIBLE_DEVICES=gpus), timeout=30)
        return r.returncode, r.stdout + r.stderr

    assert "warm_spares: 0" in dry(str(conf), gpus="")[1]  # auto without a GPU
    assert "warm_spares: 1" in dry(str(conf), gpus="0")[1]  # auto on a GPU node
    assert "warm_spares: 0" in dry(str(script), gpus="0")[1]  # a script cannot wait as a spare
    assert "warm_spares: 1" in dry("--warm-spares", "1", str(conf), gpus="")[1]
    assert "warm_spares: 0" in dry("--warm-spares", "0", str(conf), gpus="0")[1]
    rc, out = dry("--warm-spares", "1", str(script), gpus="")
    assert rc == 2 and "only the built-in trainer" in out and "s.py" in out, out
    rc, out = dry("--warm-spares", "2", str(conf), gpus="")
    assert rc == 2 and "--warm-spares: '2' is not 0, 1 or auto" in out, out
