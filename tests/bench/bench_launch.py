#!/usr/bin/python3
"""ddprun against Debian's torchrun (torch 1.13), side by side in one run:

  launch      : wall time of `--standalone --nproc-per-node 4` running /bin/true (--no-python),
                from exec to exit; median of N runs each.
  recovery    : one agent with 4 workers; kill -9 one worker; time until all 4 replacement workers
                run (each worker writes a timestamp when it starts); median of N runs each.
  recovery2x2 : the same with 2 agents x 2 workers on loopback (c10d rendezvous), the killed worker
                on the second node.
  rdzv32      : 32 agents x 1 worker on loopback: from starting the agents to the first worker
                running (ddprun only; torchrun with 32 agents is run with --rdzv32-torchrun).

torchrun runs with `-r 1 -t 1` (its enum parsing breaks on the defaults on this Python) and
--monitor_interval 0.1. Prints each median and the ratio torchrun/ddprun.

--baseline PATH measures a second ddprun (the build before a change) in the same run, alternating
with this one run by run, so that a before/after comparison sees the same load; --no-torchrun-2x2
skips torchrun's 2 x 2 recovery (it does not recover: 60 s per run).

Usage: /usr/bin/python3 tests/bench/bench_launch.py [--runs N] [--json FILE] [--rdzv32-torchrun]
           [--baseline PATH] [--no-torchrun-2x2]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from build_paths import build_path

RECOVERY_LIMIT_S = 60

WORKER = """#!/bin/sh
date +%s%N > "$OUT_DIR/start.$TORCHELASTIC_RESTART_COUNT.$RANK"
echo $$ > "$OUT_DIR/pid.$TORCHELASTIC_RESTART_COUNT.$RANK"
[ "$TORCHELASTIC_RESTART_COUNT" -ge 1 ] || [ -n "$BENCH_EXIT_AT_ONCE" ] && exit 0
exec sleep 60
"""


def commands(ddprun, program, restarts):
    ours = [ddprun, "--standalone", "--nproc-per-node", "4", "--max-restarts", str(restarts),
            "--no-python", program]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "-r", "1", "-t", "1",
                "--standalone", "--nproc_per_node", "4", "--max_restarts", str(restarts),
                "--monitor_interval", "0.1", "--no_python", program]
    return {"ddprun": ours, "torchrun": torchrun}


def time_launch(cmd, tmp):
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=300)
    if r.returncode != 0:
        sys.exit(f"bench_launch: {cmd[0]} failed: {r.stderr[-2000:]}")
    return time.monotonic() - t0


def wait_files(paths, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in paths):
            return True
        time.sleep(0.001)
    return False


def median_or_none(values):
    """Median, where a run that never finished (None) counts as slower than any other."""
    vals = sorted(values, key=lambda v: float("inf") if v is None else v)
    return vals[len(vals) // 2]


def free_port():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def time_recovery(cmds, n_workers):
    """cmds: one command per agent. Kill one worker of the last agent; time the replacements."""
    out = tempfile.mkdtemp(prefix="bench-recovery-")
    env = dict(os.environ, OUT_DIR=out)
    procs = []
    for cmd in cmds:
        procs.append(subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        time.sleep(0.05)
    try:
        first = [f"{out}/pid.0.{r}" for r in range(n_workers)]
        if not wait_files(first, 120):
            sys.exit(f"bench_launch: {cmds[0][0]}: workers did not start")
        victim = int(open(first[-1]).read())
        t_kill = time.time_ns()
        os.kill(victim, signal.SIGKILL)
        second = [f"{out}/start.1.{r}" for r in range(n_workers)]
        if not wait_files(second, RECOVERY_LIMIT_S):
            if "torch.distributed.run" not in cmds[0]:
                sys.exit("bench_launch: ddprun did not restart every worker")
            return None  # the anchor did not recover in time: reported as such
        started = max(int(open(p).read()) for p in second)
        for p in procs:
            p.wait(timeout=120)
        return (started - t_kill) / 1e9
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(out, ignore_errors=True)


def multi_node(ddprun, program, n_agents, nproc, restarts, tool):
    port = free_port()
    if tool == "ddprun":
        return [[ddprun, "--nnodes", str(n_agents), "--nproc-per-node", str(nproc),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                 "bench", "--max-restarts", str(restarts), "--no-python", program]
                for _ in range(n_agents)]
    return [[sys.executable, "-m", "torch.distributed.run", "-r", "1", "-t", "1", "--nnodes",
             str(n_agents), "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "bench", "--max_restarts",
             str(restarts), "--monitor_interval", "0.1", "--no_python", program]
            for _ in range(n_agents)]


def time_rendezvous(cmds, n_workers):
    out = tempfile.mkdtemp(prefix="bench-rdzv-")
    env = dict(os.environ, OUT_DIR=out, BENCH_EXIT_AT_ONCE="1")
    t0 = time.time_ns()
    procs = [subprocess.Popen(c, cwd=out, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for c in cmds]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            starts = [f for f in os.listdir(out) if f.startswith("start.0.")]
            if starts:
                first = min(int(open(f"{out}/{f}").read() or 0) or 10 ** 20 for f in starts)
                if first < 10 ** 20:
                    break
            time.sleep(0.001)
        else:
            sys.exit("bench_launch: rendezvous did not start any worker")
        for p in procs:
            p.wait(timeout=300)
        if any(p.returncode for p in procs):
            sys.exit(f"bench_launch: an agent failed the {len(cmds)}-agent run")
        return (first - t0) / 1e9
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description="ddprun vs torchrun: launch, recovery, rendezvous")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--rdzv32-torchrun", action="store_true",
                    help="also time 32 torchrun agents (slow: a Python process each)")
    ap.add_argument("--baseline", help="another ddprun to measure alongside (before a change)")
    ap.add_argument("--no-torchrun-2x2", action="store_true",
                    help="skip torchrun's 2 x 2 recovery (it does not recover: 60 s per run)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-launch-")
    worker = os.path.join(tmp, "worker.sh")
    with open(worker, "w") as f:
        f.write(WORKER)
    os.chmod(worker, 0o755)
    bins = {"ddprun": build_path("launcher", "ddprun")}
    if args.baseline:
        bins["baseline"] = os.path.abspath(args.baseline)
    results = {name: {} for name in list(bins) + ["torchrun"]}

    def measure(metric, sample):
        """sample(name) -> seconds or None; the ddprun builds alternate run by run."""
        for group in ([n for n in bins], ["torchrun"]):
            if metric == "recovery2x2_s" and group == ["torchrun"] and args.no_torchrun_2x2:
                continue
            if metric == "rdzv32_s" and group == ["torchrun"]:
                continue
            got = {n: [] for n in group}
            for _ in range(args.runs):
                for n in group:
                    got[n].append(sample(n))
            for n in group:
                results[n][metric] = median_or_none(got[n])

    def ddprun_of(name):
        return bins.get(name, bins["ddprun"])

    measure("launch_s", lambda n: time_launch(commands(ddprun_of(n), "/bin/true", 0)[
        "torchrun" if n == "torchrun" else "ddprun"], tmp))
    measure("recovery_s", lambda n: time_recovery([commands(ddprun_of(n), worker, 1)[
        "torchrun" if n == "torchrun" else "ddprun"]], 4))
    measure("recovery2x2_s", lambda n: time_recovery(multi_node(
        ddprun_of(n), worker, 2, 2, 1, "torchrun" if n == "torchrun" else "ddprun"), 4))
    measure("rdzv32_s", lambda n: time_rendezvous(multi_node(ddprun_of(n), worker, 32, 1, 0,
                                                             "ddprun"), 32))
    if args.rdzv32_torchrun:
        results["torchrun"]["rdzv32_s"] = time_rendezvous(
            multi_node(bins["ddprun"], worker, 32, 1, 0, "torchrun"), 32)
    for metric in ("launch_s", "recovery_s", "recovery2x2_s", "rdzv32_s"):
        b = results["torchrun"].get(metric, "not run")
        for name in bins:
            a = results[name][metric]
            line = f"{metric[:-2]:12} {name:8} {a * 1000:8.1f} ms"
            if b is None:
                line += f"   torchrun did not recover within {RECOVERY_LIMIT_S} s (median run)"
            elif b != "not run":
                results[name][metric + "_ratio"] = b / a
                line += f"   torchrun {b * 1000:8.1f} ms   torchrun/{name} {b / a:6.1f}x"
            print(line, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results, runs=args.runs, date=time.strftime("%Y-%m-%d"),
                           binaries=bins), f, indent=1)


if __name__ == "__main__":
    main()
