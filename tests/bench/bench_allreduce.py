#!/usr/bin/python3
"""All-reduce of float32 buffers between processes on loopback: ddpworker's TCP ring (comm_ring)
against gloo's allreduce (Debian's torch 1.13), side by side in one run, same sizes, same worlds.
Each side: 2 warm-up rounds then --iters timed ones per size, a barrier before each; the figure
is rank 0's median. Algorithm bandwidth = buffer bytes / time. The last column is ddpworker's
speed relative to gloo's (gloo ms / ring ms: above 1, the ring is faster). The ring side also
checks one all-reduce of known values per size.

Usage: /usr/bin/python3 tests/bench/bench_allreduce.py [--worlds 2,4] [--sizes-mb 1,4,16,64]
           [--iters 10] [--quick] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from build_paths import build_path  # noqa: E402

GLOO = r"""
import json, os, sys, time, datetime
import torch, torch.distributed as dist
rank, world, port, sizes, iters = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   [float(s) for s in sys.argv[4].split(",")], int(sys.argv[5]))
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
for mb in sizes:
    t = torch.zeros(int(mb * (1 << 20)) // 4)
    times = []
    for i in range(-2, iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= 0:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    if rank == 0:
        print(json.dumps({"mb": mb, "ms": times[iters // 2]}), flush=True)
dist.destroy_process_group()
"""


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_ranks(cmds):
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"bench_allreduce: a rank failed: {[p.returncode for p in procs]}")
    return {r["mb"]: r["ms"] for r in map(json.loads, outs[0].split("\n")[:-1])}


def run_ring(world, sizes, iters):
    ddprun, bench = build_path("launcher", "ddprun"), build_path("tests", "bench", "bench_allreduce_rank")
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        store = subprocess.Popen([ddprun, "store", "--host", "127.0.0.1", "--port", "0",
                                  "--port-file", port_file], stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(port_file) or not open(port_file).read().strip():
                time.sleep(0.02)
            port = open(port_file).read().strip()
            return run_ranks([[bench, str(r), str(world), port, f"/bench/{os.getpid()}/", sizes,
                               str(iters)] for r in range(world)])
        finally:
            store.terminate()
            store.wait()


def run_gloo(world, sizes, iters):
    port = free_port()
    return run_ranks([[sys.executable, "-c", GLOO, str(r), str(world), str(port), sizes,
                       str(iters)] for r in range(world)])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4", help="comma-separated numbers of ranks")
    ap.add_argument("--world", type=int, help="one number of ranks (overrides --worlds)")
    ap.add_argument("--sizes-mb", default="1,4,16,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 3 iterations")
    ap.add_argument("--json")
    args = ap.parse_args()
    worlds = [args.world] if args.world else [int(w) for w in args.worlds.split(",")]
    if args.quick:
        worlds, args.iters = [args.world or 2], 3
    import torch
    print(f"all-reduce, float32, loopback, median of {args.iters}: ddpworker ring vs gloo "
          f"(torch {torch.__version__}), {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'MB':>5} {'ring ms':>9} {'ring GB/s':>10} {'gloo ms':>9} "
          f"{'gloo GB/s':>10} {'ring/gloo':>9}")
    rows = []
    for world in worlds:
        ring = run_ring(world, args.sizes_mb, args.iters)
        gloo = run_gloo(world, args.sizes_mb, args.iters)
        for mb in ring:
            r, g = ring[mb], gloo[mb]
            gb = mb * (1 << 20) / 1e9
            print(f"{world:5d} {mb:5g} {r:9.2f} {gb / (r / 1e3):10.2f} {g:9.2f} "
                  f"{gb / (g / 1e3):10.2f} {g / r:8.2f}x", flush=True)
            rows.append({"world": world, "mb": mb, "ring_ms": r, "gloo_ms": g,
                         "ring_speed_over_gloo": g / r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"worlds": worlds, "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
