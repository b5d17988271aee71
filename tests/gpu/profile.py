#!/usr/bin/env python3
"""Where a ddpworker training step spends GPU time: runs a short synthetic run under Nsight Compute
(ncu, one metric: each kernel's duration), sums the durations of the last timed step by kernel name
and prints the top of the table.

Usage: python3 tests/gpu/profile.py [--model resnet18] [--batch 512] [--precision fp32] [--out DIR]
"""
import argparse
import collections
import csv
import io
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--shape", default="32,32,3")
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    h, w, c = (int(v) for v in args.shape.split(","))
    build = os.environ.get("DDP_BUILD_DIR", os.path.join(ROOT, "build"))
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "profile.conf")
        with open(conf, "w") as f:
            f.write(f"[model]\nname = {args.model}\nwidth = {args.width}\n"
                    f"[data]\nkind = synthetic\nheight = {h}\nwidth = {w}\nchannels = {c}\n"
                    f"classes = 10\ntrain_limit = {args.batch * 2}\ntest_limit = {args.batch}\n"
                    f"[train]\nbackend = cuda\nbatch_size = {args.batch}\nmax_steps = 2\neval_interval = 1000\n"
                    f"[precision]\nmode = {args.precision}\n")
        run = subprocess.run(["ncu", "--csv", "--metrics", "gpu__time_duration.sum",
                              os.path.join(build, "worker", "ddpworker"), conf],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    raw = os.path.join(args.out, f"ncu_{args.model}_{args.precision}.csv")
    with open(raw, "w") as f:
        f.write(run.stdout)
    rows = [r for r in csv.DictReader(io.StringIO("\n".join(
        line for line in run.stdout.splitlines() if line.startswith('"'))))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        print(run.stdout[-3000:])
        sys.exit("profile.py: ncu reported no kernels")
    # The step boundary: the SGD kernel ends each training step; keep the launches of step 2.
    ends = [i for i, r in enumerate(rows) if "sgd" in r["Kernel Name"]]
    step = rows[ends[-2] + 1:ends[-1] + 1] if len(ends) >= 2 else rows
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    total = collections.Counter()
    count = collections.Counter()
    for r in step:
        name = r["Kernel Name"][:90]
        total[name] += float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0)
        count[name] += 1
    step_us = sum(total.values())
    print(f"{args.model} w{args.width} batch {args.batch} {args.precision}: {len(step)} kernels, "
          f"{step_us / 1e3:.2f} ms of GPU time in one step -> {args.batch / step_us * 1e6:.0f} img/s bound")
    for name, us in total.most_common(args.top):
        print(f"{us:9.1f} us {100 * us / step_us:5.1f}% x{count[name]:<4} {name}")


if __name__ == "__main__":
    main()
