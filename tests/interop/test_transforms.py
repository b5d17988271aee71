"""ddpworker's image transforms against torchvision 0.14's on the same decoded pixels (a uint8
tensor): Resize to a square, Resize(int(S/0.875)) + CenterCrop(S), and resized_crop (the resample
of RandomResizedCrop) with a flip, all antialiased bilinear; within 1/255 of the uint8 values (the issue asks 2/255),
and the test holds them to 1 (rounding alone). Also: the random-resized-crop plan keeps torchvision's constraints."""
import os
import subprocess

import numpy as np
import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")
F = pytest.importorskip("torchvision.transforms.functional")
from torchvision.transforms import InterpolationMode  # noqa: E402


def image(h, w, seed):
    rng = np.random.default_rng(seed)
    # smooth structure plus noise: edges and gradients both exercise the filter
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                     ((x + y) % 64) * 4], axis=-1)
    noise = rng.integers(-40, 40, size=(h, w, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def probe(build_dir, tmp_path, img, *args):
    h, w, _ = img.shape
    src, dst = tmp_path / "in.rgb", tmp_path / "out.rgb"
    src.write_bytes(img.tobytes())
    tool = built_tool(build_dir, "transform_probe")
    r = subprocess.run([tool, str(src), str(w), str(h), str(dst), *map(str, args)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dst


def ours(build_dir, tmp_path, img, size, *args):
    out = probe(build_dir, tmp_path, img, *args)
    return np.frombuffer(out.read_bytes(), np.uint8).reshape(size, size, 3).astype(int)


def theirs(t):
    return t.permute(1, 2, 0).numpy().astype(int)


def tensor(img):
    return torch.from_numpy(img).permute(2, 0, 1).contiguous()


SHAPES = [(96, 128), (128, 96), (300, 200), (40, 57), (64, 64), (17, 301)]


@pytest.mark.parametrize("h,w", SHAPES)
@pytest.mark.parametrize("size", [32, 128])
def test_resize_and_center_crop_match_torchvision(build_dir, tmp_path, h, w, size):
    img = image(h, w, h * 1000 + w)
    t = tensor(img)
    want = theirs(F.resize(t, [size, size], InterpolationMode.BILINEAR, antialias=True))
    got = ours(build_dir, tmp_path, img, size, "resize", size)
    assert np.abs(got - want).max() <= 1, np.abs(got - want).max()
    resized = F.resize(t, int(size / 0.875), InterpolationMode.BILINEAR, antialias=True)
    want = theirs(F.center_crop(resized, [size, size]))
    got = ours(build_dir, tmp_path, img, size, "center", size)
    assert np.abs(got - want).max() <= 1, np.abs(got - want).max()


@pytest.mark.parametrize("box,flip", [((10, 5, 60, 40), 0), ((0, 0, 128, 96), 1),
                                      ((37, 11, 13, 29), 1), ((90, 70, 38, 26), 0)])
def test_resized_crop_matches_torchvision(build_dir, tmp_path, box, flip):
    img = image(96, 128, 7)
    x, y, bw, bh = box
    want = F.resized_crop(tensor(img), y, x, bh, bw, [64, 64], InterpolationMode.BILINEAR,
                          antialias=True)
    if flip:
        want = F.hflip(want)
    got = ours(build_dir, tmp_path, img, 64, "crop", x, y, bw, bh, 64, flip)
    diff = np.abs(got - theirs(want)).max()
    assert diff <= 1, diff


def test_random_resized_crop_plans_keep_torchvision_constraints(build_dir, tmp_path):
    img = image(90, 160, 1)
    seen_flip, areas = set(), []
    for index in range(40):
        out = probe(build_dir, tmp_path, img, "plan", 5, 2, index, 64)
        x, y, w, h, flip = map(float, out.read_text().split())
        assert 0 <= x and x + w <= 160 and 0 <= y and y + h <= 90
        ratio = w / h
        areas.append(w * h / (160 * 90))
        seen_flip.add(int(flip))
        # within the ratio range, or torchvision's central fallback
        assert 3 / 4 - 0.05 <= ratio <= 4 / 3 + 0.05 or (x, y) == ((160 - w) // 2, (90 - h) // 2)
    assert seen_flip == {0, 1} and min(areas) < 0.5 and max(areas) > 0.5
    # a function of (seed, epoch, index): the same again, another epoch differs
    a = probe(build_dir, tmp_path, img, "plan", 5, 2, 3, 64).read_text()
    b = probe(build_dir, tmp_path, img, "plan", 5, 2, 3, 64).read_text()
    c = probe(build_dir, tmp_path, img, "plan", 5, 3, 3, 64).read_text()
    assert a == b and a != c
