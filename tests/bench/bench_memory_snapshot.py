#!/usr/bin/python3
"""Memory snapshots (snapshot.every_memory), measured on this machine, side by side in one run.

  overhead : ddpworker (CPU backend, 2 ranks under ddprun) with a memory snapshot after every step
             against the same run with none (every_memory = 0), alternating on/off runs so both
             see the same machine; the median step time of each (log_interval 1, past the
             warm-up), the difference in %, and rank 0's own time per memory snapshot (what the
             training thread waits for: the statistics' copy, the slot, the copy before the
             optimizer; the checksums are on the writer's thread) against a step. On a shared,
             loaded machine the step times' difference is noise; the CPU seconds of the whole run
             (workers and agent, from getrusage of the children), on against off, are the
             steadier measure of what the snapshots cost, and the stall of what training waits.
             "seal CPU" is the thread CPU time of each snapshot's copies, checksums and checks
             (CLOCK_THREAD_CPUTIME_ID, whichever thread made them: a load-independent cost),
             against a rank's CPU time per step in the off runs (the run's CPU seconds / ranks /
             steps, start-up included). "taken" is the share of due snapshots taken (a GPU skips
             one due while the last is still being copied or sealed; the cpu backend takes all).
  recovery : kill -9 of one of 2 workers mid-run, from the kill to the first training step the
             restarted workers complete; resumed from memory (every_memory = 1) against today's
             disk path (every_memory = 0, snapshot.every = 20, killed half-way between two disk
             snapshots), with the steps each lost (the "resume" event).

Run it niced on a shared machine:
  nice -n 10 /usr/bin/python3 tests/bench/bench_memory_snapshot.py [--rounds 3] [--json FILE]
On a GPU (tests/gpu/run.sh memsnap): --backend cuda --ranks 1 --precision bf16 runs ResNet-18
(CIFAR shape) and ResNet-50 (128x128) instead, one rank on the GPU; the copy is then the
side-stream one, overlapped with the next step.
"""
import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_snapshot import CONF, read_events, wait_for_step  # noqa: E402
from build_paths import build_path  # noqa: E402

MODELS = [("cnn", 32, 28, 1, 64, 120), ("resnet18", 16, 32, 3, 32, 50),
          ("resnet18", 64, 32, 3, 8, 30)]
GPU_MODELS = [("resnet18", 64, 32, 3, 256, 120), ("resnet50", 64, 128, 3, 128, 60)]
EXTRA = []   # train.conf overrides of every run (--backend, --precision)
RANKS = 2


def write_conf(tmp, model, width, size, channels, batch, steps, every):
    metrics = os.path.join(tmp, "m.jsonl")
    conf = os.path.join(tmp, "b.conf")
    open(conf, "w").write(CONF.format(model=model, width=width, size=size, channels=channels,
                                      samples=batch * RANKS * steps, batch=batch, steps=steps,
                                      metrics=metrics, every=every))
    return conf, metrics


def one_run(model, width, size, channels, batch, steps, memory):
    """(step times in ms past the warm-up, rank 0's memory snapshot stall per snapshot in ms, CPU
    seconds of the run, CPU ms per snapshot's sealing)."""
    with tempfile.TemporaryDirectory() as tmp:
        conf, metrics = write_conf(tmp, model, width, size, channels, batch, steps, 0)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([build_path("launcher", "ddprun"), "--standalone", "--nproc-per-node",
                        str(RANKS), conf, f"snapshot.dir={tmp}/snap",
                        f"snapshot.every_memory={memory}", *EXTRA],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        events = read_events(metrics)
        trains = [e for e in events if e["event"] == "train"][3:]
        step_ms = [batch * RANKS / e["img_per_s"] * 1e3 for e in trains]
        mem = [e for e in events if e["event"] == "memory_snapshots"]
        if memory and not mem:
            sys.exit("bench_memory_snapshot: no memory_snapshots event: not under ddprun?")
        # a GPU skips a snapshot due while the last is on its way: the share taken
        taken = (mem[0]["count"] / (mem[0]["count"] + mem[0].get("skipped", 0))) if mem else 0.0
        return (step_ms, (mem[0]["stall_ms_mean"] if mem else 0.0), cpu_s,
                mem[0].get("seal_cpu_ms_mean", 0.0) if mem else 0.0, taken)


def overhead(spec, rounds):
    on, off, stalls, seals, taken, cpu = [], [], [], [], [], {0: [], 1: []}
    for r in range(rounds):
        for memory in ((1, 0) if r % 2 == 0 else (0, 1)):
            steps, stall, cpu_s, seal, share = one_run(*spec, memory)
            (on if memory else off).extend(steps)
            cpu[memory].append(cpu_s)
            if memory:
                stalls.append(stall)
                seals.append(seal)
                taken.append(share)
    m_on, m_off = statistics.median(on), statistics.median(off)
    model, width, size, channels, batch, n_steps = spec
    step_cpu_ms = statistics.median(cpu[0]) / (RANKS * n_steps) * 1e3
    return {"model": f"{model} w{width} {size}x{size}x{channels} b{batch}", "step_ms_off": m_off,
            "step_ms_on": m_on, "overhead_pct": (m_on / m_off - 1) * 100,
            "stall_ms": statistics.median(stalls),
            "stall_pct": statistics.median(stalls) / m_off * 100,
            "cpu_s_off": statistics.median(cpu[0]), "cpu_s_on": statistics.median(cpu[1]),
            "cpu_pct": (statistics.median(cpu[1]) / statistics.median(cpu[0]) - 1) * 100,
            "seal_cpu_ms": statistics.median(seals),
            "seal_cpu_pct": statistics.median(seals) / step_cpu_ms * 100,
            "taken_pct": statistics.median(taken) * 100}


def wait_for_restart_step(metrics, starts_before, timeout=120):
    """The moment the restarted worker (a new "start" event) logs its first training step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(metrics)
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        if len(starts) > starts_before and any(e["event"] == "train"
                                               for e in events[starts[-1]:]):
            return time.monotonic(), events
        time.sleep(0.002)
    sys.exit(f"bench_memory_snapshot: no step after the restart within {timeout} s")


def recovery(memory, spec, steps=400, every=20, kill_after=70):
    """(ms from the kill to the first step after it, steps lost, resume source)."""
    model, width, size, channels, batch, _ = spec
    with tempfile.TemporaryDirectory() as tmp:
        conf, metrics = write_conf(tmp, model, width, size, channels, batch, steps, every)
        job = subprocess.Popen([build_path("launcher", "ddprun"), "--standalone",
                                "--nproc-per-node", str(RANKS), "--max-restarts", "3", conf,
                                f"snapshot.dir={tmp}/snap", f"snapshot.every_memory={memory}",
                                *EXTRA],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_step(metrics, kill_after)
            events = read_events(metrics)
            starts = [e for e in events if e["event"] == "start"]
            reached = max(e.get("step", 0) for e in events if e["event"] == "train")
            t0 = time.monotonic()
            # rank 0 by the pid its start event names: on a GPU node the newest ddpworker is
            # the warm spare, which trains nothing (killing it restarts nothing)
            os.kill(starts[-1]["pid"], signal.SIGKILL)
            t1, events = wait_for_restart_step(metrics, len(starts))
        finally:
            job.kill()
            job.wait()
        resume = [e for e in events if e["event"] == "resume"]
        lost = resume[-1]["steps_lost"] if resume else None
        if resume and lost < 0:  # no progress record: what the metrics saw before the kill
            lost = reached - resume[-1]["step"]
        return (t1 - t0) * 1e3, lost, resume[-1]["source"] if resume else "none"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs per model; recoveries")
    ap.add_argument("--models", default="all", help="'all', or how many of the list to run")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--precision", default=None, help="precision.mode (cuda: bf16, fp16, ...)")
    ap.add_argument("--no-recovery", action="store_true", help="the overhead table alone")
    ap.add_argument("--json")
    args = ap.parse_args()
    global RANKS
    RANKS = args.ranks
    EXTRA.append(f"train.backend={args.backend}")
    if args.precision:
        EXTRA.append(f"precision.mode={args.precision}")
    table = GPU_MODELS if args.backend == "cuda" else MODELS
    models = table if args.models == "all" else table[:int(args.models)]
    print(f"memory snapshot every step vs none ({RANKS} rank(s) under ddprun, {args.backend}"
          f"{' ' + args.precision if args.precision else ''}; median step time over "
          f"{args.rounds} alternating on/off runs each)")
    print(f"{'model':30} {'off ms':>8} {'on ms':>8} {'overhead':>9} {'stall ms':>9} "
          f"{'stall/step':>10} {'CPU s off':>9} {'CPU s on':>9} {'CPU +':>7} {'seal CPU ms':>11} "
          f"{'/step CPU':>9} {'taken':>6}")
    rows = []
    for spec in models:
        r = overhead(spec, args.rounds)
        rows.append(r)
        print(f"{r['model']:30} {r['step_ms_off']:8.2f} {r['step_ms_on']:8.2f} "
              f"{r['overhead_pct']:8.2f}% {r['stall_ms']:9.3f} {r['stall_pct']:9.3f}% "
              f"{r['cpu_s_off']:9.2f} {r['cpu_s_on']:9.2f} {r['cpu_pct']:6.2f}% "
              f"{r['seal_cpu_ms']:11.3f} {r['seal_cpu_pct']:8.3f}% {r['taken_pct']:5.0f}%",
              flush=True)
    runs = {"memory": [], "disk": []}
    if args.no_recovery:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"overhead": rows}, f, indent=1)
        return
    for i in range(args.rounds):
        for memory in ((1, 0) if i % 2 == 0 else (0, 1)):
            runs["memory" if memory else "disk"].append(recovery(memory, models[0]))
    print(f"\nkill -9 of 1 of {RANKS} workers at step 70 ({models[0][0]}, disk snapshots every "
          f"20) -> first step completed after the restart (median of {args.rounds})")
    for name, rs in runs.items():
        ms = statistics.median(r[0] for r in rs)
        print(f"  {name:7}: {ms:8.1f} ms, steps lost {[r[1] for r in rs]}, "
              f"sources {sorted(set(r[2] for r in rs))}")
    mem_ms = statistics.median(r[0] for r in runs["memory"])
    disk_ms = statistics.median(r[0] for r in runs["disk"])
    print(f"  disk / memory: {disk_ms / mem_ms:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": rows, "recovery": runs}, f, indent=1)


if __name__ == "__main__":
    main()
