"""ddpworker's image decoding and folder scan against what torchvision's ImageFolder gets from
Debian's PIL and torchvision 0.14: the same RGB pixels as Image.open(f).convert("RGB") for JPEG
(baseline 4:2:0/4:2:2/4:4:4, progressive, grayscale, CMYK, extraneous bytes before a marker) and
PNG (RGB, RGBA, palette with and without transparency, grayscale with and without alpha, 1 bit, 16
bit); DCT-scaled decodes equal to PIL's draft() at the same scale; the same errors for truncated
and non-image files; the same classes, files, order and labels as ImageFolder on an awkward tree."""
import io
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest

from conftest import built_tool

Image = pytest.importorskip("PIL.Image")


def picture(h, w, seed=0):
    """Smooth gradients with noise and a sharp edge: chroma subsampling and DCT both show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x // 5 + y // 7) % 2) * 200],
                   axis=-1) + rng.integers(-30, 30, size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def decode(build_dir, tmp_path, data, *min_size):
    src, dst = tmp_path / "in.img", tmp_path / "out.rgb"
    src.write_bytes(data)
    r = subprocess.run([built_tool(build_dir, "image_probe"), "decode", str(src), str(dst),
                        *map(str, min_size)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return None, r.stderr.strip()
    w, h = map(int, r.stdout.split())
    return np.frombuffer(dst.read_bytes(), np.uint8).reshape(h, w, 3), ""


def pil_rgb(data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def saved(img, fmt, **kw):
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


RGB = picture(37, 53)
JPEGS = {
    "baseline-420": lambda: saved(Image.fromarray(RGB), "JPEG", quality=85),
    "baseline-422": lambda: saved(Image.fromarray(RGB), "JPEG", quality=90, subsampling=1),
    "baseline-444": lambda: saved(Image.fromarray(RGB), "JPEG", quality=95, subsampling=0),
    "progressive": lambda: saved(Image.fromarray(RGB), "JPEG", quality=80, progressive=True),
    "grayscale": lambda: saved(Image.fromarray(RGB[..., 0]), "JPEG", quality=90),
    "cmyk": lambda: saved(Image.fromarray(np.concatenate([RGB, RGB[..., :1] // 2], axis=-1), "CMYK"),
                          "JPEG", quality=90),
}


@pytest.mark.parametrize("name", sorted(JPEGS))
def test_jpeg_pixels_are_pils(build_dir, tmp_path, name):
    data = JPEGS[name]()
    got, err = decode(build_dir, tmp_path, data)
    assert got is not None, err
    want = pil_rgb(data)
    assert got.shape == want.shape
    assert np.array_equal(got, want), np.abs(got.astype(int) - want).max()


def test_extraneous_bytes_before_a_marker_decode_as_pil_does(build_dir, tmp_path):
    data = JPEGS["baseline-420"]()
    assert data.endswith(b"\xff\xd9")
    data = data[:-2] + bytes(17) + b"\xff\xd9"  # libjpeg: "17 extraneous bytes before marker"
    got, err = decode(build_dir, tmp_path, data)
    assert got is not None, err
    assert np.array_equal(got, pil_rgb(data))


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_dct_scaled_jpeg_is_pils_draft(build_dir, tmp_path, scale):
    big = picture(240, 320, 3)
    data = saved(Image.fromarray(big), "JPEG", quality=90)
    got, err = decode(build_dir, tmp_path, data, 320 // scale, 240 // scale)
    assert got is not None, err
    assert got.shape == (240 // scale, 320 // scale, 3), "the smallest factor still covering it"
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (320 // scale, 240 // scale))
    want = np.asarray(im.convert("RGB"))
    assert want.shape == got.shape and np.array_equal(got, want)


def png_chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png16_rgb(img16):
    """A 16-bit RGB PNG (PIL cannot write one)."""
    h, w, _ = img16.shape
    raw = b"".join(b"\x00" + img16[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + png_chunk(b"IDAT", zlib.compress(raw)) + png_chunk(b"IEND", b""))


def pngs():
    rgba = np.concatenate([RGB, RGB[..., 1:2]], axis=-1)
    pal = Image.fromarray(RGB).convert("P", palette=Image.ADAPTIVE, colors=32)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    rng = np.random.default_rng(5)
    return {
        "rgb": saved(Image.fromarray(RGB), "PNG"),
        "rgba": saved(Image.fromarray(rgba, "RGBA"), "PNG"),
        "palette": saved(pal, "PNG"),
        "palette-transparent": saved(pal_t, "PNG", transparency=3),
        "grey": saved(Image.fromarray(RGB[..., 0]), "PNG"),
        "grey-alpha": saved(Image.fromarray(rgba[..., ::3].copy(), "LA"), "PNG"),
        "one-bit": saved(Image.fromarray(RGB[..., 0] > 128), "PNG"),
        "rgb-16": png16_rgb(rng.integers(0, 65536, size=(9, 11, 3))),
    }


@pytest.mark.parametrize("name", sorted(pngs()))
def test_png_pixels_are_pils(build_dir, tmp_path, name):
    data = pngs()[name]
    got, err = decode(build_dir, tmp_path, data)
    assert got is not None, err
    want = pil_rgb(data)
    assert np.array_equal(got, want), np.abs(got.astype(int) - want).max()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_and_foreign_files_fail_as_in_pil(build_dir, tmp_path, fmt):
    whole = saved(Image.fromarray(picture(64, 64, 1)), fmt)
    for data in (whole[: len(whole) // 2], b"GIF89a" + bytes(40), b"", whole[:20]):
        with pytest.raises(Exception):
            pil_rgb(data)
        got, err = decode(build_dir, tmp_path, data)
        assert got is None and err, "decoded what PIL refuses"


def test_imagefolder_scan_is_torchvisions(build_dir, tmp_path):
    """Classes (hidden and linked ones too) and files in ImageFolder's order, which sorts
    directories by whole path: a/b < a/b-c < a/b/d, not depth first."""
    datasets = pytest.importorskip("torchvision.datasets")
    jpeg = saved(Image.fromarray(picture(8, 8)), "JPEG")
    root = tmp_path / "tree"
    files = ["train/cat/b/x.jpg", "train/cat/b-c/y.JPG", "train/cat/b/d/z.jpeg", "train/cat/0.png",
             "train/cat/a.txt", "train/Dog/k.Jpg", "train/.hidden/h.jpg", "train/dog/.j.jpg",
             "train/dog/j.webp", "train/dog/ä.jpg", "train/dog/Z.jpg", "train/dog/_.jpg",
             "val/dog/v.jpg", "val/cat/w.jpg"]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_bytes(jpeg)
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "l.jpg").write_bytes(jpeg)
    os.symlink(root / "elsewhere", root / "train" / "linked")
    r = subprocess.run([built_tool(build_dir, "image_probe"), "scan", str(root)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    classes = [l.split(" ", 1)[1] for l in lines if l.startswith("class ")]
    ours = {s: [(l.split(" ", 2)[2], int(l.split(" ", 2)[1])) for l in lines if l.startswith(s + " ")]
            for s in ("train", "val")}
    train = datasets.ImageFolder(str(root / "train"))
    assert classes == train.classes
    assert ours["train"] == train.samples
    val = datasets.ImageFolder(str(root / "val"))
    # val is labelled by train's class names (torchvision would number val's own classes)
    assert [(p, classes[l]) for p, l in ours["val"]] == [(p, val.classes[l]) for p, l in val.samples]
