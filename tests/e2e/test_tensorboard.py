"""train.tensorboard_dir: TensorBoard itself (from PyPI, in a virtual environment this module makes
once and keeps in a cache directory) reads the event files back with its EventAccumulator and finds
every scalar of the metrics file at every logged step, the config as text, one file per start
written by rank 0 only, and after a kill -9 of the worker and ddprun's restart from a snapshot one
run: the steps continue, none twice, each with the value the resumed run logged."""
import fcntl
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import clean_env

CONF = """[model]
name = cnn
width = 8
[data]
kind = synthetic
height = 16
width = 16
channels = 1
classes = 10
train_limit = 2048
test_limit = 256
val_split = 0.125
[optim]
lr = 0.05
[train]
batch_size = 16
epochs = 2
log_interval = 4
eval_interval = 32
"""

# Run by the venv's interpreter: every scalar and tensor TensorBoard sees, as JSON.
READER = r"""
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
    "tensors": {t: [[e.step, [s.decode() for s in e.tensor_proto.string_val]]
                    for e in acc.Tensors(t)] for t in tags["tensors"]},
    "plugins": {t: acc.SummaryMetadata(t).plugin_data.plugin_name for t in tags["tensors"]},
}))
"""


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "ddprun-tests")


@pytest.fixture(scope="session")
def tb_python():
    """The interpreter of a venv with TensorBoard from PyPI: made on first use, then reused (one
    per machine, under ~/.cache/ddprun-tests; a lock keeps concurrent sessions from racing)."""
    venv = os.path.join(cache_dir(), "tensorboard-venv")
    python = os.path.join(venv, "bin", "python")
    os.makedirs(cache_dir(), exist_ok=True)
    probe = [python, "-c", "import tensorboard.backend.event_processing.event_accumulator"]
    with open(os.path.join(cache_dir(), "tensorboard-venv.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(python, os.X_OK) and subprocess.run(probe, capture_output=True).returncode == 0:
            return python
        subprocess.run(["rm", "-rf", venv], check=True)
        r = subprocess.run(["/usr/bin/python3", "-m", "venv", venv], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([python, "-m", "pip", "install", "-q", "tensorboard>=2.10"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            subprocess.run(["rm", "-rf", venv])
            pytest.skip("cannot install tensorboard from PyPI: " + r.stderr[-2000:])
        r = subprocess.run(probe, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return python


def read_run(tb_python, logdir):
    r = subprocess.run([tb_python, "-c", READER, str(logdir)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def metrics(path):
    return [json.loads(line) for line in open(path)]


def expected_scalars(lines):
    """{tag: {step: value}} from the metrics lines, the last line of a step winning (a resumed run
    logs the steps after its snapshot again)."""
    want = {}

    def put(tag, step, value):
        want.setdefault(tag, {})[step] = math.nan if value is None else value

    for m in lines:
        step = m.get("step")
        if m["event"] == "train":
            for key in ("loss", "lr", "img_per_s", "loss_scale"):
                if key in m:
                    put(f"train/{key}", step, m[key])
        elif m["event"] in ("eval", "final"):
            prefix = m["split"] if m["event"] == "eval" else "final"
            for key in ("loss", "top1", "top5"):
                put(f"{prefix}/{key}", step, m[key])
        elif m["event"] == "epoch":
            for key in ("img_per_s", "wall_s"):
                put(f"epoch/{key}", step, m[key])
    return want


def assert_same_run(got, lines):
    want = expected_scalars(lines)
    for tag in ("train/loss", "train/lr", "train/img_per_s", "val/loss", "val/top1", "val/top5",
                "final/top1", "final/top5", "epoch/img_per_s"):
        assert tag in want, f"the run logged no {tag}: the test would check nothing"
    assert sorted(got["scalars"]) == sorted(want), "tags differ"
    for tag, by_step in want.items():
        events = got["scalars"][tag]
        steps = [s for s, _ in events]
        assert steps == sorted(by_step), f"{tag}: steps {steps}, want {sorted(by_step)}"
        for step, value in events:
            w = by_step[step]
            assert (math.isnan(value) and math.isnan(w)) or \
                math.isclose(value, w, rel_tol=1e-6, abs_tol=1e-7), f"{tag} at {step}: {value} != {w}"


def run(cmd, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def event_files(logdir):
    return sorted(n for n in os.listdir(logdir) if "tfevents" in n)


def test_tensorboard_reads_every_scalar_at_every_step(ddprun, tb_python, tmp_path):
    conf = tmp_path / "tb.conf"
    conf.write_text(CONF)
    logdir, jsonl = tmp_path / "runs" / "a", tmp_path / "metrics.jsonl"
    run([ddprun, "--standalone", "--nproc-per-node", "2", str(conf),
         f"train.tensorboard_dir={logdir}", f"train.metrics_file={jsonl}", "optim.momentum=0.9",
         "precision.loss_scaling=dynamic"])
    assert len(event_files(logdir)) == 1, "rank 0 alone writes, one file per start"
    got = read_run(tb_python, logdir)
    assert_same_run(got, metrics(jsonl))
    assert got["scalars"]["train/loss_scale"], "no loss scale"
    [(step, [text])] = got["tensors"]["config"]
    assert step == 1 and got["plugins"]["config"] == "text"
    assert "eval_interval = 32" in text and str(conf) in text, text
    assert "optim.momentum=0.9" in text, text


def worker_of(conf):
    # anchored: a shim's command line ("ddprun __shim PID -- .../ddpworker conf") holds it too
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(str(conf))}"],
                       capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def test_a_kill_9_and_resume_is_one_run_without_repeated_steps(ddprun, tb_python, tmp_path):
    conf = tmp_path / "tb.conf"
    conf.write_text(CONF)
    logdir, jsonl, snap = tmp_path / "tb", tmp_path / "metrics.jsonl", tmp_path / "snap"
    job = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
                            str(conf), f"train.tensorboard_dir={logdir}",
                            f"train.metrics_file={jsonl}", f"snapshot.dir={snap}",
                            # from the disk only: a memory snapshot of every step would resume
                            # at the killed step, and no step would be logged twice
                            "snapshot.every=16", "snapshot.every_memory=0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=clean_env(), start_new_session=True)
    try:
        # kill once rank 0 has logged steps past a snapshot (step 16 is one), so that the resumed
        # run logs them again
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and job.poll() is None, "no step 24 logged in time"
            steps = [m["step"] for m in metrics(jsonl) if m["event"] == "train"] \
                if jsonl.exists() else []
            if steps and max(steps) >= 24 and max(steps) % 16:
                break
            time.sleep(0.005)
        [pid] = worker_of(conf)
        os.kill(pid, 9)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    assert job.returncode == 0, out
    lines = metrics(jsonl)
    starts = [m for m in lines if m["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed"], starts
    train_steps = [m["step"] for m in lines if m["event"] == "train"]
    assert len(train_steps) > len(set(train_steps)), \
        "no step was logged twice: the kill came too late to test the resume"
    assert len(event_files(logdir)) == 2
    got = read_run(tb_python, logdir)
    assert_same_run(got, lines)
    # the config of each start, at its first step: the first one's and the resumed one's
    resumed_at = starts[1]["step"]
    assert [s for s, _ in got["tensors"]["config"]] == [1, resumed_at + 1]


def test_a_directory_that_cannot_be_made_stops_the_run_naming_it(ddprun, tmp_path):
    conf = tmp_path / "tb.conf"
    conf.write_text(CONF)
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", str(conf),
                        f"train.tensorboard_dir={blocker}/tb"], capture_output=True, text=True,
                       timeout=120, env=clean_env())
    assert r.returncode != 0
    assert f"train.tensorboard_dir: cannot create {blocker}/tb" in r.stdout + r.stderr
