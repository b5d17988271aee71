"""ddpworker's dynamic loss-scale rule (worker/nn/loss_scale.h, through tests/tools/loss_scale_probe)
against PyTorch's own, torch._amp_update_scale_ (what GradScaler.update calls), on the same
sequences of overflowed and clean steps: the scale and the growth tracker after every step, bit for
bit. Needs a torch with that op on the CPU (recent ones) or a GPU: Debian's 1.13 has it only for
CUDA, so on a CPU-only machine with it this skips; tests/gpu/run.sh runs it on the GPU machine."""
import random
import struct
import subprocess

import pytest

from conftest import built_tool

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def probe(build_dir):
    return built_tool(build_dir, "loss_scale_probe")


def update(device, scale, tracker, flag, interval):
    found = torch.tensor([float(flag)], dtype=torch.float32, device=device)
    torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, interval)


@pytest.fixture(scope="module")
def device():
    """Where this torch has _amp_update_scale_: the CPU, else a GPU."""
    for where in ("cpu", "cuda"):
        if where == "cuda" and not torch.cuda.is_available():
            break
        try:
            update(where, torch.ones(1, device=where), torch.zeros(1, dtype=torch.int32, device=where), 0, 1)
            return where
        except (RuntimeError, NotImplementedError):
            continue
    pytest.skip(f"torch {torch.__version__} has _amp_update_scale_ for no device here")


def torch_rule(device, flags, initial, interval):
    scale = torch.tensor([initial], dtype=torch.float32, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    out = []
    for flag in flags:
        update(device, scale, tracker, flag, interval)
        out.append((scale.item(), int(tracker.item())))
    return out


def probe_rule(probe, flags, initial, interval):
    r = subprocess.run([probe, repr(initial), str(interval)], input="\n".join(map(str, flags)),
                       capture_output=True, text=True, timeout=30, check=True)
    return [(float(s), int(g)) for s, g in (line.split() for line in r.stdout.splitlines())]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.mark.parametrize("initial, interval, p_inf, n", [
    (65536.0, 3, 0.2, 300),     # the usual: growth and back-off interleaved
    (65536.0, 1, 0.0, 200),     # growth every step up to fp32's top, never to inf
    (1.0, 5, 0.9, 200),         # mostly overflows: the scale shrinks into subnormals and to 0
    (f32(3.0e38), 2, 0.1, 50),  # starting next to the top
])
def test_the_rule_matches_torchs_amp_update_scale(probe, device, initial, interval, p_inf, n):
    rng = random.Random(hash((initial, interval, p_inf)))
    flags = [int(rng.random() < p_inf) for _ in range(n)]
    want = torch_rule(device, flags, initial, interval)
    got = probe_rule(probe, flags, initial, interval)
    for step, (w, g) in enumerate(zip(want, got)):
        assert f32(g[0]) == f32(w[0]) and g[1] == w[1], f"step {step}: torch {w}, ddpworker {g}"
