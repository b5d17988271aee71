"""`ddprun plot`: a real ddpworker metrics file and a hand-written one (no "time", a null loss, a
line that is not JSON, a resume that replays steps) drawn on one chart as PNG and SVG, and the same
series as CSV: one set per run, the values those of the files, the restart marked, the bad line
reported with its file and line."""
import csv
import json
import os
import subprocess

import pytest

from conftest import clean_env

def at(seconds):
    return f"2026-11-25T10:{seconds // 60:02d}:{seconds % 60:02d}.000Z"


HANDWRITTEN = [  # the first two lines without "time", as older files
    {"event": "train", "step": 5, "epoch": 1, "loss": 2.5, "lr": 0.1, "img_per_s": 100},
    {"event": "train", "step": 10, "epoch": 1, "loss": None, "lr": 0.1, "img_per_s": 100},
    "this line is not JSON",
    {"event": "eval", "time": at(0), "split": "val", "loss": 1.5, "top1": 0.4, "top5": 0.9,
     "step": 10, "epoch": 1, "samples": 20},
    {"event": "epoch", "time": at(0), "epoch": 1, "step": 10, "wall_s": 1.0, "img_per_s": 100,
     "split": "val", "val_loss": 1.5, "val_top1": 0.4, "val_top5": 0.9},
    {"event": "train", "time": at(10), "step": 15, "epoch": 2, "loss": 1.25, "lr": 0.1,
     "img_per_s": 100},
    # killed after step 15; resumed from the snapshot of step 10: step 15 again
    {"event": "train", "time": at(70), "step": 15, "epoch": 2, "loss": 1.25, "lr": 0.1,
     "img_per_s": 100},
    {"event": "train", "time": at(80), "step": 20, "epoch": 2, "loss": 1.0, "lr": 0.1,
     "img_per_s": 100},
    {"event": "eval", "time": at(81), "split": "val", "loss": 1.0, "top1": 0.6, "top5": 0.95,
     "step": 20, "epoch": 2, "samples": 20},
    {"event": "final", "time": at(82), "split": "test", "loss": 1.1, "top1": 0.55, "top5": 0.9,
     "step": 20, "epoch": 2, "samples": 20, "weights": "last"},
]


@pytest.fixture(scope="module")
def metrics(ddpworker, tmp_path_factory):
    """(real run's file, hand-written file)"""
    d = tmp_path_factory.mktemp("plot")
    real = d / "real.jsonl"
    conf = d / "train.conf"
    conf.write_text("[train]\nseed = 3\n")
    r = subprocess.run([ddpworker, str(conf), "data.kind=synthetic", "data.height=8",
                        "data.width=8", "data.channels=1", "data.train_limit=64",
                        "data.test_limit=16", "data.val_split=0.25", "model.name=mlp",
                        "model.width=8", "train.batch_size=8", "train.epochs=2",
                        "train.log_interval=2", f"train.metrics_file={real}"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    hand = d / "hand.jsonl"
    hand.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n"
                            for e in HANDWRITTEN))
    return real, hand


def plot(ddprun, *args):
    return subprocess.run([ddprun, "plot", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=clean_env())


def has_matplotlib():
    python = os.environ.get("DDPRUN_PYTHON") or "/usr/bin/python3"
    return subprocess.run([python, "-c", "import matplotlib"], capture_output=True).returncode == 0


def test_csv_has_every_series_of_every_run(ddprun, metrics, tmp_path):
    real, hand = metrics
    out = tmp_path / "curves.csv"
    r = plot(ddprun, real, hand, "--csv", out, "--label", "real run", "--label", "hand")
    assert r.returncode == 0, r.stderr
    assert f"{hand}:3: not JSON" in r.stderr, r.stderr
    rows = list(csv.DictReader(open(out)))
    series = {(row["run"], row["series"]) for row in rows}
    for run in ("real run", "hand"):
        for s in ("train_loss", "val_loss", "val_top1", "final_test_loss", "final_test_top1"):
            assert (run, s) in series, f"{run} lacks {s}: {sorted(series)}"
    # the real run's figures are its file's
    events = [json.loads(line) for line in open(real)]
    evals = [e for e in events if e["event"] == "eval"]
    real_rows = [row for row in rows if row["run"] == "real run"]
    assert [float(row["value"]) for row in real_rows if row["series"] == "val_top1"] == \
        [e["top1"] for e in evals]
    assert all(row["time_s"] for row in real_rows)
    trains = [e for e in events if e["event"] == "train"]
    got = [(int(row["step"]), float(row["value"])) for row in rows
           if row["run"] == "real run" and row["series"] == "train_loss"]
    assert got == [(e["step"], e["loss"]) for e in trains]
    # the hand-written run: null loss kept as an empty value, epochs placed by the epochs' ends
    # (the second as long as the first), times from its first "time" (none before it),
    # validation from its "eval" events only (not again from "epoch"), the replayed step a restart
    hand_rows = [row for row in rows if row["run"] == "hand"]
    train = [(row["epoch"], row["time_s"], row["step"], row["value"]) for row in hand_rows
             if row["series"] == "train_loss"]
    assert train == [("0.5", "", "5", "2.5"), ("1.0", "", "10", ""), ("1.5", "10.0", "15", "1.25"),
                     ("1.5", "70.0", "15", "1.25"), ("2.0", "80.0", "20", "1.0")], train
    val = [(row["epoch"], row["time_s"], row["value"]) for row in hand_rows
           if row["series"] == "val_top1"]
    assert val == [("1.0", "0.0", "0.4"), ("2.0", "81.0", "0.6")], val
    restarts = [(row["epoch"], row["time_s"], row["step"]) for row in hand_rows
                if row["series"] == "restart"]
    assert restarts == [("1.5", "70.0", "15")], restarts


def test_one_restart_is_one_restart_line(ddprun, tmp_path):
    """A resumed start event followed by the steps it replays is one restart, not two."""
    lines = [{"event": "start", "time": at(0), "step": 0, "epoch": 1, "resumed": False},
             {"event": "train", "time": at(5), "step": 5, "epoch": 1, "loss": 2.0},
             {"event": "train", "time": at(10), "step": 10, "epoch": 1, "loss": 1.5},
             # killed after step 10; resumed from the snapshot of step 5: step 10 again
             {"event": "start", "time": at(20), "step": 5, "epoch": 1, "resumed": True,
              "restart_count": 1},
             {"event": "train", "time": at(25), "step": 10, "epoch": 1, "loss": 1.5},
             {"event": "train", "time": at(30), "step": 15, "epoch": 1, "loss": 1.0}]
    f = tmp_path / "restarted.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in lines))
    r = plot(ddprun, f, "--csv", tmp_path / "c.csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    restarts = [(row["time_s"], row["step"]) for row in rows if row["series"] == "restart"]
    assert restarts == [("20.0", "5")], restarts


def test_a_file_without_time_plots_against_epoch_only(ddprun, tmp_path):
    f = tmp_path / "old.jsonl"
    f.write_text(json.dumps(HANDWRITTEN[0]) + "\n" + json.dumps(HANDWRITTEN[1]) + "\n")
    r = plot(ddprun, f, "--csv", tmp_path / "c.csv")
    assert r.returncode == 0, r.stderr
    assert f"{f}: no \"time\"" in r.stderr, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert [row["epoch"] for row in rows] == ["0.5", "1.0"] and not any(r["time_s"] for r in rows)


@pytest.mark.parametrize("ext,magic", [("png", b"\x89PNG\r\n\x1a\n"), ("svg", b"<svg")])
def test_picture_of_two_runs(ddprun, metrics, tmp_path, ext, magic):
    if not has_matplotlib():
        pytest.skip("/usr/bin/python3 has no matplotlib (Debian: apt-get install "
                    "python3-matplotlib)")
    real, hand = metrics
    out = tmp_path / f"curves.{ext}"
    r = plot(ddprun, real, hand, "-o", out, "--csv", tmp_path / "c.csv", "--title", "two runs")
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert len(data) > 5000 and (data.startswith(magic) or magic in data[:2000]), data[:200]
    if ext == "svg":
        text = data.decode()
        for label in ("real", "hand", "two runs", "epoch", "top-1"):
            assert label in text, f"{label} is not in the SVG"
    assert (tmp_path / "c.csv").exists()


def test_usage_errors(ddprun, metrics, tmp_path):
    real, _ = metrics
    r = plot(ddprun, real)
    assert r.returncode == 2 and "nothing to write" in r.stderr, r.stderr
    r = plot(ddprun, real, "-o", tmp_path / "curves.gif")
    assert r.returncode == 2 and ".png, .svg or .pdf" in r.stderr, r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    r = plot(ddprun, empty, "--csv", tmp_path / "x.csv")
    assert r.returncode == 1 and "no training or validation figures" in r.stderr, r.stderr
    r = plot(ddprun, tmp_path / "missing.jsonl", "--csv", tmp_path / "x.csv")
    assert r.returncode == 1 and "missing.jsonl" in r.stderr, r.stderr
    r = subprocess.run([ddprun, "plot", real, "--csv", tmp_path / "x.csv"], capture_output=True,
                       text=True, env=clean_env(DDPRUN_PLOT_SCRIPT=str(tmp_path / "nope.py")))
    assert r.returncode == 1 and "DDPRUN_PLOT_SCRIPT" in r.stderr, r.stderr


def utc(stamp):
    import datetime
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_scaling_report_of_a_1_and_a_2_worker_run(ddprun, tmp_path):
    """`ddprun plot --table` over the metrics of real runs on 1 and 2 workers (sqrt lr scaling):
    per run the world size, global batch, lr after scaling, img/s, speed-up and efficiency against
    the 1-worker run, time to the best validation loss, that loss, the final top-1/top-5 with its
    split, and restarts; as Markdown on stdout and as CSV, the figures those of the files."""
    conf = tmp_path / "scale.conf"
    conf.write_text("[model]\nname = mlp\nwidth = 16\n[data]\nkind = synthetic\nheight = 8\n"
                    "width = 8\nchannels = 1\ntrain_limit = 512\ntest_limit = 64\n"
                    "val_split = 0.25\n[optim]\nlr = 0.05\nlr_scaling = sqrt\n[train]\n"
                    "batch_size = 16\nepochs = 2\nlog_interval = 2\nseed = 1\n")
    files = []
    for world in (1, 2):
        metrics = tmp_path / f"w{world}.jsonl"
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", str(world), str(conf),
                            f"train.metrics_file={metrics}"], capture_output=True, text=True,
                           timeout=300, env=clean_env())
        assert r.returncode == 0, r.stdout + r.stderr
        files.append(metrics)
    table_csv = tmp_path / "scaling.csv"
    r = plot(ddprun, *files, "--table", "--table-csv", table_csv)
    assert r.returncode == 0, r.stderr
    rows = {row["run"]: row for row in csv.DictReader(open(table_csv))}
    assert set(rows) == {"w1", "w2"}, rows
    want = {}
    for f in files:
        ev = [json.loads(line) for line in open(f)]
        start = ev[0]
        rates = sorted(e["img_per_s"] for e in ev if e["event"] == "train")
        evals = [e for e in ev if e["event"] == "eval"]
        best = min(evals, key=lambda e: e["loss"])
        want[f.stem] = {"world": start["world"], "batch": start["global_batch"], "lr": start["lr"],
                        "rate": rates[len(rates) // 2], "best": best["loss"],
                        "to_best": utc(best["time"]) - utc(start["time"]), "final": ev[-1]}
    assert want["w2"]["lr"] == pytest.approx(0.05 * 2 ** 0.5) and want["w1"]["lr"] == 0.05
    for name, w in want.items():
        row = rows[name]
        assert int(row["world_size"]) == w["world"] and int(row["global_batch"]) == w["batch"]
        assert float(row["lr"]) == w["lr"] and float(row["img_per_s"]) == w["rate"]
        assert float(row["best_val_loss"]) == w["best"] and row["validation_split"] == "val"
        assert float(row["time_to_best_s"]) == pytest.approx(w["to_best"], abs=1e-6)
        assert float(row["final_top1"]) == w["final"]["top1"]
        assert float(row["final_top5"]) == w["final"]["top5"]
        assert row["final_split"] == "test" and row["restarts"] == "0", row
    assert (int(rows["w1"]["world_size"]), int(rows["w2"]["world_size"])) == (1, 2)
    assert float(rows["w1"]["speedup"]) == 1.0 and float(rows["w1"]["efficiency"]) == 1.0
    speedup = want["w2"]["rate"] / want["w1"]["rate"]
    assert float(rows["w2"]["speedup"]) == pytest.approx(speedup)
    assert float(rows["w2"]["efficiency"]) == pytest.approx(speedup / 2)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| run | world size | global batch | lr (after scaling) | img/s | "
                               "speed-up | efficiency | time to best val loss (s) |"), r.stdout
    row2 = next(line for line in lines if line.startswith("| w2 |"))
    assert row2.startswith(f"| w2 | 2 | 32 | {0.05 * 2 ** 0.5:.6g} | {want['w2']['rate']:.0f} | "
                           f"{speedup:.2f} | {speedup / 2:.2f} |"), row2
    assert row2.endswith(" | test | 0 |"), row2
    assert "against w1 (world size 1)" in r.stdout, r.stdout
