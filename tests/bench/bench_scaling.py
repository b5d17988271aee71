#!/usr/bin/env python3
"""The scaling report of seed 002: the same train.conf at 1, 2 and 4 ranks (ddprun --standalone),
the learning rate scaled by the run's rule, and one table of what a user compares.

    tests/bench/bench_scaling.py CONF [--ranks 1,2,4] [--lr-scaling sqrt] [section.key=value ...]

Columns per world size: learning rate, global batch, steps per epoch, average epoch time, epochs
run, scaling efficiency (epoch time at 1 rank / (epoch time here x ranks): 1.0 is linear), best
validation loss, test loss and top-1 (the final event: the best weights with train.best_by).
Figures come from each run's metrics file (epoch, eval and final events)."""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_paths import build_path  # noqa: E402


def conf_value(conf_text, overrides, section, key, default):
    for o in overrides:
        if o.startswith(f"{section}.{key}="):
            return o.split("=", 1)[1]
    current = None
    for line in conf_text.splitlines():
        line = line.split(";")[0].strip()
        m = re.match(r"^\[(.+)\]$", line)
        if m:
            current = m.group(1).strip()
        elif current == section and "=" in line and line.split("=", 1)[0].strip() == key:
            return line.split("=", 1)[1].strip()
    return default


def run(ddprun, conf, ranks, overrides, workdir):
    metrics = os.path.join(workdir, f"metrics-{ranks}.jsonl")
    cmd = [ddprun, "--standalone", "--nproc-per-node", str(ranks), conf,
           f"train.metrics_file={metrics}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_scaling: {ranks} ranks failed ({r.returncode}):\n{r.stderr[-3000:]}")
    events = [json.loads(line) for line in open(metrics)]
    header = re.search(r"(\d+) steps/epoch", r.stdout)
    return events, int(header.group(1)) if header else 0


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
    text = open(args.conf).read()
    lr = float(conf_value(text, overrides, "optim", "lr", "0.1"))
    rule = conf_value(text, overrides, "optim", "lr_scaling", "none")
    batch = int(conf_value(text, overrides, "train", "batch_size", "128"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as workdir:
        for ranks in [int(x) for x in args.ranks.split(",")]:
            events, steps = run(ddprun, args.conf, ranks, overrides, workdir)
            epochs = [e for e in events if e["event"] == "epoch"]
            evals = [e["loss"] for e in events if e["event"] == "eval"
                     and e["loss"] is not None]
            final = [e for e in events if e["event"] == "final"][-1]
            factor = {"none": 1, "linear": ranks, "sqrt": math.sqrt(ranks)}[rule]
            rows.append({
                "ranks": ranks, "lr": lr * factor, "global_batch": batch * ranks,
                "steps_per_epoch": steps,
                "epoch_s": sum(e["wall_s"] for e in epochs) / len(epochs) if epochs else 0,
                "epochs": len(epochs), "best_val_loss": min(evals) if evals else None,
                "test_loss": final["loss"], "top1": final["top1"], "split": final["split"],
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
