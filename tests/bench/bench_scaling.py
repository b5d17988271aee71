#!/usr/bin/env python3
"""The scaling report: the same train.conf at 1, 2 and 4 ranks (ddprun --standalone),
the learning rate scaled by the run's rule, and one table of what a user compares.

    tests/bench/bench_scaling.py CONF [--ranks 1,2,4] [--lr-scaling sqrt] [section.key=value ...]

Columns per world size: learning rate (after optim.lr_scaling, as the worker applied it), global
batch, steps per epoch, average epoch time, epochs run, scaling efficiency (epoch time at 1 rank /
(epoch time here x ranks): 1.0 is linear), best validation loss (validations on the val split:
set data.val_split for datasets without one), test loss and top-1 (the final event: the best
weights with train.best_by). Figures come from each run's metrics file (start, epoch, eval and
final events). Runs one after another on this machine: with fewer cores than ranks the ranks share
them, and the efficiency says so."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_paths import build_path  # noqa: E402


def run(ddprun, conf, ranks, overrides, workdir):
    metrics = os.path.join(workdir, f"metrics-{ranks}.jsonl")
    cmd = [ddprun, "--standalone", "--nproc-per-node", str(ranks), conf,
           f"train.metrics_file={metrics}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_scaling: {ranks} ranks failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in open(metrics)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("conf")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--lr-scaling", default=None, choices=["none", "linear", "sqrt"],
                    help="optim.lr_scaling for every run (default: the conf's)")
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args()
    ddprun = build_path("launcher", "ddprun")
    overrides = list(args.overrides)
    if args.lr_scaling:
        overrides.append(f"optim.lr_scaling={args.lr_scaling}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as workdir:
        for ranks in [int(x) for x in args.ranks.split(",")]:
            events = run(ddprun, args.conf, ranks, overrides, workdir)
            start = [e for e in events if e["event"] == "start"][0]
            epochs = [e for e in events if e["event"] == "epoch"]
            if not epochs:
                sys.exit(f"bench_scaling: {ranks} ranks ran no whole epoch: set train.epochs")
            evals = [e["loss"] for e in events
                     if e["event"] == "eval" and e["split"] == "val" and e["loss"] is not None]
            final = [e for e in events if e["event"] == "final"][-1]
            rows.append({
                "ranks": ranks, "lr": start["lr"], "global_batch": start["global_batch"],
                "steps_per_epoch": start["steps_per_epoch"],
                "epoch_s": sum(e["wall_s"] for e in epochs) / len(epochs),
                "epochs": len(epochs), "best_val_loss": min(evals) if evals else None,
                "test_loss": final["loss"], "top1": final["top1"], "split": final["split"],
                "weights": final["weights"],
            })
    base = rows[0]["epoch_s"] * rows[0]["ranks"]
    for r in rows:
        r["efficiency"] = base / (r["epoch_s"] * r["ranks"]) if r["epoch_s"] else 0

    def line(label, fmt):
        return f"| {label:<24} | " + " | ".join(f"{fmt(r):>9}" for r in rows) + " |"
    print("| " + " " * 24 + " | " + " | ".join(f"{str(r['ranks']) + ' rank' + ('s' if r['ranks'] > 1 else ''):>9}" for r in rows) + " |")
    print("|" + "---|" * (len(rows) + 1))
    print(line("Learning rate", lambda r: f"{r['lr']:.4g}"))
    print(line("Global batch size", lambda r: str(r["global_batch"])))
    print(line("Steps per epoch", lambda r: str(r["steps_per_epoch"])))
    print(line("Avg epoch time (s)", lambda r: f"{r['epoch_s']:.2f}"))
    print(line("Epochs", lambda r: str(r["epochs"])))
    print(line("Scaling efficiency", lambda r: f"{r['efficiency']:.2f}"))
    print(line("Best validation loss", lambda r: "-" if r["best_val_loss"] is None
               else f"{r['best_val_loss']:.4f}"))
    print(line(f"{rows[0]['split'].capitalize()} loss", lambda r: f"{r['test_loss']:.4f}"))
    print(line(f"Top-1 {rows[0]['split']} accuracy", lambda r: f"{100 * r['top1']:.2f}%"))
    print(f"\n{os.cpu_count()} cores; the final figures are of the {rows[0]['weights']} weights;"
          f" best validation loss over the val split's validations ('-': no val split)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
