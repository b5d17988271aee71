"""Memory snapshots (snapshot.every_memory, worker/memory_snapshot.h): rank 0 copies its state
after every step into shared memory its agent owns; a restart resumes from there. Each test kills
a worker with SIGKILL (after damaging its memory copies where that is the point) and asserts on the
outcome: the source the job resumed from, the steps lost, and a final state equal bit for bit to
an uninterrupted run's. The job is small (two CPU ranks, 64 steps): seconds each."""
import glob
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import clean_env, free_port, wait_until

CONF = """[model]
name = cnn
width = 8
[data]
kind = synthetic
height = 28
width = 28
channels = 1
classes = 10
train_limit = 1024
test_limit = 128
augment = true
[optim]
lr = 0.05
[train]
batch_size = 16
epochs = {epochs}
log_interval = 4
collective_timeout = 30
[snapshot]
every = {every}
keep = 2
"""
STEPS = 64


def state_hash(ddpworker, snap_dir):
    """The state hash and step of the snapshot `latest` names (it must verify)."""
    latest = (snap_dir / "latest").read_text().strip()
    r = subprocess.run([ddpworker, "inspect", str(snap_dir / latest)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", r.stdout, re.M))
    return fields["state hash"], int(fields["step"].split()[0])


def write_conf(tmp_path, every, epochs=2):
    conf = tmp_path / "mem.conf"
    conf.write_text(CONF.format(every=every, epochs=epochs))
    return str(conf)


def start_job(ddprun, conf, snap, metrics, *flags, env=None, nnodes=None, port=None):
    cmd = [ddprun, "--nproc-per-node", "2", "--max-restarts", "3", *flags]
    if nnodes:
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", "memsnap"]
    else:
        cmd += ["--standalone"]
    cmd += [conf, f"snapshot.dir={snap}", f"train.metrics_file={metrics}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or clean_env(), start_new_session=True)


def reference(ddprun, ddpworker, conf, tmp_path):
    snap = tmp_path / "reference"
    job = start_job(ddprun, conf, snap, tmp_path / "ref.jsonl")
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0 and "restarting" not in out, out
    return state_hash(ddpworker, snap)


def read_until_step(job, step):
    seen = []
    for line in job.stdout:
        seen.append(line)
        if f" step {step}/" in line:
            return "".join(seen)
    pytest.fail("the job ended before step %d:\n%s" % (step, "".join(seen)))


def rank0_pid(metrics):
    starts = [e for e in map(json.loads, open(metrics)) if e.get("event") == "start"]
    return starts[-1]["pid"]


def memory_dir(agent_pid, base="/dev/shm"):
    found = glob.glob(f"{base}/ddprun-mem-{agent_pid}-*")
    assert len(found) == 1, found
    return found[0]


def slot_steps(mem_dir, names=("own-0.ddps", "own-1.ddps")):
    """{slot file: step} of the slots (the own ones unless names) whose header is sealed (magic,
    header checksum not checked here: the worker does that); a slot not there yet is left out."""
    steps = {}
    for name in names:
        if not os.path.exists(os.path.join(mem_dir, name)):
            continue
        with open(os.path.join(mem_dir, name), "rb") as f:
            head = f.read(24)
        if head[:7] == b"DDPSNAP":
            steps[name] = struct.unpack_from("<Q", head, 16)[0]
    return steps


def damage(path, offset=4096, n=4096):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([0x5A]) * n)


def resume_of(out):
    """(path, step, source, steps lost) of the one resume in out."""
    found = re.findall(r"resuming from (\S+): step (\d+).*; source (\w+) \(rank \d+\)"
                       r"(?:, (\d+) steps lost)?", out)
    assert len(found) == 1, out
    path, step, source, lost = found[0]
    return path, int(step), source, int(lost) if lost else None


def stop_with_two_generations(pid, mem_dir, timeout=30):
    """SIGSTOP pid at a moment both of its slots hold sealed generations; their steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)
        steps = slot_steps(mem_dir)
        if len(steps) == 2:
            return steps
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    pytest.fail("never two sealed generations at once")


def kill_node(job):
    """SIGKILL to a job's agent and workers, back once none of them is left (a worker dying
    meanwhile can still finish writing a snapshot file)."""
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()

    def group_gone():
        try:
            os.killpg(job.pid, 0)
            return False
        except ProcessLookupError:
            return True
    assert wait_until(group_gone, timeout=30), "node's processes outlive SIGKILL"


def kill_left(jobs):
    """SIGKILL to the process group of every job still running (a failed test's leftovers)."""
    for j in jobs:
        if j.poll() is None:
            os.killpg(j.pid, signal.SIGKILL)


def finish(job):
    out, _ = job.communicate(timeout=300)
    return out


def kill_rank0_with_damaged_copies(job, metrics, to_damage):
    """Past step 20, stop rank 0 holding two sealed generations, damage the slots to_damage(steps)
    names ({slot name: step}), kill -9 it and let the job finish: (its output, steps)."""
    seen = read_until_step(job, 20)
    mem_dir, pid = memory_dir(job.pid), rank0_pid(metrics)
    steps = stop_with_two_generations(pid, mem_dir)
    for name in to_damage(steps):
        damage(os.path.join(mem_dir, name))
    os.kill(pid, signal.SIGKILL)
    return seen + finish(job), steps


def test_kill_9_of_rank_0_resumes_from_memory_losing_at_most_one_step(ddprun, ddpworker,
                                                                     tmp_path):
    """No disk snapshot before the end (every = 1000): only memory can resume it."""
    conf = write_conf(tmp_path, 1000)
    ref = reference(ddprun, ddpworker, conf, tmp_path)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    job = start_job(ddprun, conf, snap, metrics)
    try:
        seen = read_until_step(job, 24)
        mem_dir = memory_dir(job.pid)
        os.kill(rank0_pid(metrics), signal.SIGKILL)
        out = seen + finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert out.count("restarting every worker") == 1, out
    path, step, source, lost = resume_of(out)
    assert source == "memory" and path.startswith(mem_dir), out
    assert step >= 24 - 1 and lost is not None and lost <= 1, (step, lost)
    assert state_hash(ddpworker, snap) == ref
    assert not os.path.exists(mem_dir), "the agent leaves its shared memory behind"


def test_a_torn_newest_copy_is_skipped_for_the_generation_before(ddprun, ddpworker, tmp_path):
    conf = write_conf(tmp_path, 1000)
    ref = reference(ddprun, ddpworker, conf, tmp_path)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    job = start_job(ddprun, conf, snap, metrics)
    try:
        # the newest copy's parameters damaged, its header intact: a torn copy
        out, steps = kill_rank0_with_damaged_copies(job, metrics,
                                                    lambda steps: [max(steps, key=steps.get)])
        newest = max(steps, key=steps.get)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert re.search(rf"memory snapshot skipped: \S*{newest}: .*checksum", out), out
    path, step, source, lost = resume_of(out)
    assert source == "memory" and step == min(steps.values()), (steps, out)
    assert lost is not None and 1 <= lost <= 2, out
    assert state_hash(ddpworker, snap) == ref


def test_corrupt_memory_copies_fall_back_to_the_disk(ddprun, ddpworker, tmp_path):
    conf = write_conf(tmp_path, 8)
    ref = reference(ddprun, ddpworker, conf, tmp_path)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    job = start_job(ddprun, conf, snap, metrics)
    try:
        out, steps = kill_rank0_with_damaged_copies(job, metrics, list)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert len(re.findall(r"memory snapshot skipped: .*checksum", out)) == 2, out
    path, step, source, lost = resume_of(out)
    assert source == "disk" and path == str(snap / f"snapshot-{step:012d}.ddps"), out
    assert step % 8 == 0 and step >= 16, (steps, out)
    assert lost in (max(steps.values()) - step, max(steps.values()) - step + 1), (steps, out)
    assert state_hash(ddpworker, snap) == ref


SECRET = "memory-snapshot-test-secret"


@pytest.mark.parametrize("after", ["scaled_down", "replaced"])
def test_a_lost_node_and_its_disk_resume_from_the_peer_copy(ddprun, ddpworker, tmp_path,
                                                            start_store, after):
    """Two nodes on an outside store; node 0 (rank 0: the memory and disk snapshots) loses its
    agent, its workers and its snapshot directory. Node 1's agent holds a copy of node 0's memory
    snapshots, and the job resumes from it, losing at most a step, and ends as a run resumed from
    that very copy: scaled_down, node 1 goes on alone (--nnodes 1:2); replaced, a fresh node 0
    (empty memory, empty disk) takes the lost one's place and rank 0, and rank 2 (node 1's local
    rank 0) sends it the state. The agents hold a shared secret (DDPRUN_STORE_SECRET), which
    their copies prove (the chaos suite runs without one)."""
    # 8 epochs (512 steps): with 2 the whole job took 1.5 s on the idle VM and could end before
    # node 0 was killed (no restart, nothing resumed)
    conf = write_conf(tmp_path, 8, epochs=8)
    env = clean_env(DDPRUN_STORE_SECRET=SECRET)
    store = start_store(env=env)
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=1"
    nnodes = "1:2" if after == "scaled_down" else "2"
    snaps = [tmp_path / "snap0", tmp_path / "snap1"]
    metrics = [tmp_path / "m0.jsonl", tmp_path / "m1.jsonl"]

    def start(node):
        return start_job(ddprun, conf, snaps[node], metrics[node], "--node-rank", str(node),
                         "--local-addr", "127.0.0.1", "--rdzv-conf", rdzv, nnodes=nnodes,
                         port=store.port, env=env)
    jobs = []
    try:
        jobs = [start(0), start(1)]
        seen = read_until_step(jobs[0], 12)
        peer_dir = memory_dir(jobs[1].pid)
        # node 1 holds a copy of step 11 or later (the copies follow the steps asynchronously)
        peer_of_0 = ("peer-0-0.ddps", "peer-0-1.ddps")
        assert wait_until(lambda: max(slot_steps(peer_dir, peer_of_0).values(), default=0) >= 11,
                          timeout=30), "no copy of step 11 or later reached node 1"
        kill_node(jobs[0])  # node 0: its agent and its workers
        shutil.rmtree(memory_dir(jobs[0].pid))  # its memory (a new agent would take it over)
        shutil.rmtree(snaps[0])                 # and its disk
        metrics[0].unlink()
        kept = tmp_path / "kept"  # node 1's copies as they are now, for the reference
        kept.mkdir()
        for path in glob.glob(f"{peer_dir}/peer-0-*.ddps"):
            shutil.copy(path, kept)
        if after == "replaced":
            jobs.append(start(0))
            out0 = finish(jobs[2])
        out = finish(jobs[1])
    finally:
        kill_left(jobs)
    assert jobs[1].returncode == 0, out
    path, step, source, lost = resume_of(out)  # printed by the rank that sent it
    assert source == "peer" and os.path.basename(path).startswith("peer-0-"), out
    assert step >= 11 and lost is not None and lost <= 1, (step, lost, seen)
    world, root, final_snaps = (2, 0, snaps[1]) if after == "scaled_down" else (4, 2, snaps[0])
    assert re.search(rf"saved by 4 ranks, now {world}\); source peer \(rank {root}\)", out), out
    if after == "replaced":
        assert jobs[2].returncode == 0 and "resuming from" not in out0, out0
    # `ddprun status` (the store outlives the job here) and rank 0's metrics say the same
    r = subprocess.run([ddprun, "status", "--rdzv-endpoint", store.endpoint, "--rdzv-id",
                        "memsnap", "--json"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["last_resume"]
    assert (res["step"], res["source"], res["rank"], res["steps_lost"]) == \
        (step, "peer", root, lost), res
    r = subprocess.run([ddprun, "status", "--rdzv-endpoint", store.endpoint, "--rdzv-id",
                        "memsnap"], capture_output=True, text=True, timeout=30, env=env)
    assert f"last resume: step {step} from peer (rank {root}), {lost} step" in r.stdout, r.stdout
    rank0 = metrics[1] if after == "scaled_down" else metrics[0]
    events = [e for e in map(json.loads, open(rank0)) if e["event"] == "resume"]
    assert [(e["step"], e["source"]) for e in events] == [(step, "peer")], events
    # the reference: the same world, resumed from the copy the job resumed from
    ref = tmp_path / "reference"
    ref.mkdir()
    shutil.copy(kept / os.path.basename(path), ref / f"snapshot-{step:012d}.ddps")
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", str(world), conf,
                        f"snapshot.dir={ref}", "snapshot.every_memory=0"], capture_output=True,
                       text=True, timeout=300, env=clean_env())
    assert r.returncode == 0 and f"resuming from {ref}" in r.stdout, r.stdout + r.stderr
    assert state_hash(ddpworker, ref) == state_hash(ddpworker, final_snaps)


def test_an_agent_killed_alone_leaves_its_generations_to_the_next_agent(ddprun, tmp_path,
                                                                         start_store):
    """Node 0's agent (rank 0's node) is killed with its workers, but not the node: the agent
    started again there with the same command line takes over the dead one's memory directory
    and the job resumes from rank 0's own generations, losing at most a step, although node 0's
    disk snapshots and node 1's copies of them are deleted."""
    # 8 epochs (512 steps): with 2 the whole job took 1.5 s on the idle VM and could end before
    # node 0 was killed (no restart, nothing resumed)
    conf = write_conf(tmp_path, 8, epochs=8)
    store = start_store()
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=1"
    snaps = [tmp_path / "snap0", tmp_path / "snap1"]
    metrics = [tmp_path / "m0.jsonl", tmp_path / "m1.jsonl"]

    def start(node):
        return start_job(ddprun, conf, snaps[node], metrics[node], "--node-rank", str(node),
                         "--local-addr", "127.0.0.1", "--rdzv-conf", rdzv, nnodes="2",
                         port=store.port)
    jobs = []
    try:
        jobs = [start(0), start(1)]
        seen = read_until_step(jobs[0], 12)
        dead_dir = memory_dir(jobs[0].pid)
        kill_node(jobs[0])  # node 0's agent and workers; its RAM stays
        assert slot_steps(dead_dir), "no generation left behind"
        shutil.rmtree(snaps[0])
        for path in glob.glob(f"{memory_dir(jobs[1].pid)}/peer-0-*"):
            os.unlink(path)
        jobs.append(start(0))
        out0 = finish(jobs[2])
        out1 = finish(jobs[1])
    finally:
        kill_left(jobs)
    assert jobs[1].returncode == 0 and jobs[2].returncode == 0, out0 + out1
    assert "taken over" in out0, out0
    assert not os.path.exists(dead_dir), "the dead agent's directory stays behind"
    path, step, source, lost = resume_of(out0)
    assert source == "memory" and os.path.basename(path).startswith("own-"), out0
    assert step >= 11 and lost is not None and lost <= 1, (step, lost, seen)


def test_generations_of_another_train_conf_are_not_resumed_from(ddprun, tmp_path):
    """An agent killed alone, then started again under the same run id with a train.conf of
    another model width: it takes over the dead agent's generations (same job to the agent), but
    the worker sees they hold another model and starts afresh, saying so, instead of failing
    the run as for a user's own snapshot.dir of another model."""
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=1"
    first = write_conf(tmp_path, 8, epochs=8)
    port = free_port()  # the same endpoint: part of the job's identity
    job = start_job(ddprun, first, tmp_path / "snap0", tmp_path / "m0.jsonl", "--local-addr",
                    "127.0.0.1", "--rdzv-conf", rdzv, nnodes="1", port=port)
    jobs = [job]
    try:
        read_until_step(job, 8)
        dead_dir = memory_dir(job.pid)
        kill_node(job)
        assert slot_steps(dead_dir), "no generation left behind"
        other = tmp_path / "other.conf"
        other.write_text(CONF.format(every=8, epochs=1).replace("width = 8", "width = 4"))
        jobs.append(start_job(ddprun, str(other), tmp_path / "snap1", tmp_path / "m1.jsonl",
                              "--local-addr", "127.0.0.1", "--rdzv-conf", rdzv, nnodes="1",
                              port=port))
        out = finish(jobs[1])
    finally:
        kill_left(jobs)
    assert "taken over" in out, out
    assert jobs[1].returncode == 0, out
    assert re.search(r"memory snapshot \S+ holds model cnn width 8 .*; not resumed from it",
                     out), out
    assert "resuming from" not in out, out
    events = [json.loads(line) for line in open(tmp_path / "m1.jsonl")]
    assert not [e for e in events if e["event"] == "resume"], events
    assert [e["step"] for e in events if e["event"] == "train"][-1] == 32, events


def test_a_node_without_a_memory_region_trains_with_the_others(ddprun, tmp_path, start_store):
    """No snapshot.dir, and node 1's agent cannot make its memory region (its DDPRUN_SHM_DIR does
    not exist): its ranks have no memory snapshots while node 0's have. Every rank still takes
    part in the agreement on what to resume from; before, node 1's ranks skipped it and entered the
    next collective, and every attempt failed the same way (exit 75 until the budget ran out)."""
    conf = write_conf(tmp_path, 8)
    store = start_store()
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=5"
    jobs = []
    for node in (0, 1):
        env = clean_env()
        if node == 1:
            env["DDPRUN_SHM_DIR"] = str(tmp_path / "no such directory")
        cmd = [ddprun, "--nproc-per-node", "2", "--max-restarts", "1", "--nnodes", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
               "--rdzv-id", "noregion", "--node-rank", str(node), "--local-addr", "127.0.0.1",
               "--rdzv-conf", rdzv, conf, "snapshot.dir=", "train.epochs=1"]
        jobs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True))
    try:
        outs = [finish(j) for j in jobs]
    finally:
        kill_left(jobs)
    assert "restarts resume from snapshot.dir" in outs[1], outs[1]
    assert [j.returncode for j in jobs] == [0, 0], outs[0] + outs[1]
    assert "restarting" not in outs[0] + outs[1], outs[0] + outs[1]


def connected_addresses(pid):
    """The local addresses of the process's established TCP connections (IPv4: /proc/net/tcp
    rows its sockets own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for line in open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and f[9] in inodes:  # ESTABLISHED
            addr = socket.inet_ntoa(struct.pack("<I", int(f[1].split(":")[0], 16)))
            found.append(addr)
    return found


def test_the_ring_is_reached_at_the_nodes_local_addr(ddprun, tmp_path, start_store):
    """ddpworker's ring advertises --local-addr (given to the workers as DDPRUN_LOCAL_ADDR) and
    listens there only: node 1 says 127.0.0.2, and rank 1 reaches rank 2 there (it was dialled at
    rank 2's route to the store, 127.0.0.1, which on a store's own node may be loopback)."""
    conf = write_conf(tmp_path, 8, epochs=8)
    store = start_store()
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=5"
    jobs = [start_job(ddprun, conf, tmp_path / f"snap{node}", tmp_path / f"m{node}.jsonl",
                      "--node-rank", str(node), "--local-addr", f"127.0.0.{node + 1}",
                      "--rdzv-conf", rdzv, nnodes="2", port=store.port) for node in (0, 1)]
    try:
        read_until_step(jobs[0], 8)
        workers = []
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            # this test's rank 2 (its conf on the command line: not another job's on the machine)
            if (b"ddpworker" in cmd and b"__shim" not in cmd and b"RANK=2" in env and
                    str(conf).encode() in cmd):
                workers.append(pid)
        assert workers, "rank 2 not found"
        addresses = connected_addresses(workers[0])
    finally:
        for j in jobs:
            if j.poll() is None:
                os.killpg(j.pid, signal.SIGKILL)
        for j in jobs:
            j.communicate()
    assert "127.0.0.2" in addresses, addresses


def test_a_copy_from_a_peer_without_the_secret_is_refused(ddprun, tmp_path, start_store):
    """An agent that holds a shared secret takes copies only from peers that prove it: a
    well-formed frame sent without the proof writes nothing and is logged."""
    conf = write_conf(tmp_path, 8)
    env = clean_env(DDPRUN_STORE_SECRET=SECRET)
    store = start_store(env=env)
    rdzv = "join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,heartbeat_timeout=5"
    jobs = [start_job(ddprun, conf, tmp_path / f"snap{node}", tmp_path / f"m{node}.jsonl",
                      "--node-rank", str(node), "--local-addr", "127.0.0.1", "--rdzv-conf", rdzv,
                      nnodes="2", port=store.port, env=env) for node in (0, 1)]
    try:
        seen = read_until_step(jobs[0], 4)
        listener = None  # node 1's, handed to node 0 in its rank record as its "next_peer"
        for index in (0, 1):
            r = subprocess.run([ddprun, "store-client", "--endpoint", store.endpoint, "get",
                                f"/ddprun/memsnap/r0/rank/{index}"], capture_output=True,
                               text=True, timeout=30, env=env)
            assert r.returncode == 0, r.stderr
            record = json.loads(r.stdout)
            if record["node"] == 0:
                listener = record["next_peer"]
        host, port = listener.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            nonce = s.recv(32)
            assert len(nonce) == 32, nonce  # the challenge comes first
            payload = b"\0" * 1024
            s.sendall(b"DDPMEMR1" + struct.pack("<IIQQQ", 7, 0, 1, len(payload), 1) + payload)
            s.settimeout(10)
            assert s.recv(1) == b"", "the connection stays open"
        peer_dir = memory_dir(jobs[1].pid)
        assert not glob.glob(f"{peer_dir}/peer-7-*"), os.listdir(peer_dir)
        for j in jobs:
            os.killpg(j.pid, signal.SIGTERM)
        outs = [seen + j.communicate(timeout=60)[0] for j in jobs]
    finally:
        kill_left(jobs)
    assert "a peer connection without the store's secret refused" in outs[1], outs[1]


def test_a_restart_with_nothing_to_resume_says_it_lost_every_step(ddprun, tmp_path):
    """Memory snapshots off and no disk snapshot yet: the restart starts over, and says how many
    steps that lost (the progress record is kept with every_memory = 0)."""
    conf = write_conf(tmp_path, 1000)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    cmd = [ddprun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", conf,
           f"snapshot.dir={snap}", f"train.metrics_file={metrics}", "snapshot.every_memory=0"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=clean_env(), start_new_session=True)
    try:
        seen = read_until_step(job, 12)
        os.kill(rank0_pid(metrics), signal.SIGKILL)
        out = seen + finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    found = re.findall(r"starting again from step 0; source none, (\d+) steps lost", out)
    # >= 11: the progress line of step 12 comes before the step is recorded as reached
    assert len(found) == 1 and int(found[0]) >= 11, out
    events = [e for e in map(json.loads, open(metrics)) if e["event"] == "resume"]
    assert [(e["source"], e["steps_lost"]) for e in events] == [("none", int(found[0]))], events


def test_a_diverged_step_is_never_sealed_so_a_rerun_resumes_before_it(ddpworker, tmp_path):
    """lr 1000, the loss logged every 50 steps: the weights turn inf/NaN long before the log step
    that ends the run (diverged, 80). No memory generation whose parameters or momentum hold inf
    or NaN is sealed (the disk path takes no snapshot of a non-finite loss either), so a rerun
    with a sane lr resumes from the last finite one."""
    conf = write_conf(tmp_path, 0)
    mem = tmp_path / "mem"
    mem.mkdir()
    env = dict(clean_env(), DDPRUN_MEMORY_SNAPSHOT_DIR=str(mem))
    r = subprocess.run([ddpworker, conf, "optim.lr=1000", "train.log_interval=50",
                        "train.max_steps=40", "snapshot.every=0"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 80, r.stdout + r.stderr
    m = re.search(r"memory snapshot of step (\d+) not sealed: the parameters or the optimizer's "
                  r"state hold inf or NaN", r.stderr)
    assert m and int(m.group(1)) < 40, r.stderr
    first_bad = int(m.group(1))
    sealed = slot_steps(mem)
    assert all(step < first_bad for step in sealed.values()), (sealed, first_bad)
    for name in sealed:
        data = (mem / name).read_bytes()
        header_bytes = struct.unpack_from("<I", data, 12)[0]
        n_params = struct.unpack_from("<Q", data, 120)[0]  # params, then momentum: checked
        floats = struct.unpack_from(f"<{2 * n_params}f", data, header_bytes)
        assert all(f == f and abs(f) != float("inf") for f in floats), name
    if not sealed:
        return  # diverged at the first step: nothing finite to resume
    r = subprocess.run([ddpworker, conf, "train.max_steps=" + str(max(sealed.values()) + 2),
                        "snapshot.every=0"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    path, step, source, _ = resume_of(r.stdout + r.stderr)
    assert source == "memory" and step == max(sealed.values()), r.stdout + r.stderr
