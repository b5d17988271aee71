"""ddpworker's cuda backend end to end, on a GPU machine (every GPU test skips where there is none,
and fails instead under DDP_REQUIRE_GPU=1, as tests/gpu/run.sh sets): convergence on Fashion-MNIST
and on a JPEG folder (the data path feeding the GPU), several ranks sharing one GPU through the ring
(equal to one rank with their whole batch), and kill -9 with a resume from the newest snapshot, in
a fresh process and in a warm spare, ending with the weights of an uninterrupted run from that
snapshot (the same check runs on the CPU backend everywhere). The per-op checks against the CPU
backend are tests/gpu/test_backend_cuda.c."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import safetensors_file
from conftest import clean_env, wait_until

# The GPU tests reuse the CPU tests' helpers and settings (tests/e2e), also when run alone (as
# tests/gpu/run.sh does), where pytest has not put tests/e2e on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from test_faults import final_state, restarts, snapshot_steps
from test_imagefolder import CONVERGENCE  # the CPU reference's settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FASHION = os.environ.get("DDP_DATA_DIR", "/usr/share/datasets/fashion-mnist")
EXIT_PEER_FAILURE = int(re.search(r"DDP_EXIT_PEER_FAILURE = (\d+)",
                                  open(os.path.join(ROOT, "proto/exit_codes.h")).read()).group(1))


def has_gpu():
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def cuda_lib(build_dir):
    """The cuda backend's library; every GPU test takes it, so that its absence (no GPU, no data,
    not built) skips them, or fails them under DDP_REQUIRE_GPU=1."""
    path = os.path.join(build_dir, "worker", "libddpworker_cuda.so")
    missing = ("no GPU" if not has_gpu() else
               f"no Fashion-MNIST in {FASHION}" if not os.path.isdir(FASHION) else
               "the cuda backend is not built (CUDA or cuDNN missing at configure time)"
               if not os.path.exists(path) else None)
    if missing and os.environ.get("DDP_REQUIRE_GPU") == "1":
        pytest.fail(f"DDP_REQUIRE_GPU=1: {missing}")
    if missing:
        pytest.skip(missing)
    return path


def one_rank_env():
    return {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE")}


def final_of(metrics):
    return [json.loads(line) for line in open(metrics) if '"final"' in line][-1]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_shipped_example_converges_on_the_gpu(ddpworker, cuda_lib, tmp_path, precision):
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddpworker, os.path.join(ROOT, "docs/examples/fashion-mnist.conf"),
                        "train.backend=cuda", f"precision.mode={precision}", f"data.dir={FASHION}",
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=600, env=one_rank_env())
    assert r.returncode == 0, r.stderr
    assert "on cuda" in r.stdout
    assert final_of(metrics)["top1"] >= 0.90, final_of(metrics)


def test_a_new_job_skips_the_search_an_earlier_job_made(ddpworker, cuda_lib, tmp_path):
    """cuDNN's timed search (about 0.1 s a shape on the H100) is shared by the jobs on a machine
    through ~/.cache/ddpworker/cudnn_algos.txt: a second job, its snapshots elsewhere, searches no
    shape, and its own snapshot folder then lists every algorithm it used (what a resume of it
    reads, whatever happens to the shared file meanwhile)."""
    env = one_rank_env()
    env.pop("DDPWORKER_ALGO_CACHE", None)
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), DDP_STARTUP_TRACE="1")

    def searched(snaps):
        r = subprocess.run([ddpworker, os.path.join(ROOT, "docs/examples/fashion-mnist.conf"),
                            "train.backend=cuda", "precision.mode=bf16", f"data.dir={FASHION}",
                            "train.max_steps=3", f"snapshot.dir={snaps}"], capture_output=True,
                           text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        found = re.search(r"cuDNN's algorithm search: [0-9.]+ s for (\d+) shapes", r.stderr)
        return int(found.group(1)) if found else 0

    assert searched(tmp_path / "first") > 0
    shared = (tmp_path / "cache" / "ddpworker" / "cudnn_algos.txt").read_text().splitlines()
    assert searched(tmp_path / "second") == 0
    own = (tmp_path / "second" / "cudnn_algos.txt").read_text().splitlines()
    assert sorted(own) == sorted(shared)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_adamw_trains_the_shipped_example_on_the_gpu(ddpworker, cuda_lib, tmp_path, precision):
    """adam_step's kernel in a whole run (fp16: under the loss scaler). The CPU reference, same
    settings, one rank: 90.8% (2 epochs, 98 s on the 2-core VM)."""
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddpworker, os.path.join(ROOT, "docs/examples/fashion-mnist.conf"),
                        "train.backend=cuda", f"precision.mode={precision}", f"data.dir={FASHION}",
                        "optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.01",
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=600, env=one_rank_env())
    assert r.returncode == 0, r.stderr
    assert final_of(metrics)["top1"] >= 0.89, final_of(metrics)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_resnet18_reaches_93_percent_on_fashion_mnist(ddpworker, cuda_lib, tmp_path, precision):
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddpworker, os.path.join(ROOT, "docs/examples/fashion-mnist-resnet18.conf"),
                        "train.backend=cuda", f"precision.mode={precision}", "model.width=64",
                        f"data.dir={FASHION}", f"train.metrics_file={metrics}"],
                       capture_output=True, text=True, timeout=900, env=one_rank_env())
    assert r.returncode == 0, r.stderr
    final = final_of(metrics)
    print(json.dumps(final))
    assert final["top1"] >= 0.93, final


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_sharing_one_gpu_equal_one_rank_with_their_batch(ddprun, ddpworker, cuda_lib,
                                                               tmp_path, ranks):
    """NCCL refuses two ranks on one GPU; the ring, staged through host memory, takes them. DDP's
    promise holds (the mlp has no batch norm, whose statistics are per rank)."""
    conf = tmp_path / "mlp.conf"
    conf.write_text(f"[model]\nname = mlp\nwidth = 64\n[data]\nkind = fashion-mnist\ndir = {FASHION}\n"
                    "train_limit = 2048\ntest_limit = 512\n[optim]\nlr = 0.05\nnesterov = true\n"
                    "label_smoothing = 0.1\n[train]\nbackend = cuda\nmax_steps = 6\nlog_interval = 2\n")
    many, one = tmp_path / "many.safetensors", tmp_path / "one.safetensors"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", str(ranks), str(conf),
                        "train.batch_size=16", f"train.params_file={many}"], capture_output=True,
                       text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run([ddpworker, str(conf), f"train.batch_size={16 * ranks}",
                        f"train.params_file={one}"], capture_output=True, text=True, timeout=300,
                       env=one_rank_env())
    assert r.returncode == 0, r.stderr
    a, b = safetensors_file.flat(many), safetensors_file.flat(one)
    assert a.shape == b.shape and a.size > 50000
    assert np.abs(a - b).max() <= 1e-5 + 1e-4 * np.abs(b).max(), np.abs(a - b).max()


def spare_is_ready(tmp_path):
    """A spare under --log-dir tmp_path/logs has said it is ready (its output file)."""
    return any("warm spare ready" in open(p).read()
               for p in glob.glob(str(tmp_path / "logs" / "*" / "spares" / "*" / "output.log")))


def kill_9_and_resume(ddprun, ddpworker, tmp_path, conf_text, spares, total_steps,
                      is_deterministic=False):
    """Starts a one-rank job of conf_text (its [snapshot] dir is {snaps}) with --warm-spares
    spares, kills its worker with SIGKILL once two snapshots were taken (and a spare is ready), and
    checks: exactly one restart; the resume is from the newest snapshot that had landed (at least
    the newest on disk before the kill, at most the last the killed worker started); the job ends
    at total_steps; and its final state equals, bit for bit, an uninterrupted run from the very
    snapshot it resumed (same algorithm cache), and with is_deterministic (the CPU backend) an
    uninterrupted run from the start too, as tests/e2e/test_faults.py: only that one sees a resume
    that restores the state wrongly in every run. cuDNN's fastest algorithms may sum with atomics,
    so on the GPU two runs need not agree bit for bit. Returns the job's final metrics line."""
    snaps = tmp_path / "snaps"
    conf = tmp_path / "kill.conf"
    conf.write_text(conf_text.format(snaps=snaps))
    metrics = tmp_path / "metrics.jsonl"
    job = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
                            "--warm-spares", str(spares), "--log-dir", str(tmp_path / "logs"),
                            str(conf), f"train.metrics_file={metrics}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=clean_env())

    def events(kind, lines=None):
        if lines is None:
            lines = [json.loads(line) for line in open(metrics)] if metrics.exists() else []
        return [e for e in lines if e.get("event") == kind]
    try:
        assert wait_until(lambda: len(events("snapshot")) >= 2, timeout=120), "no snapshots"
        if spares:
            assert wait_until(lambda: spare_is_ready(tmp_path), timeout=120), "no spare got ready"
        landed = snapshot_steps(snaps)  # complete (renamed into place) before the kill
        killed_at = time.monotonic()
        os.kill(events("start")[-1]["pid"], signal.SIGKILL)
        # hard links keep every snapshot there was (retention, keep = 2, deletes them later); the
        # resumed worker deletes nothing before it has written two more
        kept = tmp_path / "kept"
        kept.mkdir()
        for step in snapshot_steps(snaps):
            os.link(snaps / f"snapshot-{step:012d}.ddps", kept / f"snapshot-{step:012d}.ddps")
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert restarts(out + err) == 1, out + err
    lines = [json.loads(line) for line in open(metrics)]
    second = [i for i, e in enumerate(lines) if e.get("event") == "start"][1]
    started = [e["step"] for e in events("snapshot", lines[:second])]  # by the killed worker
    resumes = re.findall(r"resuming from (\S+): step (\d+)", out)
    assert len(resumes) == 1, out
    path, step = resumes[0][0], int(resumes[0][1])
    assert landed and landed[-1] <= step <= max(started), (landed, started, step)
    assert path == str(snaps / f"snapshot-{step:012d}.ddps"), path
    finals = events("final", lines)
    assert finals and finals[-1]["step"] == total_steps, finals
    starts = events("start", lines)
    assert len(starts) == 2 and starts[1].get("warm_spare", False) == bool(spares), starts
    print(f"killed, then finished {time.monotonic() - killed_at:.1f} s later")

    # the uninterrupted run from the snapshot the job resumed, with the same convolution algorithms
    ref = tmp_path / "reference"
    ref.mkdir()
    assert (kept / os.path.basename(path)).exists(), (path, os.listdir(kept))
    shutil.copy(kept / os.path.basename(path), ref)
    (ref / "latest").write_text(os.path.basename(path) + "\n")
    if (snaps / "cudnn_algos.txt").exists():
        shutil.copy(snaps / "cudnn_algos.txt", ref)
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--warm-spares", "0",
                        str(conf), f"snapshot.dir={ref}"], capture_output=True, text=True,
                       timeout=600, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming from {ref / os.path.basename(path)}: step {step}" in r.stdout, r.stdout
    want = final_state(ddpworker, ref)
    assert want[1] == total_steps, want
    assert final_state(ddpworker, snaps) == want, \
        "the killed job's final weights differ from a run resumed from the same snapshot"
    if is_deterministic:
        scratch = tmp_path / "scratch"
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--warm-spares", "0",
                            str(conf), f"snapshot.dir={scratch}"], capture_output=True, text=True,
                           timeout=600, env=clean_env())
        assert r.returncode == 0 and "resuming from" not in r.stdout, r.stdout + r.stderr
        assert final_state(ddpworker, snaps) == final_state(ddpworker, scratch), \
            "the killed job's final weights differ from an uninterrupted run's"
    return finals[-1]


KILL_CONF_CPU = ("[model]\nname = cnn\nwidth = 8\n[data]\nkind = synthetic\nheight = 16\n"
                 "width = 16\nchannels = 1\nclasses = 10\ntrain_limit = 4096\ntest_limit = 128\n"
                 "augment = true\n[optim]\nlr = 0.05\n[train]\nbatch_size = 16\nepochs = {epochs}\n"
                 "log_interval = 16\n[snapshot]\ndir = {{snaps}}\nevery = 20\nkeep = 2\nevery_memory = 0\n")


@pytest.mark.parametrize("spares", [0, 1])
def test_kill_9_on_the_cpu_resumes_the_newest_snapshot_and_ends_as_if_uninterrupted(
        ddprun, ddpworker, tmp_path, spares):
    """The GPU test's checks (below) against the CPU backend, so that they run everywhere."""
    epochs = 3 if spares else 2
    kill_9_and_resume(ddprun, ddpworker, tmp_path, KILL_CONF_CPU.format(epochs=epochs), spares,
                      256 * epochs, is_deterministic=True)


@pytest.mark.parametrize("spares", [0, 1])
def test_kill_9_on_the_gpu_resumes_from_the_newest_snapshot(ddprun, ddpworker, cuda_lib, tmp_path,
                                                            spares):
    """With --warm-spares 1 (the default on a GPU node) the restarted round runs in the spare that
    was ready before the kill; with 0 in a fresh process. The spare starts once the first round
    trains and needs a CUDA start of its own: that job runs 3 epochs, to be still running then."""
    epochs = 3 if spares else 1
    conf = (f"[model]\nname = resnet18\nwidth = 32\n[data]\nkind = fashion-mnist\n"
            f"dir = {FASHION}\ntrain_limit = 25600\ntest_limit = 1000\n[optim]\nlr = 0.05\n"
            f"[train]\nbackend = cuda\nbatch_size = 128\nepochs = {epochs}\nlog_interval = 10\n"
            "[snapshot]\ndir = {snaps}\nevery = 20\nkeep = 2\nevery_memory = 0\n")
    final = kill_9_and_resume(ddprun, ddpworker, tmp_path, conf, spares, 200 * epochs)
    assert final["top1"] > 0.7, final


def test_kill_9_on_the_gpu_resumes_from_memory_losing_a_few_steps(ddprun, ddpworker, cuda_lib,
                                                                  tmp_path):
    """Memory snapshots on the GPU (a copy into a device buffer, then a side-stream copy into
    page-locked shared memory, overlapped with the next steps; a due snapshot is skipped while the
    last is on its way): the worker killed mid-run resumes from the agent's memory with at most
    the steps one generation's copy and seal take lost (5 here: 22 MB, a step of about a
    millisecond), and ends as a run resumed from that very copy (same algorithm cache). The agent
    is frozen while the copies are kept, so that the restarted worker cannot overwrite them
    first."""
    snaps, metrics = tmp_path / "snaps", tmp_path / "metrics.jsonl"
    conf = tmp_path / "mem.conf"
    conf.write_text(f"[model]\nname = resnet18\nwidth = 32\n[data]\nkind = fashion-mnist\n"
                    f"dir = {FASHION}\ntrain_limit = 25600\ntest_limit = 1000\n[optim]\nlr = 0.05\n"
                    f"[train]\nbackend = cuda\nbatch_size = 128\nepochs = 1\nlog_interval = 10\n"
                    f"[snapshot]\nevery = 1000\nkeep = 2\nevery_memory = 1\n")
    job = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
                            "--warm-spares", "0", str(conf), f"snapshot.dir={snaps}",
                            f"train.metrics_file={metrics}"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=clean_env())
    kept = tmp_path / "kept"
    kept.mkdir()
    try:
        def trained():
            lines = [json.loads(x) for x in open(metrics)] if metrics.exists() else []
            return [e for e in lines if e.get("event") == "train" and e["step"] >= 60]
        assert wait_until(trained, timeout=300), "no training"
        mem = glob.glob(f"/dev/shm/ddprun-mem-{job.pid}-*")
        assert len(mem) == 1, mem
        pid = [json.loads(x) for x in open(metrics) if '"start"' in x][-1]["pid"]
        os.kill(job.pid, signal.SIGSTOP)  # the agent: no restart before the copies are kept
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        for path in glob.glob(f"{mem[0]}/own-*.ddps"):
            shutil.copy(path, kept)
        os.kill(job.pid, signal.SIGCONT)
        out, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0 and restarts(out) == 1, out
    found = re.findall(r"resuming from (\S+): step (\d+).*; source (\w+) \(rank 0\), (\d+) steps? "
                       r"lost", out)
    assert len(found) == 1, out
    path, step, source, lost = found[0][0], int(found[0][1]), found[0][2], int(found[0][3])
    assert source == "memory" and step >= 55 and lost <= 5, (source, step, lost)
    ref = tmp_path / "reference"
    ref.mkdir()
    shutil.copy(kept / os.path.basename(path), ref / f"snapshot-{step:012d}.ddps")
    # the killed job's convolution algorithms: a fresh timed search may pick others, which round
    # otherwise
    shutil.copy(snaps / "cudnn_algos.txt", ref)
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--warm-spares", "0",
                        str(conf), f"snapshot.dir={ref}", "snapshot.every_memory=0"],
                       capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0 and f"resuming from {ref}" in r.stdout, r.stdout + r.stderr
    assert final_state(ddpworker, snaps) == final_state(ddpworker, ref), \
        "the killed job's final weights differ from a run resumed from the same memory copy"


def mlp_conf(tmp_path, extra=""):
    conf = tmp_path / "mlp.conf"
    conf.write_text(f"[model]\nname = mlp\nwidth = 64\n[data]\nkind = fashion-mnist\ndir = {FASHION}\n"
                    "train_limit = 2048\ntest_limit = 512\n[optim]\nlr = 0.05\n[train]\n"
                    f"backend = cuda\nbatch_size = 64\nmax_steps = 8\nlog_interval = 4\n{extra}")
    return conf


def test_nccl_at_world_one_gives_the_same_bits_as_no_collective(ddprun, ddpworker, cuda_lib, tmp_path):
    """NCCL through its whole path (the id, the communicator, the initial broadcast, the bucketed
    all-reduce on its own stream, the evaluation sums staged from host memory), at the one world
    size a single GPU allows it."""
    conf = mlp_conf(tmp_path)
    nccl, none = tmp_path / "nccl.safetensors", tmp_path / "none.safetensors"
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", str(conf), "train.collective=nccl",
                        f"train.params_file={nccl}", f"train.metrics_file={metrics}"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run([ddpworker, str(conf), f"train.params_file={none}"], capture_output=True,
                       text=True, timeout=300, env=one_rank_env())
    assert r.returncode == 0, r.stderr
    a, b = safetensors_file.flat(nccl), safetensors_file.flat(none)
    assert a.size > 50000 and np.array_equal(a, b)
    assert final_of(metrics)["samples"] == 512


def test_nccl_with_two_ranks_on_one_gpu_fails_fast_and_clearly(ddprun, cuda_lib, tmp_path):
    conf = mlp_conf(tmp_path, "collective_timeout = 20\n")
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                        str(conf), "train.collective=nccl"], capture_output=True, text=True,
                       timeout=240, env=clean_env())
    # NCCL refuses a GPU shared by two ranks (invalid usage) or the other rank's join times out:
    # either way the worker's own exit, 'peer failure', is the job's, with its reason
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_PEER_FAILURE, out[-3000:]
    assert re.search(r"cannot join the NCCL communicator: rank [01] of 2: ", out), out[-3000:]
    assert time.monotonic() - t0 < 120


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    """43000 JPEGs/PNGs made from Fashion-MNIST, once for the precisions that train on them."""
    root = tmp_path_factory.mktemp("jpeg") / "folder"
    subprocess.run([sys.executable, os.path.join(ROOT, "tests/tools/make_jpeg_folder.py"),
                    str(root), "--per-class", "4000", "--val-per-class", "300"], check=True,
                   env={**os.environ, "DDP_DATA_DIR": FASHION})
    return root


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_jpeg_folder_path_trains_resnet18_imagenet_stem_to_90_percent_on_the_gpu(
        ddpworker, cuda_lib, tmp_path, jpeg_folder, precision):
    """The JPEG data path (decode threads, resize, the batch uploaded) feeding the GPU: the CPU
    reference of tests/e2e/test_imagefolder.py (91.40% on the CPU), on cuda in bf16 and fp16."""
    root = jpeg_folder
    conf = tmp_path / "jpeg.conf"
    conf.write_text(CONVERGENCE.format(root=root))
    metrics = tmp_path / "metrics.jsonl"
    r = subprocess.run([ddpworker, str(conf), "train.backend=cuda", f"precision.mode={precision}",
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=1200, env=one_rank_env())
    assert r.returncode == 0, r.stderr
    final = final_of(metrics)
    assert final["split"] == "val" and final["samples"] == 3000, final
    assert final["top1"] >= 0.90, final
