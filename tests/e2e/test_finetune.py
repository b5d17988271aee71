"""The fine-tuning user's path through the real ddpworker: pretrained weights that do not fit are
refused beyond the final layer, naming the first mismatches, unless listed in model.init_skip, and
every load says what loaded and what was skipped; a finished run is not trained again."""
import csv
import json
import os
import re
import subprocess
import textwrap

import pytest

from conftest import clean_env

EXIT_CONFIG = 78

VGG = """[model]
name = vgg11_bn
width = 16
fc_width = 16
[data]
kind = synthetic
height = 32
width = 32
channels = 3
classes = 10
train_limit = 64
test_limit = 16
[train]
batch_size = 16
max_steps = 1
"""


def run(ddpworker, conf, *overrides):
    return subprocess.run([ddpworker, str(conf), *overrides], capture_output=True, text=True,
                          timeout=300, env=clean_env())


def test_weights_of_another_width_are_refused_unless_the_tensors_are_listed(ddpworker, tmp_path):
    conf = tmp_path / "vgg.conf"
    conf.write_text(VGG)
    wide = tmp_path / "w16.safetensors"
    r = run(ddpworker, conf, "train.max_steps=0", f"train.params_file={wide}")
    assert r.returncode == 0, r.stderr
    # a new head of 5 classes would be skipped, but width 8 does not fit anywhere else
    r = run(ddpworker, conf, "model.width=8", "data.classes=5", f"model.init={wide}",
            "model.init_skip_mismatched=true")
    assert r.returncode == EXIT_CONFIG, r.stdout + r.stderr
    assert (f"model.init: {wide}: tensor 'features.0.weight': shape [16, 3, 3, 3] in the file, "
            "[8, 3, 3, 3] in the model; tensor 'features.0.bias'") in r.stderr, r.stderr
    assert "and 46 more (49 of the model's 62 tensors" in r.stderr, r.stderr
    assert "model.init_skip" in r.stderr and "ddpworker: vgg11_bn" not in r.stdout, "no training"
    # listed, they are skipped on purpose, and the report counts and names them
    r = run(ddpworker, conf, "model.width=8", "data.classes=5", f"model.init={wide}",
            "model.init_skip_mismatched=true", "model.init_skip=features.*, classifier.0.weight")
    assert r.returncode == 0, r.stderr
    assert (f"model.init: {wide}: loaded 3 of the model's 62 tensors; skipped 59, which keep their "
            "drawn initial values (model.init_skip, model.init_skip_mismatched): features.0.weight,"
            ) in r.stderr, r.stderr
    assert "skipping tensor 'classifier.6.weight': shape [10, 16] in the file, [5, 16]" in r.stderr
    # a new head alone: two tensors skipped, named
    r = run(ddpworker, conf, "data.classes=5", f"model.init={wide}",
            "model.init_skip_mismatched=true")
    assert r.returncode == 0, r.stderr
    assert (f"loaded 60 of the model's 62 tensors; skipped 2, which keep their drawn initial values "
            "(model.init_skip_mismatched): classifier.6.weight, classifier.6.bias\n") in r.stderr
    # a file that fits: all of it
    r = run(ddpworker, conf, f"model.init={wide}")
    assert r.returncode == 0 and "loaded 62 of the model's 62 tensors\n" in r.stderr, r.stderr


MLP = """[model]
name = mlp
width = 32
[data]
kind = synthetic
height = 8
width = 8
channels = 1
classes = 10
train_limit = 512
test_limit = 64
[optim]
lr = 0.05
schedule = constant
[train]
batch_size = 32
epochs = 1
log_interval = 2
[snapshot]
every = 4
"""


def inspect(ddpworker, snap):
    latest = (snap / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap / latest)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout
    return latest, dict(re.findall(r"^([a-z ]+):\s+(.*)$", r.stdout, re.M))


def test_a_finished_run_is_not_trained_again_unless_asked_for_more(ddprun, ddpworker, tmp_path):
    conf = tmp_path / "mlp.conf"
    conf.write_text(MLP)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    common = [f"snapshot.dir={snap}", f"train.metrics_file={metrics}"]
    r = run(ddpworker, conf, *common)                               # 16 steps, one epoch
    assert r.returncode == 0, r.stderr
    latest, fields = inspect(ddpworker, snap)
    assert fields["step"].startswith("16 ") and fields["finished"].startswith("yes"), fields
    # one epoch numbering: inspect, the progress lines, the final event (and below the messages)
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert fields["epoch"] == "1" and final["epoch"] == 1 and "epoch 1  step 16" in r.stdout, fields
    before = metrics.read_bytes()
    # the same command again: nothing trained, nothing appended, no snapshot written
    r = run(ddpworker, conf, *common)
    assert r.returncode == 0, r.stderr
    assert f"ddpworker: already finished at step 16, epoch 1 (snapshot.dir {snap})" in r.stdout, \
        r.stdout
    assert "resuming" not in r.stdout and "step 17" not in r.stdout, r.stdout
    assert metrics.read_bytes() == before and inspect(ddpworker, snap)[0] == latest
    # under ddprun on another world size too (the snapshot was saved by 1 rank)
    job = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", str(conf), *common],
                         capture_output=True, text=True, timeout=300, env=clean_env())
    assert job.returncode == 0, job.stdout + job.stderr
    assert "already finished at step 16, epoch 1" in job.stdout, job.stdout
    assert metrics.read_bytes() == before and inspect(ddpworker, snap)[0] == latest
    # asked for more: a second epoch continues from the finished one, and finishes in turn
    r = run(ddpworker, conf, *common, "train.epochs=2")
    assert r.returncode == 0, r.stderr
    assert "that run had finished, train.conf now asks for more" in r.stdout, r.stdout
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "train"]
    assert steps[-8:] == [18, 20, 22, 24, 26, 28, 30, 32], steps
    assert events[-1]["event"] == "final" and events[-1]["step"] == 32, events[-1]
    assert "resuming from" in r.stdout and "step 16, epoch 1, 512 samples into it" in r.stdout
    _, fields = inspect(ddpworker, snap)
    assert fields["step"].startswith("32 ") and fields["finished"].startswith("yes"), fields
    assert fields["epoch"] == "2" and events[-1]["epoch"] == 2 and "epoch 2  step 32" in r.stdout


FOLDER_CONF = """[model]
name = mlp
width = 16
[data]
kind = imagefolder
dir = {root}
image_size = 16
workers = 1
[train]
batch_size = 16
epochs = 2
log_interval = 5
best_by = val_loss
"""


def test_without_a_test_split_the_final_evaluation_is_labelled_val(ddprun, ddpworker, tmp_path):
    """An image folder without test/: the final evaluation runs on val, the split that chose the
    best weights; the final event, stdout and `ddprun plot` call it val and say so."""
    make = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                        "make_jpeg_folder.py")
    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        pytest.skip("no Debian Fashion-MNIST")
    root = tmp_path / "folder"
    r = subprocess.run(["/usr/bin/python3", make, str(root), "--per-class", "4",
                        "--val-per-class", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    conf = tmp_path / "folder.conf"
    conf.write_text(FOLDER_CONF.format(root=root))
    metrics = tmp_path / "m.jsonl"
    r = run(ddpworker, conf, f"train.best_file={tmp_path / 'best.safetensors'}",
            f"train.metrics_file={metrics}")
    assert r.returncode == 0, r.stdout + r.stderr
    final = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert final["event"] == "final" and final["split"] == "val" and final["weights"] == "best"
    assert final["chosen_on"] == "val" and final["split_chose_weights"] is True, final
    assert "the final evaluation is on val, the split that also chose these weights" in r.stdout
    out = tmp_path / "c.csv"
    p = subprocess.run([ddprun, "plot", str(metrics), "--csv", str(out)], capture_output=True,
                       text=True, timeout=120, env=clean_env())
    assert p.returncode == 0, p.stderr
    series = {row["series"] for row in csv.DictReader(open(out))}
    assert {"final_val_loss", "final_val_top1"} <= series, series
    assert not any("test" in s for s in series), series


def man_blocks(page, key):
    """The .nf/.fi examples of the paragraph of key in a man page, as plain text."""
    text = open(os.path.join(ROOT, "docs", page)).read()
    para = text.split(f".B {key}\n", 1)[1].split("\n.TP\n", 1)[0]
    return [textwrap.dedent(b.replace("\\-", "-"))
            for b in re.findall(r"^\.nf\n(.*?)^\.fi\n", para, re.S | re.M)]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_documented_numpy_only_vgg19_bn_file_loads(ddpworker, tmp_path):
    """train.conf(5)'s model.init recipe as a user runs it, with Debian's torch 1.13 and
    torchvision 0.14 and no safetensors package: a VGG-19-BN of model.width 16 and fc_width 512
    built from torchvision's parts, saved with numpy alone, loads into ddpworker strictly."""
    torch_python = "/usr/bin/python3"
    if subprocess.run([torch_python, "-c", "import torchvision"], capture_output=True).returncode:
        pytest.skip("/usr/bin/python3 has no torchvision")
    blocks = man_blocks("train.conf.5", "model.init")
    assert len(blocks) == 3, blocks
    save, build = blocks[1], blocks[2]
    assert 'weights="DEFAULT"' in save and "numpy()" in save
    # no network here: the model the third example builds stands for the pretrained one
    script = "import torch\n" + build + "\n" + "\n".join(
        "state = model.state_dict()" if line.startswith("state = ") else line
        for line in save.splitlines())
    r = subprocess.run([torch_python, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    conf = tmp_path / "vgg.conf"
    conf.write_text(VGG)
    r = run(ddpworker, conf, "model.name=vgg19_bn", "model.width=16", "model.fc_width=512",
            "data.height=224", "data.width=224", "data.classes=20", "data.test_limit=2",
            "train.batch_size=2", "train.max_steps=0", f"model.init={tmp_path / 'vgg19_bn.safetensors'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loaded 118 of the model's 118 tensors\n" in r.stderr, r.stderr
