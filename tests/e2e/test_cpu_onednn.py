"""The cpu backend's oneDNN convolutions (DDP_CPU_ONEDNN=1, worker/cpu/cpu_dnnl.h) in a whole
training run: a ResNet-18 trains the same as on the im2col path, step for step, within fp32
rounding (the ops themselves: tests/unit/test_cpu_dnnl.c; against PyTorch: the interop tests with
the variable set). Skips where ddpworker was built without oneDNN."""
import json
import math
import os
import re
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


def has_onednn(build_dir):
    cache = open(os.path.join(build_dir, "CMakeCache.txt")).read()
    return re.search(r"^DNNL_LIBRARY:FILEPATH=(?!.*NOTFOUND).+$", cache, re.M) is not None


def train(ddpworker, tmp_path, onednn):
    conf = tmp_path / "r.conf"
    conf.write_text(CONF)
    metrics = tmp_path / f"m{onednn}.jsonl"
    env = clean_env(DDP_CPU_ONEDNN=str(onednn), DNNL_VERBOSE="1")
    r = subprocess.run([ddpworker, str(conf), f"train.metrics_file={metrics}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [m["loss"] for m in map(json.loads, metrics.read_text().splitlines())
              if m["event"] == "train"]
    return losses, r.stdout


def test_onednn_trains_as_im2col(ddpworker, build_dir, tmp_path):
    if not has_onednn(build_dir):
        pytest.skip("ddpworker was built without oneDNN")
    ref, ref_out = train(ddpworker, tmp_path, 0)
    got, out = train(ddpworker, tmp_path, 1)
    # the switch took effect: oneDNN ran convolutions (its verbose lines), and not without it
    assert "onednn_verbose,exec,cpu,convolution" in out
    assert "onednn_verbose,exec" not in ref_out
    assert "ref:any" not in out.split("onednn_verbose,exec,cpu,convolution", 1)[1].split("\n")[0], \
        "oneDNN fell back to its reference kernel"
    assert len(got) == len(ref) == 4
    # the first steps agree to rounding; momentum SGD then amplifies the last bits a little
    assert math.isclose(got[0], ref[0], rel_tol=1e-4), f"first loss: oneDNN {got[0]}, im2col {ref[0]}"
    for step, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=1e-2), f"loss at log {step}: oneDNN {a}, im2col {b}"
    assert got != ref, "bit-identical: was oneDNN used at all?"
