#!/usr/bin/python3
"""Snapshots and crash recovery, measured on this machine.

  stall    : ddpworker (CPU backend, 2 ranks under ddprun) taking a snapshot every N steps: rank 0's
             stall per snapshot (copying the arenas to the writer's host buffers; the disk work runs
             on a thread) against a normal step, and the time a blocking write of the same snapshot
             takes (the final one), for a few models.
  recovery : kill -9 one of 2 workers mid-run; time from the kill to the first training step
             completed after resuming from the newest snapshot. Side by side with the anchor:
             torchrun (Debian's torch 1.13, -r 1 -t 1) running a PyTorch DDP script (gloo) of the
             same cnn, batch and data shape, checkpointing with torch.save every N steps and
             resuming with torch.load, as the PyTorch tutorials do. Prints both and the ratio.

Usage: /usr/bin/python3 tests/bench/bench_snapshot.py [--runs 3] [--json FILE]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from build_paths import build_path  # noqa: E402
ROOT = os.path.dirname(os.path.dirname(HERE))

CONF = """[model]
name = {model}
width = {width}
[data]
kind = synthetic
height = {size}
width = {size}
channels = {channels}
classes = 10
train_limit = {samples}
test_limit = 64
[optim]
lr = 0.01
[train]
batch_size = {batch}
max_steps = {steps}
log_interval = 1
metrics_file = {metrics}
[snapshot]
every = {every}
keep = 2
"""

TORCH_SCRIPT = r"""
import json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["MODELS_DIR"])
import torch_models
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
ckpt, log = os.environ["CKPT"], os.environ["STEP_LOG"]
model, _ = torch_models.build("cnn", 32, 28, 28, 1, 10)
model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
while step < int(os.environ["STEPS"]):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    step += 1
    if rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps({"step": step, "t": time.time()}) + "\n")
        if step % int(os.environ["EVERY"]) == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
dist.destroy_process_group()
"""


def read_events(path):
    """The complete JSON lines of path (a line being written is skipped)."""
    events = []
    try:
        for line in open(path):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    except FileNotFoundError:
        pass
    return events


def stall(model, width, size, channels, batch, steps, every):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        conf = os.path.join(tmp, "s.conf")
        open(conf, "w").write(CONF.format(model=model, width=width, size=size, channels=channels,
                                          samples=batch * 2 * steps, batch=batch, steps=steps,
                                          metrics=metrics, every=every))
        subprocess.run([build_path("launcher", "ddprun"), "--standalone", "--nproc-per-node", "2",
                        conf, f"snapshot.dir={tmp}/snap"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        events = read_events(metrics)
        trains = [e for e in events if e["event"] == "train"][2:]  # past the warm-up
        step_ms = statistics.median(batch * 2 / e["img_per_s"] * 1e3 for e in trains)
        snaps = [e for e in events if e["event"] == "snapshot"]
        stalls = [e["stall_ms"] for e in snaps if "written_ms" not in e]
        final = [e["written_ms"] for e in snaps if "written_ms" in e]
        size_mb = max(os.path.getsize(os.path.join(tmp, "snap", f))
                      for f in os.listdir(os.path.join(tmp, "snap")) if f.endswith(".ddps")) / 2**20
        return {"model": f"{model} w{width} {size}x{size}x{channels}", "step_ms": step_ms,
                "stall_ms": statistics.median(stalls), "blocking_write_ms": final[0],
                "snapshot_mb": size_mb}


def kill_one(pattern):
    out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in out]
    os.kill(max(pids), signal.SIGKILL)


def wait_for_resumed_step(path, timeout=120):
    """After a kill: the first step logged by the restarted job. The resumed job replays steps
    after its snapshot, so its first line has a step no later than the last one logged before
    the kill (the dying job may still log one step beyond)."""
    events = [e for e in read_events(path) if e.get("event", "train") == "train"]
    last, n_before = events[-1]["step"], len(events)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = [e for e in read_events(path) if e.get("event", "train") == "train"]
        if any(e["step"] <= last for e in events[n_before:]):
            return time.monotonic()
        time.sleep(0.002)
    sys.exit(f"bench_snapshot: no resumed step within {timeout} s in {path}: "
             f"{read_events(path)[n_before - 2:n_before + 3]}")


def wait_for_step(path, step):
    """Until a training step >= step is logged. Callers pick a step half-way between snapshots, so
    the resumed job's first step (the newest snapshot's + 1) is one the dying job already logged."""
    while not any(e.get("step", 0) >= step for e in read_events(path)):
        time.sleep(0.005)


def recovery_ddprun(steps=400, every=20, kill_after=70):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        conf = os.path.join(tmp, "r.conf")
        open(conf, "w").write(CONF.format(model="cnn", width=32, size=28, channels=1,
                                          samples=64 * 2 * steps, batch=64, steps=steps,
                                          metrics=metrics, every=every))
        job = subprocess.Popen([build_path("launcher", "ddprun"), "--standalone", "--nproc-per-node",
                                "2", "--max-restarts", "3", conf, f"snapshot.dir={tmp}/snap"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_step(metrics, kill_after)
        t0 = time.monotonic()
        kill_one(f"worker/ddpworker {conf}")
        t1 = wait_for_resumed_step(metrics)
        job.kill()
        job.wait()
        return (t1 - t0) * 1e3


def recovery_torchrun(steps=400, every=20, kill_after=70):
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        open(script, "w").write(TORCH_SCRIPT)
        log = os.path.join(tmp, "steps.jsonl")
        env = dict(os.environ, MODELS_DIR=os.path.join(ROOT, "tests", "interop"),
                   CKPT=os.path.join(tmp, "ckpt.pt"), STEP_LOG=log, STEPS=str(steps),
                   EVERY=str(every), OMP_NUM_THREADS="1")
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "-r", "1", "-t", "1",
                                "--standalone", "--nproc_per_node", "2", "--max_restarts", "3",
                                "--monitor_interval", "0.1", script], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_step(log, kill_after)
        t0 = time.monotonic()
        kill_one(f"-u {script}")
        t1 = wait_for_resumed_step(log)
        job.kill()
        job.wait()
        return (t1 - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    print("snapshot stall (rank 0, 2 ranks under ddprun, every 5 steps; median)")
    print(f"{'model':28} {'MB':>6} {'step ms':>8} {'stall ms':>9} {'stall/step':>10} "
          f"{'blocking write ms':>18}")
    rows = []
    for model, width, size, channels, batch, steps in [("cnn", 32, 28, 1, 64, 60),
                                                       ("resnet18", 16, 32, 3, 32, 30),
                                                       ("resnet18", 64, 32, 3, 8, 20)]:
        r = stall(model, width, size, channels, batch, steps, 5)
        rows.append(r)
        print(f"{r['model']:28} {r['snapshot_mb']:6.1f} {r['step_ms']:8.1f} {r['stall_ms']:9.2f} "
              f"{r['stall_ms'] / r['step_ms']:10.3f} {r['blocking_write_ms']:18.1f}")
    ours = [recovery_ddprun() for _ in range(args.runs)]
    theirs = [recovery_torchrun() for _ in range(args.runs)]
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"\nkill -9 of 1 of 2 workers -> first training step completed after resuming "
          f"(median of {args.runs})")
    print(f"ddprun + ddpworker: {o:8.1f} ms   torchrun + PyTorch (torch.save/load): {t:8.1f} ms"
          f"   ratio {t / o:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stall": rows, "recovery_ms": {"ddprun": ours, "torchrun": theirs}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
