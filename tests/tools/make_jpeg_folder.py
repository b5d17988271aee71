#!/usr/bin/env python3
"""An ImageNet-style JPEG folder made from Debian's Fashion-MNIST, for ddpworker's imagefolder
tests and benchmarks: ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg (optionally test/), the
ten classes named as Fashion-MNIST's, RGB (the grey item in a random tint: colour says nothing
of the class), upscaled to sides of
40-96 px (--sides LO-HI: e.g. 300-500 for ImageNet's sizes) at several aspect ratios, a few
grayscale JPEGs and PNGs, and with --broken N, N corrupt, truncated or non-image files among the
training images. Deterministic for a given --seed.

    make_jpeg_folder.py ROOT [--per-class 50] [--val-per-class 10] [--test] [--broken 3]
        [--sides 40-96]"""
import argparse
import gzip
import os
import random
import struct

import numpy as np
from PIL import Image

# Debian's, or where the GPU machine's carried copy lies (tests/gpu/run.sh sets DDP_DATA_DIR)
FASHION = os.environ.get("DDP_DATA_DIR", "/usr/share/datasets/fashion-mnist")
CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
           "ankle-boot"]
TINTS = [(255, 80, 80), (80, 255, 80), (80, 80, 255), (255, 255, 80), (255, 80, 255),
         (80, 255, 255), (255, 160, 80), (160, 80, 255), (200, 200, 200), (120, 255, 160)]


def read_idx(name):
    for path in (os.path.join(FASHION, name + ".gz"), os.path.join(FASHION, name)):
        if os.path.exists(path):
            data = (gzip.open if path.endswith(".gz") else open)(path, "rb").read()
            dims = data[3]
            shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
            return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)
    raise SystemExit(f"make_jpeg_folder: {FASHION}/{name}[.gz] is missing "
                     "(apt-get install dataset-fashion-mnist)")


def write_split(root, split, images, labels, per_class, rng, broken, sides=(40, 96)):
    counts = [0] * len(CLASSES)
    written = []
    for img, label in zip(images, labels):
        if counts[label] >= per_class:
            continue
        n = counts[label]
        counts[label] += 1
        folder = os.path.join(root, split, CLASSES[label])
        os.makedirs(folder, exist_ok=True)
        side = rng.randrange(sides[0], sides[1] + 1)
        aspect = rng.choice([1.0, 0.75, 4 / 3, 0.6, 1.6])
        size = (max(8, int(side * aspect)), side)
        grey = Image.fromarray(img)
        if n % 17 == 5:                       # a grayscale JPEG
            grey.resize(size, Image.BILINEAR).save(os.path.join(folder, f"{n:05d}.jpg"), quality=90)
            continue
        tint = np.array(TINTS[rng.randrange(len(TINTS))], np.float32) / 255
        rgb = (np.asarray(grey, np.float32)[..., None] * tint).astype(np.uint8)
        pic = Image.fromarray(rgb).resize(size, Image.BILINEAR)
        if n % 13 == 7:                       # a PNG among the JPEGs
            pic.save(os.path.join(folder, f"{n:05d}.png"))
        else:
            path = os.path.join(folder, f"{n:05d}.JPEG" if n % 11 == 3 else f"{n:05d}.jpg")
            pic.save(path, quality=rng.choice([75, 90, 95]))
            written.append(path)
        if all(c >= per_class for c in counts):
            break
    for i in range(broken):
        path = written[(i * 7919) % len(written)]
        data = open(path, "rb").read()
        if i % 3 == 0:
            data = data[: len(data) // 3]            # truncated
        elif i % 3 == 1:
            data = b"not an image at all\n" * 10     # not an image
        else:
            data = data[:200] + bytes(200) + data[400:]  # damaged in the middle
        open(path, "wb").write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--per-class", type=int, default=50)
    ap.add_argument("--val-per-class", type=int, default=10)
    ap.add_argument("--test", action="store_true", help="also a test/ split")
    ap.add_argument("--broken", type=int, default=0, help="damaged training files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="40-96", help="range of the side that the aspect ratio scales, in pixels (LO-HI)")
    args = ap.parse_args()
    try:
        sides = tuple(int(v) for v in args.sides.split("-"))
        assert len(sides) == 2 and 8 <= sides[0] <= sides[1]
    except (ValueError, AssertionError):
        ap.error(f"--sides {args.sides}: expected LO-HI with 8 <= LO <= HI")
    rng = random.Random(args.seed)
    train_x, train_y = read_idx("train-images-idx3-ubyte"), read_idx("train-labels-idx1-ubyte")
    test_x, test_y = read_idx("t10k-images-idx3-ubyte"), read_idx("t10k-labels-idx1-ubyte")
    write_split(args.root, "train", train_x, train_y, args.per_class, rng, args.broken, sides)
    half = len(test_y) // 2
    write_split(args.root, "val", test_x[:half], test_y[:half], args.val_per_class, rng, 0, sides)
    if args.test:
        write_split(args.root, "test", test_x[half:], test_y[half:], args.val_per_class, rng, 0, sides)


if __name__ == "__main__":
    main()
