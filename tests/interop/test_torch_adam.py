"""ddpworker's Adam and AdamW (optim.name, worker/nn/adam.h on the CPU backend) against Debian's
torch.optim.Adam / AdamW (torch 1.13): a few steps on a small model from the same weights and
batch. At every step the model's gradients must agree with PyTorch's (the model is the same), and
torch.optim, given ddpworker's gradient, must produce ddpworker's parameters to fp32 precision:
the optimizer's arithmetic alone, with no gradient difference to amplify. A free-running PyTorch
loop (its own gradients) must stay close too."""
import copy
import subprocess

import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")
import torch_models  # noqa: E402  (tests/interop is on sys.path: pytest's rootdir-relative import)

STEPS = 4
CASES = [
    # optimizer, model, width, h, w, c, classes, batch, lr, betas, eps, weight decay
    ("adam", "cnn", 8, 12, 12, 1, 10, 16, 0.01, (0.9, 0.999), 1e-8, 0.01),
    ("adamw", "cnn", 8, 12, 12, 1, 10, 16, 0.01, (0.8, 0.99), 1e-6, 0.05),
    ("adam", "mlp", 16, 8, 8, 2, 5, 8, 0.003, (0.9, 0.999), 1e-8, 0.0),
    ("adamw", "mlp", 16, 8, 8, 2, 5, 8, 0.003, (0.5, 0.9), 1e-8, 0.1),
]


def read(path, dtype=None):
    return torch.from_numpy(__import__("numpy").fromfile(path, dtype=dtype or "float32"))


def max_error(ours, ref):
    return (ours - ref).abs().max().item(), ref.abs().max().item()


def assert_close(ours, ref, what, rtol, atol):
    err, scale = max_error(ours, ref)
    assert err <= atol + rtol * scale, f"{what}: max |ddpworker - torch| = {err:.3g} (scale {scale:.3g})"


def per_parameter(model, shapes, flat):
    """ddpworker's flat arena as one tensor per parameter of model, in PyTorch's layout."""
    scratch = copy.deepcopy(model)
    torch_models.to_torch_layout(scratch, shapes, flat)
    return [p.detach().clone() for p in scratch.parameters()]


def make_optimizer(kind, params, lr, betas, eps, weight_decay):
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    # foreach=False: the single-tensor loop, torch 1.13's default on CPU
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)


@pytest.fixture(scope="module")
def optim_probe(build_dir):
    return built_tool(build_dir, "optim_probe")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_steps_match_torch_optim(case, optim_probe, tmp_path):
    kind, name, width, h, w, c, classes, batch, lr, betas, eps, wd = case
    subprocess.run([optim_probe, kind, name, str(width), str(h), str(w), str(c), str(classes),
                    str(batch), "5", str(STEPS), repr(lr), f"{betas[0]!r},{betas[1]!r}", repr(eps),
                    repr(wd), str(tmp_path)], check=True, timeout=120)
    torch.manual_seed(0)
    model, shapes = torch_models.build(name, width, h, w, c, classes)
    model.train()
    torch_models.to_torch_layout(model, shapes, read(tmp_path / "params0.f32"))
    free = copy.deepcopy(model)  # trains on its own gradients
    x = read(tmp_path / "input.f32").view(batch, h, w, c).permute(0, 3, 1, 2).contiguous()
    labels = read(tmp_path / "labels.i32", "int32").long()
    replay = make_optimizer(kind, model.parameters(), lr, betas, eps, wd)
    own = make_optimizer(kind, free.parameters(), lr, betas, eps, wd)
    for step in range(1, STEPS + 1):
        for m, opt in ((model, replay), (free, own)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), labels).backward()
        torch_grads = torch_models.from_torch_layout(model, shapes, [p.grad for p in model.parameters()])
        ours = read(tmp_path / f"grads{step}.f32")
        assert_close(ours, torch_grads, f"step {step}: gradients", rtol=2e-3, atol=2e-5)
        for p, g in zip(model.parameters(), per_parameter(model, shapes, ours)):
            p.grad.copy_(g)
        replay.step()
        own.step()
        want = torch_models.from_torch_layout(model, shapes, [p.detach() for p in model.parameters()])
        got = read(tmp_path / f"params{step}.f32")
        # a few fp32 roundings per step, applied to parameters of order 1
        assert_close(got, want, f"step {step}: parameters after torch.optim.{type(replay).__name__}",
                     rtol=1e-6, atol=1e-6)
    # torch's own gradients differ from ours by fp32 noise, and Adam divides each by its own size,
    # so a gradient near zero could move its parameter differently; seen: < 1e-4 of a move of
    # STEPS * lr. One step's lr apart is already a different optimizer (no bias correction: 2.2 lr)
    free_params = torch_models.from_torch_layout(free, shapes, [p.detach() for p in free.parameters()])
    assert_close(read(tmp_path / f"params{STEPS}.f32"), free_params,
                 "parameters after a free-running torch loop", rtol=0, atol=lr)
