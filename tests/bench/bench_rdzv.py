#!/usr/bin/python3
"""ddprun's etcd rendezvous backend against its c10d backend, side by side in one run:

  rdzv32    : 32 agents x 1 worker on loopback, from starting the agents to the first worker
              running (each worker writes a timestamp when it starts); median of N runs.
  node_loss : 2 agents x 1 worker, --nnodes 1:2; kill -9 one agent; time from the kill until the
              survivor's new worker runs (the node found lost and the next round formed). The
              liveness timeout (c10d: heartbeat_timeout; etcd: lease_ttl) is the same TTL for both,
              with keep-alives every TTL/4. c10d loses the non-host node (its store dies with the
              host); etcd loses the node that served the round's store, the harder case.
              c10d's detection is TTL after the last heartbeat its reader saw (a node is lost
              when its counter stood still for TTL); an etcd lease expires TTL after its last
              renewal, i.e. 0 to TTL/4 earlier than TTL after the kill, so for etcd the bench also
              watches the dead node's lease-bound `node` record (etcdctl watch) and reports ddprun's own part:
              from etcd deleting it (the lease expired) to the survivor's new worker running.

etcd is a real 3-member cluster on loopback (tests/tools/etcd_cluster.py; Debian's etcd-server).
Both backends run with last_call_timeout=0, so a round forms as soon as its members are known.

Usage: /usr/bin/python3 tests/bench/bench_rdzv.py [--runs N] [--ttl S] [--members M] [--json FILE]
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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from build_paths import build_path  # noqa: E402
from etcd_cluster import ETCDCTL, EtcdCluster, free_port  # noqa: E402

# A worker writes its start time; before the kill it sleeps, after it (the bench creates "lost")
# it exits at once so the survivor's job finishes.
WORKER = """#!/bin/sh
date +%s%N > "$OUT_DIR/start.$$"
[ -n "$BENCH_EXIT_AT_ONCE" ] || [ -e "$OUT_DIR/lost" ] && exit 0
exec sleep 120
"""


def agent_cmds(ddprun, backend, endpoint, n_agents, nnodes, program, rdzv_conf, job):
    return [[ddprun, "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "0",
             "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", job,
             "--rdzv-conf", rdzv_conf, "--local-addr", "127.0.0.1", "--no-python", program]
            for _ in range(n_agents)]


def starts(out):
    times = []
    for name in os.listdir(out):
        if name.startswith("start."):
            text = open(os.path.join(out, name)).read().strip()
            if text:
                times.append(int(text))
    return times


def spawn(cmds, out, env, log_dir):
    procs = []
    for i, cmd in enumerate(cmds):
        log = open(os.path.join(log_dir, f"agent{i}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def reap(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def logs_tail(log_dir):
    return "\n".join(f"--- {n}\n" + open(os.path.join(log_dir, n)).read()[-1500:]
                     for n in sorted(os.listdir(log_dir)))


def time_rendezvous(cmds):
    out = tempfile.mkdtemp(prefix="bench-rdzv-")
    log_dir = tempfile.mkdtemp(prefix="bench-rdzv-logs-")
    env = dict(os.environ, OUT_DIR=out, BENCH_EXIT_AT_ONCE="1")
    t0 = time.time_ns()
    procs = spawn(cmds, out, env, log_dir)
    try:
        deadline = time.monotonic() + 300
        while not starts(out):
            if time.monotonic() > deadline:
                sys.exit("bench_rdzv: rendezvous did not start any worker\n" + logs_tail(log_dir))
            time.sleep(0.001)
        first = min(starts(out))
        for p in procs:
            p.wait(timeout=300)
        if any(p.returncode for p in procs):
            sys.exit(f"bench_rdzv: an agent failed the {len(cmds)}-agent run\n"
                     + logs_tail(log_dir))
        return (first - t0) / 1e9
    finally:
        reap(procs)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


def etcd_store_host_pid(ddprun, endpoints, job):
    """The agent pid of the round's node 0 (the store's host), from `ddprun status`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = subprocess.run([ddprun, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                            endpoints, "--rdzv-id", job, "--json"], capture_output=True,
                           text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            st = json.loads(r.stdout)
            if st.get("state") == "running" and len(st.get("nodes", [])) == 2:
                return st["nodes"][0]["agent_pid"]
        time.sleep(0.05)
    sys.exit("bench_rdzv: `ddprun status` did not show the running 2-node job")


class RecordDeletes:
    """`etcdctl watch` on a job's keys: the time each `node` record is deleted (its lease expired)."""

    def __init__(self, endpoints, job):
        self.times = []
        self.proc = subprocess.Popen(
            [ETCDCTL, "--endpoints", endpoints, "watch", "--prefix", f"/ddprun/{job}/"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=dict(os.environ, ETCDCTL_API="3"))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        last = None
        for line in self.proc.stdout:
            now = time.time_ns()
            line = line.strip()
            if last == "DELETE" and "/node/" in line:
                self.times.append(now)
            last = line

    def close(self):
        self.proc.kill()
        self.proc.wait()


def time_node_loss(cmds, victim_of, watch=None):
    """Start 2 agents, wait for both workers, kill -9 the agent victim_of(procs) names (with its
    worker); seconds from the kill until the survivor's next worker writes its start, and (with
    watch, an RecordDeletes) from the dead node's record's deletion until then."""
    out = tempfile.mkdtemp(prefix="bench-loss-")
    log_dir = tempfile.mkdtemp(prefix="bench-loss-logs-")
    env = dict(os.environ, OUT_DIR=out)
    procs = spawn(cmds, out, env, log_dir)
    try:
        deadline = time.monotonic() + 120
        while len(starts(out)) < 2:
            if time.monotonic() > deadline:
                sys.exit("bench_rdzv: the 2-node job did not start\n" + logs_tail(log_dir))
            time.sleep(0.005)
        time.sleep(0.5)  # past the round's start-up, in steady heartbeats/keep-alives
        victim = victim_of(procs)
        open(os.path.join(out, "lost"), "w").close()
        t_kill = time.time_ns()
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        survivor = next(p for p in procs if p is not victim)
        deadline = time.monotonic() + 120
        while not [t for t in starts(out) if t > t_kill]:
            if time.monotonic() > deadline:
                sys.exit("bench_rdzv: the survivor formed no new round\n" + logs_tail(log_dir))
            time.sleep(0.001)
        restarted = min(t for t in starts(out) if t > t_kill)
        survivor.wait(timeout=120)
        if survivor.returncode != 0:
            sys.exit("bench_rdzv: the survivor failed\n" + logs_tail(log_dir))
        after_expiry = None
        if watch:
            expired = [t for t in watch.times if t > t_kill]
            if not expired:
                sys.exit("bench_rdzv: the watch saw no node record deleted")
            after_expiry = (restarted - expired[0]) / 1e9
        return (restarted - t_kill) / 1e9, after_expiry
    finally:
        if watch:
            watch.close()
        reap(procs)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description="etcd vs c10d rendezvous: 32 agents, node loss")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ttl", type=float, default=2.0,
                    help="lease_ttl (etcd) and heartbeat_timeout (c10d), seconds")
    ap.add_argument("--members", type=int, default=3, help="etcd cluster members")
    ap.add_argument("--json")
    args = ap.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("bench_rdzv: etcd is not installed (apt-get install etcd-server etcd-client)")
    ddprun = build_path("launcher", "ddprun")
    tmp = tempfile.mkdtemp(prefix="bench-rdzv-")
    worker = os.path.join(tmp, "worker.sh")
    with open(worker, "w") as f:
        f.write(WORKER)
    os.chmod(worker, 0o755)
    results = {"c10d": {}, "etcd": {}}
    ttl = args.ttl
    keep_alive = ttl / 4
    c10d_conf = f"last_call_timeout=0,heartbeat_timeout={ttl},keep_alive_interval={keep_alive}"
    etcd_conf = f"last_call_timeout=0,lease_ttl={ttl},keep_alive_interval={keep_alive}"
    with EtcdCluster(os.path.join(tmp, "etcd"), members=args.members) as cluster:
        cluster.start()
        for run in range(args.runs):
            for backend in ("c10d", "etcd"):
                job = f"bench-{backend}-{run}"
                endpoint = (f"127.0.0.1:{free_port()}" if backend == "c10d"
                            else cluster.endpoints)
                conf = c10d_conf if backend == "c10d" else etcd_conf
                r = results[backend]
                r.setdefault("rdzv32", []).append(time_rendezvous(
                    agent_cmds(ddprun, backend, endpoint, 32, "32", worker, conf, job + "-32")))
                cmds = agent_cmds(ddprun, backend, endpoint, 2, "1:2", worker, conf,
                                  job + "-loss")
                if backend == "c10d":
                    # agent 0 hosts the store, agent 1 is lost
                    for cmd, is_host in zip(cmds, ("true", "false")):
                        cmd[cmd.index("--rdzv-conf") + 1] += f",is_host={is_host}"
                    victim_of = (lambda procs: procs[1])
                    watch = None
                else:
                    victim_of = (lambda procs, j=job + "-loss": next(
                        p for p in procs if p.pid == etcd_store_host_pid(ddprun, cluster.endpoints,
                                                                         j)))
                    watch = RecordDeletes(",".join(cluster.urls), job + "-loss")
                loss, after_expiry = time_node_loss(cmds, victim_of, watch)
                r.setdefault("node_loss", []).append(loss)
                if after_expiry is not None:
                    r.setdefault("after_lease_expiry", []).append(after_expiry)
    shutil.rmtree(tmp, ignore_errors=True)

    summary = {b: {m: statistics.median(v) for m, v in r.items()} for b, r in results.items()}
    print(f"etcd: {args.members} members on loopback; liveness timeout {ttl} s both; "
          f"median of {args.runs}")
    c, e = summary["c10d"], summary["etcd"]
    print(f"rdzv32     c10d {c['rdzv32'] * 1000:8.1f} ms   etcd {e['rdzv32'] * 1000:8.1f} ms   "
          f"etcd/c10d {e['rdzv32'] / c['rdzv32']:.2f}x")
    print(f"node_loss  c10d {c['node_loss'] * 1000:8.1f} ms   etcd {e['node_loss'] * 1000:8.1f} ms"
          f"   (from the kill; c10d minus the timeout {(c['node_loss'] - ttl) * 1000:+.1f} ms)")
    print(f"etcd: lease expired (node record deleted) -> next round's worker running: "
          f"{e['after_lease_expiry'] * 1000:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ttl_s": ttl, "members": args.members, "runs": results,
                       "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
