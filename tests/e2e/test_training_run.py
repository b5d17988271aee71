"""What a run is made of, end to end on the cpu backend: train/val/test splits (data.val_split),
int32 labels (1000 classes), model.classes, the best weights by validation kept across a restart
(train.best_by, train.best_file), also a best newer than the newest snapshot across a kill -9
under ddprun and a best file that vanished, the test at the end with them, evaluation-only runs
(train.max_steps = 0), the start event, and train.hours counted across restarts."""
import datetime
import json
import os
import re
import signal
import subprocess
import time

import safetensors_file
from conftest import clean_env

EXIT_CONFIG = 78

CONF = """[model]
name = mlp
width = 32
[data]
kind = synthetic
height = 8
width = 8
channels = 1
classes = {classes}
train_limit = 512
test_limit = 128
[optim]
lr = 0.05
schedule = constant
[train]
batch_size = 32
epochs = 2
log_interval = 4
"""


def conf_file(tmp_path, classes=10):
    path = tmp_path / "run.conf"
    path.write_text(CONF.format(classes=classes))
    return str(path)


def worker(ddpworker, conf, *overrides, check=True):
    r = subprocess.run([ddpworker, conf, *overrides], capture_output=True, text=True, timeout=300,
                       env=clean_env())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_held_out_validation_split_is_validated_and_the_test_set_tested(ddpworker, tmp_path):
    metrics = tmp_path / "m.jsonl"
    worker(ddpworker, conf_file(tmp_path), "data.val_split=0.25", f"train.metrics_file={metrics}")
    ev = events(metrics)
    evals = [e for e in ev if e["event"] == "eval"]
    assert evals and all(e["split"] == "val" and e["samples"] == 128 for e in evals), evals
    final = ev[-1]
    assert final["event"] == "final" and final["split"] == "test" and final["samples"] == 128
    # the held-out samples are not trained on: 384 of 512 remain, 12 steps of 32 per epoch
    assert [e["step"] for e in ev if e["event"] == "epoch"] == [12, 24]
    start = ev[0]
    assert start["event"] == "start" and start["resumed"] is False, start
    assert (start["train_samples"], start["val_samples"], start["test_samples"]) == (384, 128, 128)
    assert (start["steps_per_epoch"], start["global_batch"], start["lr"]) == (12, 32, 0.05), start


def test_the_held_out_split_is_the_same_for_every_seed(ddpworker, tmp_path):
    finals = []
    for seed in (1, 2):
        metrics = tmp_path / f"m{seed}.jsonl"
        worker(ddpworker, conf_file(tmp_path), "data.val_split=0.5", "train.max_steps=0",
               f"train.seed={seed}", f"train.metrics_file={metrics}")
        finals.append([e for e in events(metrics) if e["event"] == "eval"][0])
    # different initial weights, same validation samples: both see 256 of them
    assert finals[0]["samples"] == finals[1]["samples"] == 256
    assert finals[0]["loss"] != finals[1]["loss"]


def test_a_thousand_classes_do_not_wrap(ddpworker, tmp_path):
    metrics = tmp_path / "m.jsonl"
    params = tmp_path / "p.bin"
    worker(ddpworker, conf_file(tmp_path, classes=1000), "train.max_steps=4",
           f"train.metrics_file={metrics}", f"train.params_file={params}")
    # mlp 64 -> 32 -> 32 -> 1000: the classifier has 1000 outputs, not 1000 % 256
    tensors = safetensors_file.load(str(params))
    last = [v for k, v in tensors.items() if k.endswith(".weight")][-1]
    assert last.shape == (1000, 32), {k: v.shape for k, v in tensors.items()}
    r = worker(ddpworker, conf_file(tmp_path, classes=1000), "model.classes=100", check=False)
    assert r.returncode == EXIT_CONFIG and "model.classes = 100, but the dataset has 1000" in r.stderr


def test_max_steps_zero_only_evaluates_the_initial_weights(ddpworker, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = worker(ddpworker, conf_file(tmp_path), "train.max_steps=0", "data.val_split=0.25",
               f"train.metrics_file={metrics}")
    kinds = [e["event"] for e in events(metrics)]
    assert kinds == ["start", "eval", "final"], kinds
    final = events(metrics)[-1]
    assert final["step"] == 0 and final["split"] == "test" and final["weights"] == "last"
    assert 1.5 < final["loss"] < 3.5, "an untrained 10-class model: about ln(10)"


def test_the_best_weights_are_kept_across_a_restart_and_tested_at_the_end(ddpworker, tmp_path):
    conf = conf_file(tmp_path)
    snap, best, metrics = tmp_path / "snap", tmp_path / "best.safetensors", tmp_path / "m.jsonl"
    common = ["data.val_split=0.25", "train.best_by=val_loss", f"train.best_file={best}",
              "train.eval_interval=3", f"snapshot.dir={snap}", "snapshot.every=3",
              f"train.metrics_file={metrics}"]
    worker(ddpworker, conf, *common, "train.max_steps=9")        # the first part of the run
    bests = [e for e in events(metrics) if e["event"] == "best"]
    assert bests and best.exists()
    # the snapshot carries the best value, so the rest of the run compares against it
    latest = (snap / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap / latest)], capture_output=True, text=True)
    m = re.search(r"^best:\s+val_loss (\S+) at step (\d+)$", r.stdout, re.M)
    assert m, r.stdout
    assert float(m.group(1)) == bests[-1]["value"] and int(m.group(2)) == bests[-1]["step"]
    before = bests[-1]
    worker(ddpworker, conf, *common)                             # resumed to the end (24 steps)
    ev = events(metrics)
    after = [e for e in ev if e["event"] == "best" and e["step"] > 9]
    assert all(e["value"] < before["value"] for e in after), "only a better one replaces it"
    final = ev[-1]
    winner = after[-1] if after else before
    assert final["weights"] == "best" and final["best_step"] == winner["step"], final
    assert final["best_value"] == winner["value"]
    assert {k: v.shape for k, v in safetensors_file.load(str(best)).items()}, "a weights file"


def stopped_by_sigterm(ddpworker, conf, snap, *overrides, steps=4):
    """A run stopped by SIGTERM once it has trained `steps` steps: its snapshot is not finished."""
    job = subprocess.Popen([ddpworker, conf, f"snapshot.dir={snap}", "train.epochs=1000",
                            "train.log_interval=1", *overrides], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=clean_env())
    try:
        for line in job.stdout:
            if re.search(rf"step {steps}\b", line):
                job.send_signal(signal.SIGTERM)
                break
        out = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 128 + signal.SIGTERM, out
    latest = (snap / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap / latest)], capture_output=True, text=True)
    assert re.search(r"^finished:\s+no$", r.stdout, re.M), r.stdout
    return r.stdout


def test_hours_count_the_whole_run_across_restarts(ddpworker, tmp_path):
    conf = conf_file(tmp_path)
    snap = tmp_path / "snap"
    # a budget already spent by an earlier part of the run: the resumed part stops at once
    inspected = stopped_by_sigterm(ddpworker, conf, snap)
    elapsed = float(re.search(r"^elapsed:\s+(\S+) s", inspected, re.M).group(1))
    step = int(re.search(r"^step:\s+(\d+)", inspected, re.M).group(1))
    assert elapsed > 0
    hours = elapsed / 3600 * 0.5                                  # half of what was used already
    r = worker(ddpworker, conf, f"snapshot.dir={snap}", "train.epochs=0", "train.max_steps=-1",
               "train.log_interval=1", f"train.hours={hours:.9f}", "optim.schedule=constant")
    assert not re.findall(r"step (\d+)  hours", r.stdout), "no step: the budget is spent " + r.stdout
    assert f"ddpworker: done: {step} steps" in r.stdout, r.stdout
    # that end is a finished run's: the same command again trains nothing
    r = worker(ddpworker, conf, f"snapshot.dir={snap}", "train.epochs=0", "train.max_steps=-1",
               "train.log_interval=1", f"train.hours={hours:.9f}", "optim.schedule=constant")
    assert f"already finished at step {step}, epoch 1 (snapshot.dir {snap})" in r.stdout, r.stdout


BUDGET_CONF = """[model]
name = resnet18
width = 8
[data]
kind = synthetic
height = 16
width = 16
channels = 3
classes = 10
train_limit = 4096
test_limit = 32
[optim]
schedule = constant
[train]
batch_size = 16
epochs = 1000
log_interval = 100000
threads = 1
hours = 0.003333
"""


def utc(stamp):
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_a_12_s_budget_ends_within_a_step_of_its_time(ddpworker, tmp_path):
    """train.hours is checked after every step (with the stop signals, in one reduction), not at
    log intervals: a log interval longer than the run does not stretch the budget."""
    conf = tmp_path / "budget.conf"
    conf.write_text(BUDGET_CONF)
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([ddpworker, str(conf), f"train.metrics_file={metrics}"], capture_output=True,
                       text=True, timeout=90, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    ev = events(metrics)
    start, last = ev[0], [e for e in ev if e["event"] == "train"][-1]
    assert start["event"] == "start"
    trained_s = utc(last["time"]) - utc(start["time"])    # to the end of the last step
    step_s = start["global_batch"] / last["img_per_s"]     # the mean step
    budget_s = 0.003333 * 3600
    print(f"budget {budget_s:.3f} s, trained {trained_s:.3f} s, {last['step']} steps of "
          f"{step_s * 1e3:.0f} ms: over by {(trained_s - budget_s) * 1e3:.0f} ms")
    assert budget_s - 0.01 <= trained_s <= budget_s + max(2 * step_s, step_s + 0.2), \
        (trained_s, step_s)


KILL_CONF = """[model]
name = cnn
width = 8
[data]
kind = synthetic
height = 16
width = 16
channels = 1
classes = 10
train_limit = 2048
test_limit = 64
val_split = 0.125
[optim]
lr = 0.02
schedule = constant
[train]
batch_size = 32
epochs = 6
log_interval = 8
eval_interval = 2
best_by = val_loss
[snapshot]
every = 7
keep = 2
# the disk path: a best newer than the newest snapshot (memory snapshots would have it)
every_memory = 0
"""


def worker_pids(conf):
    """ddpworker processes running conf (not ddprun's shims, whose command lines hold it too)."""
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(conf)}"],
                       capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def newest_snapshot(snap):
    steps = [int(m.group(1)) for n in os.listdir(snap) if (m := re.match(r"snapshot-(\d+)\.ddps$", n))]
    return max(steps, default=-1)


def test_a_best_written_after_the_last_snapshot_survives_a_kill_9(ddprun, ddpworker, tmp_path):
    """The worker is SIGKILLed when its newest best weights (train.best_file) are newer than its
    newest snapshot; ddprun restarts it from that snapshot. The resumed run takes the best value
    from the file's own metadata, so it never forgets that best nor writes an equal or worse one
    over it: the best values in the metrics only ever go down, and the end tests the last one."""
    conf = tmp_path / "kill.conf"
    conf.write_text(KILL_CONF)
    snap, best, metrics = tmp_path / "snap", tmp_path / "best.safetensors", tmp_path / "m.jsonl"
    job = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
                            str(conf), f"snapshot.dir={snap}", f"train.best_file={best}",
                            f"train.metrics_file={metrics}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=clean_env(), start_new_session=True)
    try:
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.005)
            pids = worker_pids(str(conf))
            if len(pids) != 1 or not snap.exists() or not metrics.exists():
                continue
            # frozen, the worker's files say exactly what a resume will find (the best file's own
            # metadata, not the metrics: its "best" line comes just after the file)
            os.kill(pids[0], signal.SIGSTOP)
            newest = newest_snapshot(snap)
            meta = safetensors_file.read_header(str(best))[1] if best.exists() else {}
            if newest > 0 and meta and int(meta["ddpworker.best_step"]) > newest:
                os.kill(pids[0], signal.SIGKILL)
                killed = ({"step": int(meta["ddpworker.best_step"]),
                           "value": float(meta["ddpworker.best_value"])}, newest)
            else:
                os.kill(pids[0], signal.SIGCONT)
        assert killed, "no moment with a best newer than the newest snapshot"
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    lost_best, resumed_at = killed
    assert job.returncode == 0, out
    assert f"resuming from {snap}/snapshot-{resumed_at:012d}.ddps" in out, out
    assert (f"train.best_file holds the best val_loss of step {lost_best['step']}" in out), out
    ev = events(metrics)
    values = [e["value"] for e in ev if e["event"] == "best"]
    assert all(b < a for a, b in zip(values, values[1:])), values
    final = ev[-1]
    last = [e for e in ev if e["event"] == "best"][-1]
    assert final["event"] == "final" and final["weights"] == "best", final
    assert (final["best_step"], final["best_value"]) == (last["step"], last["value"]), (final, last)
    assert last["value"] <= lost_best["value"]
    _, meta, _ = safetensors_file.read_header(str(best))
    assert float(meta["ddpworker.best_value"]) == last["value"], meta
    assert int(meta["ddpworker.best_step"]) == last["step"], meta


def test_a_lost_best_file_is_reported_and_the_best_starts_afresh(ddpworker, tmp_path):
    conf = conf_file(tmp_path)
    snap, best, metrics = tmp_path / "snap", tmp_path / "best.safetensors", tmp_path / "m.jsonl"
    common = ["data.val_split=0.25", "train.best_by=val_top1", f"train.best_file={best}",
              "train.eval_interval=3", f"snapshot.dir={snap}", f"train.metrics_file={metrics}"]
    worker(ddpworker, conf, *common, "train.max_steps=9")
    best.unlink()
    r = worker(ddpworker, conf, *common)
    assert f"train.best_file {best} is gone: the best weights (step" in r.stderr, r.stderr
    final = events(metrics)[-1]
    assert final["weights"] == "best" and final["best_step"] > 9 and best.exists(), final
