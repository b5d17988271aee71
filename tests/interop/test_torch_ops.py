"""The CPU backend's new ops one by one against PyTorch (Debian's torch 1.13): forward values and
autograd's gradients for the same inputs, through tests/tools/op_probe (NHWC files in, NHWC out).
conv 7x7/2 pad 3 (the ImageNet stem), max-pool 3x3/2 pad 1, adaptive average pool (VGG's 7x7,
from larger and from smaller inputs), dropout (nn.Dropout's scaling; the mask is ours), linear."""
import subprocess

import numpy as np
import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.fixture(scope="module")
def op_probe(build_dir):
    return built_tool(build_dir, "op_probe")


def write(d, name, t):
    t.detach().contiguous().numpy().astype("float32").tofile(d / f"{name}.f32")


def read(d, name, shape):
    return torch.from_numpy(np.fromfile(d / f"{name}.f32", dtype="float32")).view(*shape)


def nhwc(t):
    return t.permute(0, 2, 3, 1)


def assert_close(ours, ref, what, rtol=1e-4, atol=1e-5):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= atol + rtol * scale, f"{what}: max |ddpworker - torch| = {err:.3g} (scale {scale:.3g})"


def run(op_probe, *args):
    subprocess.run([op_probe, *map(str, args)], check=True, timeout=60)


@pytest.mark.parametrize("shape", [(2, 3, 32, 32, 8), (2, 3, 17, 21, 4)],
                         ids=["32x32", "17x21"])
def test_conv_7x7_stride_2_pad_3(shape, op_probe, tmp_path):
    n, c, h, w, k = shape
    torch.manual_seed(1)
    x = torch.randn(n, c, h, w, requires_grad=True)
    weight = torch.randn(k, c, 7, 7, requires_grad=True)
    y = F.conv2d(x, weight, stride=2, padding=3)
    dy = torch.randn_like(y)
    y.backward(dy)
    write(tmp_path, "x", nhwc(x))
    write(tmp_path, "w", nhwc(weight))  # (K, C, R, S) -> (K, R, S, C)
    write(tmp_path, "dy", nhwc(dy))
    run(op_probe, "conv", n, h, w, c, k, 7, 2, 3, tmp_path)
    oh, ow = y.shape[2:]
    assert_close(read(tmp_path, "y", (n, oh, ow, k)), nhwc(y.detach()), "conv forward")
    assert_close(read(tmp_path, "dx", (n, h, w, c)), nhwc(x.grad), "conv dx")
    assert_close(read(tmp_path, "dw", (k, 7, 7, c)), nhwc(weight.grad), "conv dw")


@pytest.mark.parametrize("hw", [(16, 16), (15, 9), (2, 2), (1, 3)])
def test_maxpool_3x3_stride_2_pad_1(hw, op_probe, tmp_path):
    h, w = hw
    n, c = 2, 5
    torch.manual_seed(2)
    x = torch.randn(n, c, h, w)
    x[0, 0] = -torch.rand(h, w) - 1  # all negative: a zero padding would win, -inf never does
    x.requires_grad_(True)
    y = F.max_pool2d(x, 3, 2, 1)
    dy = torch.randn_like(y)
    y.backward(dy)
    write(tmp_path, "x", nhwc(x))
    write(tmp_path, "dy", nhwc(dy))
    run(op_probe, "maxpool", n, h, w, c, 3, 2, 1, tmp_path)
    oh, ow = y.shape[2:]
    assert_close(read(tmp_path, "y", (n, oh, ow, c)), nhwc(y.detach()), "max-pool forward", 0, 0)
    assert_close(read(tmp_path, "dx", (n, h, w, c)), nhwc(x.grad), "max-pool dx", 0, 0)


@pytest.mark.parametrize("case", [(14, 14, 7, 7), (15, 11, 7, 7), (4, 4, 7, 7), (1, 1, 7, 7),
                                  (3, 5, 7, 7), (9, 6, 4, 3), (7, 7, 1, 1)],
                         ids=lambda c: "%dx%d-to-%dx%d" % c)
def test_adaptive_avgpool(case, op_probe, tmp_path):
    h, w, oh, ow = case
    n, c = 2, 6
    torch.manual_seed(3)
    x = torch.randn(n, c, h, w, requires_grad=True)
    y = F.adaptive_avg_pool2d(x, (oh, ow))
    dy = torch.randn_like(y)
    y.backward(dy)
    write(tmp_path, "x", nhwc(x))
    write(tmp_path, "dy", nhwc(dy))
    run(op_probe, "adaptive", n, h, w, c, oh, ow, tmp_path)
    assert_close(read(tmp_path, "y", (n, oh, ow, c)), nhwc(y.detach()), "adaptive pool forward")
    assert_close(read(tmp_path, "dx", (n, h, w, c)), nhwc(x.grad), "adaptive pool dx")


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_dropout_scales_as_nn_dropout(p, op_probe, tmp_path):
    """PyTorch's mask comes from its own generator, so ours is read off our output (the input has
    no zeros); with that mask, forward and backward must equal nn.Dropout's arithmetic, and about
    p of the elements are dropped."""
    count = 100000
    torch.manual_seed(4)
    x = torch.rand(count) + 0.5
    dy = torch.randn(count)
    write(tmp_path, "x", x)
    write(tmp_path, "dy", dy)
    run(op_probe, "dropout", count, p, 987654321, tmp_path)
    y, dx = read(tmp_path, "y", (count,)), read(tmp_path, "dx", (count,))
    mask = y != 0
    assert abs(1 - mask.float().mean().item() - p) < 0.01, "fraction dropped"
    # torch's survivors are x * (1 / (1 - p)) in fp32: read the factor off torch itself
    probe = F.dropout(torch.ones(1000), p, training=True)
    factor = probe[probe != 0][0]
    assert torch.equal(y, x * mask * factor), "dropout forward"
    xr = x.clone().requires_grad_(True)
    (xr * mask * factor).backward(dy)
    assert torch.equal(dx, xr.grad), "dropout backward"


def test_linear(op_probe, tmp_path):
    n, fin, fout = 5, 300, 70
    torch.manual_seed(5)
    lin = torch.nn.Linear(fin, fout)
    x = torch.randn(n, fin, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    for name, t in (("x", x), ("w", lin.weight), ("b", lin.bias), ("dy", dy)):
        write(tmp_path, name, t)
    run(op_probe, "linear", n, fin, fout, tmp_path)
    assert_close(read(tmp_path, "y", (n, fout)), y.detach(), "linear forward")
    assert_close(read(tmp_path, "dx", (n, fin)), x.grad, "linear dx")
    assert_close(read(tmp_path, "dw", (fout, fin)), lin.weight.grad, "linear dw")
    assert_close(read(tmp_path, "db", (fout,)), lin.bias.grad, "linear db")


@pytest.mark.parametrize("relu,residual", [(1, 1), (1, 0), (0, 0)],
                         ids=["bn-add-relu", "bn-relu", "bn"])
def test_bn_act_is_batch_norm_then_add_then_relu(relu, residual, op_probe, tmp_path):
    """The fused batch norm + residual add + ReLU (bn_act) in training: PyTorch's batch_norm (biased
    variance to normalize, unbiased for the running one, momentum 0.1), + the residual, relu."""
    rows, c = 96, 6
    torch.manual_seed(5)
    x = (torch.randn(rows, c) * 2 + 0.5).requires_grad_(True)
    gamma = torch.randn(c, requires_grad=True)
    beta = torch.randn(c, requires_grad=True)
    res = torch.randn(rows, c, requires_grad=True)
    mean, var = torch.zeros(c), torch.ones(c)
    y = F.batch_norm(x, mean, var, gamma, beta, training=True, momentum=0.1, eps=1e-5)
    if residual:
        y = y + res
    if relu:
        y = F.relu(y)
    dy = torch.randn_like(y)
    y.backward(dy)
    for name, t in (("x", x), ("gamma", gamma), ("beta", beta), ("res", res), ("dy", dy)):
        write(tmp_path, name, t)
    run(op_probe, "bnact", rows, c, relu, residual, tmp_path)
    assert_close(read(tmp_path, "y", (rows, c)), y.detach(), "bn_act forward")
    assert_close(read(tmp_path, "dx", (rows, c)), x.grad, "bn_act dx")
    if residual:
        assert_close(read(tmp_path, "dres", (rows, c)), res.grad, "bn_act dresidual", 0, 0)
    assert_close(read(tmp_path, "dgamma", (c,)), gamma.grad, "bn_act dgamma")
    assert_close(read(tmp_path, "dbeta", (c,)), beta.grad, "bn_act dbeta")
    assert_close(read(tmp_path, "running", (2, c)), torch.stack([mean, var]), "running statistics")
