#!/usr/bin/python3
"""How far bf16 or fp16 storage alone moves a ResNet-18's gradients: the reference figures behind
the bounds of test_backend_cuda.c's one_resnet18_step_in_{bf16,fp16}_is_close_to_cpu. PyTorch
computes in fp32 but rounds every activation and every activation gradient to the narrow type
(what ddpworker's cuda backend does in precision.mode=bf16 and fp16; fp16 gradients are rounded
at the loss scale the test uses, 1024); the relative norm error of all parameter gradients against
plain fp32 is printed for the test's network (width 8, 16x16x3, 10 classes, label smoothing 0.1)
at a few batch sizes and seeds. Seen on 2026-11-23 with Debian's torch 1.13: bf16 0.27-0.32,
fp16 0.08-0.12.

Usage: /usr/bin/python3 tests/interop/low_storage_emulation.py [bf16|fp16]
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_models  # noqa: E402


LOW = torch.bfloat16
GRAD_SCALE = 1.0  # the loss scale the gradients are stored at (fp16: 1024, as the test)


class RoundToLow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.to(LOW).to(torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return (grad * GRAD_SCALE).to(LOW).to(torch.float32) / GRAD_SCALE


def gradients(model, x, y, is_low):
    model.zero_grad()
    hooks = [m.register_forward_hook(lambda mod, inp, out: RoundToLow.apply(out))
             for m in model.modules() if is_low and isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))]
    relu = torch.relu
    if is_low:  # the blocks' ReLUs and residual sums are activations too
        torch.relu = lambda t: RoundToLow.apply(relu(t))
    try:
        out = model(RoundToLow.apply(x) if is_low else x)
        nn.functional.cross_entropy(out, y, label_smoothing=0.1).backward()
    finally:
        torch.relu = relu
        for h in hooks:
            h.remove()
    # per module (a layer of ddpworker's model: conv weight, batch norm gamma and beta, linear
    # weight and bias), in the order of model.modules()
    return [[p.grad.clone() for p in m.parameters(recurse=False)] for m in model.modules()
            if any(True for _ in m.parameters(recurse=False))]


def main():
    global LOW, GRAD_SCALE
    if sys.argv[1:] == ["fp16"]:
        LOW, GRAD_SCALE = torch.float16, 1024.0
    elif sys.argv[1:] not in ([], ["bf16"]):
        sys.exit(__doc__)
    for batch in (8, 32, 64):
        for seed in (0, 1):
            torch.manual_seed(seed)
            model, _ = torch_models.build("resnet18", 8, 16, 16, 3, 10)
            model.train()
            x = (torch.rand(batch, 3, 16, 16) * 2 - 1) * 2
            y = torch.arange(batch) % 10
            state = {k: v.clone() for k, v in model.state_dict().items()}
            exact = gradients(model, x, y, False)
            model.load_state_dict(state)
            low = gradients(model, x, y, True)
            diffs = [sum(((a - b) ** 2).sum().item() for a, b in zip(ea, la))
                     for ea, la in zip(exact, low)]
            refs = [sum((a ** 2).sum().item() for a in ea) for ea in exact]
            worst, layer = max(((d / r) ** 0.5, i) for i, (d, r) in enumerate(zip(diffs, refs))
                               if r > 0)
            print(f"batch {batch:3d} seed {seed}: relative gradient error "
                  f"{(sum(diffs) / sum(refs)) ** 0.5:.3f}, worst layer {layer} {worst:.3f}")


if __name__ == "__main__":
    main()
