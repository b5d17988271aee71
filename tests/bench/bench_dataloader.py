#!/usr/bin/env python3
"""ddpworker's image-folder input pipeline (decode + augment, worker/loader/loader) against PyTorch's
DataLoader over torchvision's ImageFolder with the same transforms and the same number of workers,
on the same JPEG folder, in one run; prints both rates and the ratio.

    tests/bench/bench_dataloader.py [--root DIR] [--size 128] [--workers N] [--epochs 3]
        [--transform rrc|center] [--per-class 300] [--sides 40-96]

Without --root, a folder is made from Debian's Fashion-MNIST (tests/tools/make_jpeg_folder.py;
--sides 300-500 gives ImageNet's sizes, where decoding at a DCT scale pays).
Both sides produce normalized fp32 batches: ours with its antialiased resample, theirs with
PIL's (ImageFolder's default loader) then ToTensor and Normalize. Times include starting the
workers; the DataLoader's are persistent across epochs, as ours are. Run with /usr/bin/python3."""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_paths import ROOT, build_path  # noqa: E402


def ours(root, size, batch, workers, epochs, transform):
    tool = build_path("tests", "bench", "bench_loader")
    r = subprocess.run([tool, root, str(size), str(batch), str(workers), str(epochs), transform],
                       capture_output=True, text=True, check=True)
    images, seconds = r.stdout.split()[1], r.stdout.split()[3]
    return int(images), float(seconds)


def theirs(root, size, batch, workers, epochs, transform):
    import torch
    import torchvision
    from torchvision import transforms as T
    torch.set_num_threads(1)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if transform == "rrc":
        tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    else:
        tf = T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.ToTensor(), norm])
    data = torchvision.datasets.ImageFolder(os.path.join(root, "train"), transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers,
                                         persistent_workers=workers > 0, prefetch_factor=2)
    images = 0
    start = time.monotonic()
    for _ in range(epochs):
        for x, _ in loader:
            images += x.shape[0]
    return images, time.monotonic() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--transform", choices=["rrc", "center"], default="rrc")
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--sides", default="40-96", help="image sides of the generated folder, LO-HI")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dataloader-") as tmp:
        root = args.root
        if not root:
            root = os.path.join(tmp, "folder")
            subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "tests", "tools",
                                                              "make_jpeg_folder.py"), root,
                            "--per-class", str(args.per_class), "--val-per-class", "1",
                            "--sides", args.sides], check=True)
        a = ours(root, args.size, args.batch, args.workers, args.epochs, args.transform)
        b = theirs(root, args.size, args.batch, args.workers, args.epochs, args.transform)
    ra, rb = a[0] / a[1], b[0] / b[1]
    print(f"images {a[0]} x {args.size}px, {args.transform}, {args.workers} workers, "
          f"batch {args.batch}, {args.epochs} epochs"
          + ("" if args.root else f", generated sides {args.sides} px"))
    print(f"ddpworker loader      {ra:9.0f} img/s  ({a[1]:.2f} s)")
    print(f"PyTorch DataLoader    {rb:9.0f} img/s  ({b[1]:.2f} s)")
    print(f"ratio ddpworker/PyTorch {ra / rb:.2f}x")


if __name__ == "__main__":
    main()
