"""ddpworker's CPU backend against PyTorch (Debian's torch 1.13 on CPU): the same initial weights
and batch must give the same loss, gradients, batch-norm running statistics and, after two SGD
steps (momentum, Nesterov, weight decay), the same parameters. The models are torchvision's
architectures (tests/interop/torch_models.py: ResNet-50 with the ImageNet stem, VGG with batch norm
and dropout, whose masks ddpworker exports for PyTorch to apply)."""
import subprocess

import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")
import torch_models  # noqa: E402  (tests/interop is on sys.path: pytest's rootdir-relative import)

CASES = [
    # name, width, h, w, c, classes, batch, smoothing, options (model_probe's and build()'s)
    ("mlp", 32, 12, 12, 2, 7, 8, 0.0, {}),
    ("cnn", 8, 28, 28, 1, 10, 16, 0.1, {}),
    ("resnet18", 8, 16, 16, 3, 10, 8, 0.0, {}),
    ("resnet34", 4, 12, 12, 3, 5, 4, 0.1, {}),
    ("resnet18", 4, 64, 48, 3, 10, 4, 0.0, {"stem": "imagenet"}),
    ("resnet50", 4, 64, 64, 3, 10, 8, 0.0, {"stem": "imagenet"}),
    ("resnet50", 2, 16, 16, 3, 6, 8, 0.1, {"stem": "cifar"}),
    ("vgg11", 8, 32, 32, 3, 10, 4, 0.0, {"fc_width": 32, "dropout": 0.5}),
    ("vgg19_bn", 4, 40, 36, 3, 10, 4, 0.0, {"fc_width": 24, "dropout": 0.3}),
]
IDS = ["%s-%dx%d%s" % (c[0], c[2], c[3], "".join(f"-{k}={v}" for k, v in c[8].items()))
       for c in CASES]


def read(path, dtype=None):
    return torch.from_numpy(__import__("numpy").fromfile(path, dtype=dtype or "float32"))


def assert_close(ours, ref, what, rtol=2e-3, atol=2e-5):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= atol + rtol * scale, f"{what}: max |ddpworker - torch| = {err:.3g} (scale {scale:.3g})"


@pytest.fixture(scope="module")
def model_probe(build_dir):
    return built_tool(build_dir, "model_probe")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_step_matches_pytorch(case, model_probe, tmp_path):
    name, width, h, w, c, classes, batch, smoothing, options = case
    subprocess.run([model_probe, name, str(width), str(h), str(w), str(c), str(classes),
                    str(batch), "11", str(smoothing), str(tmp_path)] +
                   [f"{k}={v}" for k, v in options.items()], check=True, timeout=120)
    params = {}
    for dtype in (torch.float64, torch.float32):  # fp64: the truth after two steps (see below)
        params[dtype] = replay(tmp_path, case, dtype)
    # Two steps at lr 0.1 from the initial weights of a deep network on a few samples amplify
    # rounding (ResNet-50: PyTorch's fp32 and fp64 parameters part by ~1% of their scale), so
    # ddpworker must be as close to fp64 as PyTorch's own fp32 is, or within the tolerance.
    ours = read(tmp_path / "params2.f32")
    noise = (params[torch.float32] - params[torch.float64]).abs().max().item()
    err = (ours - params[torch.float64]).abs().max().item()
    scale = params[torch.float64].abs().max().item()
    # PyTorch's own fp32 noise depends on its thread count (1 on a machine that showed 2 cores:
    # 0.0078 of 3.8, where ddpworker's sums in another order reached 0.049): ResNet-50's
    # amplification (~1% of the scale, above) is the bound there, whatever the threads
    amplified = 0.015 * scale if name == "resnet50" else 0.0
    assert err <= max(2e-5 + 2e-3 * scale, 2 * noise, amplified), \
        f"parameters after two SGD steps: max |ddpworker - torch fp64| = {err:.3g} (scale " \
        f"{scale:.3g}, torch fp32 vs fp64: {noise:.3g})"


def replay(tmp_path, case, dtype):
    """The probe's two steps in PyTorch; checks the first against fp64 (PyTorch's own fp32 strays
    by up to 1e-2 of a gradient's scale on ResNet-50 at initialisation: its CPU batch norm folds
    the mean into an offset). Returns the parameters after both in ddpworker's layout."""
    name, width, h, w, c, classes, batch, smoothing, options = case
    torch.manual_seed(0)
    model, shapes = torch_models.build(name, width, h, w, c, classes, **options)
    model.train()
    torch_models.to_torch_layout(model, shapes, read(tmp_path / "params.f32"))
    model.to(dtype)
    x = read(tmp_path / "input.f32").view(batch, h, w, c).permute(0, 3, 1, 2).contiguous()
    x = x.to(dtype)
    labels = read(tmp_path / "labels.i32", "int32").long()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    for step in range(2):
        for k, layer in enumerate(torch_models.dropouts(model)):
            layer.mask = read(tmp_path / f"mask{step}_{k}.f32").to(dtype)
            assert 0 < layer.mask.sum() < layer.mask.numel(), "a mask that drops some, not all"
        opt.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
        loss.backward()
        if step == 0 and dtype == torch.float64:
            ours_loss = float(open(tmp_path / "loss.txt").read())
            assert abs(ours_loss - loss.item()) <= 1e-4 * max(1.0, abs(loss.item())), \
                f"loss: ddpworker {ours_loss}, torch {loss.item()}"
            assert_close(read(tmp_path / "logits.f32").view(batch, classes),
                         logits.detach().float(), "logits")
            grads = torch_models.from_torch_layout(model, shapes,
                                                   [p.grad.float() for p in model.parameters()])
            ours = read(tmp_path / "grads.f32")
            at = 0
            for i, p in enumerate(model.parameters()):
                n = p.numel()
                assert_close(ours[at:at + n], grads[at:at + n], f"gradient of parameter {i} "
                             f"{tuple(p.shape)}")
                at += n
            running = [t for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
                       for t in (m.running_mean, m.running_var)]
            if running:
                assert_close(read(tmp_path / "buffers.f32"), torch.cat(running).float(),
                             "running stats")
        opt.step()
    return torch_models.from_torch_layout(model, shapes,
                                          [p.detach().float() for p in model.parameters()])
