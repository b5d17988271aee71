"""tests/bench/bench_scaling.py, the scaling table across world sizes, on a tiny synthetic run at 1 and 2
ranks: the figures come from the runs (the worker's own lr after optim.lr_scaling, the global batch,
steps per epoch, epochs, validation and test figures), so the report cannot drift from the worker."""
import json
import os
import subprocess

from conftest import ROOT, clean_env

CONF = """[model]
name = mlp
width = 16
[data]
kind = synthetic
height = 8
width = 8
channels = 1
train_limit = 256
test_limit = 64
val_split = 0.25
[optim]
lr = 0.05
schedule = constant
[train]
batch_size = 16
epochs = 2
best_by = val_loss
best_file = {best}
"""


def test_the_scaling_table_comes_from_the_runs(build_dir, tmp_path):
    conf = tmp_path / "tiny.conf"
    conf.write_text(CONF.format(best=tmp_path / "best.safetensors"))
    table = tmp_path / "table.json"
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "tests", "bench", "bench_scaling.py"),
                        str(conf), "--ranks", "1,2", "--lr-scaling", "linear", "--json", str(table)],
                       capture_output=True, text=True, timeout=300,
                       env=clean_env(DDP_BUILD_DIR=build_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(table.read_text())
    assert [row["ranks"] for row in rows] == [1, 2]
    assert [row["lr"] for row in rows] == [0.05, 0.1], "linear scaling, as the worker applied it"
    assert [row["global_batch"] for row in rows] == [16, 32]
    assert [row["steps_per_epoch"] for row in rows] == [12, 6], "192 samples left for training"
    assert all(row["epochs"] == 2 and row["epoch_s"] > 0 for row in rows), rows
    assert all(row["best_val_loss"] is not None and row["split"] == "test" for row in rows), rows
    assert all(row["weights"] == "best" and 0 <= row["top1"] <= 1 for row in rows), rows
    assert rows[0]["efficiency"] == 1.0
    for label in ("Learning rate", "Global batch size", "Steps per epoch", "Avg epoch time (s)",
                  "Scaling efficiency", "Best validation loss", "Test loss", "Top-1 test accuracy"):
        assert f"| {label}" in r.stdout, r.stdout
