#!/usr/bin/python3
"""Rendezvous and restart at scale: N ddprun agents x 1 trivial worker on this machine.

  rendezvous : from starting the N agents to every worker running (each writes its start time)
  restart    : kill -9 of one worker to every worker of the next round running
  all CPU    : the CPU seconds of every process of the run (agents, shims, workers, store): on a
               machine with few cores the agents' own start-up is what the time goes to
  store      : the store's CPU seconds and peak memory over the whole run (c10d: a standalone
               `ddprun store` that every agent uses with is_host=false, so that its cost is its
               own; etcd: the 3 members together, tests/tools/etcd_cluster.py)

The open-file limit is raised to its hard limit first (each agent holds a few sockets on the
store). With --protocol the N agents are N threads of one process (tests/bench/bench_rdzv_agents.c): each
does an agent's join with its own client, one asks for a restart, all join the next round. No
process starts, workers or heartbeats: the rendezvous protocol's own cost, which 2048 processes
starting on a 2-core machine hide. Usage:

    /usr/bin/python3 tests/bench/bench_scale.py [--agents 256,512,1024] [--backend c10d|etcd]
        [--protocol | --torchrun] [--json FILE]

--torchrun: the same job with Debian's torchrun (torch 1.13) as the N agents, on the same
standalone store (is_host=false), the anchor.
"""
import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from build_paths import build_path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))

WORKER = """#!/bin/sh
A=${DDPRUN_ATTEMPT:-$TORCHELASTIC_RESTART_COUNT}
date +%s%N > "$OUT_DIR/start.$A.$RANK.tmp" && mv "$OUT_DIR/start.$A.$RANK.tmp" "$OUT_DIR/start.$A.$RANK"
echo $$ > "$OUT_DIR/pid.$A.$RANK"
exec sleep 600
"""


def cpu_and_rss(pids):
    """(utime + stime in seconds, VmHWM in MiB) summed over pids."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = rss = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmHWM:"):
                    rss += int(line.split()[1]) / 1024
        except OSError:
            pass
    return cpu, rss


def wait_count(out, attempt, n, timeout, agents=()):
    """The latest start time (ns) once n workers of attempt started, or None (also as soon as
    every agent has exited)."""
    deadline = time.monotonic() + timeout
    prefix = f"start.{attempt}."
    while time.monotonic() < deadline:
        if agents and all(a.poll() is not None for a in agents):
            return None
        names = [f for f in os.listdir(out) if f.startswith(prefix) and not f.endswith(".tmp")]
        if len(names) >= n:
            return max(int(open(os.path.join(out, f)).read()) for f in names)
        time.sleep(0.02)
    return None


def start_store(ddprun, out, backend):
    """(the --rdzv-endpoint, the store's pids, the etcd cluster or the store process)."""
    if backend == "c10d":
        port_file = os.path.join(out, "port")
        store = subprocess.Popen([ddprun, "store", "--host", "127.0.0.1", "--port", "0",
                                  "--port-file", port_file], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            time.sleep(0.01)
        return f"127.0.0.1:{int(open(port_file).read())}", [store.pid], store
    from etcd_cluster import EtcdCluster
    etcd = EtcdCluster(os.path.join(out, "etcd"), members=3).start()
    return etcd.endpoints, [p.pid for p in etcd.procs], etcd


def run_protocol(ddprun, n, backend, timeout):
    out = tempfile.mkdtemp(prefix=f"bench-proto-{n}-")
    endpoint, store_pids, store = start_store(ddprun, out, backend)
    result = {"agents": n, "backend": backend, "protocol": True}
    try:
        bench = build_path("tests/bench", "bench_rdzv_agents")
        r = subprocess.run(["/usr/bin/time", "-f", "%U %S", bench, backend, endpoint, str(n)],
                           capture_output=True, text=True, timeout=timeout)
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            result["error"] = f"bench_rdzv_agents exit {r.returncode}: {r.stderr[-500:]}"
            return result
        result.update(json.loads(lines[-1]))
        user, system = r.stderr.strip().splitlines()[-1].split()
        result["agents_cpu_s"] = float(user) + float(system)
        result["store_cpu_s"], result["store_peak_mib"] = cpu_and_rss(store_pids)
        return result
    finally:
        if isinstance(store, subprocess.Popen):
            store.kill()
            store.wait()
        else:
            store.close()
        shutil.rmtree(out, ignore_errors=True)


def torchrun_cmd(endpoint, n, worker):
    """Debian's torchrun (torch 1.13) as an agent of the same job on the same standalone store
    (is_host=false; `-r 1 -t 1`: its enum parsing breaks on the defaults on this Python)."""
    return [sys.executable, "-m", "torch.distributed.run", "-r", "1", "-t", "1", "--nnodes",
            str(n), "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
            endpoint, "--rdzv_id", "scale", "--rdzv_conf",
            "join_timeout=600,last_call_timeout=1,is_host=false", "--max_restarts", "3",
            "--monitor_interval", "0.1", "--no_python", worker]


def run(ddprun, n, backend, timeout, tool="ddprun"):
    out = tempfile.mkdtemp(prefix=f"bench-scale-{n}-")
    worker = os.path.join(out, "worker.sh")
    with open(worker, "w") as f:
        f.write(WORKER)
    os.chmod(worker, 0o755)
    conf = "join_timeout=600,last_call_timeout=0.5,keep_alive_interval=1"
    store_pids, etcd, store = [], None, None
    if backend == "c10d":
        port_file = os.path.join(out, "port")
        store = subprocess.Popen([ddprun, "store", "--host", "127.0.0.1", "--port", "0",
                                  "--port-file", port_file], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        while not os.path.exists(port_file):
            time.sleep(0.01)
        time.sleep(0.05)
        endpoint = f"127.0.0.1:{int(open(port_file).read())}"
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-conf", conf + ",heartbeat_timeout=30,is_host=false"]
        store_pids = [store.pid]
    else:
        from etcd_cluster import EtcdCluster
        etcd = EtcdCluster(os.path.join(out, "etcd"), members=3).start()
        rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
                "--rdzv-conf", conf + ",lease_ttl=30"]
        store_pids = [p.pid for p in etcd.procs]
    env = dict(os.environ, OUT_DIR=out)
    cmd = [ddprun, "--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-id", "scale",
           "--max-restarts", "3", "--monitor-interval", "0.1"] + rdzv + [worker]
    if tool == "torchrun":
        cmd = torchrun_cmd(endpoint, n, worker)
    agents = []
    result = {"agents": n, "backend": backend, "tool": tool}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        t0 = time.time_ns()
        for _ in range(n):
            log = open(os.path.join(out, f"agent.{len(agents)}.log"), "w")
            agents.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
            log.close()
        t_spawned = time.time_ns()
        last = wait_count(out, 0, n, timeout, agents)
        if last is None:
            result["error"] = "not every worker of round 0 started (agents' logs in " + out + ")"
            out = None
            return result
        result["rendezvous_s"] = (last - t0) / 1e9
        result["spawn_agents_s"] = (t_spawned - t0) / 1e9
        time.sleep(1)
        victim = int(open(os.path.join(out, f"pid.0.{n - 1}")).read())
        t_kill = time.time_ns()
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            result["error"] = "round 0 ended by itself before the kill (agents' logs in " + out + ")"
            out = None  # kept for the logs
            return result
        last = wait_count(out, 1, n, timeout, agents)
        if last is None:
            result["error"] = "not every worker of round 1 started"
            return result
        result["restart_s"] = (last - t_kill) / 1e9
        result["store_cpu_s"], result["store_peak_mib"] = cpu_and_rss(store_pids)
        return result
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        for a in agents:
            a.wait()
        if store:
            store.kill()
            store.wait()
        if etcd:
            etcd.close()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # every agent, shim and worker, and the store (whose own share is store_cpu_s)
        result["all_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        if out:
            shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", default="256,512,1024")
    ap.add_argument("--backend", choices=("c10d", "etcd"), default="c10d")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--protocol", action="store_true",
                    help="the N agents as threads of one process (bench_rdzv_agents): the protocol alone")
    ap.add_argument("--torchrun", action="store_true",
                    help="the agents are Debian's torchrun (c10d only), on the same store")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.torchrun and (args.protocol or args.backend != "c10d"):
        sys.exit("bench_scale: --torchrun runs agents as processes on c10d")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ddprun = build_path("launcher", "ddprun")
    rows = []
    for n in (int(x) for x in args.agents.split(",")):
        if args.protocol:
            r = run_protocol(ddprun, n, args.backend, args.timeout)
        else:
            r = run(ddprun, n, args.backend, args.timeout,
                    "torchrun" if args.torchrun else "ddprun")
        r["loadavg"] = os.getloadavg()[0]
        rows.append(r)
        if "error" in r:
            print(f"{args.backend} {n:5d} agents: {r['error']}", flush=True)
            continue
        if args.protocol:
            print(f"{args.backend} {n:5d} agents as threads: rendezvous {r['rendezvous_s']:7.2f} s, "
                  f"restart {r['restart_s']:6.2f} s, agents {r['agents_cpu_s']:.2f} s CPU, store "
                  f"{r['store_cpu_s']:.2f} s CPU, {r['store_peak_mib']:.0f} MiB peak "
                  f"(load average {r['loadavg']:.1f})", flush=True)
            continue
        print(f"{r['tool']} {args.backend} {n:5d} agents: rendezvous {r['rendezvous_s']:7.2f} s "
              f"(agents spawned in {r['spawn_agents_s']:.2f} s), restart {r['restart_s']:6.2f} s, "
              f"store {r['store_cpu_s']:.2f} s CPU, {r['store_peak_mib']:.0f} MiB peak; all "
              f"processes {r['all_cpu_s']:.1f} s CPU on {os.cpu_count()} cores (load average "
              f"{r['loadavg']:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "date": time.strftime("%Y-%m-%d"), "binary": ddprun}, f,
                      indent=1)


if __name__ == "__main__":
    main()
