"""ddpworker's CPU backend against PyTorch (Debian's torch 1.13 on CPU): the same initial weights
and batch must give the same loss, gradients, batch-norm running statistics and, after two SGD
steps (momentum, Nesterov, weight decay), the same parameters."""
import subprocess

import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")
import torch_models  # noqa: E402  (tests/interop is on sys.path: pytest's rootdir-relative import)

CASES = [
    # name, width, h, w, c, classes, batch, smoothing
    ("mlp", 32, 12, 12, 2, 7, 8, 0.0),
    ("cnn", 8, 28, 28, 1, 10, 16, 0.1),
    ("resnet18", 8, 16, 16, 3, 10, 8, 0.0),
    ("resnet34", 4, 12, 12, 3, 5, 4, 0.1),
]


def read(path, dtype=None):
    return torch.from_numpy(__import__("numpy").fromfile(path, dtype=dtype or "float32"))


def assert_close(ours, ref, what, rtol=2e-3, atol=2e-5):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= atol + rtol * scale, f"{what}: max |ddpworker - torch| = {err:.3g} (scale {scale:.3g})"


@pytest.fixture(scope="module")
def model_probe(build_dir):
    return built_tool(build_dir, "model_probe")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_step_matches_pytorch(case, model_probe, tmp_path):
    name, width, h, w, c, classes, batch, smoothing = case
    subprocess.run([model_probe, name, str(width), str(h), str(w), str(c), str(classes),
                    str(batch), "11", str(smoothing), str(tmp_path)], check=True, timeout=120)
    torch.manual_seed(0)
    model, shapes = torch_models.build(name, width, h, w, c, classes)
    model.train()
    torch_models.to_torch_layout(model, shapes, read(tmp_path / "params.f32"))
    x = read(tmp_path / "input.f32").view(batch, h, w, c).permute(0, 3, 1, 2).contiguous()
    labels = read(tmp_path / "labels.i32", "int32").long()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    for step in range(2):
        opt.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
        loss.backward()
        if step == 0:
            ours_loss = float(open(tmp_path / "loss.txt").read())
            assert abs(ours_loss - loss.item()) <= 1e-4 * max(1.0, abs(loss.item())), \
                f"loss: ddpworker {ours_loss}, torch {loss.item()}"
            assert_close(read(tmp_path / "logits.f32").view(batch, classes), logits.detach(),
                         "logits")
            grads = torch_models.from_torch_layout(model, shapes,
                                                   [p.grad for p in model.parameters()])
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
                assert_close(read(tmp_path / "buffers.f32"), torch.cat(running), "running stats")
        opt.step()
    params = torch_models.from_torch_layout(model, shapes, [p.detach() for p in model.parameters()])
    assert_close(read(tmp_path / "params2.f32"), params, "parameters after two SGD steps")
