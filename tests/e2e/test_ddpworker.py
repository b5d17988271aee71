"""ddpworker, the built-in trainer, through ddprun and on its own: training on 2 ranks with the
metrics file and the final line, DDP equivalence (2 ranks x batch B == 1 rank x batch 2B), clear
errors with the right exit codes for bad train.conf files, missing and truncated datasets, and a
peer that dies or hangs in the middle of an all-reduce (exit "peer failure", never a hang)."""
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

import safetensors_file
from conftest import clean_env, wait_until

FASHION = "/usr/share/datasets/fashion-mnist"
EXIT_DATA, EXIT_PEER_FAILURE, EXIT_CONFIG = 65, 75, 78

needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION),
                                   reason="Debian's dataset-fashion-mnist is not installed")


def write_conf(path, text):
    path.write_text(text)
    return str(path)


SMALL = """[model]
name = {model}
width = 16
[data]
kind = {kind}
train_limit = {train_limit}
test_limit = 400
[optim]
lr = 0.05
schedule = constant
[train]
batch_size = {batch}
epochs = {epochs}
log_interval = 5
"""


def small_conf(tmp_path, name="small.conf", model="mlp", kind="fashion-mnist", train_limit=1024,
               batch=32, epochs=1):
    return write_conf(tmp_path / name, SMALL.format(model=model, kind=kind, train_limit=train_limit,
                                                    batch=batch, epochs=epochs))


@needs_fashion
def test_two_ranks_train_and_rank0_reports_the_final_evaluation(ddprun, tmp_path):
    conf = small_conf(tmp_path, model="cnn", epochs=2)
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf,
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    # a validation after each epoch (here on the test split: there is no val split), an epoch
    # event with it, and the final evaluation, which reuses the last validation (same split,
    # same weights)
    assert kinds.count("train") >= 4 and kinds.count("eval") == 2 and kinds[-1] == "final"
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2], epochs
    assert all(e["wall_s"] > 0 and e["img_per_s"] > 0 and e["split"] == "test" for e in epochs)
    final = events[-1]
    assert final["samples"] == 400 and final["step"] == 2 * 1024 // 64 and final["epoch"] == 2
    assert final["split"] == "test" and final["weights"] == "last"
    assert epochs[-1]["val_loss"] == final["loss"]
    assert final["top1"] > 0.6 and final["top5"] >= final["top1"], final
    steps = [e["step"] for e in events if e["event"] == "train"]
    assert steps == sorted(steps) and all(e["img_per_s"] > 0 for e in events if "img_per_s" in e)
    # the summary line on rank 0's stdout is the metrics file's last line
    printed = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if '"final"' in line]
    assert len(printed) == 1 and json.loads(printed[0]) == final
    assert "step 32/32" in r.stdout and "img/s" in r.stdout and "ETA" in r.stdout


@needs_fashion
def test_two_ranks_of_batch_b_equal_one_rank_of_batch_2b(ddprun, ddpworker, tmp_path):
    """DDP's promise: averaging gradients over ranks is training on the union of their batches.
    The mlp has no batch norm, whose statistics are per rank (as in PyTorch DDP)."""
    conf = small_conf(tmp_path, train_limit=640)
    two, one = tmp_path / "two.safetensors", tmp_path / "one.safetensors"
    common = ["train.max_steps=4", "optim.nesterov=true", "optim.label_smoothing=0.1"]
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf, "train.batch_size=16",
                        f"train.params_file={two}"] + common, capture_output=True, text=True,
                       timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([ddpworker, conf, "train.batch_size=32", f"train.params_file={one}"] + common,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    a, b = safetensors_file.flat(two), safetensors_file.flat(one)
    assert a.shape == b.shape and a.size > 10000
    init = small_conf(tmp_path, name="init.conf", train_limit=640)
    assert np.abs(a - b).max() <= 1e-5 + 1e-4 * np.abs(b).max(), np.abs(a - b).max()
    # and training did move the parameters (the comparison is not between two initial states)
    r = subprocess.run([ddpworker, init, "train.max_steps=1", "optim.lr=0",
                        f"train.params_file={tmp_path / 'init.safetensors'}"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert np.abs(safetensors_file.flat(tmp_path / "init.safetensors") - b).max() > 1e-3


def test_an_unknown_key_is_a_config_error_naming_file_line_and_key(ddprun, tmp_path):
    conf = write_conf(tmp_path / "bad.conf", "[model]\nname = cnn\n[optim]\nlr_typo = 0.1\n")
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                        conf], capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert f"{conf}:4: optim.lr_typo: unknown key" in r.stderr
    assert "exit 78 is not retried" in r.stderr and "attempt 2" not in r.stderr


def test_a_bad_override_and_a_bad_value_are_config_errors(ddpworker, tmp_path):
    conf = write_conf(tmp_path / "ok.conf", "[train]\nbatch_size = 8\n")
    r = subprocess.run([ddpworker, conf, "optim.lr=fast"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_CONFIG
    assert "override 'optim.lr=fast': optim.lr: 'fast' is not a number" in r.stderr
    conf = write_conf(tmp_path / "neg.conf", "[train]\n\nbatch_size = -3\n")
    r = subprocess.run([ddpworker, conf], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_CONFIG and f"{conf}:3: train.batch_size" in r.stderr, r.stderr
    r = subprocess.run([ddpworker, str(tmp_path / "missing.conf")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_CONFIG and "missing.conf: cannot open" in r.stderr


def test_nothing_to_train_and_an_impossible_model_are_config_errors(ddpworker, tmp_path):
    conf = small_conf(tmp_path, kind="synthetic", train_limit=64)
    r = subprocess.run([ddpworker, conf, "train.epochs=0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_CONFIG and "nothing says when to stop" in r.stderr, r.stderr
    r = subprocess.run([ddpworker, conf, "model.name=cnn", "data.height=3", "data.width=3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_CONFIG and "too small" in r.stderr, r.stderr


def test_a_missing_dataset_is_a_data_error_naming_the_path(ddprun, tmp_path):
    conf = small_conf(tmp_path)
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", conf,
                        f"data.dir={tmp_path}/nowhere"], capture_output=True, text=True,
                       timeout=60, env=clean_env())
    assert r.returncode == EXIT_DATA, r.stderr
    assert f"{tmp_path}/nowhere" in r.stderr


@needs_fashion
def test_a_truncated_dataset_is_a_data_error_naming_the_file(ddpworker, tmp_path):
    data = tmp_path / "fm"
    shutil.copytree(FASHION, data)
    images = next(p for p in data.iterdir() if p.name.startswith("train-images"))
    raw = gzip.open(images).read() if images.suffix == ".gz" else images.read_bytes()
    images.unlink()
    (data / "train-images-idx3-ubyte").write_bytes(raw[: len(raw) // 2])
    r = subprocess.run([ddpworker, small_conf(tmp_path), f"data.dir={data}"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == EXIT_DATA, r.stderr
    assert "train-images-idx3-ubyte" in r.stderr and "ddpworker" in r.stderr


def start_pair(ddpworker, store, conf, *overrides):
    procs, run_id = [], f"pair-{os.getpid()}-{time.monotonic_ns()}"
    for rank in range(2):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                        TORCHELASTIC_RUN_ID=run_id)
        procs.append(subprocess.Popen([ddpworker, conf, *overrides], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def wait_for_training(proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "step" in line:
            return
        assert line, "rank 0 ended before training"
    pytest.fail("rank 0 did not start training")


def test_a_peer_killed_mid_training_ends_the_other_with_peer_failure(ddpworker, store, tmp_path):
    conf = small_conf(tmp_path, kind="synthetic", train_limit=4096, epochs=1000)
    procs = start_pair(ddpworker, store, conf, "train.log_interval=1",
                       "train.collective_timeout=30")
    try:
        wait_for_training(procs[0])
        procs[1].kill()
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=20)
        assert procs[0].returncode == EXIT_PEER_FAILURE, err
        assert time.monotonic() - start < 10, "a closed connection is noticed at once"
        assert "rank 1 (127.0.0.1:" in err, err
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_hung_peer_hits_the_collective_deadline(ddpworker, store, tmp_path):
    conf = small_conf(tmp_path, kind="synthetic", train_limit=4096, epochs=1000)
    procs = start_pair(ddpworker, store, conf, "train.log_interval=1",
                       "train.collective_timeout=2")
    try:
        wait_for_training(procs[0])
        procs[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        elapsed = time.monotonic() - start
        assert procs[0].returncode == EXIT_PEER_FAILURE, err
        assert 1.5 < elapsed < 15, elapsed
        assert re.search(r"no data (from|to) rank 1 \(127\.0\.0\.1:\d+, (prev|next)\) for 2000 ms",
                         err), err
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.communicate()


def run_example(ddprun, conf, tmp_path, timeout):
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf,
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=timeout, env=clean_env())
    assert r.returncode == 0, r.stderr
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["event"] == "final" and final["samples"] == 10000, final
    return final


@needs_fashion
@pytest.mark.cpu_bound
def test_the_shipped_example_reaches_90_percent_on_two_ranks(ddprun, tmp_path):
    """The README's main job: docs/examples/fashion-mnist.conf, 2 epochs on 2 ranks."""
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "examples",
                        "fashion-mnist.conf")
    final = run_example(ddprun, conf, tmp_path, timeout=1200)
    assert final["top1"] >= 0.90, final


@needs_fashion
@pytest.mark.skipif(os.environ.get("DDP_SLOW_TESTS") != "1",
                    reason="hours on a CPU; opt in with DDP_SLOW_TESTS=1")
def test_the_resnet18_example_reaches_93_percent(ddprun, tmp_path):
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "examples",
                        "fashion-mnist-resnet18.conf")
    final = run_example(ddprun, conf, tmp_path, timeout=48 * 3600)
    assert final["top1"] >= 0.93, final


@pytest.mark.parametrize("override, message", [
    ("precision.mode=bf16", "precision.mode: bf16 needs train.backend=cuda"),
    ("precision.mode=tf32", "precision.mode: tf32 needs train.backend=cuda"),
    ("precision.mode=fp16", "precision.mode: fp16 needs train.backend=cuda"),
    ("train.collective=nccl", "train.collective: nccl needs train.backend=cuda"),
    ("train.collective=gloo", "train.collective: 'gloo' is not one of auto|ring|nccl"),
])
def test_gpu_only_settings_on_the_cpu_backend_are_config_errors(ddpworker, tmp_path, override, message):
    conf = write_conf(tmp_path / "cpu.conf", "[data]\nkind = synthetic\ntrain_limit = 64\n[train]\nmax_steps = 1\n")
    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([ddpworker, conf, override], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert message in r.stderr, r.stderr


FAKE_CUDA_LIB = r"""
#include <stdint.h>
#include <stddef.h>
struct table { uint32_t version, size; void *fns[5]; };
%s
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("body, message", [
    ("const struct table ddpworker_cuda_api = {999, sizeof(struct table), {0}};",
     "from another build of ddprun (its table is version 999"),
    ("const struct table ddpworker_cuda_api = {1, 8, {0}};", "version 1 of 8 bytes"),
    ("int unrelated = 1;", "not a ddpworker backend (no ddpworker_cuda_api)"),
])
def test_a_cuda_library_from_another_build_is_refused_plainly(ddpworker, tmp_path, body, message):
    """ddpworker takes libddpworker_cuda.so's one versioned table (cuda/cuda_api.h) and refuses a
    library whose table is missing, of another version or of another size, naming the file."""
    src = tmp_path / "fake.c"
    src.write_text(FAKE_CUDA_LIB % body)
    lib = tmp_path / "libddpworker_cuda.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    conf = write_conf(tmp_path / "cuda.conf", "[data]\nkind = synthetic\ntrain_limit = 64\n"
                                              "[train]\nbackend = cuda\nmax_steps = 1\n")
    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([ddpworker, conf], capture_output=True, text=True, timeout=60,
                       env={**env, "DDPWORKER_CUDA_LIB": str(lib)})
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert message in r.stderr and str(lib) in r.stderr, r.stderr


EXIT_DIVERGED = 80


def test_a_diverging_loss_ends_the_run_with_its_own_code_and_is_not_retried(ddprun, tmp_path):
    """lr 1000 without loss scaling: the loss turns NaN/inf, every rank stops at the log step
    where it shows, with "diverged" (80), which ddprun does not retry; the metrics file holds
    only valid JSON (non-finite numbers as null), each line with a UTC time."""
    conf = small_conf(tmp_path, kind="synthetic", model="cnn")
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                        conf, "optim.lr=1000", "train.log_interval=2",
                        f"train.metrics_file={metrics}"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == EXIT_DIVERGED, r.stdout + r.stderr
    assert "the run diverged" in r.stderr and "exit 80 is not retried" in r.stderr, r.stderr
    # no restart: the root cause is on the first attempt, nothing was restarted, one start
    assert "on attempt 1 of 4" in r.stderr, r.stderr
    assert "restarting every worker" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert '"event":"final"' not in r.stdout, "never a final result from NaN weights"
    events = []
    for line in metrics.read_text().splitlines():
        event = json.loads(line)                     # every line parses (no -nan, no inf)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", event["time"]), event
        events.append(event["event"])
    assert events.count("start") == 1, events


def test_a_diverged_run_snapshots_no_nan_weights_between_log_steps(ddpworker, tmp_path):
    """Snapshots every 2 steps, the loss logged every 50: the divergence is caught at the first
    snapshot after it, so no snapshot holds NaN weights for a rerun (with a lower lr) to resume."""
    conf = small_conf(tmp_path, kind="synthetic", model="cnn")
    snap = tmp_path / "snap"
    r = subprocess.run([ddpworker, conf, "optim.lr=1000", "train.log_interval=50",
                        "train.max_steps=40", "train.epochs=10", f"snapshot.dir={snap}",
                        "snapshot.every=2"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == EXIT_DIVERGED, r.stdout + r.stderr
    m = re.search(r"the training loss is (NaN|inf) by step (\d+)", r.stderr)
    assert m and int(m.group(2)) < 40 and int(m.group(2)) % 2 == 0, r.stderr
    taken = [int(n[9:21]) for n in os.listdir(snap) if n.endswith(".ddps")] if snap.exists() else []
    assert all(step < int(m.group(2)) for step in taken), (taken, r.stderr)


def test_metrics_are_json_lines_with_utc_time(ddprun, tmp_path):
    conf = small_conf(tmp_path, kind="synthetic")
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", conf,
                        f"train.metrics_file={metrics}", "train.max_steps=6"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {"train", "final"} <= {e["event"] for e in events}
    assert all(e["time"].endswith("Z") for e in events)
    printed = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if '"final"' in line]
    assert json.loads(printed[0]) == events[-1]


def test_progress_updates_one_line_on_a_terminal_and_prints_lines_when_piped(ddpworker, tmp_path):
    import pty
    conf = small_conf(tmp_path, kind="synthetic")
    args = [ddpworker, conf, "train.max_steps=20", "train.log_interval=5"]
    out = bytearray()
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(ddpworker, args)
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = out.decode()
    assert text.count("\r\x1b[Kepoch 1  step") == 4, repr(text)    # one line, rewritten
    assert "step 20/20" in text and "\n{\"event\":\"final\"" in text.replace("\r\n", "\n")
    piped = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
    assert "\r" not in piped and piped.count("\nepoch 1  step") == 4, piped
    assert "ddpworker: done: 20 steps" in piped
