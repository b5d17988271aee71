"""Fault injection: crashes, hangs, lost nodes, corrupt snapshots and full disks, each against
ddprun + ddpworker (CPU backend) with snapshots on. Every test asserts on the final state (the
weights' hash from `ddpworker inspect`, the step reached, the files on disk), and the bar is exact:
a run that is killed and resumed ends with the same weights, bit for bit, as one that never failed
(with Adam's state too)."""
import ctypes
import ctypes.util
import os
import random
import re
import signal
import struct
import subprocess
import time

import pytest

from conftest import clean_env, environment_broken, free_port

EXIT_IO = 74
EXIT_CONFIG = 78

CONF = """[model]
name = cnn
width = 16
[data]
kind = synthetic
height = 28
width = 28
channels = 1
classes = 10
train_limit = 4096
test_limit = 256
augment = true
[optim]
lr = 0.05
[train]
batch_size = 16
epochs = 2
log_interval = 8
collective_timeout = 30
[snapshot]
every = 4
keep = 3
"""


@pytest.fixture
def conf(tmp_path):
    path = tmp_path / "faults.conf"
    path.write_text(CONF)
    return str(path)


def inspect(ddpworker, path):
    r = subprocess.run([ddpworker, "inspect", str(path)], capture_output=True, text=True, timeout=30)
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", r.stdout, re.M))
    return r.returncode, fields


def final_state(ddpworker, snap_dir):
    """(state hash, step, world size) of the snapshot `latest` names; asserts it verifies."""
    latest = (snap_dir / "latest").read_text().strip()
    rc, f = inspect(ddpworker, snap_dir / latest)
    assert rc == 0, f
    return f["state hash"], int(f["step"].split()[0]), int(f["world size"])


def restarts(out):
    """How many times the agent whose output this is restarted its workers: the N of its last
    "restart N of M". A test allows exactly the restarts its faults cause: a worker that failed on
    its own (a sanitizer abort, a crash) is restarted too and would pass unseen."""
    found = re.findall(r"restarting every worker \(restart (\d+) of", out)
    return int(found[-1]) if found else 0


def snapshot_steps(snap_dir):
    return sorted(int(m.group(1)) for name in os.listdir(snap_dir)
                  if (m := re.match(r"snapshot-(\d+)\.ddps$", name)))


def start_job(ddprun, conf, snap_dir, *extra, nproc=2, nnodes=None, port=None, rdzv_conf=None,
              extra_flags=()):
    cmd = [ddprun, "--nproc-per-node", str(nproc), "--max-restarts", "10", *extra_flags]
    if nnodes:
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", "faults"]
        if rdzv_conf:
            cmd += ["--rdzv-conf", rdzv_conf]
    else:
        cmd += ["--standalone"]
    cmd += [conf, f"snapshot.dir={snap_dir}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(), start_new_session=True)


def read_until_step(job, step):
    """The job's output up to rank 0's progress line for `step`: the workers are training (with
    their signal handlers in place) and far from done, however fast the build."""
    seen = []
    for line in job.stdout:
        seen.append(line)
        if f" step {step}/" in line:
            return "".join(seen)
    pytest.fail("the job ended before step %d:\n%s" % (step, "".join(seen)))


def run_job(ddprun, conf, snap_dir, *extra, timeout=300, **kw):
    """A job with no fault injected: it must not restart anything."""
    p = start_job(ddprun, conf, snap_dir, *extra, **kw)
    out, _ = p.communicate(timeout=timeout)
    assert restarts(out) == 0, out
    return p.returncode, out


def reference(ddprun, ddpworker, conf, tmp_path, nproc=2, nnodes=1):
    """The uninterrupted run's final state, same world size."""
    snap = tmp_path / "reference"
    if nnodes == 1:
        rc, out = run_job(ddprun, conf, snap, nproc=nproc)
        assert rc == 0, out
    else:
        port = free_port()
        jobs = [start_job(ddprun, conf, snap, nproc=nproc, nnodes=str(nnodes), port=port)
                for _ in range(nnodes)]
        outs = [j.communicate(timeout=300)[0] for j in jobs]
        assert [j.returncode for j in jobs] == [0] * nnodes, outs
        assert [restarts(o) for o in outs] == [0] * nnodes, outs
    return final_state(ddpworker, snap)


def workers_of(conf):
    """pids of the ddpworker processes running conf (not their shims)."""
    # anchored: a shim's command line ("ddprun __shim PID -- .../ddpworker conf") holds it too
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(conf)}"],
                       capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def env_of(pid):
    return dict(e.split(b"=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                if b"=" in e)


def agent_of(pid, agents):
    """The one of agents (pids) that pid descends from."""
    while pid > 1 and pid not in agents:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    assert pid in agents, pid
    return pid


def wait_for_new_round(conf, gone, n_workers=4, timeout=60):
    """pids of a full set of workers, none of them in gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = workers_of(conf)
        if len(live) == n_workers and not gone & set(live):
            return live
        time.sleep(0.01)
    pytest.fail(f"no new round of {n_workers} workers within {timeout} s")


def latest_step(snap_dir):
    steps = snapshot_steps(snap_dir) if snap_dir.exists() else []
    return steps[-1] if steps else 0


def wait_for_snapshot_after(snap_dir, step, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = latest_step(snap_dir)
        if newest > step:
            return newest
        time.sleep(0.01)
    pytest.fail(f"no snapshot after step {step} within {timeout} s")


def test_kill_9_of_random_workers_ends_with_the_uninterrupted_weights(ddprun, ddpworker, conf,
                                                                       tmp_path):
    """2 nodes x 2 workers on loopback; three times, a random worker is SIGKILLed at a random
    moment after the job has made progress."""
    want = reference(ddprun, ddpworker, conf, tmp_path, nnodes=2)
    snap = tmp_path / "faulty"
    port = free_port()
    jobs = [start_job(ddprun, conf, snap, nnodes="2", port=port) for _ in range(2)]
    rng = random.Random(os.getpid())
    gone = set()
    for _ in range(3):
        # kill in a round that has made progress of its own: all four workers new (the killed
        # round's are gone, and with them any snapshot write they had in flight), and a snapshot
        # newer than any from before it
        current = wait_for_new_round(conf, gone)
        wait_for_snapshot_after(snap, latest_step(snap))
        time.sleep(rng.uniform(0, 0.05))
        os.kill(rng.choice(current), signal.SIGKILL)
        gone |= set(current)
    outs = [j.communicate(timeout=300)[0] for j in jobs]
    assert [j.returncode for j in jobs] == [0, 0], outs
    assert [restarts(o) for o in outs] == [3, 3], outs  # one per kill, no more
    assert sum(o.count("resuming from") for o in outs) >= 3, outs
    assert final_state(ddpworker, snap) == want


def test_a_stopped_worker_fails_the_collective_deadline_and_the_job_recovers(ddprun, ddpworker,
                                                                            conf, tmp_path):
    want = reference(ddprun, ddpworker, conf, tmp_path)
    snap = tmp_path / "faulty"
    job = start_job(ddprun, conf, snap, "train.collective_timeout=2")
    wait_for_snapshot_after(snap, 8)
    stopped = workers_of(conf)[-1]
    os.kill(stopped, signal.SIGSTOP)
    t0 = time.monotonic()
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert re.search(r"no data (from|to) rank \d", out) and "resuming from" in out, out
    assert restarts(out) == 1, out
    assert time.monotonic() - t0 < 60
    # the stopped worker is continued with its SIGTERM, not left for --shutdown-timeout's (30 s)
    # SIGKILL: the restart follows the failure within seconds
    failed = re.search(r"^(\d\d):(\d\d):(\d\d\.\d+) .*exited with 75", out, re.M)
    restart = re.search(r"^(\d\d):(\d\d):(\d\d\.\d+) .*restarting every worker", out, re.M)
    assert failed and restart, out
    seconds = [int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) for m in (failed, restart)]
    assert (seconds[1] - seconds[0]) % 86400 < 20, out
    assert final_state(ddpworker, snap) == want


def test_the_agent_detects_a_hung_worker_from_its_progress(ddprun, ddpworker, conf, tmp_path):
    """The collective deadline is 300 s here: the agent's own detector (--hang-timeout) must act
    long before it, from the progress counter ddpworker keeps in DDPRUN_PROGRESS_FILE."""
    want = reference(ddprun, ddpworker, conf, tmp_path)
    snap = tmp_path / "faulty"
    job = start_job(ddprun, conf, snap, "train.collective_timeout=300", extra_flags=["--hang-timeout", "1"])
    wait_for_snapshot_after(snap, 8)
    os.kill(workers_of(conf)[0], signal.SIGSTOP)
    t0 = time.monotonic()
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "made no progress for" in out and "--hang-timeout" in out, out
    assert "resuming from" in out
    assert restarts(out) == 1, out
    assert time.monotonic() - t0 < 30, "detected by the agent, not by the 300 s collective deadline"
    assert final_state(ddpworker, snap) == want


def test_sigterm_takes_a_snapshot_at_the_next_step_and_the_rerun_continues_exactly(
        ddprun, ddpworker, conf, tmp_path):
    """A preemption: SIGTERM to ddprun reaches the workers, which agree at the next step boundary,
    write a snapshot there (not only at the periodic ones) and exit; the job started again ends
    with the uninterrupted run's weights."""
    want = reference(ddprun, ddpworker, conf, tmp_path)
    snap = tmp_path / "preempted"
    job = start_job(ddprun, conf, snap, "snapshot.every=1000")  # only the signal's snapshot
    before = read_until_step(job, 8)
    job.send_signal(signal.SIGTERM)
    out = before + job.communicate(timeout=60)[0]
    assert job.returncode == 128 + signal.SIGTERM, out
    assert restarts(out) == 0, out
    assert re.search(r"signal 15: snapshot at step \d+ taken", out), out
    steps = snapshot_steps(snap)
    assert len(steps) == 1 and steps[0] > 0, steps
    rc, out = run_job(ddprun, conf, snap)
    assert rc == 0, out
    assert f"resuming from {snap}/snapshot-{steps[0]:012d}.ddps" in out, out
    assert final_state(ddpworker, snap) == want


def test_sigterm_after_the_last_step_is_not_ignored(ddpworker, conf, tmp_path):
    """A stop that lands after the last step's agreement (here in the last validation) used to be
    ignored: the worker went on through the final evaluation, which can outlast --shutdown-timeout
    (then SIGKILL), and exited 0. Now it stops as at a step boundary: the last step's snapshot (the
    only one here), 143; the same command resumes at the end, evaluates and finishes."""
    snap = tmp_path / "late"
    cmd = [ddpworker, conf, f"snapshot.dir={snap}", "snapshot.every=1000", "train.max_steps=8",
           "train.log_interval=1", "data.test_limit=20000"]
    w = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=clean_env())
    seen = []
    for line in w.stdout:
        seen.append(line)
        if "step 8/8" in line:
            break
    w.send_signal(signal.SIGTERM)
    out = "".join(seen) + w.communicate(timeout=120)[0]
    assert w.returncode == 128 + signal.SIGTERM, out
    assert "signal 15: snapshot at step 8 taken" in out, out
    assert '"event":"final"' not in out, out
    assert snapshot_steps(snap) == [8], out
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from" in r.stdout and "step 8" in r.stdout, r.stdout
    assert '"event":"final"' in r.stdout and "ddpworker: done: 8 steps" in r.stdout, r.stdout


def test_sigusr1_to_one_worker_snapshots_and_the_job_resumes_from_there(ddprun, ddpworker, conf,
                                                                        tmp_path):
    want = reference(ddprun, ddpworker, conf, tmp_path)
    snap = tmp_path / "checkpointed"
    job = start_job(ddprun, conf, snap, "snapshot.every=1000")
    before = read_until_step(job, 8)
    os.kill(workers_of(conf)[-1], signal.SIGUSR1)
    out = before + job.communicate(timeout=120)[0]
    assert job.returncode == 0, out
    assert restarts(out) == 1, out  # the worker's exit after its snapshot, and no other
    match = re.search(r"signal 10: snapshot at step (\d+) taken", out)
    assert match, out
    assert f"snapshot-{int(match.group(1)):012d}.ddps: step {match.group(1)}" in out, out
    assert final_state(ddpworker, snap) == want


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_snapshot_is_skipped_with_a_warning(ddprun, ddpworker, conf, tmp_path,
                                                            damage):
    """Crash the whole job (SIGKILL to the agent: its workers die with it), damage the newest
    snapshot, start the job again: it resumes from the one before and still ends exact."""
    want = reference(ddprun, ddpworker, conf, tmp_path)
    snap = tmp_path / "faulty"
    job = start_job(ddprun, conf, snap)
    wait_for_snapshot_after(snap, 40)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    steps = snapshot_steps(snap)
    assert len(steps) >= 2
    newest = snap / f"snapshot-{steps[-1]:012d}.ddps"
    data = bytearray(newest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 100]
    newest.write_bytes(bytes(data))
    assert inspect(ddpworker, newest)[0] != 0
    rc, out = run_job(ddprun, conf, snap)
    assert rc == 0, out
    assert f"warning: skipping snapshot {newest}" in out, out
    assert f"resuming from {snap}/snapshot-{steps[-2]:012d}.ddps" in out, out
    assert final_state(ddpworker, snap) == want


@pytest.fixture
def adamw_conf(tmp_path):
    path = tmp_path / "adamw.conf"
    path.write_text(CONF.replace("[optim]\nlr = 0.05\n",
                                 "[optim]\nname = adamw\nlr = 0.002\nweight_decay = 0.01\n"))
    return str(path)


def test_an_adamw_run_preempted_and_rerun_ends_with_the_uninterrupted_weights(
        ddprun, ddpworker, adamw_conf, tmp_path):
    """Adam's state is both moments and a step count: the snapshot must carry them and every rank
    must get them. The state hash covers them too, so equal hashes mean equal moments and count."""
    want = reference(ddprun, ddpworker, adamw_conf, tmp_path)
    snap = tmp_path / "preempted"
    job = start_job(ddprun, adamw_conf, snap, "snapshot.every=1000")
    before = read_until_step(job, 8)
    job.send_signal(signal.SIGTERM)
    out = before + job.communicate(timeout=60)[0]
    assert job.returncode == 128 + signal.SIGTERM, out
    assert restarts(out) == 0, out
    steps = snapshot_steps(snap)
    assert len(steps) == 1 and steps[0] > 0, steps
    rc, f = inspect(ddpworker, snap / f"snapshot-{steps[0]:012d}.ddps")
    assert rc == 0 and f["optimizer"].endswith(f", {steps[0]} steps taken"), f
    rc, out = run_job(ddprun, adamw_conf, snap)
    assert rc == 0, out
    assert f"resuming from {snap}/snapshot-{steps[0]:012d}.ddps" in out, out
    assert final_state(ddpworker, snap) == want


def test_an_sgd_snapshot_is_not_resumed_as_adam_nor_the_reverse(ddpworker, conf, tmp_path):
    """SGD's momentum is not Adam's first moment and SGD keeps no second moment: a config error
    naming both optimizers. Adam and AdamW keep the same state (as in torch) and resume each other."""
    def run(snap, *overrides):
        return subprocess.run([ddpworker, conf, f"snapshot.dir={snap}", "train.max_steps=4",
                               *overrides], capture_output=True, text=True, timeout=120,
                              env=clean_env())
    for first, then in (("sgd", "adam"), ("adamw", "sgd")):
        snap = tmp_path / first
        assert run(snap, f"optim.name={first}").returncode == 0
        r = run(snap, f"optim.name={then}", "train.max_steps=8")
        assert r.returncode == EXIT_CONFIG, r.stdout + r.stderr
        assert f"taken with optim.name={first}" in r.stderr and f"asks for optim.name={then}" in r.stderr, \
            r.stderr
        assert snapshot_steps(snap) == [4], "nothing was written"
    r = run(tmp_path / "adamw", "optim.name=adam", "train.max_steps=8")
    assert r.returncode == 0, r.stderr
    assert "taken with optim.name=adamw; continuing its moments and step count with adam" in r.stdout
    assert inspect(ddpworker, tmp_path / "adamw" / "snapshot-000000000008.ddps")[1]["optimizer"] \
        .endswith(", 8 steps taken")


SHAPE_CONF = """[model]
name = resnet18
width = 4
[data]
kind = synthetic
height = 8
width = 8
channels = 3
classes = 10
train_limit = 64
test_limit = 16
[train]
batch_size = 16
threads = 1
"""


def run_worker(ddpworker, conf, snap, *overrides):
    return subprocess.run([ddpworker, str(conf), f"snapshot.dir={snap}", *overrides],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def test_a_snapshot_of_another_input_shape_is_not_resumed(ddpworker, tmp_path):
    """A resnet's parameter count does not depend on its input's size: a snapshot taken at 8x8
    used to continue silently at 16x16. The input's height, width, channels and the class count
    are compared too (a config error naming both shapes); the same shape still resumes."""
    conf = tmp_path / "shape.conf"
    conf.write_text(SHAPE_CONF)
    snap = tmp_path / "snap"
    r = run_worker(ddpworker, conf, snap, "train.max_steps=2")
    assert r.returncode == 0, r.stderr
    r = run_worker(ddpworker, conf, snap, "train.max_steps=4", "data.height=16", "data.width=16")
    assert r.returncode == EXIT_CONFIG, r.stdout + r.stderr
    assert "holds model resnet18 for 8x8x3 inputs and 10 classes; train.conf gives 16x16x3 and 10" \
        in r.stderr, r.stderr
    assert snapshot_steps(snap) == [2], "nothing was written"
    r = run_worker(ddpworker, conf, snap, "train.max_steps=4")
    assert r.returncode == 0, r.stderr
    assert f"resuming from {snap}/snapshot-{2:012d}.ddps" in r.stdout, r.stdout


FASHION = "/usr/share/datasets/fashion-mnist"
DATA_KIND_AT = 116   # proto/snapshot_format.h: the header's data_kind (reserved1 before it)


def reseal_without_data_kind(path):
    """The header as a ddpworker from before data_kind wrote it: the field 0 (it was reserved),
    the header's XXH3-64 (over every byte before the checksum, its last 8) made again."""
    lib = ctypes.CDLL(ctypes.util.find_library("xxhash"))
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    data = bytearray(path.read_bytes())
    header_bytes = struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<I", data, DATA_KIND_AT, 0)
    struct.pack_into("<Q", data, header_bytes - 8,
                     lib.XXH3_64bits(bytes(data[:header_bytes - 8]), header_bytes - 8))
    path.write_bytes(bytes(data))


@pytest.mark.skipif(not os.path.isdir(FASHION),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_a_snapshot_of_another_data_kind_is_not_resumed(ddpworker, tmp_path):
    """MNIST and Fashion-MNIST have the same shape and size: switching data.kind used to resume
    the other dataset's weights and position. The header records data.kind; files written before
    it was (the field 0) still resume as they did."""
    conf = tmp_path / "kind.conf"
    conf.write_text(f"[model]\nname = mlp\nwidth = 16\n[data]\nkind = mnist\ndir = {FASHION}\n"
                    "train_limit = 64\ntest_limit = 16\n[train]\nbatch_size = 16\nthreads = 1\n")
    snap = tmp_path / "snap"
    r = run_worker(ddpworker, conf, snap, "train.max_steps=2")
    assert r.returncode == 0, r.stderr
    r = run_worker(ddpworker, conf, snap, "train.max_steps=4", "data.kind=fashion-mnist")
    assert r.returncode == EXIT_CONFIG, r.stdout + r.stderr
    assert "was taken on data.kind=mnist; train.conf asks for data.kind=fashion-mnist" \
        in r.stderr, r.stderr
    assert snapshot_steps(snap) == [2], "nothing was written"
    path = snap / f"snapshot-{2:012d}.ddps"
    rc, fields = inspect(ddpworker, path)
    assert rc == 0 and fields["data"] == "mnist", fields
    reseal_without_data_kind(path)
    rc, fields = inspect(ddpworker, path)
    assert rc == 0 and fields["data"] == "not recorded", fields
    r = run_worker(ddpworker, conf, snap, "train.max_steps=4", "data.kind=fashion-mnist")
    assert r.returncode == 0, r.stderr
    assert f"resuming from {path}" in r.stdout, r.stdout


def test_a_lost_node_scales_the_job_down_and_it_resumes_with_fewer_ranks(ddprun, ddpworker, conf,
                                                                         tmp_path):
    snap = tmp_path / "elastic"
    port = free_port()
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=1"
    jobs = [start_job(ddprun, conf, snap, nnodes="1:2", port=port, rdzv_conf=rdzv)]
    time.sleep(0.05)
    jobs.append(start_job(ddprun, conf, snap, nnodes="1:2", port=port, rdzv_conf=rdzv))
    wait_for_snapshot_after(snap, 8)
    os.killpg(jobs[1].pid, signal.SIGKILL)           # node 1: its agent and its workers
    jobs[1].communicate()
    out, _ = jobs[0].communicate(timeout=300)
    assert jobs[0].returncode == 0, out
    assert re.search(r"saved by 4 ranks, now 2", out), out
    assert restarts(out) == 1 and "the last restart was a lost node" in out, out
    _, step, world = final_state(ddpworker, snap)
    assert world == 2
    rc, f = inspect(ddpworker, snap / (snap / "latest").read_text().strip())
    assert int(f["epoch"]) == 2 and f["cursor"].startswith("4096 of 4096"), f


def test_a_frozen_node_costs_no_shutdown_timeout(ddprun, ddpworker, conf, tmp_path):
    """Node 1 freezes whole (agent and workers, SIGSTOP: its sockets stay open): node 0 ends the
    round on the heartbeat timeout and stops its workers, which wait in a collective on the frozen
    rank. They leave within the stop's grace, not at collective_timeout after --shutdown-timeout's
    SIGKILL (60 s here), and node 0 resumes alone."""
    snap = tmp_path / "frozen"
    port = free_port()
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=1"
    jobs = [start_job(ddprun, conf, snap, "train.collective_timeout=300", nnodes="1:2", port=port,
                      rdzv_conf=rdzv, extra_flags=["--shutdown-timeout", "60"]) for _ in range(2)]
    frozen = []
    try:
        wait_for_snapshot_after(snap, 8)
        # node 1 (the agents' start order does not fix which): its agent and its workers (their
        # shims' sessions are their own)
        workers = [pid for pid in workers_of(conf) if env_of(pid)[b"GROUP_RANK"] == b"1"]
        frozen = [agent_of(workers[0], [j.pid for j in jobs])] + workers
        assert len(frozen) == 3, frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        survivor = next(j for j in jobs if j.pid != frozen[0])
        out, _ = survivor.communicate(timeout=300)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
        for j in jobs:
            if j.poll() is None:
                os.killpg(j.pid, signal.SIGKILL)
            j.wait()
    assert survivor.returncode == 0, out
    ended = re.search(r"^(\d\d):(\d\d):(\d\d\.\d+) .*sent no heartbeat", out, re.M)
    began = re.search(r"^(\d\d):(\d\d):(\d\d\.\d+) .*round 1: node 0 of 1", out, re.M)
    assert ended and began, out
    seconds = [int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) for m in (ended, began)]
    assert (seconds[1] - seconds[0]) % 86400 < 15, out
    assert "stopping (SIGTERM) while rank" in out, out
    assert "resuming from" in out and "0 steps lost" in out, out


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_tmpfs(tmp_path):
    mounted = []

    def mount(size, options=""):
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            environment_broken(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)])


@needs_root
def test_a_full_disk_is_reported_and_older_snapshots_stay_intact(ddpworker, conf, small_tmpfs,
                                                                  tmp_path):
    sizing = tmp_path / "sizing"
    r = subprocess.run([ddpworker, conf, f"snapshot.dir={sizing}", "train.max_steps=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    one = max(p.stat().st_size for p in sizing.iterdir())
    disk = small_tmpfs(f"{2 * one + 3 * 4096}")   # room for two snapshots and the manifest
    params = tmp_path / "final.params"
    r = subprocess.run([ddpworker, conf, f"snapshot.dir={disk}", "snapshot.keep=10",
                        "snapshot.every=2", f"train.params_file={params}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == EXIT_IO, r.stderr
    assert "No space left on device" in r.stderr and "warning: snapshot failed" in r.stderr
    # the final weights were written before the final snapshot failed, and the run says so
    assert params.exists() and params.stat().st_size > 0
    assert "failed: " in r.stderr and "the final weights are in train.params_file" in r.stderr
    # while writes fail, the progress line shows the failure and the last snapshot that landed
    failing = [l for l in r.stdout.splitlines() if "snapshot FAILING:" in l]
    assert failing and "No space left on device" in failing[-1], r.stdout
    assert re.search(r"last landed \d+s ago \(step \d+\)", failing[-1]), failing[-1]
    steps = snapshot_steps(disk)
    assert steps, "the first snapshots fit"
    for step in steps:
        assert inspect(ddpworker, disk / f"snapshot-{step:012d}.ddps")[0] == 0
    assert not [n for n in os.listdir(disk) if n.endswith(".tmp")], os.listdir(disk)


@needs_root
def test_a_read_only_snapshot_dir_is_a_clear_error(ddpworker, conf, small_tmpfs):
    disk = small_tmpfs("1m", ",ro")
    r = subprocess.run([ddpworker, conf, f"snapshot.dir={disk}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_IO, r.stderr
    assert f"snapshot.dir: cannot write into {disk}" in r.stderr, r.stderr


def test_retention_never_deletes_the_only_valid_snapshots(ddprun, ddpworker, conf, tmp_path):
    """Snapshots to step 30, every file corrupted, then a shorter run: it starts over, the corrupt
    files are moved aside (named in the log) instead of outranking the new valid ones in keep-N
    retention, and `latest` names a snapshot that exists and verifies."""
    snap = tmp_path / "snap"
    rc, out = run_job(ddprun, conf, snap, "train.max_steps=30", "snapshot.every=10", nproc=1)
    assert rc == 0, out
    old = snapshot_steps(snap)
    assert old and old[-1] == 30, old
    for step in old:
        path = snap / f"snapshot-{step:012d}.ddps"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    rc, out = run_job(ddprun, conf, snap, "train.max_steps=12", "snapshot.every=4",
                      "snapshot.keep=2", nproc=1)
    assert rc == 0, out
    for step in old:
        name = f"snapshot-{step:012d}.ddps"
        assert f"moved {snap}/{name} aside" in out, out
        assert (snap / (name + ".corrupt")).exists()
    assert snapshot_steps(snap) == [8, 12], "the new run's newest two, none deleted for old ones"
    hash_, step, _ = final_state(ddpworker, snap)   # `latest` exists and verifies
    assert step == 12


def test_a_fifo_named_like_a_snapshot_does_not_block_resume(ddprun, ddpworker, conf, tmp_path):
    snap = tmp_path / "snap"
    rc, out = run_job(ddprun, conf, snap, "train.max_steps=8", nproc=1)
    assert rc == 0, out
    os.mkfifo(snap / f"snapshot-{99:012d}.ddps")
    rc, out = run_job(ddprun, conf, snap, "train.max_steps=12", nproc=1, timeout=120)
    assert rc == 0, out
    assert "not a regular file" in out, out
    assert f"resuming from {snap}/snapshot-{8:012d}.ddps" in out, out
    assert (snap / f"snapshot-{99:012d}.ddps").exists(), "not ours: left alone"


def test_a_fifo_of_a_later_step_is_not_counted_toward_keep(ddpworker, conf, tmp_path):
    """keep = 1 with a FIFO named like a snapshot of step 999999 (the resume skips it and leaves
    it): retention must not rank it above what the run writes. It used to unlink each snapshot
    right after writing it; the run said "3 snapshots written", `latest` named a missing file and
    a rerun trained again from scratch."""
    snap = tmp_path / "snap"
    snap.mkdir()
    fifo = snap / f"snapshot-{999999:012d}.ddps"
    os.mkfifo(fifo)

    def run():
        return subprocess.run([ddpworker, conf, f"snapshot.dir={snap}", "train.max_steps=3",
                               "snapshot.every=1", "snapshot.keep=1"], capture_output=True,
                              text=True, timeout=120, env=clean_env())
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot_steps(snap) == [3, 999999], "the newest snapshot written, and the FIFO"
    assert final_state(ddpworker, snap)[1] == 3   # `latest` exists and verifies
    warning = f"{fifo}: not a regular file; not counted toward snapshot.keep, left in place"
    assert r.stderr.count(warning) == 1, r.stderr   # said once, not at every snapshot
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already finished at step 3" in r.stdout, r.stdout   # not trained again from scratch

