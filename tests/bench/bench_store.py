#!/usr/bin/python3
"""ddprun's store against PyTorch's own TCPStore server, side by side in one run.

Both servers listen on 127.0.0.1 and are driven by the same load generator (bench_store_load) speaking
the legacy numbering, so they receive identical bytes (torch 1.13's server knows only that
numbering; ours speaks both). Each measurement runs against one server, then the other (the order
alternates), for SET, GET, ADD and WAIT wake-ups with 1, 16 and 128 clients. It prints ops/s,
p50/p99 latency, the ratio ours/torch, each server's CPU time per op (from /proc) and the load
generator's, then our server's peak RSS (VmRSS sampled during the 128-client runs, and VmHWM).

  in flight 1  : closed loop through ddprun's blocking client, one op in flight per client, as
                 PyTorch's client does (GET = WAIT, then GET; SET = SET + CHECK).
  in flight 16 : the same bytes pipelined on a raw socket, 16 ops per client in flight: the servers,
                 not the load generator, are saturated. (Not for WAIT.)

Exits 1 if a server cannot start or a run fails; with --check-targets also 3 if a target of the
project (>= 2x torch's ops/s and lower p99 at 128 clients, RSS < 50 MiB) is missed.

Usage: /usr/bin/python3 tests/bench/bench_store.py [--seconds S] [--json FILE] [--quick]
       [--check-targets]      (finds build-bench/, build/ or $DDP_BUILD_DIR)
"""
import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TICKS = os.sysconf("SC_CLK_TCK")
RSS_TARGET_MIB = 50
RATIO_TARGET = 2.0

TORCH_SERVER = r"""
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""


class BenchError(Exception):
    pass


def find(build_rel):
    dirs = [os.environ["DDP_BUILD_DIR"]] if os.environ.get("DDP_BUILD_DIR") else []
    for build in dirs + ["build-bench", "build"]:
        path = os.path.join(ROOT, build, build_rel)
        if os.access(path, os.X_OK):
            return path
    raise BenchError(f"{build_rel} is not built: cmake -S . -B build-bench && "
                     f"cmake --build build-bench --target ddprun bench_store_load")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Server:
    """One server process; the port comes from --port-file (ours) or its stdout (torch's)."""

    def __init__(self, name, argv, port_from_stdout, timeout_s=60):
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix="bench-store-")
        self.log = open(os.path.join(self.tmp, "stderr"), "w+")
        deadline = time.monotonic() + timeout_s
        if port_from_stdout:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True)
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            line = self.proc.stdout.readline() if ready else ""
            if not line.strip().isdigit():
                self.stop()
                raise BenchError(f"{name} server did not start: {self.stderr()}")
            self.port = int(line)
        else:
            port_file = os.path.join(self.tmp, "port")
            self.proc = subprocess.Popen(argv + ["--port-file", port_file], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self.log)
            while not os.path.exists(port_file):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise BenchError(f"{name} server did not start: {self.stderr()}")
                time.sleep(0.01)
            self.port = int(open(port_file).read())

    def stderr(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-2000:].strip() or "(no output)"

    def check_alive(self):
        if self.proc.poll() is not None:
            raise BenchError(f"{self.name} server exited ({self.proc.returncode}): {self.stderr()}")

    def stop(self):
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_load(bench, server, op, clients, depth, seconds, sample_rss):
    rss_peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            rss_peak[0] = max(rss_peak[0], status_kib(server.proc.pid, "VmRSS"))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample)
    if sample_rss:
        sampler.start()
    server.check_alive()
    cpu0 = cpu_seconds(server.proc.pid)
    argv = [bench, "--endpoint", f"127.0.0.1:{server.port}", "--legacy", "--op", op,
            "--clients", str(clients), "--depth", str(depth), "--seconds", str(seconds)]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds * 10 + 60)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{op} x{clients} against {server.name}: bench_store_load hung")
    finally:
        stop.set()
        if sample_rss:
            sampler.join()
    cpu1 = cpu_seconds(server.proc.pid)
    server.check_alive()
    if r.returncode != 0:
        raise BenchError(f"{op} x{clients} depth {depth} against {server.name} failed "
                         f"(exit {r.returncode}): {r.stderr.strip()}")
    result = json.loads(r.stdout)
    result["server_cpu_us_per_op"] = (cpu1 - cpu0) * 1e6 / result["ops"]
    if sample_rss:
        result["server_rss_peak_kib"] = rss_peak[0]
    return result


def fmt_us(us):
    return f"{us / 1000:.1f}ms" if us >= 10000 else f"{us:.0f}"


def print_row(row):
    a, b = row["ours"], row["torch"]
    print(" | ".join([
        f"{row['op']:<5} {row['clients']:>4} {row['depth']:>3}",
        f"{a['ops_per_s']:>9,.0f} {b['ops_per_s']:>9,.0f} {row['ratio']:>6.2f}x",
        f"{fmt_us(a['p50_us']):>6} / {fmt_us(a['p99_us']):>6}  "
        f"{fmt_us(b['p50_us']):>6} / {fmt_us(b['p99_us']):>6}",
        f"{a['server_cpu_us_per_op']:>5.1f} / {b['server_cpu_us_per_op']:>5.1f}",
        f"{a['client_cpu_us_per_op']:>5.1f}"]), flush=True)


HEADER = "\n".join(" | ".join(cols) for cols in [
    [f"{'op':<5} {'clnt':>4} {'in':>3}", f"{'ours/s':>9} {'torch/s':>9} {'ratio':>7}",
     f"{'ours p50/p99':>15}  {'torch p50/p99':>15}", f"{'server CPU':>13}", "load gen"],
    [f"{'':<14}", f"{'':>27}", f"{'(us)':>15}  {'(us)':>15}", f"{'us/op o / t':>13}",
     "CPU us/op"]])


def targets(rows, peak_mib, ncpu):
    """Lines saying which targets are met; the second item is whether all were."""
    lines, all_met = [], True
    for row in rows:
        if row["clients"] != 128:
            continue
        a, b = row["ours"], row["torch"]
        ok_ratio = row["ratio"] >= RATIO_TARGET
        ok_p99 = a["p99_us"] < b["p99_us"]
        all_met &= ok_ratio and ok_p99
        line = (f"  {row['op']:<5} x128 in flight {row['depth']:<2}: ratio {row['ratio']:.2f}x "
                f"{'met' if ok_ratio else 'MISSED'}, p99 {a['p99_us']:.0f} vs {b['p99_us']:.0f} us "
                f"{'met' if ok_p99 else 'MISSED'}")
        if row["op"] != "wait":
            # The load generator shares the cores with the server, so even a server costing no CPU
            # tops out at ncpu / (load generator CPU per op). (WAIT's load generator CPU includes
            # the rounds' set-up, outside the timed part, so no such bound is given for it.)
            bound = ncpu / (a["client_cpu_us_per_op"] * 1e-6)
            line += (f"; a zero-cost server could reach at most {bound:,.0f}/s = "
                     f"{bound / b['ops_per_s']:.2f}x torch on these {ncpu} cores")
        lines.append(line)
    ok_rss = peak_mib < RSS_TARGET_MIB
    all_met &= ok_rss
    lines.append(f"  RSS {peak_mib:.1f} MiB < {RSS_TARGET_MIB} MiB {'met' if ok_rss else 'MISSED'}")
    return lines, all_met


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement (default 3)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="in flight 1 only")
    ap.add_argument("--check-targets", action="store_true",
                    help="exit 3 if a target is missed (default: only report)")
    args = ap.parse_args()

    ddprun, bench = find("launcher/ddprun"), find("tests/bench/bench_store_load")
    plan = []
    for op in ("set", "get", "add", "wait"):
        for depth in ((1,) if op == "wait" or args.quick else (1, 16)):
            for clients in (1, 16, 128):
                plan.append((op, clients, depth))
    ours = torch = None
    rows = []
    try:
        ours = Server("ddprun", [ddprun, "store", "--host", "127.0.0.1", "--port", "0",
                                 "--log-level", "warn"], False)
        torch = Server("torch", ["/usr/bin/python3", "-c", TORCH_SERVER], True)
        print(f"ddprun store pid {ours.proc.pid} port {ours.port}; torch TCPStore pid "
              f"{torch.proc.pid} port {torch.port}; {args.seconds:g} s per measurement")
        print(HEADER, flush=True)
        for i, (op, clients, depth) in enumerate(plan):
            order = (ours, torch) if i % 2 == 0 else (torch, ours)
            res = {s.name: run_load(bench, s, op, clients, depth, args.seconds,
                                    sample_rss=s is ours and clients == 128) for s in order}
            a, b = res["ddprun"], res["torch"]
            rows.append({"op": op, "clients": clients, "depth": depth, "ours": a, "torch": b,
                         "ratio": a["ops_per_s"] / b["ops_per_s"]})
            print_row(rows[-1])
        hwm_kib = status_kib(ours.proc.pid, "VmHWM")
        rss_kib = status_kib(ours.proc.pid, "VmRSS")
    except BenchError as e:
        print(f"bench_store: {e}", file=sys.stderr)
        return 1
    finally:
        for s in (ours, torch):
            if s:
                s.stop()
    peak_128_kib = max(r["ours"]["server_rss_peak_kib"] for r in rows if r["clients"] == 128)
    peak_mib = max(peak_128_kib, hwm_kib) / 1024
    print(f"ddprun store RSS: peak {peak_128_kib / 1024:.1f} MiB sampled during the 128-client runs,"
          f" VmHWM {hwm_kib / 1024:.1f} MiB over the whole run, VmRSS {rss_kib / 1024:.1f} MiB at "
          f"the end")
    lines, all_met = targets(rows, peak_mib, os.cpu_count())
    print("targets at 128 clients (>= 2x torch's ops/s, lower p99) and RSS:")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ours_vmhwm_kib": hwm_kib, "ours_rss_peak_128_kib": peak_128_kib,
                       "seconds": args.seconds, "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "targets_met": all_met}, f,
                      indent=1)
    return 3 if args.check_targets and not all_met else 0


if __name__ == "__main__":
    sys.exit(main())
