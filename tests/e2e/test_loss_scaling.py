"""Dynamic loss scaling (precision.loss_scaling, GradScaler's rule) through the real binaries on
the CPU backend, where fp32 makes its effects exact: a power-of-two scale trains bit-identically to
no scaling on two ranks; overflowed steps are skipped (the weights stay those of the last good
step) while the scale backs off; and a resumed run continues the scaler's state from the snapshot
(scale and growth count), ending with the uninterrupted run's weights and scale, and an Adam run
resumed after skipped steps continues Adam's own step count."""
import json
import re
import subprocess

import numpy as np

import safetensors_file
from conftest import clean_env

CONF = """[model]
name = cnn
width = 16
[data]
kind = synthetic
height = 16
width = 16
channels = 3
classes = 10
train_limit = 1024
test_limit = 64
[optim]
lr = 0.05
schedule = constant
[train]
batch_size = 32
max_steps = 12
log_interval = 1
"""
TWO_TO_127 = 2.0 ** 127  # the largest power of two in fp32: its first gradients overflow easily


def conf_file(tmp_path):
    path = tmp_path / "scaling.conf"
    path.write_text(CONF)
    return str(path)


def train_events(metrics):
    return [e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "train"]


def run_worker(ddpworker, conf, *overrides):
    r = subprocess.run([ddpworker, conf, *overrides], capture_output=True, text=True, timeout=300,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    return r


def n_params(stdout):
    return int(re.search(r"\((\d+) parameters\)", stdout).group(1))


def test_a_power_of_two_scale_trains_bit_identically_on_two_ranks(ddprun, tmp_path):
    conf = conf_file(tmp_path)
    finals = {}
    for scaling in ("off", "dynamic"):
        params, metrics = tmp_path / f"{scaling}.bin", tmp_path / f"{scaling}.jsonl"
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf,
                            f"precision.loss_scaling={scaling}", "precision.loss_scale=1024",
                            "precision.growth_interval=5", f"train.params_file={params}",
                            f"train.metrics_file={metrics}"],
                           capture_output=True, text=True, timeout=300, env=clean_env())
        assert r.returncode == 0, r.stderr
        finals[scaling] = params.read_bytes()
        events = train_events(metrics)
    assert finals["off"] == finals["dynamic"]
    # the dynamic run's scale grew every 5 clean steps and nothing was skipped
    assert [e["loss_scale"] for e in events] == [1024.0 * 2 ** (s // 5) for s in range(1, 13)]
    assert all(e["skipped_steps"] == 0 for e in events)


def test_overflowed_steps_are_skipped_and_the_scale_backs_off(ddpworker, tmp_path):
    conf = conf_file(tmp_path)
    # lr 1000 blows the weights up in one step; from then on 2^127 times any gradient is inf
    blown, one_step = tmp_path / "blown.bin", tmp_path / "one.bin"
    metrics = tmp_path / "m.jsonl"
    r = run_worker(ddpworker, conf, "optim.lr=1000", "train.max_steps=6",
                   "precision.loss_scaling=dynamic", f"precision.loss_scale={TWO_TO_127!r}",
                   f"train.params_file={blown}", f"train.metrics_file={metrics}")
    run_worker(ddpworker, conf, "optim.lr=1000", "train.max_steps=1", f"train.params_file={one_step}")
    events = train_events(metrics)
    assert [e["skipped_steps"] for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e["loss_scale"] for e in events] == [TWO_TO_127 / 2 ** k for k in range(6)]
    # a skipped step changes no weight: they are the first step's (the statistics moved on)
    n = n_params(r.stdout)
    got, want = safetensors_file.parameters(blown), safetensors_file.parameters(one_step)
    assert got.size == n
    assert np.isfinite(got).all() and np.array_equal(got, want)


def inspect_scale(ddpworker, snap_dir):
    latest = (snap_dir / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap_dir / latest)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    scale = re.search(r"^loss scale:\s+(\S+) \((\d+) good steps\)", r.stdout, re.M)
    state = re.search(r"^state hash:\s+(\S+)", r.stdout, re.M)
    return float(scale.group(1)), int(scale.group(2)), state.group(1)


def test_a_resumed_run_continues_the_scale_and_its_growth_count(ddpworker, tmp_path):
    """Growth every 4 clean steps; the resume at step 6 is mid-count (2 good steps), so a run that
    forgot the count would grow at step 10 instead of 8 and 12 and end at half the scale."""
    conf = conf_file(tmp_path)
    common = ["precision.loss_scaling=dynamic", "precision.loss_scale=256",
              "precision.growth_interval=4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_worker(ddpworker, conf, *common, f"snapshot.dir={whole}")
    run_worker(ddpworker, conf, *common, f"snapshot.dir={parts}", "train.max_steps=6")
    assert inspect_scale(ddpworker, parts)[:2] == (512.0, 2)
    r = run_worker(ddpworker, conf, *common, f"snapshot.dir={parts}")
    assert "resuming from" in r.stdout
    assert inspect_scale(ddpworker, whole) == inspect_scale(ddpworker, parts)
    assert inspect_scale(ddpworker, whole)[:2] == (256.0 * 8, 0)


def adam_steps(ddpworker, snap_dir):
    latest = (snap_dir / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap_dir / latest)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return int(re.search(r"^optimizer:\s+adam .*, (\d+) steps taken$", r.stdout, re.M).group(1))


def test_a_resumed_adam_run_continues_its_step_count_past_skipped_steps(ddpworker, tmp_path):
    """Adam's bias corrections come from its own step count, which an overflowed (skipped) step
    does not advance. With a first scale of 2^127 and lr 0.2 the weights grow until a few steps
    overflow, so the count lags the run's step; a resume after them must continue the count from
    the snapshot (not from the step) to end with the uninterrupted run's state, whose hash covers
    both moments and the count."""
    conf = conf_file(tmp_path)
    common = ["optim.name=adam", "optim.lr=0.2", "precision.loss_scaling=dynamic",
              f"precision.loss_scale={TWO_TO_127!r}", "precision.growth_interval=1000"]
    whole, parts, metrics = tmp_path / "whole", tmp_path / "parts", tmp_path / "m.jsonl"
    run_worker(ddpworker, conf, *common, f"snapshot.dir={whole}", f"train.metrics_file={metrics}")
    skipped = [e["skipped_steps"] for e in train_events(metrics)]
    k = skipped[-1]
    resume_at = skipped.index(k) + 3  # the step of the last skip, then two counted steps
    assert skipped[0] == 0 and k > 0 and resume_at < 12, f"no skips mid-run to test: {skipped}"
    assert adam_steps(ddpworker, whole) == 12 - k
    run_worker(ddpworker, conf, *common, f"snapshot.dir={parts}", f"train.max_steps={resume_at}")
    assert adam_steps(ddpworker, parts) == resume_at - k
    r = run_worker(ddpworker, conf, *common, f"snapshot.dir={parts}")
    assert "resuming from" in r.stdout
    assert inspect_scale(ddpworker, whole) == inspect_scale(ddpworker, parts)
    assert adam_steps(ddpworker, parts) == 12 - k
