"""The cpu backend on oneDNN (worker/cpu/cpu_dnnl.h) in a whole training run: the default build
uses it without being asked, on train.threads threads; a ResNet-18 trains the same as on the plain
path (DDP_CPU_ONEDNN=0: im2col + SGEMM and loops, what a build without oneDNN runs), step for
step, within fp32 rounding. The ops themselves: tests/unit/test_cpu_dnnl.c and test_cpu_ops.c;
against PyTorch: tests/interop. A real build without oneDNN: the DDP_SLOW_TESTS test below."""
import json
import math
import os
import subprocess

import pytest

from conftest import clean_env

CONF = """[model]
name = resnet18
width = 8
[data]
kind = synthetic
height = 32
width = 32
channels = 3
classes = 10
train_limit = 512
test_limit = 64
[optim]
lr = 0.05
momentum = 0.9
[train]
batch_size = 16
max_steps = 8
log_interval = 2
threads = 2
"""


def has_onednn(ddpworker):
    """ddpworker links libdnnl (CMake found a oneDNN it speaks)"""
    libs = subprocess.run(["ldd", ddpworker], capture_output=True, text=True).stdout
    return "libdnnl" in libs


def train(ddpworker, tmp_path, onednn, *overrides):
    """onednn: the value of DDP_CPU_ONEDNN, None: unset (the default)"""
    conf = tmp_path / "r.conf"
    conf.write_text(CONF)
    metrics = tmp_path / f"m{onednn}.jsonl"
    env = {k: v for k, v in clean_env(DNNL_VERBOSE="1").items() if k != "DDP_CPU_ONEDNN"}
    if onednn is not None:
        env["DDP_CPU_ONEDNN"] = str(onednn)
    r = subprocess.run([ddpworker, str(conf), f"train.metrics_file={metrics}", *overrides],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [m["loss"] for m in map(json.loads, metrics.read_text().splitlines())
              if m["event"] == "train"]
    return losses, r.stdout


def test_onednn_is_the_default_and_trains_as_the_plain_path(ddpworker, tmp_path):
    if not has_onednn(ddpworker):
        pytest.skip("ddpworker was built without oneDNN")
    ref, ref_out = train(ddpworker, tmp_path, 0)
    got, out = train(ddpworker, tmp_path, None)
    # oneDNN ran the convolutions (its verbose lines) without being asked, on train.threads
    # threads; DDP_CPU_ONEDNN=0 turned it off
    assert "onednn_verbose,exec,cpu,convolution" in out
    assert "runtime:OpenMP,nthr:2" in out, "oneDNN's threads are not train.threads"
    assert "onednn_verbose,exec" not in ref_out
    assert "ref:any" not in out.split("onednn_verbose,exec,cpu,convolution", 1)[1].split("\n")[0], \
        "oneDNN fell back to its reference kernel"
    assert len(got) == len(ref) == 4
    # the first steps agree to rounding; momentum SGD then amplifies the last bits a little
    assert math.isclose(got[0], ref[0], rel_tol=1e-4), f"first loss: oneDNN {got[0]}, im2col {ref[0]}"
    for step, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=1e-2), f"loss at log {step}: oneDNN {a}, im2col {b}"
    assert got != ref, "bit-identical: was oneDNN used at all?"


def test_onednn_runs_on_train_threads(ddpworker, tmp_path):
    if not has_onednn(ddpworker):
        pytest.skip("ddpworker was built without oneDNN")
    _, out = train(ddpworker, tmp_path, None, "train.threads=1", "train.max_steps=2")
    assert "runtime:OpenMP,nthr:1" in out, out[:2000]


@pytest.mark.skipif(os.environ.get("DDP_SLOW_TESTS") != "1",
                    reason="a second build of ddpworker (minutes); opt in with DDP_SLOW_TESTS=1")
def test_a_build_without_onednn_trains(tmp_path):
    """CMake without oneDNN (as on a machine without libdnnl-dev): the build is complete and
    trains on the plain path, and says nothing of oneDNN."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    build = tmp_path / "build-no-onednn"
    subprocess.run(["cmake", "-S", root, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DDDP_CUDA=OFF", "-DDDP_BUILD_TESTS=OFF", "-DDDP_BUILD_TOOLS=OFF",
                    "-DDNNL_LIBRARY=DNNL_LIBRARY-NOTFOUND",
                    "-DDNNL_INCLUDE_DIR=DNNL_INCLUDE_DIR-NOTFOUND"],
                   check=True, capture_output=True, timeout=300)
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "ddpworker"], check=True,
                   capture_output=True, timeout=1200)
    worker = str(build / "worker" / "ddpworker")
    assert not has_onednn(worker)
    losses, out = train(worker, tmp_path, None)
    assert "onednn_verbose" not in out
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
