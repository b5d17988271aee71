"""data.kind = imagefolder end to end on the cpu backend: a JPEG/PNG folder made from Debian's
Fashion-MNIST (tests/tools/make_jpeg_folder.py) trains through ddprun on 2 ranks, validates on val/
and tests on test/; a broken file stops the run naming it (data.on_bad_image = error, exit 65) or
is replaced and counted (skip); the crops are the same for any world size."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

FASHION = "/usr/share/datasets/fashion-mnist"
MAKE = os.path.join(ROOT, "tests", "tools", "make_jpeg_folder.py")
EXIT_DATA = 65

pytestmark = pytest.mark.skipif(not os.path.isdir(FASHION), reason="no Debian Fashion-MNIST")

CONF = """[model]
name = resnet18
width = 8
[data]
kind = imagefolder
dir = {root}
image_size = 32
workers = 2
[optim]
lr = 0.05
[train]
batch_size = 16
epochs = 2
log_interval = 5
"""


def make_folder(tmp_path, *args):
    root = tmp_path / "folder"
    r = subprocess.run(["/usr/bin/python3", MAKE, str(root), "--per-class", "20",
                        "--val-per-class", "5", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    conf = tmp_path / "folder.conf"
    conf.write_text(CONF.format(root=root))
    return root, str(conf)


def test_a_jpeg_folder_trains_validates_and_tests(ddprun, tmp_path):
    root, conf = make_folder(tmp_path, "--test")
    metrics = tmp_path / "m.jsonl"
    # random-resized-crop on 200 images learns too slowly for a steady bound here (the final
    # top-1 of 6 epochs spread over 0.14-0.34 across seeds); resize reaches 0.42-0.52 in 10
    # epochs (6 seeds), and the tests below train with the default crop
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", conf, "train.epochs=10",
                        "data.train_transform=resize", "optim.lr=0.1",
                        f"train.metrics_file={metrics}"], capture_output=True, text=True,
                       timeout=600, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and all(e["split"] == "val" and e["samples"] == 50 for e in evals)
    final = events[-1]
    assert final["split"] == "test" and final["samples"] == 50
    assert all(e["loss"] is not None for e in events if e["event"] == "train")
    assert final["top1"] > 0.3, "it learns something in 10 epochs of 200 images (chance: 0.1)"


def test_a_broken_file_is_an_error_naming_it_or_skipped_and_counted(ddpworker, tmp_path):
    root, conf = make_folder(tmp_path, "--broken", "3")
    r = subprocess.run([ddpworker, conf], capture_output=True, text=True, timeout=600,
                       env=clean_env())
    assert r.returncode == EXIT_DATA, r.stderr
    assert f"data: {root}/train/" in r.stderr and "data.on_bad_image = skip" in r.stderr
    r = subprocess.run([ddpworker, conf, "data.on_bad_image=skip", "train.epochs=1"],
                       capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stderr
    final = json.loads([l for l in r.stdout.splitlines() if '"final"' in l][0])
    assert final["skipped_images"] == 3, final


def test_limits_take_the_first_files_in_imagefolder_order(ddpworker, tmp_path):
    root, conf = make_folder(tmp_path, "--test")
    r = subprocess.run([ddpworker, conf, "data.train_limit=30", "data.test_limit=7",
                        "train.epochs=1"], capture_output=True, text=True, timeout=600,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    final = json.loads([l for l in r.stdout.splitlines() if '"final"' in l][0])
    # 30 training files are 2 steps of 16; the test split is cut to 7 files
    assert final["step"] == 2 and final["split"] == "test" and final["samples"] == 7, final


def test_folder_errors_name_what_is_wrong(ddpworker, tmp_path):
    root = tmp_path / "empty"
    (root / "train").mkdir(parents=True)
    conf = tmp_path / "c.conf"
    conf.write_text(CONF.format(root=root))
    r = subprocess.run([ddpworker, str(conf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_DATA and "no class folders" in r.stderr, r.stderr
    (root / "train" / "cat").mkdir()
    (root / "train" / "cat" / "a.jpg").write_bytes(b"\xff\xd8\xff")
    (root / "val" / "dog").mkdir(parents=True)
    r = subprocess.run([ddpworker, str(conf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_DATA and "class 'dog' is not among" in r.stderr, r.stderr


CONVERGENCE = """[model]
name = resnet18
width = 16
stem = imagenet
[data]
kind = imagefolder
dir = {root}
image_size = 48
train_transform = resize
eval_transform = resize
[optim]
lr = 0.1
momentum = 0.9
nesterov = true
weight_decay = 0.0005
label_smoothing = 0.1
schedule = one-cycle
[train]
batch_size = 64
epochs = 5
log_interval = 100
seed = 1
"""


@pytest.mark.cpu_bound
def test_resnet18_imagenet_stem_reaches_90_percent_on_the_jpeg_folder(ddprun, tmp_path):
    """ResNet-18 with the ImageNet stem on 40000 JPEGs made from Fashion-MNIST (48 px), validated on
    3000 of its test images: >= 90% top-1 on the CPU (measured 91.40% in 4m26s with a release
    build; 13m49s with tests/run.sh's ASan build on 2 cores shared with two other jobs, 2026-11-25:
    CI runs it)."""
    root = tmp_path / "folder"
    subprocess.run(["/usr/bin/python3", MAKE, str(root), "--per-class", "4000",
                    "--val-per-class", "300"], check=True)
    conf = tmp_path / "conv.conf"
    conf.write_text(CONVERGENCE.format(root=root))
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", str(conf)],
                       capture_output=True, text=True, timeout=3600, env=clean_env())
    assert r.returncode == 0, r.stderr
    final = json.loads([l for l in r.stdout.splitlines() if '"final"' in l][0].split(": ", 1)[1])
    assert final["split"] == "val" and final["samples"] == 3000
    assert final["top1"] >= 0.90, final
