#!/usr/bin/env python3
"""Startup and recovery latency on one GPU: ddprun + ddpworker against torchrun + a PyTorch DDP
script, side by side in one run. Both train the same CIFAR-style ResNet-18 (tests/interop/
torch_models.py mirrors worker/nn/model.c) on synthetic 32x32x3 input, batch --batch, SGD (lr 0.01,
momentum 0.9, Nesterov, weight decay 5e-4), one worker (--nproc-per-node 1, --max-restarts 3),
a snapshot every 10 steps.

  launch to first step    : from starting the launcher to the first line `step 1/N` on its
                            stdout (rank 0 prints one line per completed step).
  kill -9 to resumed step : once a snapshot of step >= --kill-after exists, SIGKILL the worker
                            (the launcher restarts it); from the kill to the first completed step
                            after the restarted worker says it resumed from a snapshot.

The PyTorch side is the standard torchrun recipe, written into the temp dir: init_process_group
(nccl, gloo on CPU), cuda.set_device(LOCAL_RANK), DDP, channels_last, the batch already on the
device; it loads its checkpoint (torch.load: model, optimizer, step) when one exists and saves one
(torch.save to a temp file, then os.replace) every 10 steps; each step ends with loss.item().
torchrun runs with its defaults (--torchrun-monitor-interval to change its polling). Each line is
stamped when this script reads it. Prints the medians of --repeats runs and torchrun/ddprun.
Two ddprun sides: `ddprun` starts fresh workers (--warm-spares 0), `ddprun-spares` keeps a warm
spare (--warm-spares 1) that the restart takes over, killed only once the spare says it is ready
(that job gets 20x the steps and is ended once measured); ddprun's killed worker is the pid its
last "start" event names (the newest ddpworker process is the waiting spare).

Usage: python3 tests/bench/bench_gpu_startup.py [--batch 512] [--steps 60] [--width 64]
           [--repeats 1] [--backend cuda|cpu] [--torch-python PYTHON]
           [--sides ddprun,ddprun-spares,torchrun]
           [--timeout 300] [--json FILE]
CPU check: DDP_BUILD_DIR=build-test /usr/bin/python3 tests/bench/bench_gpu_startup.py \\
           --backend cpu --batch 32 --steps 40 --width 8 --torch-python /usr/bin/python3
"""
import argparse
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ALGO_CACHE = os.path.join(tempfile.gettempdir(), "bench_gpu_startup_cudnn_algos.txt")
from build_paths import build_path  # noqa: E402
ROOT = os.path.dirname(os.path.dirname(HERE))
INTEROP = os.path.join(ROOT, "tests", "interop")

SNAPSHOT_EVERY = 10
SIDES = ("ddprun", "ddprun-spares", "torchrun")
STEP_RE = re.compile(r"\bstep (\d+)/(\d+)")
RESUME_RE = re.compile(r"resuming from .*: step (\d+)")

TORCH_SCRIPT = r'''
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, {interop!r})
import torch_models  # noqa: E402

DEVICE, WIDTH, BATCH, STEPS, EVERY = {device!r}, {width}, {batch}, {steps}, {every}
CKPT, METRICS = {ckpt!r}, {metrics!r}
H, W, C, CLASSES = 32, 32, 3, 10


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    if DEVICE == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, _ = torch_models.build("resnet18", WIDTH, H, W, C, CLASSES)
    model = model.to(device).to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    step = 0
    if os.path.exists(CKPT):
        ckpt = torch.load(CKPT, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        if rank == 0:
            print(f"torch: resuming from {{CKPT}}: step {{step}}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if DEVICE == "cuda" else None)
    x = torch.randn(BATCH, C, H, W, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (BATCH,), device=device)
    while step < STEPS:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        value = loss.item()  # waits for the step to finish on the device
        step += 1
        if rank == 0:
            print(f"step {{step}}/{{STEPS}}  loss {{value:.4f}}", flush=True)
            if step % EVERY == 0 and step < STEPS:
                torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}}, CKPT + ".tmp")
                os.replace(CKPT + ".tmp", CKPT)
                with open(METRICS, "a") as f:
                    f.write(json.dumps({{"event": "snapshot", "step": step}}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


class BenchError(Exception):
    pass


class Output:
    """Reads a process's stdout line by line in a thread, stamping each with time.monotonic()."""

    def __init__(self, proc):
        self.proc, self.lines, self.eof = proc, [], False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_for(self, match, start, deadline, what):
        """The first (index, stamp, line) at index >= start for which match(line) is true."""
        with self.cond:
            while True:
                for i in range(start, len(self.lines)):
                    if match(self.lines[i][1]):
                        return i, self.lines[i][0], self.lines[i][1]
                start = len(self.lines)
                if self.eof:
                    try:
                        rc = self.proc.wait(5)
                    except subprocess.TimeoutExpired:
                        rc = "unknown: its output closed"
                    raise BenchError(f"the job ended (exit {rc}) before {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"timed out waiting for {what}")
                self.cond.wait(min(left, 0.5))

    def count(self):
        with self.cond:
            return len(self.lines)

    def tail(self, n=30):
        with self.cond:
            return "\n".join(line for _, line in self.lines[-n:])


def step_of(line):
    m = STEP_RE.search(line)
    return int(m.group(1)) if m else None


def snapshot_step(metrics):
    """The newest snapshot's step in a metrics file of JSON lines, or None."""
    best = None
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line still being written
                if event.get("event") == "snapshot":
                    best = max(best or 0, int(event["step"]))
    except FileNotFoundError:
        pass
    return best


def proc_info(pid):
    """(parent pid, start time in clock ticks) of a live, non-zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def last_start(metrics):
    """ddpworker's last "start" event in the metrics file ({} before the first)."""
    start = {}
    try:
        with open(metrics) as f:
            for line in f:
                event = json.loads(line)
                if event.get("event") == "start":
                    start = event
    except FileNotFoundError:
        pass
    return start


def started_worker(metrics):
    """The pid of the worker whose start rank 0 recorded last: with warm spares, the newest
    ddpworker process is the waiting spare, not the one that trains."""
    return last_start(metrics).get("pid")


def find_worker(pattern, exclude):
    """The worker among the processes whose command line matches `pattern` (pgrep -f): the
    launcher (or ddprun's per-worker shim) matches too, so take a match none of whose children
    matches, the newest if several."""
    r = subprocess.run(["pgrep", "-f", pattern], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in r.stdout.split() if int(p) not in exclude]
    info = {p: proc_info(p) for p in pids}
    info = {p: i for p, i in info.items() if i}
    parents = {ppid for ppid, _ in info.values()}
    leaves = [p for p in info if p not in parents]
    return max(leaves, key=lambda p: info[p][1]) if leaves else None


def kill_tree(proc, pattern):
    """End the launcher (SIGTERM, then SIGKILL to its process group) and then any process that
    is still running our temp dir's files (pattern), by pid."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for _ in range(50):
        r = subprocess.run(["pgrep", "-f", pattern], stdout=subprocess.PIPE, text=True)
        left = [int(p) for p in r.stdout.split() if int(p) != os.getpid()]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    print(f"warning: processes left behind: {left}", file=sys.stderr)


TRACE_RE = re.compile(r"ddpworker: startup: (.*) ([0-9.]+) s$")


def print_startup_trace(name, out, end, t0, t1):
    """The first worker's DDP_STARTUP_TRACE lines (among the first `end` lines of output): each
    phase's own duration and when this script read the line (after launch; step 1 was read at
    t1), so that the gaps show what the launcher and the process start took."""
    with out.cond:
        lines = out.lines[:end]
    trace = [(stamp, m.group(1), float(m.group(2))) for stamp, line in lines
             if (m := TRACE_RE.search(line))]
    if not trace:
        return
    print(f"  {name}: where launch to step 1 ({t1 - t0:.3f} s) went (read at, phase, its "
          "duration):", flush=True)
    for stamp, phase, seconds in trace:
        print(f"    +{stamp - t0:6.3f} s  {phase}: {seconds:.3f} s", flush=True)


def measure(name, cmd, env, cwd, metrics, worker_pattern, args, ready=None):
    """Run one job; returns (launch to first step, kill -9 to resumed step) in seconds. ready: what
    must also hold before the kill (a warm spare ready); such a job is ended once measured, since
    it is given more steps than it needs."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, errors="replace", start_new_session=True)
    out = Output(proc)
    try:
        _, t1, _ = out.wait_for(lambda line: step_of(line) == 1, 0, t0 + args.timeout,
                                "the first step")
        launch = t1 - t0

        deadline = time.monotonic() + args.timeout
        while True:
            snap = snapshot_step(metrics)
            if snap is not None and snap >= args.kill_after and (ready is None or ready()):
                break
            if proc.poll() is not None:
                raise BenchError(f"the job ended (exit {proc.returncode}) before a snapshot of "
                                 f"step >= {args.kill_after}")
            if time.monotonic() > deadline:
                raise BenchError(f"timed out waiting for a snapshot of step >= {args.kill_after}")
            time.sleep(0.005)
        pid = None
        while pid is None:
            pid = (started_worker(metrics) if worker_pattern is None
                   else find_worker(worker_pattern, {os.getpid(), proc.pid}))
            if pid is None:
                if time.monotonic() > deadline:
                    raise BenchError(f"no worker process matches {worker_pattern!r}")
                time.sleep(0.01)
        start = out.count()
        print_startup_trace(name, out, start, t0, t1)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        deadline = t_kill + args.timeout
        i, _, line = out.wait_for(lambda line: RESUME_RE.search(line), start, deadline,
                                  "the restarted worker to resume from a snapshot")
        resumed = int(RESUME_RE.search(line).group(1))
        _, t2, _ = out.wait_for(lambda line: (step_of(line) or 0) > resumed, i + 1, deadline,
                                f"the first step after resuming from step {resumed}")
        recovery = t2 - t_kill
        print(f"  {name}: launch to step 1 {launch:.2f} s; killed pid {pid} after snapshot "
              f"{snap}, resumed from step {resumed}, next step after {recovery:.2f} s", flush=True)
        if ready is not None:
            if not last_start(metrics).get("warm_spare"):
                raise BenchError("the restarted round did not run in the warm spare")
            return launch, recovery

        try:
            rc = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise BenchError("timed out waiting for the job to finish")
        out.thread.join(10)
        if rc != 0:
            raise BenchError(f"the job exited with {rc}")
        return launch, recovery
    except BenchError as e:
        raise BenchError(f"{name}: {e}\n--- last output of {name} ---\n{out.tail()}") from None
    finally:
        kill_tree(proc, re.escape(cwd))


def clean_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PET_")}


def spare_is_ready(log_dir):
    """A spare under ddprun's --log-dir has said it is ready (its output file)."""
    for path in glob.glob(os.path.join(log_dir, "*", "spares", "*", "output.log")):
        with open(path, errors="replace") as f:
            if "warm spare ready" in f.read():
                return True
    return False


def run_ddprun(args, spares=0):
    with tempfile.TemporaryDirectory(prefix="bench_startup_ddprun_") as tmp:
        conf, metrics = os.path.join(tmp, "train.conf"), os.path.join(tmp, "metrics.jsonl")
        log_dir = os.path.join(tmp, "logs")
        # a spare starts once the round trains and is ready a CUDA start later: room to wait for
        # it before the kill (the job is ended once measured)
        steps = args.steps * 20 if spares else args.steps
        with open(conf, "w") as f:
            f.write(f"[model]\nname = resnet18\nwidth = {args.width}\n"
                    f"[data]\nkind = synthetic\nheight = 32\nwidth = 32\nchannels = 3\n"
                    f"classes = 10\ntrain_limit = {args.batch * args.steps * 2}\n"
                    f"test_limit = {args.batch}\n"
                    f"[optim]\nlr = 0.01\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.0005\n"
                    f"schedule = constant\n"
                    f"[train]\nbackend = {args.backend}\nbatch_size = {args.batch}\n"
                    f"max_steps = {steps}\nlog_interval = 1\nmetrics_file = {metrics}\n"
                    f"[snapshot]\ndir = {os.path.join(tmp, 'snaps')}\n"
                    f"every = {SNAPSHOT_EVERY}\nkeep = 2\n")
        env = clean_env()
        env["DDPWORKER"] = build_path("worker", "ddpworker")
        # cuDNN's algorithm search runs once per machine; the cache outlives the run's directory,
        # so the first repeat starts cold and the later ones warm, as a user's runs do
        env.setdefault("DDPWORKER_ALGO_CACHE", ALGO_CACHE)
        env.setdefault("DDP_STARTUP_TRACE", "1")  # ddpworker's start-up phases (startup_trace.h)
        cmd = [build_path("launcher", "ddprun"), "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "3", "--warm-spares", str(spares), "--log-dir", log_dir, conf]
        return measure("ddprun-spares" if spares else "ddprun", cmd, env, tmp, metrics, None, args,
                       ready=(lambda: spare_is_ready(log_dir)) if spares else None)


def run_torchrun(args):
    with tempfile.TemporaryDirectory(prefix="bench_startup_torch_") as tmp:
        script, metrics = os.path.join(tmp, "train.py"), os.path.join(tmp, "metrics.jsonl")
        with open(script, "w") as f:
            f.write(TORCH_SCRIPT.format(interop=INTEROP, device=args.backend, width=args.width,
                                        batch=args.batch, steps=args.steps, every=SNAPSHOT_EVERY,
                                        ckpt=os.path.join(tmp, "checkpoint.pt"),
                                        metrics=metrics))
        cmd = [args.torch_python, "-m", "torch.distributed.run"]
        if args.torch_version.startswith("1.") or (args.torch_version == "?" and
                                                   args.torch_python == "/usr/bin/python3"):
            cmd += ["-r", "1", "-t", "1"]  # Debian's torch 1.13: its enum parsing breaks on the defaults
        cmd += ["--standalone", "--nproc_per_node", "1", "--max_restarts", "3",
                "--log_dir", os.path.join(tmp, "logs")]
        if args.torchrun_monitor_interval is not None:
            cmd += ["--monitor_interval", str(args.torchrun_monitor_interval)]
        cmd.append(script)
        return measure("torchrun", cmd, clean_env(), tmp, metrics, re.escape(script), args)


def torch_description(python):
    code = ("import torch; print(torch.__version__); "
            "print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")
    try:
        r = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, timeout=120)
        version, device = (r.stdout.strip().splitlines() + ["?", "?"])[:2]
        return version, device
    except (OSError, subprocess.TimeoutExpired):
        return "?", "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                    help="ddpworker's train.backend; the PyTorch side runs on the same device")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60, help="max_steps of each job")
    ap.add_argument("--width", type=int, default=64, help="ResNet-18's base width")
    ap.add_argument("--kill-after", type=int, default=20,
                    help="kill the worker once a snapshot of at least this step exists")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side; medians are printed")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="the Python whose torch (torch.distributed.run) runs the PyTorch side")
    ap.add_argument("--torchrun-monitor-interval", type=float,
                    help="torchrun --monitor-interval (default: torchrun's own)")
    ap.add_argument("--sides", default="ddprun,ddprun-spares,torchrun",
                    help="ddprun: fresh workers (--warm-spares 0); ddprun-spares: --warm-spares 1")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each phase may take")
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.path.exists(ALGO_CACHE):  # the first ddprun repeat is a cold start
        os.remove(ALGO_CACHE)
    sides = args.sides.split(",")
    if any(s not in SIDES for s in sides):
        ap.error("--sides: any of " + ",".join(SIDES))
    if args.kill_after < SNAPSHOT_EVERY or args.steps < args.kill_after + 2 * SNAPSHOT_EVERY:
        ap.error(f"need --kill-after >= {SNAPSHOT_EVERY} and --steps >= --kill-after + "
                 f"{2 * SNAPSHOT_EVERY}")

    version, device = torch_description(args.torch_python) if "torchrun" in sides else ("-", "-")
    args.torch_version = version
    print(f"ddprun + ddpworker ({args.backend}) vs torchrun + PyTorch {version} on {device}: "
          f"resnet18 width {args.width}, batch {args.batch}, {args.steps} steps, snapshot every "
          f"{SNAPSHOT_EVERY}, kill -9 after the snapshot of step >= {args.kill_after}, "
          f"{args.repeats} run(s) each", flush=True)
    runs = {s: {"launch_s": [], "resume_s": []} for s in sides}
    runners = {"ddprun": run_ddprun, "ddprun-spares": lambda a: run_ddprun(a, spares=1),
               "torchrun": run_torchrun}
    try:
        for _ in range(args.repeats):
            for side in sides:
                launch, resume = runners[side](args)
                runs[side]["launch_s"].append(launch)
                runs[side]["resume_s"].append(resume)
    except BenchError as e:
        print(f"bench_gpu_startup: {e}", file=sys.stderr)
        sys.exit(1)

    results = []
    for key, label in (("launch_s", "launch to first step"), ("resume_s", "kill -9 to resumed step")):
        row = {"phase": label}
        for side in SIDES:
            row[f"{side}_s"] = statistics.median(runs[side][key]) if side in runs else None
        ref = row["torchrun_s"]
        for side in ("ddprun", "ddprun-spares"):
            ours = row[f"{side}_s"]
            row[f"ratio_{side}"] = ref / ours if ours and ref else None
        results.append(row)
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    print(f"\n{'':24} {'ddprun s':>9} {'+spares s':>10} {'torchrun s':>11} {'ratio':>6} "
          f"{'ratio +spares':>14}")
    for r in results:
        print(f"{r['phase']:24} {fmt(r['ddprun_s'], '.2f'):>9} {fmt(r['ddprun-spares_s'], '.2f'):>10} "
              f"{fmt(r['torchrun_s'], '.2f'):>11} {fmt(r['ratio_ddprun'], '.1f'):>6} "
              f"{fmt(r['ratio_ddprun-spares'], '.1f'):>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "model": "resnet18", "width": args.width,
                       "batch": args.batch, "steps": args.steps, "kill_after": args.kill_after,
                       "repeats": args.repeats, "torch": version, "device": device,
                       "runs": runs, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
