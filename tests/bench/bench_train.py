#!/usr/bin/python3
"""Training throughput of ddpworker's CPU backend against PyTorch (Debian's torch 1.13, CPU), side
by side in one run: the same model definition (tests/interop/torch_models.py mirrors
worker/nn/model.c), the same synthetic input shape, batch, optimizer (SGD momentum 0.9, Nesterov,
weight decay 5e-4), fp32, and the same number of threads. Each side warms up for --steps steps,
then times --steps more; img/s = samples / seconds of those. Prints img/s and ddpworker/PyTorch.

ddpworker's figure is its own img/s over the timed window (from its metrics file); the PyTorch
loop is the plain one from the tutorials (zero_grad, forward, cross-entropy, backward, step).
ddpworker's cpu backend runs on oneDNN where it was built with it (the header says; the
environment's DDP_CPU_ONEDNN=0 measures the plain path). --repeat N alternates the two sides N
times per model and takes each side's median, so that a change in the machine's load lands on
both; the load average is printed before and after (on a shared machine it moves the figures).
--torch-passive runs the PyTorch side in a child with OMP_WAIT_POLICY=passive, as ddpworker runs
itself: on a loaded machine PyTorch's spinning OpenMP threads cost it more than the compute does.
--cpu also prints images per CPU-second of each side's timed steps (user + system time of all its
threads), which a shared machine moves far less than wall time: PyTorch's from its own process
over the timed loop; ddpworker's as the difference between a run of 2N steps and one of N steps
(the same start-up, warm-up and evaluation).

Usage: /usr/bin/python3 tests/bench/bench_train.py [--models cnn,resnet18] [--batch 64]
           [--steps 10] [--threads N] [--repeat N] [--torch-passive] [--cpu] [--json FILE]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from build_paths import build_path  # noqa: E402
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "interop"))

# model, width, (H, W, C), classes
SHAPES = {
    "mlp": ("mlp", 256, (28, 28, 1), 10),
    "cnn": ("cnn", 32, (28, 28, 1), 10),
    "resnet18": ("resnet18", 64, (32, 32, 3), 10),
    "resnet18-w16": ("resnet18", 16, (32, 32, 3), 10),
}


def cpu_seconds(who):
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def run_ddpworker(key, batch, steps, threads, max_steps=None):
    """(img/s of the last log window, the run's CPU seconds); max_steps: 2 * steps"""
    max_steps = max_steps or 2 * steps
    model, width, (h, w, c), classes = SHAPES[key]
    with tempfile.TemporaryDirectory() as tmp:
        conf, metrics = os.path.join(tmp, "bench.conf"), os.path.join(tmp, "metrics.jsonl")
        with open(conf, "w") as f:
            f.write(f"[model]\nname = {model}\nwidth = {width}\n"
                    f"[data]\nkind = synthetic\nheight = {h}\nwidth = {w}\nchannels = {c}\n"
                    f"classes = {classes}\ntrain_limit = {batch * 2 * steps}\ntest_limit = {batch}\n"
                    f"[optim]\nlr = 0.01\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.0005\n"
                    f"schedule = constant\n"
                    f"[train]\nbatch_size = {batch}\nmax_steps = {max_steps}\nlog_interval = {steps}\n"
                    f"threads = {threads}\nmetrics_file = {metrics}\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        cpu0 = cpu_seconds(resource.RUSAGE_CHILDREN)
        subprocess.run([build_path("worker", "ddpworker"), conf], check=True, stdout=subprocess.DEVNULL, env=env)
        cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
        windows = [json.loads(line) for line in open(metrics) if '"train"' in line]
        return windows[-1]["img_per_s"], cpu


def ddpworker_side(key, batch, steps, threads, with_cpu):
    """(img/s, img per CPU-second or None)"""
    wall, cpu_2n = run_ddpworker(key, batch, steps, threads)
    if not with_cpu:
        return wall, None
    _, cpu_n = run_ddpworker(key, batch, steps, threads, max_steps=steps)
    return wall, batch * steps / max(cpu_2n - cpu_n, 1e-9)


def run_torch(key, batch, steps, threads):
    import torch
    import torch_models
    model_name, width, (h, w, c), classes = SHAPES[key]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _ = torch_models.build(model_name, width, h, w, c, classes)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    x = torch.randn(batch, c, h, w)
    y = torch.randint(0, classes, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(steps):
        step()
    t0, cpu0 = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF)
    for _ in range(steps):
        step()
    t1, cpu1 = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF)
    return batch * steps / (t1 - t0), batch * steps / max(cpu1 - cpu0, 1e-9)


def run_torch_child(key, batch, steps, threads):
    """run_torch in a fresh interpreter with passive OpenMP waits (libgomp reads the variable
    when torch loads it)"""
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-only", key,
                        "--batch", str(batch), "--steps", str(steps), "--threads", str(threads)],
                       check=True, capture_output=True, text=True, env=env)
    wall, per_cpu = r.stdout.split()[-2:]
    return float(wall), float(per_cpu)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,resnet18")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--torch-passive", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--torch-only", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.torch_only:
        print(*run_torch(args.torch_only, args.batch, args.steps, args.threads))
        return
    torch_side = run_torch_child if args.torch_passive else run_torch
    import torch
    worker = build_path("worker", "ddpworker")
    libs = subprocess.run(["ldd", worker], capture_output=True, text=True).stdout
    path = ("plain (DDP_CPU_ONEDNN=0)" if os.environ.get("DDP_CPU_ONEDNN") == "0"
            else "oneDNN" if "libdnnl" in libs else "plain (built without oneDNN)")
    load0 = os.getloadavg()
    print(f"ddpworker (cpu backend: {path}) vs PyTorch {torch.__version__} (CPU), batch "
          f"{args.batch}, {args.threads} threads, {args.steps} timed steps after {args.steps} "
          f"warm-up, median of {args.repeat}"
          f"{'; PyTorch with OMP_WAIT_POLICY=passive' if args.torch_passive else ''}; "
          f"load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}")
    cpu_head = f" {'ddpworker img/CPU-s':>20} {'torch img/CPU-s':>16} {'ratio':>6}" if args.cpu else ""
    print(f"{'model':14} {'input':>9} {'ddpworker img/s':>16} {'torch img/s':>12} {'ratio':>6}"
          + cpu_head)
    results = []
    for key in args.models.split(","):
        ours, ref = [], []
        for _ in range(args.repeat):
            ours.append(ddpworker_side(key, args.batch, args.steps, args.threads, args.cpu))
            ref.append(torch_side(key, args.batch, args.steps, args.threads))
        o, r = statistics.median(x[0] for x in ours), statistics.median(x[0] for x in ref)
        h, w, c = SHAPES[key][2]
        row = {"model": key, "ddpworker_img_s": o, "torch_img_s": r, "ratio": o / r,
               "ddpworker_runs": ours, "torch_runs": ref}
        line = f"{key:14} {f'{h}x{w}x{c}':>9} {o:16.1f} {r:12.1f} {o / r:6.2f}"
        if args.cpu:
            oc, rc = statistics.median(x[1] for x in ours), statistics.median(x[1] for x in ref)
            row.update(ddpworker_img_cpu_s=oc, torch_img_cpu_s=rc, cpu_ratio=oc / rc)
            line += f" {oc:20.1f} {rc:16.1f} {oc / rc:6.2f}"
        print(line)
        results.append(row)
    load1 = os.getloadavg()
    print(f"load average after: {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "threads": args.threads, "backend": path,
                       "repeat": args.repeat, "torch_passive": args.torch_passive, "load_before": load0, "load_after": load1,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
