#!/usr/bin/python3
"""How far bf16 storage alone moves a ResNet-18's gradients: the reference figure behind the bound
of test_backend_cuda.c's one_resnet18_step_in_bf16_is_close_to_cpu. PyTorch computes in fp32 but
rounds every activation and every activation gradient to bf16 (what ddpworker's cuda backend does
in precision.mode=bf16); the relative norm error of all parameter gradients against plain fp32 is
printed for the test's network (width 8, 16x16x3, 10 classes, label smoothing 0.1) at a few batch
sizes and seeds. Seen on 2026-11-23 with Debian's torch 1.13: 0.27-0.32.

Usage: /usr/bin/python3 tests/interop/bf16_storage_emulation.py
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_models  # noqa: E402


class RoundToBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(torch.float32)


def gradients(model, x, y, is_bf16):
    model.zero_grad()
    hooks = [m.register_forward_hook(lambda mod, inp, out: RoundToBf16.apply(out))
             for m in model.modules() if is_bf16 and isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))]
    relu = torch.relu
    if is_bf16:  # the blocks' ReLUs and residual sums are activations too
        torch.relu = lambda t: RoundToBf16.apply(relu(t))
    try:
        out = model(RoundToBf16.apply(x) if is_bf16 else x)
        nn.functional.cross_entropy(out, y, label_smoothing=0.1).backward()
    finally:
        torch.relu = relu
        for h in hooks:
            h.remove()
    return [p.grad.clone() for p in model.parameters()]


def main():
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
            diff = sum(((a - b) ** 2).sum().item() for a, b in zip(exact, low))
            ref = sum((a ** 2).sum().item() for a in exact)
            print(f"batch {batch:3d} seed {seed}: relative gradient error {(diff / ref) ** 0.5:.3f}")


if __name__ == "__main__":
    main()
