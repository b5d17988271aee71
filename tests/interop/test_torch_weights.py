"""Weights interchange with torchvision (Debian's torchvision 0.14): torchvision's randomly
initialized resnet18, resnet50 and vgg19_bn saved as safetensors load into ddpworker and give
torchvision's logits in evaluation mode; what ddpworker saves loads into torchvision with
load_state_dict(strict=True) and gives ddpworker's logits; model.init, model.init_skip_mismatched
and train.params_file through the real ddpworker; a damaged file is an error naming the file and
the tensor."""
import subprocess

import numpy as np
import pytest

import safetensors_file
from conftest import built_tool

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

EXIT_CONFIG = 78
N = 4
CLASSES = 10
# torchvision name, image side: ResNet-50 at 64 px keeps layer4 2x2; VGG needs 32 px for its pools
CASES = [("resnet18", 32), ("resnet50", 64), ("vgg19_bn", 32)]


@pytest.fixture(scope="module")
def weights_probe(build_dir):
    return built_tool(build_dir, "weights_probe")


def torchvision_model(name, classes=CLASSES, seed=0):
    """A randomly initialized torchvision model whose batch-norm affine parameters and running
    statistics are random too (else evaluation would not see them), in evaluation mode."""
    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(num_classes=classes)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(3)
    return model.eval()


def batch(side, seed=1):
    torch.manual_seed(seed)
    return torch.randn(N, 3, side, side)


def probe(weights_probe, tmp_path, name, side, x, *options, check=True):
    """weights_probe on x (NCHW); returns (logits (N, CLASSES) as torch, the CompletedProcess)."""
    x.permute(0, 2, 3, 1).contiguous().numpy().tofile(tmp_path / "x.f32")
    out = tmp_path / "logits.f32"
    r = subprocess.run([weights_probe, name, "64", str(side), str(side), "3", str(CLASSES), str(N),
                        str(tmp_path / "x.f32"), str(out), "stem=imagenet", *options],
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    logits = torch.from_numpy(np.fromfile(out, dtype=np.float32)).view(N, CLASSES) if r.returncode == 0 else None
    return logits, r


def assert_close(ours, ref, what, rtol=1e-4):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale + 1e-6, f"{what}: max |ddpworker - torchvision| = {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name,side", CASES, ids=[c[0] for c in CASES])
def test_torchvision_weights_give_torchvision_logits(name, side, weights_probe, tmp_path):
    model = torchvision_model(name)
    path = tmp_path / f"{name}.safetensors"
    safetensors_file.save(path, model.state_dict(), {"format": "pt"})
    x = batch(side)
    with torch.no_grad():
        want = model(x)
    got, _ = probe(weights_probe, tmp_path, name, side, x, f"load={path}")
    assert_close(got, want, f"{name} logits")


@pytest.mark.parametrize("name,side", CASES, ids=[c[0] for c in CASES])
def test_ddpworker_weights_load_strictly_into_torchvision(name, side, weights_probe, tmp_path):
    path = tmp_path / "ours.safetensors"
    x = batch(side, seed=2)
    # two training steps: parameters and running statistics away from their initial values
    got, _ = probe(weights_probe, tmp_path, name, side, x, "train=2", "steps=7", f"save={path}")
    header, meta, _ = safetensors_file.read_header(path)
    assert meta.get("format") == "pt"
    # (VGG's own init of 143M parameters would only be overwritten)
    extra = {"init_weights": False} if name.startswith("vgg") else {}
    model = getattr(torchvision.models, name)(num_classes=CLASSES, **extra)
    assert list(header) == list(model.state_dict()), "torchvision's names in its order"
    model.load_state_dict(safetensors_file.load_torch(path), strict=True)
    model.eval()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(m.num_batches_tracked.item() == 7 for m in bns)
    assert any((m.running_var != 1).any() for m in bns), "the statistics moved"
    with torch.no_grad():
        want = model(x)
    assert_close(got, want, f"{name} logits")


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_files_load(dtype, weights_probe, tmp_path):
    model = torchvision_model("resnet18")
    path = tmp_path / "half.safetensors"
    safetensors_file.save(path, model.state_dict(), dtype=dtype)
    # the reference: torchvision with the very values the file holds
    model.load_state_dict(safetensors_file.load_torch(path), strict=False)
    model.float().eval()
    x = batch(32)
    with torch.no_grad():
        want = model(x)
    got, _ = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}")
    assert_close(got, want, f"{dtype} logits")


def test_a_new_classifier_head_is_an_error_unless_skipped(weights_probe, tmp_path):
    model = torchvision_model("resnet18", classes=1000)
    path = tmp_path / "imagenet.safetensors"
    safetensors_file.save(path, model.state_dict())
    x = batch(32)
    _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", check=False)
    assert r.returncode == 3
    assert f"{path}: tensor 'fc.weight': shape [1000, 512] in the file, [10, 512] in the model" in r.stderr
    got, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", "skip=1")
    assert "skipping tensor 'fc.weight'" in r.stderr and "skipping tensor 'fc.bias'" in r.stderr
    assert r.stderr.count("skipping") == 2, r.stderr
    # everything but the head is torchvision's: the features before fc are
    model.fc = torch.nn.Identity()
    with torch.no_grad():
        features = model(x)
    drawn, _ = probe(weights_probe, tmp_path, "resnet18", 32, x)  # the head as drawn from seed 5
    head = tmp_path / "head.safetensors"
    probe(weights_probe, tmp_path, "resnet18", 32, x, f"save={head}")
    fc = safetensors_file.load_torch(head)
    assert_close(got, features @ fc["fc.weight"].T + fc["fc.bias"], "logits with a drawn head")
    assert (drawn - got).abs().max() > 1e-3


def test_missing_and_unexpected_tensors_are_named(weights_probe, tmp_path):
    state = torchvision_model("resnet18").state_dict()
    missing = {k: v for k, v in state.items() if k != "layer2.1.bn1.running_var"}
    extra = dict(state, **{"layer9.conv.weight": torch.zeros(3)})
    no_count = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    x = batch(32)
    for tensors, message in ((missing, "tensor 'layer2.1.bn1.running_var': not in the file"),
                             (extra, "tensor 'layer9.conv.weight': not in the model")):
        path = tmp_path / "bad.safetensors"
        safetensors_file.save(path, tensors)
        _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", check=False)
        assert r.returncode == 3 and message in r.stderr, r.stderr
        # skipping is for the final layer: elsewhere it refuses, unless the tensor is listed
        _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", "skip=1", check=False)
        assert r.returncode == 3 and message in r.stderr and "model.init_skip" in r.stderr, r.stderr
        name = message.split("'")[1]
        _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", f"skip_list={name}")
        assert "model.init_skip" in r.stderr, r.stderr
    path = tmp_path / "old.safetensors"  # PyTorch accepts files without num_batches_tracked too
    safetensors_file.save(path, no_count)
    probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}")
    path = tmp_path / "vgg.safetensors"
    safetensors_file.save(path, torchvision.models.vgg11(num_classes=CLASSES).state_dict())
    _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", "skip=1", check=False)
    assert r.returncode == 3 and "no tensor of the file fits model resnet18" in r.stderr, r.stderr


def test_damaged_files_are_errors_naming_file_and_tensor(weights_probe, tmp_path):
    state = {"conv1.weight": torch.zeros(64, 3, 7, 7), "bn1.weight": torch.ones(64)}
    good = tmp_path / "good.safetensors"
    safetensors_file.save(good, state)
    data = good.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = data[8:8 + header_len]
    cases = {
        "truncated.safetensors": (data[:-10], "bn1.weight"),
        "short.safetensors": (data[:5], "not a safetensors file"),
        "huge_header.safetensors": ((10 ** 12).to_bytes(8, "little") + data[8:], "header length"),
        "not_json.safetensors": (data[:8] + b"{" * header_len + data[8 + header_len:], "not JSON"),
        "bad_dtype.safetensors": (data[:8] + header.replace(b'"F32"', b'"Q32"', 1) + data[8 + header_len:],
                                  "unknown dtype"),
    }
    x = batch(32)
    for file_name, (content, needle) in cases.items():
        path = tmp_path / file_name
        path.write_bytes(content)
        _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", check=False)
        assert r.returncode == 3, (file_name, r.stderr)
        assert str(path) in r.stderr and needle in r.stderr, (file_name, r.stderr)
    # offsets past the data, and a byte count that does not match the shape
    for file_name, edit in (("outside.safetensors", lambda h: h.replace(b"[0, 37632]", b"[0, 99999999]")),
                            ("short_tensor.safetensors", lambda h: h.replace(b"[0, 37632]", b"[0, 37628]"))):
        h = edit(header)
        assert h != header
        path = tmp_path / file_name
        path.write_bytes(len(h).to_bytes(8, "little") + h + data[8 + header_len:])
        _, r = probe(weights_probe, tmp_path, "resnet18", 32, x, f"load={path}", check=False)
        assert r.returncode == 3 and "tensor 'conv1.weight'" in r.stderr, (file_name, r.stderr)


CONF = """[model]
name = resnet18
stem = imagenet
[data]
kind = synthetic
height = 32
width = 32
classes = 10
train_limit = 64
test_limit = 16
[optim]
lr = 0
momentum = 0
weight_decay = 0
[train]
batch_size = 8
max_steps = 3
log_interval = 1
"""


def test_model_init_and_params_file_through_ddpworker(ddpworker, tmp_path):
    """torchvision's weights in, the same parameters out (lr 0) in a file torchvision loads
    strictly, with num_batches_tracked = the steps taken and the statistics of those steps."""
    conf = tmp_path / "t.conf"
    conf.write_text(CONF)
    init, out = tmp_path / "init.safetensors", tmp_path / "out.safetensors"
    safetensors_file.save(init, torchvision_model("resnet18").state_dict())
    r = subprocess.run([ddpworker, str(conf), f"model.init={init}", f"train.params_file={out}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(safetensors_file.parameters(out), safetensors_file.parameters(init))
    model = torchvision.models.resnet18(num_classes=CLASSES)
    model.load_state_dict(safetensors_file.load_torch(out), strict=True)
    assert model.bn1.num_batches_tracked.item() == 3
    assert not torch.equal(model.bn1.running_mean, safetensors_file.load_torch(init)["bn1.running_mean"])
    # a file for another head: a config error naming the tensor, or skipped and named
    head = tmp_path / "head.safetensors"
    safetensors_file.save(head, torchvision_model("resnet18", classes=1000).state_dict())
    r = subprocess.run([ddpworker, str(conf), f"model.init={head}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert "model.init: " in r.stderr and "tensor 'fc.weight': shape [1000, 512]" in r.stderr
    r = subprocess.run([ddpworker, str(conf), f"model.init={head}", "model.init_skip_mismatched=true",
                        f"train.params_file={out}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "skipping tensor 'fc.weight'" in r.stderr
    r = subprocess.run([ddpworker, str(conf), f"model.init={tmp_path / 'nowhere.safetensors'}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == EXIT_CONFIG and "nowhere.safetensors: cannot open" in r.stderr, r.stderr
