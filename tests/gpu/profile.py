#!/usr/bin/env python3
"""Where a ddpworker training step spends GPU time, as the bench runs it: a short synthetic run
(the bench's SGD settings) whose first --warmup steps run unprofiled (cuDNN's timed algorithm search
among them, so the convolutions are the algorithms the bench uses, not the ones a profiler's
replays make look fastest), then --steps steps inside the profiler's capture range (DDP_CUDA_PROFILE:
the cuda backend calls cudaProfilerStart/Stop at those steps' forwards). Prints one table:
kernel, ms per step, share of the step's kernel time.

  --tool nsys (default when nsys is on PATH): Nsight Systems, kernels as they ran (real clocks,
      concurrency); --capture-range=cudaProfilerApi.
  --tool ncu: Nsight Compute, one metric (gpu__time_duration.sum) with --profile-from-start off,
      clocks and caches left alone (--clock-control none --cache-control none); kernels serialized.

Usage: python3 tests/gpu/profile.py [--model resnet18] [--batch 512] [--precision fp32]
           [--shape 32,32,3] [--classes 10] [--warmup 5] [--steps 3] [--tool nsys|ncu] [--out DIR]
       python3 tests/gpu/profile.py --parse-only FILE.csv --tool ncu|nsys --steps N   (the table of
           an earlier run's CSV; no GPU needed)
"""
import argparse
import collections
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
           "second": 1e6, "s": 1e6}


def write_conf(path, args, h, w, c):
    steps = args.warmup + args.steps + 1  # the forward after the last profiled step stops the range
    with open(path, "w") as f:
        f.write(f"[model]\nname = {args.model}\nwidth = {args.width}\n"
                f"[data]\nkind = synthetic\nheight = {h}\nwidth = {w}\nchannels = {c}\n"
                f"classes = {args.classes}\ntrain_limit = {args.batch * (steps + 1)}\n"
                f"test_limit = {args.batch}\n"
                f"[optim]\nlr = 0.01\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.0005\n"
                f"schedule = constant\n"
                f"[train]\nbackend = cuda\nbatch_size = {args.batch}\nmax_steps = {steps}\n"
                f"eval_interval = 100000\nlog_interval = {steps}\n"
                f"[precision]\nmode = {args.precision}\n")


def kernels_ncu(text):
    """(name, microseconds) for every kernel of an `ncu --csv` run."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith('"'))
    out = []
    for r in csv.DictReader(io.StringIO(lines)):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        out.append((r["Kernel Name"], value * UNIT_US.get(r["Metric Unit"], 1.0)))
    return out


def kernels_nsys(text):
    """(name, microseconds) per kernel name from `nsys stats -r cuda_gpu_kern_sum --format csv`
    (Total Time in ns; one row per name, its instance count in Instances)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Total Time" in line and "Name" in line), None)
    if start is None:
        return []
    out = []
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        total = next((v for k, v in r.items() if k and k.startswith("Total Time")), None)
        if not total or not r.get("Name"):
            continue
        out.append((r["Name"], float(total.replace(",", "")) * 1e-3, int(r.get("Instances", "1") or 1)))
    return out


def table(rows, steps, top, title):
    """rows: (name, us[, count]); prints kernel, ms per step, share."""
    total, count = collections.Counter(), collections.Counter()
    for r in rows:
        name = r[0][:100]
        total[name] += r[1]
        count[name] += r[2] if len(r) > 2 else 1
    step_us = sum(total.values()) / steps
    print(f"{title}: {sum(count.values()) // steps} kernels per step, {step_us / 1e3:.2f} ms of kernel "
          f"time per step (mean of {steps})")
    print("| kernel | ms per step | share | launches per step |")
    print("| --- | ---: | ---: | ---: |")
    for name, us in total.most_common(top):
        print(f"| {name.replace('|', '/')} | {us / steps / 1e3:.3f} | {100 * us / steps / step_us:.1f}% "
              f"| {count[name] / steps:g} |")
    rest = sum(us for name, us in total.most_common()[top:])
    if rest:
        print(f"| (the other {len(total) - top} kernels) | {rest / steps / 1e3:.3f} | "
              f"{100 * rest / steps / step_us:.1f}% | |")
    return step_us


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--shape", default="32,32,3")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (the algorithm search)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps; the table is their mean")
    ap.add_argument("--tool", choices=("nsys", "ncu"), default="nsys" if shutil.which("nsys") else "ncu")
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--parse-only", metavar="CSV", help="print the table of an earlier run's CSV")
    args = ap.parse_args()
    title = (f"{args.model} w{args.width} batch {args.batch} {args.precision} {args.shape} "
             f"({args.tool}, {args.steps} steps after {args.warmup})")
    parse = kernels_nsys if args.tool == "nsys" else kernels_ncu
    if args.parse_only:
        rows = parse(open(args.parse_only).read())
        if not rows:
            sys.exit(f"profile.py: no kernels in {args.parse_only}")
        table(rows, args.steps, args.top, title)
        return
    h, w, c = (int(v) for v in args.shape.split(","))
    build = os.environ.get("DDP_BUILD_DIR", os.path.join(ROOT, "build"))
    worker = os.path.join(build, "worker", "ddpworker")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["DDP_CUDA_PROFILE"] = f"{args.warmup + 1},{args.steps}"
    stem = os.path.join(os.path.abspath(args.out), f"{args.tool}_{args.model}_{args.precision}")
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "profile.conf")
        write_conf(conf, args, h, w, c)
        if args.tool == "ncu":
            cmd = ["ncu", "--csv", "--metrics", "gpu__time_duration.sum", "--profile-from-start", "off",
                   "--clock-control", "none", "--cache-control", "none", worker, conf]
        else:
            cmd = ["nsys", "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
                   "--trace=cuda", "--sample=none", "--cpuctxsw=none", "--force-overwrite=true",
                   "-o", stem, worker, conf]
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        text = run.stdout
        if args.tool == "nsys":
            stats = subprocess.run(["nsys", "stats", "--force-export=true", "-r", "cuda_gpu_kern_sum",
                                    "--format", "csv", stem + ".nsys-rep"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            text = stats.stdout
    raw = stem + ".csv"
    with open(raw, "w") as f:
        f.write(text)
    rows = parse(text)
    if run.returncode != 0 or not rows:
        print(run.stdout[-3000:])
        sys.exit(f"profile.py: {args.tool} rc {run.returncode}, {len(rows)} kernels (raw output: {raw})")
    table(rows, args.steps, args.top, title)


if __name__ == "__main__":
    main()
