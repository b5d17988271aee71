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
--rows runs the standard GPU workloads (ROWS below), each with its own model, shape and batch (resnet18-cifar:
ResNet-18 w64 on 32x32x3, batch 512; resnet50-128: ResNet-50 w64 with the ImageNet stem on
128x128x3, 1000 classes, batch 256), and ends with one line per row and precision:
  RESULT <row> <precision> ddpworker=<img/s> torch_eager=<img/s> torch_compile=<img/s> ratio=<ddpworker/eager>
resnet18-128-jpeg is ddpworker against itself: ResNet-18 (ImageNet stem) at 128 px, batch 256, 10
classes, reading a JPEG folder (tests/tools/make_jpeg_folder.py, sides --jpeg-sides, enough images
that no epoch ends inside the timed windows; RandomResizedCrop + flip to 128 px, decoded on all the
host's cores: data.workers 0) against the same run on synthetic data:
  RESULT resnet18-128-jpeg <precision> ddpworker_jpeg=<img/s> ddpworker_synthetic=<img/s> ratio=<jpeg/synthetic>
and, once per folder, the loader alone on every core (tests/bench/bench_loader, no training): what
the host can feed at most.
--backend cpu runs ddpworker's cpu backend and no PyTorch (fp32 only): a check of this harness
on a machine without a GPU, with --width, --row-batch and --steps small.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
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
# --rows: name -> (model, shape, batch); the jpeg row: data from a JPEG folder against synthetic
ROWS = {"resnet18-cifar": ("resnet18", "cifar", 512), "resnet50-128": ("resnet50", "i128", 256),
        "resnet18-128-jpeg": ("resnet18", "jpeg128", 256)}
SHAPES["jpeg128"] = ((128, 128, 3), 10)  # the folder's 10 classes (Fashion-MNIST's)
JPEG_ROWS = {"resnet18-128-jpeg"}


def make_jpeg_folder(root, images, sides, parts):
    """root/train/<class>/ with at least `images` training images (and a small val/), made by
    `parts` make_jpeg_folder.py processes at once (seeds 0..parts-1, each into its own folder,
    then moved under one root: a throughput bench does not mind repeated items). Kept across runs
    when root is given and complete."""
    done = os.path.join(root, ".complete")
    if os.path.exists(done) and int(open(done).read() or 0) >= images:
        return
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    tool = os.path.join(ROOT, "tests", "tools", "make_jpeg_folder.py")
    per_class = -(-images // (10 * parts)) + 1

    def one(k):
        part = os.path.join(root, f".part{k}")
        subprocess.run([sys.executable, tool, part, "--per-class", str(per_class), "--val-per-class",
                        "5", "--sides", sides, "--seed", str(k)], check=True)
        return part

    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        made = list(pool.map(one, range(parts)))
    for k, part in enumerate(made):
        for split in ("train", "val"):
            for cls in os.listdir(os.path.join(part, split)):
                dst = os.path.join(root, split, cls)
                os.makedirs(dst, exist_ok=True)
                for name in os.listdir(os.path.join(part, split, cls)):
                    os.rename(os.path.join(part, split, cls, name), os.path.join(dst, f"{k:02d}_{name}"))
        shutil.rmtree(part)
    with open(done, "w") as f:
        f.write(str(per_class * parts * 10))


def run_ddpworker(shape, model, width, precision, batch, steps, backend="cuda", jpeg_dir=None):
    """The second of two windows of `steps` steps: the first is its warm-up. jpeg_dir: the
    samples come from that image folder (random-resized-crop to the shape's side, decoded on all
    cores), else synthetic."""
    (h, w, c), classes = SHAPES[shape]
    if jpeg_dir:
        data = (f"kind = imagefolder\ndir = {jpeg_dir}\nimage_size = {h}\n"
                f"train_transform = random-resized-crop\nworkers = 0\n")
        model_extra = "stem = imagenet\n"
    else:
        data = (f"kind = synthetic\nheight = {h}\nwidth = {w}\nchannels = {c}\n"
                f"classes = {classes}\ntrain_limit = {batch * 2 * steps}\ntest_limit = {batch}\n")
        model_extra = "stem = imagenet\n" if shape == "jpeg128" else ""
    with tempfile.TemporaryDirectory() as tmp:
        conf, metrics = os.path.join(tmp, "bench.conf"), os.path.join(tmp, "metrics.jsonl")
        with open(conf, "w") as f:
            f.write(f"[model]\nname = {model}\nwidth = {width}\n{model_extra}"
                    f"[data]\n{data}"
                    f"[optim]\nlr = 0.01\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.0005\n"
                    f"schedule = constant\n"
                    f"[train]\nbackend = {backend}\nbatch_size = {batch}\nmax_steps = {2 * steps}\n"
                    f"epochs = 1000\n"
                    f"log_interval = {steps}\nmetrics_file = {metrics}\neval_interval = 1000000000\n"
                    f"[precision]\nmode = {precision}\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        run = subprocess.run([build_path("worker", "ddpworker"), conf], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if run.returncode != 0:
            print(run.stdout[-2000:], file=sys.stderr)
            return None
        windows = [json.loads(line) for line in open(metrics) if '"train"' in line]
        if not windows or windows[-1]["step"] != 2 * steps:  # an epoch (the data) ended first
            print(f"ddpworker stopped at step {windows[-1]['step'] if windows else 0} of "
                  f"{2 * steps}: too few samples", file=sys.stderr)
            return None
        check_window_clock(windows[-2:], batch * steps)
        return windows[-1]["img_per_s"]


def loader_rate(root, size, batch):
    """img/s of the image-folder loader alone on root (tests/bench/bench_loader: every core
    decoding and cropping one epoch, nothing trained): what the host can feed at most. None when
    the tool is not built."""
    tool = build_path("tests", "bench", "bench_loader")
    if not os.access(tool, os.X_OK):
        return None
    r = subprocess.run([tool, root, str(size), str(batch), str(os.cpu_count() or 1), "1", "rrc"],
                       capture_output=True, text=True, timeout=600)
    found = r.stdout.split()
    if r.returncode != 0 or len(found) != 4:
        print(f"bench_loader failed: {r.stderr.strip()}", file=sys.stderr)
        return None
    return int(found[1]) / float(found[3])


def event_time(event):
    """An event's "time" (ISO 8601 UTC, milliseconds) in seconds."""
    stamp = datetime.datetime.strptime(event["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    return stamp.replace(tzinfo=datetime.timezone.utc).timestamp()


def check_window_clock(last_two, samples):
    """The worker's img/s against the wall clock between its last two "train" events (each written
    after the window's loss read-back): a window timed before that read-back measured only the
    host's launches (0.09 ms for a ResNet-18 step on the H200, 2026-11-28). Says so on stderr
    when they differ by more than 5%."""
    if len(last_two) != 2:
        return
    seconds = event_time(last_two[1]) - event_time(last_two[0])
    if seconds <= 0.05:  # the stamps' milliseconds would decide
        return
    wall = samples / seconds
    if abs(last_two[1]["img_per_s"] / wall - 1) > 0.05:
        print(f"ddpworker's window says {last_two[1]['img_per_s']:.0f} img/s, the wall clock "
              f"between its events {wall:.0f}: the worker's clock is off", file=sys.stderr)


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
    ap.add_argument("--rows", help="the standard workloads (ROWS) instead of --shapes/--model/--batch: "
                                   + ",".join(ROWS))
    ap.add_argument("--row-batch", type=int, help="--rows: this batch instead of each row's")
    ap.add_argument("--jpeg-sides", default="160-256",
                    help="resnet18-128-jpeg: the folder's image sides, LO-HI px (make_jpeg_folder.py)")
    ap.add_argument("--jpeg-dir", help="resnet18-128-jpeg: make (or reuse) the folder here and keep it")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: ddpworker's cpu backend, no PyTorch (checks this harness without a GPU)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.rows and any(r not in ROWS for r in args.rows.split(",")):
        ap.error("--rows: any of " + ",".join(ROWS))
    if args.backend == "cpu" and args.precisions != "fp32":
        ap.error("--backend cpu: --precisions fp32 only")
    what = (f"rows {args.rows}, width {args.width}" if args.rows else
            f"{args.model} width {args.width}, batch {args.batch}")
    if args.backend == "cuda":
        import torch
        versus = f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}"
    else:
        versus = "no PyTorch (cpu backend: a check of the harness)"
    print(f"ddpworker ({args.backend}) vs {versus}: "
          f"{what}, {args.steps} timed steps after {args.warmup} warm-up", flush=True)
    # (row name or None, model, shape, batch) for each configuration to time
    if args.rows:
        configs = [(name, m, shape, args.row_batch or b) for name in args.rows.split(",")
                   for m, shape, b in [ROWS[name]]]
    else:
        configs = [(None, args.model, shape, args.batch) for shape in args.shapes.split(",")]
    results = []
    tmp_jpeg = None
    for name, model, shape, batch in configs:
        jpeg_dir = None
        if name in JPEG_ROWS:
            jpeg_dir = args.jpeg_dir
            if not jpeg_dir:
                tmp_jpeg = tmp_jpeg or tempfile.mkdtemp(prefix="ddp-bench-jpeg-")
                jpeg_dir = tmp_jpeg
            t0 = time.monotonic()
            make_jpeg_folder(jpeg_dir, 2 * args.steps * batch + batch, args.jpeg_sides,
                             min(16, os.cpu_count() or 1))
            print(f"JPEG folder {jpeg_dir} ready in {time.monotonic() - t0:.1f} s", flush=True)
            loader_alone = loader_rate(jpeg_dir, SHAPES[shape][0][0], batch)
            print(f"the loader alone (bench_loader, {os.cpu_count()} threads, no training): "
                  f"{loader_alone or 0:.0f} img/s", flush=True)
        for precision in args.precisions.split(","):
            row = {"shape": shape, "precision": precision, "model": model, "batch": batch}
            if name:
                row["row"] = name
            if jpeg_dir:
                row["loader_alone"] = loader_alone
                row["ddpworker_jpeg"] = run_ddpworker(shape, model, args.width, precision, batch,
                                                      args.steps, args.backend, jpeg_dir)
                row["ddpworker"] = run_ddpworker(shape, model, args.width, precision, batch,
                                                 args.steps, args.backend)
                ok = row["ddpworker_jpeg"] and row["ddpworker"]
                row["ratio"] = row["ddpworker_jpeg"] / row["ddpworker"] if ok else None
                results.append(row)
                print(json.dumps(row), flush=True)
                continue
            if args.backend == "cuda":
                row["torch_eager"] = run_torch(shape, model, args.width, precision, batch,
                                               args.warmup, args.steps, False)
                if args.compile:
                    row["torch_compile"] = run_torch(shape, model, args.width, precision, batch,
                                                     args.warmup, args.steps, True)
            else:
                row["torch_eager"] = None
            row["ddpworker"] = run_ddpworker(shape, model, args.width, precision, batch,
                                             args.steps, args.backend)
            best = max((v for k, v in row.items() if k.startswith("torch") and v), default=None)
            row["ratio"] = row["ddpworker"] / best if row["ddpworker"] and best else None
            results.append(row)
            print(json.dumps(row), flush=True)
    if tmp_jpeg:
        shutil.rmtree(tmp_jpeg, ignore_errors=True)
    print(f"\n{'shape':7} {'prec':5} {'torch eager':>12} {'torch compile':>14} {'ddpworker':>10} {'ratio':>6}")
    for r in results:
        fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        if "ddpworker_jpeg" in r:  # against itself: jpeg in the eager column, synthetic as ddpworker
            print(f"{r['shape']:7} {r['precision']:5} {fmt(r['ddpworker_jpeg']):>12} {'(jpeg)':>14} "
                  f"{fmt(r['ddpworker']):>10} {ratio:>6}")
            continue
        print(f"{r['shape']:7} {r['precision']:5} {fmt(r['torch_eager']):>12} "
              f"{fmt(r.get('torch_compile')):>14} {fmt(r['ddpworker']):>10} {ratio:>6}")
    for r in results:
        if "row" not in r:
            continue
        fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        if "ddpworker_jpeg" in r:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
            print(f"RESULT {r['row']} {r['precision']} ddpworker_jpeg={fmt(r['ddpworker_jpeg'])} "
                  f"ddpworker_synthetic={fmt(r['ddpworker'])} ratio={ratio}")
            continue
        ok = r["ddpworker"] and r["torch_eager"]
        eager_ratio = f"{r['ddpworker'] / r['torch_eager']:.2f}" if ok else "-"
        print(f"RESULT {r['row']} {r['precision']} ddpworker={fmt(r['ddpworker'])} "
              f"torch_eager={fmt(r['torch_eager'])} torch_compile={fmt(r.get('torch_compile'))} "
              f"ratio={eager_ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "model": args.model, "width": args.width,
                       "backend": args.backend, "versus": versus, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
