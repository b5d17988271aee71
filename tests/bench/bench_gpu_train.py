#!/usr/bin/env python3
"""Training throughput on one GPU: ddpworker's cuda backend against PyTorch (2.x, CUDA), side by
side in one run. Same CIFAR-style network (tests/interop/torch_models.py mirrors worker/nn/model.c),
synthetic input, batch, SGD (momentum 0.9, Nesterov, weight decay 5e-4), precision.

PyTorch runs as its performance guides advise: channels_last, cudnn.benchmark, the batch already
on the GPU, autocast for bf16 and fp16 (fp16 with GradScaler), optionally torch.compile. fp32 is
strict fp32 (TF32 off) and tf32 allows TF32, on both sides. PyTorch warms up for --warmup steps,
ddpworker for one window of --steps steps; each then times --steps steps; img/s = samples / seconds of those (PyTorch: synchronized clock;
ddpworker: its own metrics window, which ends on a read-back of the loss, so it is synchronized).
The ratio is ddpworker over the best PyTorch variant (eager or compiled) at that precision.

Usage: python3 tests/bench/bench_gpu_train.py [--shapes cifar,fmnist] [--precisions fp32,bf16]
           [--batch 512] [--steps 50] [--warmup 20] [--compile] [--json FILE]
       python3 tests/bench/bench_gpu_train.py --rows resnet18-cifar,resnet50-128 --compile
           [--precisions bf16,fp16]
--rows runs the GPU issue's workloads, each with its own model, shape and batch (resnet18-cifar:
ResNet-18 w64 on 32x32x3, batch 512; resnet50-128: ResNet-50 w64 with the ImageNet stem on
128x128x3, 1000 classes, batch 256), and ends with one line per row and precision:
  RESULT <row> <precision> ddpworker=<img/s> torch_eager=<img/s> torch_compile=<img/s> ratio=<ddpworker/eager>
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from build_paths import build_path  # noqa: E402
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "interop"))

# name -> (H, W, C), classes
SHAPES = {"cifar": ((32, 32, 3), 10), "fmnist": ((28, 28, 1), 10), "i128": ((128, 128, 3), 1000)}
# --rows: name -> (model, shape, batch)
ROWS = {"resnet18-cifar": ("resnet18", "cifar", 512), "resnet50-128": ("resnet50", "i128", 256)}


def run_ddpworker(shape, model, width, precision, batch, steps):
    """The second of two windows of `steps` steps: the first is its warm-up."""
    (h, w, c), classes = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        conf, metrics = os.path.join(tmp, "bench.conf"), os.path.join(tmp, "metrics.jsonl")
        with open(conf, "w") as f:
            f.write(f"[model]\nname = {model}\nwidth = {width}\n"
                    f"[data]\nkind = synthetic\nheight = {h}\nwidth = {w}\nchannels = {c}\n"
                    f"classes = {classes}\ntrain_limit = {batch * 2 * steps}\n"
                    f"test_limit = {batch}\n"
                    f"[optim]\nlr = 0.01\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.0005\n"
                    f"schedule = constant\n"
                    f"[train]\nbackend = cuda\nbatch_size = {batch}\nmax_steps = {2 * steps}\n"
                    f"log_interval = {steps}\nmetrics_file = {metrics}\n"
                    f"[precision]\nmode = {precision}\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        run = subprocess.run([build_path("worker", "ddpworker"), conf], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if run.returncode != 0:
            print(run.stdout[-2000:], file=sys.stderr)
            return None
        windows = [json.loads(line) for line in open(metrics) if '"train"' in line]
        return windows[-1]["img_per_s"]


def run_torch(shape, model_name, width, precision, batch, warmup, steps, compiled):
    import torch
    import torch_models
    (h, w, c), classes = SHAPES[shape]
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    model, _ = torch_models.build(model_name, width, h, w, c, classes)
    model = model.cuda().to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    x = torch.randn(batch, c, h, w, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device="cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cifar,fmnist")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--precisions", default="fp32,tf32,bf16,fp16")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--rows", help="the GPU issue's rows instead of --shapes/--model/--batch: "
                                   + ",".join(ROWS))
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.rows and any(r not in ROWS for r in args.rows.split(",")):
        ap.error("--rows: any of " + ",".join(ROWS))
    import torch
    what = (f"rows {args.rows}, width {args.width}" if args.rows else
            f"{args.model} width {args.width}, batch {args.batch}")
    print(f"ddpworker (cuda) vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: "
          f"{what}, {args.steps} timed steps after {args.warmup} warm-up", flush=True)
    # (row name or None, model, shape, batch) for each configuration to time
    if args.rows:
        configs = [(name, *ROWS[name]) for name in args.rows.split(",")]
    else:
        configs = [(None, args.model, shape, args.batch) for shape in args.shapes.split(",")]
    results = []
    for name, model, shape, batch in configs:
        for precision in args.precisions.split(","):
            row = {"shape": shape, "precision": precision, "model": model, "batch": batch}
            if name:
                row["row"] = name
            row["torch_eager"] = run_torch(shape, model, args.width, precision, batch,
                                           args.warmup, args.steps, False)
            if args.compile:
                row["torch_compile"] = run_torch(shape, model, args.width, precision, batch,
                                                 args.warmup, args.steps, True)
            row["ddpworker"] = run_ddpworker(shape, model, args.width, precision, batch,
                                             args.steps)
            best = max(v for k, v in row.items() if k.startswith("torch") and v)
            row["ratio"] = row["ddpworker"] / best if row["ddpworker"] else None
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':7} {'prec':5} {'torch eager':>12} {'torch compile':>14} {'ddpworker':>10} {'ratio':>6}")
    for r in results:
        fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"{r['shape']:7} {r['precision']:5} {fmt(r['torch_eager']):>12} "
              f"{fmt(r.get('torch_compile')):>14} {fmt(r['ddpworker']):>10} {ratio:>6}")
    for r in results:
        if "row" not in r:
            continue
        fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        eager_ratio = f"{r['ddpworker'] / r['torch_eager']:.2f}" if r["ddpworker"] else "-"
        print(f"RESULT {r['row']} {r['precision']} ddpworker={fmt(r['ddpworker'])} "
              f"torch_eager={fmt(r['torch_eager'])} torch_compile={fmt(r.get('torch_compile'))} "
              f"ratio={eager_ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "model": args.model, "width": args.width,
                       "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
