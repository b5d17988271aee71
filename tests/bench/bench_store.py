#!/usr/bin/python3
"""ddprun's store against PyTorch's own TCPStore server, side by side in one run.

Both servers run on 127.0.0.1 and are driven by the same load generator (store_bench) speaking the
legacy numbering, so they receive identical bytes (torch 1.13's server knows only that numbering;
ours speaks both). For SET, GET, ADD and WAIT wake-ups with 1, 16 and 128 clients it prints ops/s,
p50/p99 latency, the ratio ours/torch, and each server's CPU time per op (from /proc), then our
server's peak RSS.

  depth 1  : closed loop, one op in flight per client, exactly like PyTorch's client.
  depth 16 : 16 ops in flight per client: the servers, not the load generator, are saturated.

Usage: /usr/bin/python3 tests/bench/bench_store.py [--seconds S] [--json FILE] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TICKS = os.sysconf("SC_CLK_TCK")

TORCH_SERVER = r"""
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""


def find(build_rel):
    for build in (os.environ.get("DDP_BUILD_DIR", "build"), "build", "build-test"):
        path = os.path.join(ROOT, build, build_rel)
        if os.access(path, os.X_OK):
            return path
    sys.exit(f"bench_store: {build_rel} not built (cmake --build build)")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Server:
    def __init__(self, name, argv, port_from_stdout):
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix="bench-store-")
        if port_from_stdout:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            self.port = int(self.proc.stdout.readline())
        else:
            port_file = os.path.join(self.tmp, "port")
            self.proc = subprocess.Popen(argv + ["--port-file", port_file],
                                         stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while not os.path.exists(port_file):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"bench_store: {name} server did not start")
                time.sleep(0.01)
            self.port = int(open(port_file).read())

    def stop(self):
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_load(bench, server, op, clients, depth, seconds):
    rss_peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            rss_peak[0] = max(rss_peak[0], status_kib(server.proc.pid, "VmRSS"))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    cpu0 = cpu_seconds(server.proc.pid)
    r = subprocess.run([bench, "--endpoint", f"127.0.0.1:{server.port}", "--legacy", "--op", op,
                        "--clients", str(clients), "--depth", str(depth), "--seconds",
                        str(seconds)], capture_output=True, text=True, timeout=seconds * 10 + 60)
    cpu1 = cpu_seconds(server.proc.pid)
    stop.set()
    sampler.join()
    if r.returncode != 0:
        sys.exit(f"bench_store: {op} x{clients} against {server.name} failed: {r.stderr}")
    result = json.loads(r.stdout)
    result["server_cpu_us_per_op"] = (cpu1 - cpu0) * 1e6 / result["ops"]
    result["server_rss_peak_kib"] = rss_peak[0]
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement (default 2)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="16 and 128 clients, depth 1 only")
    args = ap.parse_args()

    ddprun, bench = find("launcher/ddprun"), find("tests/bench/store_bench")
    ours = Server("ddprun", [ddprun, "store", "--host", "127.0.0.1", "--port", "0"], False)
    torch = Server("torch", ["/usr/bin/python3", "-c", TORCH_SERVER], True)
    plan = []
    for op in ("set", "get", "add", "wait"):
        for depth in ((1,) if op == "wait" or args.quick else (1, 16)):
            for clients in ((16, 128) if args.quick else (1, 16, 128)):
                plan.append((op, clients, depth))
    rows = []
    try:
        for op, clients, depth in plan:
            a = run_load(bench, ours, op, clients, depth, args.seconds)
            b = run_load(bench, torch, op, clients, depth, args.seconds)
            rows.append({"op": op, "clients": clients, "depth": depth, "ours": a, "torch": b,
                         "ratio": a["ops_per_s"] / b["ops_per_s"]})
            print(f"{op:5} x{clients:<4} depth {depth:<3}"
                  f" ours {a['ops_per_s']:>9.0f}/s p50 {a['p50_us']:>7.0f} p99 {a['p99_us']:>7.0f}us"
                  f" cpu {a['server_cpu_us_per_op']:5.1f}us/op |"
                  f" torch {b['ops_per_s']:>9.0f}/s p50 {b['p50_us']:>7.0f} p99 {b['p99_us']:>7.0f}us"
                  f" cpu {b['server_cpu_us_per_op']:5.1f}us/op | ratio {rows[-1]['ratio']:.2f}x",
                  flush=True)
        hwm = status_kib(ours.proc.pid, "VmHWM")
    finally:
        ours.stop()
        torch.stop()
    peak_128 = max(r["ours"]["server_rss_peak_kib"] for r in rows if r["clients"] == 128)
    print(f"ddprun store peak RSS with 128 clients: {peak_128 / 1024:.1f} MiB "
          f"(VmHWM over the whole run {hwm / 1024:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ours_vmhwm_kib": hwm, "ours_rss_peak_128_kib": peak_128,
                       "seconds": args.seconds, "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
