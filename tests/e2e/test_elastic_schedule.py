"""The learning-rate schedule of a run resumed at another world size (elastic scale-down or
scale-up) goes on from where the run is: an epoch's decays and the cosine are read from the epoch
and the samples trained, not from the step count, which another world size reaches at another
rate. Before, a run of 4 ranks resumed by 2 after 2 epochs of a step schedule decayed one epoch
late (the 2 ranks' steps 16-31 are its third epoch, which the 4 ranks' step count called the
second)."""
import json
import subprocess

from conftest import clean_env

CONF = """[model]
name = mlp
width = 8
[data]
kind = synthetic
height = 4
width = 4
channels = 1
train_limit = 512
test_limit = 32
[train]
batch_size = 16
epochs = 4
log_interval = 1
metrics_file = {metrics}
[optim]
lr = 0.1
schedule = step
step_every_epochs = 1
step_gamma = 0.5
[snapshot]
dir = {snap}
every = 4
"""


def test_a_resume_at_another_world_size_keeps_the_schedule_of_its_epochs(ddprun, tmp_path):
    metrics = tmp_path / "m.jsonl"
    conf = tmp_path / "c.conf"
    conf.write_text(CONF.format(metrics=metrics, snap=tmp_path / "snap"))

    def run(nproc, *overrides):
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", str(nproc), str(conf),
                            *overrides], capture_output=True, text=True, timeout=300,
                           env=clean_env())
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    run(4, "train.epochs=2")
    out = run(2)
    assert "saved by 4 ranks, now 2" in out, out
    steps = [json.loads(line) for line in open(metrics)]
    steps = [e for e in steps if e["event"] == "train"]
    assert {e["epoch"] for e in steps} == {1, 2, 3, 4}, steps
    for e in steps:  # StepLR per epoch: 0.1, 0.05, 0.025, 0.0125, whatever the world
        assert abs(e["lr"] - 0.1 * 0.5 ** (e["epoch"] - 1)) < 1e-12, e
