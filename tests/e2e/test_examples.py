"""Every shipped example (docs/examples/*.conf) is a valid train.conf whose model builds and
trains: each runs a step on the cpu backend here, its dataset replaced by synthetic images of the
same shape (the real ones are not on a CI machine) and its outputs sent to a temporary directory."""
import glob
import os
import re
import subprocess

import pytest

from conftest import ROOT, clean_env

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "docs", "examples", "*.conf")))

SHAPES = {"cifar10": (32, 3, 10), "cifar100": (32, 3, 100), "fashion-mnist": (28, 1, 10),
          "mnist": (28, 1, 10)}


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_example_builds_and_trains_a_step(ddpworker, example, tmp_path):
    text = open(example).read()
    kind = re.search(r"^kind\s*=\s*(\S+)", text, re.M).group(1)
    side, channels, classes = SHAPES.get(kind, (64, 3, 10))
    out = {k: str(tmp_path / k) for k in ("metrics", "best", "params", "snap")}
    overrides = ["data.kind=synthetic", f"data.height={side}", f"data.width={side}",
                 f"data.channels={channels}", f"data.classes={classes}", "data.train_limit=16",
                 "data.test_limit=8", "train.batch_size=4", "train.max_steps=1",
                 "train.backend=cpu", "precision.mode=fp32", "model.width=8",
                 f"train.metrics_file={out['metrics']}", f"snapshot.dir={out['snap']}"]
    if "best_file" in text:
        overrides.append(f"train.best_file={out['best']}")
    if "params_file" in text:
        overrides.append(f"train.params_file={out['params']}")
    if "fc_width" in text or re.search(r"name\s*=\s*vgg", text):
        overrides.append("model.fc_width=16")
    if re.search(r"^init\s*=", text, re.M):
        overrides.append("model.init=")          # the pretrained file is the user's to make
    if "hours" in text:
        overrides.append("train.hours=0")
    r = subprocess.run([ddpworker, example, *overrides], capture_output=True, text=True,
                       timeout=300, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"event":"final"' in r.stdout
