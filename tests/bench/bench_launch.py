#!/usr/bin/python3
"""ddprun against Debian's torchrun (torch 1.13), side by side in one run, on one node:

  launch   : wall time of `--standalone --nproc-per-node 4` running /bin/true (--no-python), from
             exec to exit; median of N runs each.
  recovery : 4 workers; kill -9 one of them; time until all 4 replacement workers are running
             (each worker writes a timestamp when it starts); median of N runs each.

torchrun runs with `-r 1 -t 1` (its enum parsing breaks on the defaults on this Python) and
--monitor_interval 0.1. Prints each median and the ratio torchrun/ddprun.

Usage: /usr/bin/python3 tests/bench/bench_launch.py [--runs N] [--json FILE]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

WORKER = """#!/bin/sh
date +%s%N > "$OUT_DIR/start.$TORCHELASTIC_RESTART_COUNT.$LOCAL_RANK"
echo $$ > "$OUT_DIR/pid.$TORCHELASTIC_RESTART_COUNT.$LOCAL_RANK"
[ "$TORCHELASTIC_RESTART_COUNT" -ge 1 ] && exit 0
exec sleep 60
"""


def ddprun_bin():
    for build in (os.environ.get("DDP_BUILD_DIR", "build"), "build", "build-test"):
        path = os.path.join(ROOT, build, "launcher", "ddprun")
        if os.access(path, os.X_OK):
            return path
    sys.exit("bench_launch: ddprun not built")


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


def time_recovery(cmd, worker):
    out = tempfile.mkdtemp(prefix="bench-recovery-")
    env = dict(os.environ, OUT_DIR=out)
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        first = [f"{out}/pid.0.{r}" for r in range(4)]
        if not wait_files(first, 120):
            sys.exit(f"bench_launch: {cmd[0]}: workers did not start")
        victim = int(open(first[1]).read())
        t_kill = time.time_ns()
        os.kill(victim, signal.SIGKILL)
        second = [f"{out}/start.1.{r}" for r in range(4)]
        if not wait_files(second, 120):
            sys.exit(f"bench_launch: {cmd[0]}: workers were not restarted")
        started = max(int(open(p).read()) for p in second)
        proc.wait(timeout=120)
        return (started - t_kill) / 1e9
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description="ddprun vs torchrun: launch and recovery")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-launch-")
    worker = os.path.join(tmp, "worker.sh")
    with open(worker, "w") as f:
        f.write(WORKER)
    os.chmod(worker, 0o755)
    results = {}
    launch = commands(ddprun_bin(), "/bin/true", 0)
    recover = commands(ddprun_bin(), worker, 1)
    for name in ("ddprun", "torchrun"):
        results[name] = {
            "launch_s": statistics.median(time_launch(launch[name], tmp) for _ in range(args.runs)),
            "recovery_s": statistics.median(time_recovery(recover[name], worker)
                                            for _ in range(args.runs)),
        }
    for metric in ("launch_s", "recovery_s"):
        a, b = results["ddprun"][metric], results["torchrun"][metric]
        results[metric + "_ratio"] = b / a
        print(f"{metric[:-2]:9} ddprun {a * 1000:8.1f} ms   torchrun {b * 1000:8.1f} ms   "
              f"torchrun/ddprun {b / a:6.1f}x", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results, runs=args.runs, date=time.strftime("%Y-%m-%d")), f, indent=1)


if __name__ == "__main__":
    main()
