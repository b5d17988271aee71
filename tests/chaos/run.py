#!/usr/bin/env python3
"""Chaos: random faults against a 2-node x 2-rank ddpworker job for a given time, then the bar of
tests/e2e/test_faults.py for the whole story: the final weights equal an uninterrupted run's, bit
for bit, no worker outlives the job, and no port is left listening.

    tests/chaos/run.py [--duration 120] [--seed N] [--report chaos.json] [--keep]
                       [--warm-spares 0|1|auto] [--rdzv-backend c10d|etcd]

Two ddprun agents (c10d on loopback, --nnodes 2, two ranks each; node 0 hosts the store) train a
small CNN on synthetic data with snapshots on a small tmpfs when this runs as root (else a plain
directory, and no disk-full faults). While the duration lasts, every few seconds one fault:
  kill9_worker   SIGKILL to a random worker
  kill9_agent    SIGKILL to a random agent's whole group (node 0's takes the store with it);
                 this harness restarts it, as a supervisor (systemd, Kubernetes) would
  sigstop_worker SIGSTOP to a random worker (its peers' collective deadline ends the round)
  corrupt_newest a flipped byte in the newest snapshot (the next resume must skip it)
  disk_full      the snapshot filesystem filled for two seconds (root only)
  partition      node 1's network link down for three seconds (root with iproute2: node 1 then runs
                 in a network namespace of its own, behind a veth link to node 0's address)
  node_loss_disk a node lost with its disk: SIGKILL to its agent's whole group, its memory
                 directory and every snapshot file deleted (on c10d node 1, as node 0's loss takes the job's store along; on
                 etcd either node); the job resumes from a memory snapshot (a node's own, or the
                 copy its peer's agent holds), and the harness starts the agent again
An agent that exits non-zero (its store vanished with node 0) is started again. When the
duration is over, the job runs to its end; the report says what was injected and what it cost,
with the steps each restart lost and where it resumed from (the workers' "resume" metrics events,
charged to the fault before them; a restart that found nothing and began again at step 0 counts
as source "none", every step trained before it lost). Memory snapshots (snapshot.every_memory =
1) are on unless --memory-snapshots 0 (today's disk path, for comparison); with them, a resume
from memory or a peer that lost more than one step fails the run.
With --warm-spares 1 each agent keeps a spare per local rank, and the worker faults pick among the
spares too (a spare killed or stopped while it waits, or taken by the next round); auto (the
default, as ddprun's) keeps them where ddprun would (a GPU node).

With --rdzv-backend etcd the agents rendezvous on a 3-member etcd (tests/tools/etcd_cluster.py,
on the address node 1's namespace reaches), each serving its own store for the rounds it leads,
and the faults add:
  kill9_etcd_leader    SIGKILL to etcd's leader, restarted 2 s later with its data (a supervisor)
  kill9_etcd_follower  the same for a follower
  partition_etcd       one member frozen (SIGSTOP) for 3 s: its peers and clients hear nothing
A failure prints the command that replays the run (the seed decides the faults and their order).
"""
import argparse
import datetime
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# threads = 1: a worker's threads default to the host's cores over its agent's workers, so the
# reference (1 agent x 4) and the chaos job (2 agents x 2) get different counts on a machine with
# more than 2 cores, and the cpu backend's oneDNN convolutions sum dL/dw in another order with
# another thread count (worker/cpu/cpu_dnnl.h): pinned, the two must end bit-identical.
CONF = """[model]
name = cnn
width = 8
[data]
kind = synthetic
height = 16
width = 16
channels = 1
classes = 10
train_limit = 4096
test_limit = 128
augment = true
[optim]
lr = 0.05
[train]
batch_size = 8
epochs = 0
max_steps = {steps}
log_interval = 16
collective_timeout = 4
threads = 1
[snapshot]
every = 8
keep = 3
"""

FAULTS = ["kill9_worker", "kill9_agent", "sigstop_worker", "corrupt_newest", "disk_full",
          "partition", "node_loss_disk"]
ETCD_FAULTS = ["kill9_etcd_leader", "kill9_etcd_follower", "partition_etcd"]
# the uninterrupted run is sized to this share of --duration (see main: it must outlast the faults)
SIZE = 0.9
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))


class Netns:
    """Node 1's own network namespace, linked to this one by a veth pair (root and iproute2)."""

    def __init__(self):
        self.tag = f"{os.getpid() % 10000}"
        self.ns, self.host_if, self.ns_if = f"chaos{self.tag}", f"chh{self.tag}", f"chn{self.tag}"
        net = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
        self.host_addr, self.ns_addr = f"{net}.1", f"{net}.2"
        self.is_up = False

    def ip(self, *args, ns=None):
        cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip"] + list(args)
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def create(self):
        if os.geteuid() != 0 or not shutil.which("ip"):
            return False
        if not self.ip("netns", "add", self.ns):
            return False
        ok = (self.ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if) and
              self.ip("link", "set", self.ns_if, "netns", self.ns) and
              self.ip("addr", "add", f"{self.host_addr}/24", "dev", self.host_if) and
              self.ip("link", "set", self.host_if, "up") and
              self.ip("addr", "add", f"{self.ns_addr}/24", "dev", self.ns_if, ns=self.ns) and
              self.ip("link", "set", self.ns_if, "up", ns=self.ns) and
              self.ip("link", "set", "lo", "up", ns=self.ns))
        self.is_up = ok
        if not ok:
            self.destroy()
        return ok

    def destroy(self):
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def find_binaries(args):
    ddprun = args.ddprun or os.environ.get("DDPRUN_BIN") or os.path.join(ROOT, "build",
                                                                          "launcher", "ddprun")
    ddpworker = os.path.join(os.path.dirname(os.path.dirname(ddprun)), "worker", "ddpworker")
    for b in (ddprun, ddpworker):
        if not os.access(b, os.X_OK):
            sys.exit(f"chaos: {b} is not built (cmake --build build, or --ddprun PATH)")
    return ddprun, ddpworker


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "DDPRUN_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def state(ddpworker, snap):
    """(state hash, step) of the snapshot `latest` names, or None if it does not verify."""
    try:
        latest = open(os.path.join(snap, "latest")).read().strip()
    except OSError:
        return None
    r = subprocess.run([ddpworker, "inspect", os.path.join(snap, latest)], capture_output=True,
                       text=True, timeout=60)
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", r.stdout, re.M))
    if r.returncode != 0:
        return None
    return fields["state hash"], int(fields["step"].split()[0])


# a report's own lines (as tests/conftest.py): "==PID==ERROR: AddressSanitizer: ..." or
# LeakSanitizer, UBSan's "file:LINE:COL" or "(binary+0xOFFSET)" and its phrase
SANITIZER_REPORT = re.compile(r"==\d+==ERROR: (?:AddressSanitizer|LeakSanitizer)|(?:\d|\)): " +
                              "runtime" + " error: ")
# worker ends no injected fault causes (the faults are SIGKILL, SIGSTOP, a peer's or a disk's
# failure): a crash, an abort (a sanitizer's too), an internal bug, a sanitizer's exit status 1
UNINJECTED = re.compile(r"worker rank \d+ \(pid \d+\) (was killed by signal (4|6|7|8|11)|"
                        r"exited with (1|70));")


def unexplained(workdir):
    """Lines of the run's logs that no injected fault explains: sanitizer reports and crashes
    (each of which ddprun would just restart)."""
    found = []
    for name in sorted(os.listdir(workdir)):
        if name.endswith(".log"):
            with open(os.path.join(workdir, name), errors="replace") as f:
                found += [f"{name}: {line.rstrip()}" for line in f
                          if SANITIZER_REPORT.search(line) or UNINJECTED.search(line)]
    return found


def snapshot_steps(snap):
    try:
        names = os.listdir(snap)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.match(r"snapshot-(\d+)\.ddps$", n)))


class Job:
    """Two agents of one c10d job; restarts an agent that died, as a supervisor would."""

    def __init__(self, ddprun, conf, snap, workdir, netns=None, warm_spares="0", etcd=None,
                 memory="1"):
        self.ddprun, self.conf, self.snap, self.workdir = ddprun, conf, snap, workdir
        self.memory = memory
        self.warm_spares = warm_spares
        self.netns = netns
        self.etcd = etcd  # an EtcdCluster: the agents rendezvous there, not on node 0's store
        self.host = netns.host_addr if netns else "127.0.0.1"
        self.port = free_port(self.host)
        self.agents = [None, None]
        self.starts = [0, 0]
        self.exits = []
        for node in (0, 1):
            self.start(node)
            time.sleep(0.1)                      # node 0 first: it hosts the store

    def start(self, node):
        log = open(os.path.join(self.workdir, f"node{node}.{self.starts[node]}.log"), "w")
        self.starts[node] += 1
        prefix = ["ip", "netns", "exec", self.netns.ns] if self.netns and node == 1 else []
        conf = "join_timeout=60,last_call_timeout=0.2,keep_alive_interval=0.2,"
        if self.etcd:
            local = self.netns.ns_addr if self.netns and node == 1 else self.host
            # lease_ttl as short as c10d's heartbeat_timeout, as long as partition_etcd's 3 s
            # freeze: a keep-alive stuck on the frozen member must go to another in time
            rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoints,
                    "--local-addr", local, "--rdzv-conf", conf + "lease_ttl=3"]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.host}:{self.port}",
                    "--rdzv-conf", conf + "heartbeat_timeout=3"]
        self.agents[node] = subprocess.Popen(
            prefix + [self.ddprun, "--nnodes", "2", "--nproc-per-node", "2"] + rdzv +
            ["--rdzv-id", "chaos", "--max-restarts", "1000", "--hang-timeout", "20",
             "--warm-spares", str(self.warm_spares), self.conf, f"snapshot.dir={self.snap}",
             f"snapshot.every_memory={self.memory}",
             f"train.metrics_file={self.workdir}/metrics-node{node}.{self.starts[node] - 1}.jsonl"],
            stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
        log.close()

    def supervise(self):
        """Restart agents that failed; True once both have exited 0."""
        done = 0
        for node, a in enumerate(self.agents):
            rc = a.poll()
            if rc is None:
                continue
            if rc == 0:
                done += 1
                continue
            self.exits.append((node, rc))
            time.sleep(0.2)
            self.start(node)
        return done == 2

    def kill_all(self):
        for a in self.agents:
            if a and a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()


def workers(conf):
    r = subprocess.run(["pgrep", "-f", f"^[^ ]*worker/ddpworker {re.escape(conf)}"],
                       capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def run_reference(ddprun, ddpworker, conf, snap, workdir, timeout=1800):
    shutil.rmtree(snap, ignore_errors=True)  # a run sized again must not resume the last one
    t0 = time.monotonic()
    with open(os.path.join(workdir, "reference.log"), "w") as log:
        r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "4", conf,
                            f"snapshot.dir={snap}"], stdout=log, stderr=subprocess.STDOUT,
                           env=clean_env(), timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"chaos: the reference run failed ({r.returncode}); see {workdir}/reference.log")
    want = state(ddpworker, snap)
    if want is None:  # else a chaos run without a state would equal it (None == None)
        sys.exit(f"chaos: the reference run left no snapshot that verifies in {snap}")
    return want, time.monotonic() - t0


def mount_tmpfs(path, size):
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def inject(kind, job, conf, snap, has_tmpfs, rng, log):
    """One fault; returns a description, or None when it had no target right now."""
    if kind in ("kill9_worker", "sigstop_worker"):
        pids = workers(conf)
        if len(pids) < 4:
            return None
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL if kind == "kill9_worker" else signal.SIGSTOP)
        except ProcessLookupError:
            return None
        return f"worker pid {pid}"
    if kind == "kill9_agent":
        node = rng.randrange(2)
        a = job.agents[node]
        if a.poll() is not None:
            return None
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()
        job.exits.append((node, -9))
        time.sleep(0.3)
        job.start(node)
        return f"node {node}'s agent" + (" (the store host)" if node == 0 and not job.etcd else "")
    if kind == "corrupt_newest":
        steps = snapshot_steps(snap)
        last = int(re.search(r"^max_steps = (\d+)$", open(conf).read(), re.M).group(1))
        if len(steps) < 2 or steps[-1] >= last:  # the final one: the job has ended, nothing resumes
            return None
        path = os.path.join(snap, f"snapshot-{steps[-1]:012d}.ddps")
        try:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(size // 2)
                b = f.read(1)
                f.seek(size // 2)
                f.write(bytes([b[0] ^ 0x10]))
        except OSError:
            return None
        return f"snapshot step {steps[-1]}"
    if kind == "node_loss_disk":
        node = rng.randrange(2) if job.etcd else 1
        a = job.agents[node]
        steps = snapshot_steps(snap)
        last = int(re.search(r"^max_steps = (\d+)$", open(conf).read(), re.M).group(1))
        if a.poll() is not None or (steps and steps[-1] >= last):  # ended: nothing to resume
            return None
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()
        job.exits.append((node, -9))
        # its RAM: the agent started again would take over the dead one's memory directory
        for path in glob.glob(f"{os.environ.get('DDPRUN_SHM_DIR') or '/dev/shm'}/"
                              f"ddprun-mem-{a.pid}-*"):
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(snap):
            if name.startswith("snapshot-") or name == "latest":
                try:
                    os.unlink(os.path.join(snap, name))
                except OSError:
                    pass
        time.sleep(0.3)
        job.start(node)
        return f"node {node}: agent, workers and every snapshot file"
    if kind == "partition":
        if not job.netns:
            return None
        job.netns.ip("link", "set", job.netns.host_if, "down")
        time.sleep(3)
        job.netns.ip("link", "set", job.netns.host_if, "up")
        return "node 1's link down for 3 s"
    if kind in ("kill9_etcd_leader", "kill9_etcd_follower"):
        leader = job.etcd.leader()
        if leader is None:
            return None  # an election is under way
        members = [i for i in range(job.etcd.members) if job.etcd.alive(i)]
        target = leader if kind == "kill9_etcd_leader" else rng.choice(
            [i for i in members if i != leader])
        job.etcd.kill(target)
        time.sleep(2)
        job.etcd.restart(target)
        return f"etcd member {target}" + (" (the leader)" if target == leader else "") + \
            ", restarted after 2 s"
    if kind == "partition_etcd":
        target = rng.randrange(job.etcd.members)
        if not job.etcd.alive(target):
            return None
        job.etcd.procs[target].send_signal(signal.SIGSTOP)
        time.sleep(3)
        job.etcd.procs[target].send_signal(signal.SIGCONT)
        return f"etcd member {target} frozen (SIGSTOP) for 3 s"
    if kind == "disk_full":
        if not has_tmpfs:
            return None
        filler = os.path.join(snap, "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        time.sleep(2)
        os.unlink(filler)
        return "snapshot filesystem full for 2 s"
    raise ValueError(kind)


def steps_lost(workdir, faults):
    """Every resume the workers reported ("resume" metrics events of every rank 0 of every
    attempt), in time order, with the fault injected last before it (None: none yet). A restart
    that found nothing to resume and started from step 0 (a "start" event, not resumed, of a
    restarted attempt) counts as a resume from source "none" that lost every step trained before
    it (the workers may not know how many: the records of progress can go with the state)."""
    resumes, fresh, trained = [], [], []  # trained: (time, step) of every "train" event
    for name in sorted(os.listdir(workdir)):
        if not (name.startswith("metrics-node") and name.endswith(".jsonl")):
            continue
        for line in open(os.path.join(workdir, name), errors="replace"):
            if '"train"' in line:  # the bulk of the file: no JSON parse for its two fields
                m = re.search(r'"time":"([^"]+)","step":(\d+)', line)
                if m:
                    trained.append((m.group(1), int(m.group(2))))
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if e.get("event") == "resume":
                resumes.append({"time": e["time"], "step": e["step"], "source": e["source"],
                                "steps_lost": e["steps_lost"]})
            elif (e.get("event") == "start" and not e.get("resumed")
                  and e.get("restart_count", 0) > 0):
                fresh.append(e["time"])
    for t in fresh:  # ISO times in UTC compare as text; the step reached last before it
        before = [(when, step) for when, step in trained if when < t]
        resumes.append({"time": t, "step": 0, "source": "none",
                        "steps_lost": max(before)[1] if before else 0})
    for r in resumes:
        r["wall"] = datetime.datetime.strptime(r.pop("time"), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
            tzinfo=datetime.timezone.utc).timestamp()
        before = [f for f in faults if f["wall"] <= r["wall"]]
        r["fault"] = before[-1]["fault"] if before else None
    return sorted(resumes, key=lambda r: r["wall"])


def lost_by_fault(resumes):
    """{fault: [steps lost by each restart it was charged with]} (-1: not known)."""
    out = {}
    for r in resumes:
        out.setdefault(r["fault"] or "none", []).append(r["steps_lost"])
    return out


def listening_ports():
    r = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True)
    return set(re.findall(r":(\d+)\s", r.stdout)) if r.returncode == 0 else set()


def replay_command(args, seed, steps):
    """The command that runs the same faults in the same order (timings differ with the load)."""
    return (f"tests/chaos/run.py --duration {args.duration:g} --seed {seed} --steps {steps} "
            f"--rdzv-backend {args.rdzv_backend} --warm-spares {args.warm_spares}"
            + (" --no-netns" if args.no_netns else "")
            + (" --memory-snapshots 0" if args.memory_snapshots == "0" else "") + " --keep")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120, help="seconds of fault injection")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ddprun", default=None)
    p.add_argument("--report", default=None, help="write the summary here as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--steps", type=int, default=0, help="training steps (0: sized to --duration)")
    p.add_argument("--no-netns", action="store_true", help="no network namespace: no partitions")
    p.add_argument("--warm-spares", choices=("0", "1", "auto"), default="auto",
                   help="ddprun --warm-spares (1: worker faults hit spares too; auto: as ddprun)")
    p.add_argument("--rdzv-backend", choices=("c10d", "etcd"), default="c10d",
                   help="etcd: a 3-member etcd, with faults of its own")
    p.add_argument("--memory-snapshots", choices=("0", "1"), default="1",
                   help="snapshot.every_memory (0: restarts resume from the disk alone)")
    args = p.parse_args()
    faults_of_backend = FAULTS + (ETCD_FAULTS if args.rdzv_backend == "etcd" else [])
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    ddprun, ddpworker = find_binaries(args)
    workdir = tempfile.mkdtemp(prefix="ddprun-chaos-")
    print(f"chaos: seed {seed}, work directory {workdir}", flush=True)

    # size the job: the faults must land while it trains, so it should outlast the duration. With
    # warm spares and memory snapshots a fault costs ~0.7 s (an etcd run of 600 s, 2026-11-27: 72
    # faults, 375.7 s under faults against 325.4 s uninterrupted, so 0.6x ended before the faults
    # did); 0.9x the duration uninterrupted lasts past it
    steps = args.steps
    if not steps:  # the rate from two short runs, so start-up time does not count as training
        times = {}
        for n in (64, 512):
            probe = os.path.join(workdir, f"probe{n}.conf")
            open(probe, "w").write(CONF.format(steps=n))
            _, times[n] = run_reference(ddprun, ddpworker, probe,
                                        os.path.join(workdir, f"probe{n}"), workdir)
        per_step = max((times[512] - times[64]) / 448, 1e-4)
        steps = max(64, int(max(args.duration, 10) * SIZE / per_step))
    conf = os.path.join(workdir, "chaos.conf")
    for attempt in range(3):
        open(conf, "w").write(CONF.format(steps=steps))
        want, t_ref = run_reference(ddprun, ddpworker, conf, os.path.join(workdir, "reference"),
                                    workdir, timeout=max(1800, 3 * args.duration))
        # the probes misjudge the rate on a loaded machine: a run far too short is sized again
        if args.steps or t_ref >= 0.75 * SIZE * args.duration or attempt == 2:
            break
        steps = int(steps * SIZE * args.duration / max(t_ref, 1.0))
        print(f"chaos: the reference took {t_ref:.1f} s, too short: {steps} steps", flush=True)
    print(f"chaos: {steps} steps, uninterrupted in {t_ref:.1f} s, state {want}", flush=True)

    snap = os.path.join(workdir, "snap")
    has_tmpfs = mount_tmpfs(snap, "64m")
    os.makedirs(snap, exist_ok=True)
    ports_before = listening_ports()
    faults = []
    netns = Netns()
    if args.no_netns or not netns.create():
        netns = None
    etcd = None
    if args.rdzv_backend == "etcd":
        from etcd_cluster import EtcdCluster
        etcd = EtcdCluster(os.path.join(workdir, "etcd"), members=3,
                           host=netns.host_addr if netns else "127.0.0.1")
        try:
            etcd.start()
        except RuntimeError:
            etcd.close()
            if netns:
                netns.destroy()
            raise
    t0 = time.monotonic()
    job = Job(ddprun, conf, snap, workdir, netns, args.warm_spares, etcd, args.memory_snapshots)
    ok = False
    try:
        next_fault = t0 + rng.uniform(2, 5)
        deadline = t0 + args.duration + 10 * t_ref + 300
        while time.monotonic() < deadline:
            if job.supervise():
                ok = True
                break
            now = time.monotonic()
            if now - t0 < args.duration and now >= next_fault:
                kind = rng.choice(faults_of_backend)
                what = inject(kind, job, conf, snap, has_tmpfs, rng, print)
                if what:
                    faults.append({"t": round(now - t0, 2), "wall": time.time(), "fault": kind,
                                   "target": what})
                    print(f"chaos: {now - t0:7.1f}s {kind}: {what}", flush=True)
                next_fault = time.monotonic() + rng.uniform(2, 6)
            time.sleep(0.05)
    finally:
        job.kill_all()
        if etcd:
            etcd.close()
        if netns:
            netns.destroy()
    elapsed = time.monotonic() - t0

    problems = []
    if not ok:
        problems.append("the job did not finish")
    got = state(ddpworker, snap)
    if got is None:
        problems.append(f"no final state: no snapshot named by {snap}/latest verifies")
    elif got != want:
        problems.append(f"final state {got} differs from the uninterrupted run's {want}")
    bad = unexplained(workdir)
    if bad:
        problems.append(f"{len(bad)} log lines no fault explains: " + "; ".join(bad[:10]))
    time.sleep(1)
    orphans = workers(conf)
    if orphans:
        problems.append(f"orphan workers: {orphans}")
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
    resumes = steps_lost(workdir, faults)
    too_many = [r for r in resumes if r["source"] in ("memory", "peer") and r["steps_lost"] > 1]
    if args.memory_snapshots == "1" and too_many:
        problems.append(f"resumes from memory that lost more than a step: {too_many}")
    leaked = listening_ports() - ports_before
    if str(job.port) in leaked:
        problems.append(f"the store's port {job.port} is still listening")
    report = {
        "seed": seed, "steps": steps, "duration_s": args.duration, "warm_spares": args.warm_spares,
        "rdzv_backend": args.rdzv_backend,
        "uninterrupted_s": round(t_ref, 2), "chaos_s": round(elapsed, 2),
        "faults_window_s": round(min(elapsed, args.duration), 2),
        "faults": faults, "agent_restarts": len(job.exits),
        "lost_s": round(elapsed - t_ref, 2),
        "lost_per_fault_s": round((elapsed - t_ref) / len(faults), 2) if faults else 0,
        "bit_identical": got is not None and got == want, "problems": problems,
        "memory_snapshots": args.memory_snapshots, "resumes": resumes,
        "steps_lost_by_fault": lost_by_fault(resumes),
    }
    if ok and elapsed < args.duration:
        print(f"chaos: the job ended after {elapsed:.1f} s, before the {args.duration:g} s of faults "
              f"asked: faults covered {elapsed:.1f} s (size it with --steps)", flush=True)
    by_kind = {k: sum(f["fault"] == k for f in faults) for k in faults_of_backend}
    print(f"chaos: {len(faults)} faults {by_kind}, {len(job.exits)} agent restarts, "
          f"{elapsed:.1f} s against {t_ref:.1f} s uninterrupted "
          f"({report['lost_per_fault_s']} s lost per fault)", flush=True)
    sources = {k: sum(r["source"] == k for r in resumes)
               for k in ("memory", "peer", "disk", "none")}
    print(f"chaos: steps lost per restart, by the fault before it: "
          f"{report['steps_lost_by_fault']}; sources {sources}", flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if has_tmpfs:
        subprocess.run(["umount", "-l", snap])
    if problems:
        print("chaos: FAILED: " + "; ".join(problems) + f" (logs in {workdir})", flush=True)
        print(f"chaos: replay: {replay_command(args, seed, steps)}", flush=True)
        return 1
    print("chaos: passed: bit-identical final weights, no orphans, no leaked ports", flush=True)
    if not args.keep:
        subprocess.run(["rm", "-rf", workdir])
    return 0


if __name__ == "__main__":
    sys.exit(main())
