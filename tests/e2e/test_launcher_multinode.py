"""Several agents as several nodes on loopback (c10d rendezvous, fixed --nnodes): ranks and
environment, a failure on any node restarts every node, the restart budget is job-wide, exit codes
and the root cause reach every agent."""
import json
import os
import socket
import subprocess
import time

import pytest

from conftest import free_port

WORKER = r"""#!/bin/sh
/usr/bin/python3 - <<'PY'
import json, os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"]
d = {k: os.environ[k] for k in keys}
d["UV_THREADPOOL_SIZE"] = os.environ.get("UV_THREADPOOL_SIZE", "unset")
path = f"{os.environ['OUT_DIR']}/rank{d['RANK']}.attempt{d['TORCHELASTIC_RESTART_COUNT']}.json"
json.dump(d, open(path, "w"))
PY
if [ "$RANK" = "${FAIL_RANK:-none}" ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt "${FAIL_ATTEMPTS:-1000}" ]; then
    exit "${FAIL_CODE:-5}"
fi
sleep 0.2
"""


def wait_listening(port, proc, timeout=20):
    """Until the first agent's store accepts connections on port (the tests count on that agent
    hosting the store; a fixed pause let a later agent win the port on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)


def run_agents(ddprun, tmp_path, n_nodes, nproc, extra=(), env=None, hints=None, timeout=60):
    worker = tmp_path / "worker.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)
    port = free_port()
    e = dict(os.environ, OUT_DIR=str(tmp_path))
    e.update(env or {})
    procs = []
    for i in range(n_nodes):
        args = [ddprun, "--nnodes", str(n_nodes), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "mn", "--rdzv-conf", "join_timeout=30"] + list(extra)
        if hints:
            args += ["--node-rank", str(hints[i])]
        procs.append(subprocess.Popen(args + [str(worker)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        if i == 0:
            wait_listening(port, procs[0])  # the first agent hosts the store
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def spawn_c10d_agents(ddprun, script, tmp_path, n, nproc, extra=()):
    """n agents of one c10d job on loopback, started a moment apart (the first hosts the store)."""
    port = free_port()
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    agents = []
    for _ in range(n):
        agents.append(subprocess.Popen(
            [ddprun, "--nnodes", str(n), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}"] + list(extra) + [str(script)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        if len(agents) == 1:
            wait_listening(port, agents[0])
    return agents


def load(tmp_path, rank, attempt=0):
    return json.load(open(tmp_path / f"rank{rank}.attempt{attempt}.json"))


def test_three_nodes_ranks_and_environment(ddprun, tmp_path):
    results = run_agents(ddprun, tmp_path, 3, 2)
    assert [r[0] for r in results] == [0, 0, 0], [r[2] for r in results]
    envs = [load(tmp_path, r) for r in range(6)]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"} and {e["GROUP_WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] + ":" + e["MASTER_PORT"] for e in envs} == {
        envs[0]["MASTER_ADDR"] + ":" + envs[0]["MASTER_PORT"]}
    for rank, e in enumerate(envs):
        assert e["GROUP_RANK"] == str(rank // 2) and e["LOCAL_RANK"] == str(rank % 2)
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["TORCHELASTIC_RUN_ID"] == "mn"
    # the store host is node 0
    assert "store hosted on" in results[0][2] and "node 0 of 3" in results[0][2]
    # the agents' own libuv pool size is theirs, not the workers'
    assert {e["UV_THREADPOOL_SIZE"] for e in envs} == {"unset"}


def test_a_variable_the_user_set_reaches_the_workers_unchanged(ddprun, tmp_path):
    results = run_agents(ddprun, tmp_path, 2, 1, env={"UV_THREADPOOL_SIZE": "7"})
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    assert {load(tmp_path, r)["UV_THREADPOOL_SIZE"] for r in range(2)} == {"7"}


def test_node_rank_hints_order_the_other_nodes(ddprun, tmp_path):
    results = run_agents(ddprun, tmp_path, 3, 1, hints=[2, 1, 0])
    assert [r[0] for r in results] == [0, 0, 0]
    # node 0 is always the store host; then the hints: agent 2 (hint 0) before agent 1 (hint 1)
    assert "node 0 of 3" in results[0][2]
    assert "node 2 of 3" in results[1][2] and "node 1 of 3" in results[2][2]


def test_failure_on_one_node_restarts_every_node(ddprun, tmp_path):
    t0 = time.monotonic()
    results = run_agents(ddprun, tmp_path, 2, 2, extra=["--max-restarts", "3"],
                         env={"FAIL_RANK": "3", "FAIL_ATTEMPTS": "2"})
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    for rank in range(4):
        assert load(tmp_path, rank, 2)["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert "round 0 ends (exit 5 on node 1" in results[0][2], "node 0 learns of node 1's failure"
    assert time.monotonic() - t0 < 20


def test_restart_budget_is_job_wide_and_exit_code_reaches_every_node(ddprun, tmp_path):
    results = run_agents(ddprun, tmp_path, 2, 2, extra=["--max-restarts", "1"],
                         env={"FAIL_RANK": "1", "FAIL_CODE": "9"})
    errs = [r[2] for r in results]
    assert [r[0] for r in results] == [9, 9], errs
    # node 0 is whichever agent the rendezvous made node 0 (under load the second one started can
    # take the store's port first): it names the root cause, the other node names node 0
    node0 = [e for e in errs if "root cause: node 0 rank 1" in e and "attempt 2 of 2" in e]
    others = [e for e in errs if "failed on another node (exit 9 on node 0" in e]
    assert len(node0) == 1 and len(others) == 1, errs
    assert not (tmp_path / "rank0.attempt2.json").exists(), "no third attempt anywhere"


def test_permanent_failure_stops_every_node_at_once(ddprun, tmp_path):
    results = run_agents(ddprun, tmp_path, 2, 1, extra=["--max-restarts", "5"],
                         env={"FAIL_RANK": "1", "FAIL_CODE": "78"})
    assert [r[0] for r in results] == [78, 78]
    assert not (tmp_path / "rank0.attempt1.json").exists()


def test_join_timeout_is_a_clear_error(ddprun, tmp_path):
    worker = tmp_path / "w.sh"
    worker.write_text("#!/bin/sh\nexit 0\n")
    worker.chmod(0o755)
    r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=1",
                        str(worker)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "did not gather --nnodes 2:2 within join_timeout=1s (1 joined)" in r.stderr


def test_losing_the_store_host_stops_every_node(ddprun, tmp_path):
    sleeper = tmp_path / "sleeper.sh"
    sleeper.write_text("#!/bin/sh\necho $$ > \"$OUT_DIR/pid$RANK\"\nexec sleep 60\n")
    sleeper.chmod(0o755)
    agents = spawn_c10d_agents(ddprun, sleeper, tmp_path, 2, 2, ["--rdzv-id", "lost"])
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pid{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.02)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    t0 = time.monotonic()
    agents[0].kill()                                # the store host dies, SIGKILL
    agents[0].wait()
    _, err = agents[1].communicate(timeout=30)
    assert agents[1].returncode == 75, err          # peer failure, not a hang
    assert "lost the job's store" in err
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        assert time.monotonic() < deadline, "a worker outlived its agent"
        time.sleep(0.02)


def test_a_beat_reconnecting_to_a_lost_store_does_not_hold_the_exit(ddprun, tmp_path):
    """The store host dies while the other node's worker takes 1 s to stop: the heartbeats go on
    meanwhile and one of them is reconnecting (for up to half the heartbeat timeout, 15 s) when the
    agent is done. The agent ends it instead of waiting for it (it exited 15 s late)."""
    worker = tmp_path / "slow_stop.sh"
    worker.write_text("#!/bin/sh\ntrap 'sleep 1; exit 1' TERM\necho $$ > \"$OUT_DIR/pid$RANK\"\n"
                      "while :; do sleep 0.05; done\n")
    worker.chmod(0o755)
    agents = spawn_c10d_agents(ddprun, worker, tmp_path, 2, 1,
                               ["--rdzv-id", "beat", "--rdzv-conf", "keep_alive_interval=0.1"])
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.02)
    t0 = time.monotonic()
    agents[0].kill()
    agents[0].wait()
    _, err = agents[1].communicate(timeout=60)
    assert agents[1].returncode == 75, err
    assert time.monotonic() - t0 < 1 + 3, err


# seen.<round>.<rank>: group world size, world size, group rank, TORCHELASTIC_RESTART_COUNT
ELASTIC_WORKER = r"""#!/bin/sh
echo "$GROUP_WORLD_SIZE $WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RESTART_COUNT" > "$OUT_DIR/seen.$DDPRUN_ATTEMPT.$RANK"
[ "$DDPRUN_ATTEMPT" = "0" ] && exec sleep "${FIRST_ROUND_S:-0}"
exit 0
"""


def start_elastic(ddprun, tmp_path, port, nnodes, env_extra=None,
                  conf="join_timeout=30,last_call_timeout=0.3"):
    worker = tmp_path / "elastic.sh"
    worker.write_text(ELASTIC_WORKER)
    worker.chmod(0o755)
    env = dict(os.environ, OUT_DIR=str(tmp_path), **(env_extra or {}))
    return subprocess.Popen(
        [ddprun, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "el", "--rdzv-conf", conf,
         str(worker)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_min_nodes_start_after_the_last_call(ddprun, tmp_path):
    port = free_port()
    agents = [start_elastic(ddprun, tmp_path, port, "2:3") for _ in range(2)]
    errs = [a.communicate(timeout=60)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs
    assert (tmp_path / "seen.0.0").read_text().split()[:2] == ["2", "2"]


def test_a_node_arriving_later_scales_the_job_up(ddprun, tmp_path):
    port = free_port()
    env = {"FIRST_ROUND_S": "30"}
    agents = [start_elastic(ddprun, tmp_path, port, "2:3", env) for _ in range(2)]
    deadline = time.monotonic() + 20
    while not ((tmp_path / "seen.0.0").exists() and (tmp_path / "seen.0.1").exists()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    agents.append(start_elastic(ddprun, tmp_path, port, "2:3", env))
    errs = [a.communicate(timeout=60)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0, 0], errs
    assert time.monotonic() - t0 < 15, "the 30 s first round was cut short by the new round"
    for rank in range(3):
        assert (tmp_path / f"seen.1.{rank}").read_text().split() == ["3", "3", str(rank), "0"], \
            "as torchrun: a membership change is not a restart (TORCHELASTIC_RESTART_COUNT 0)"
    assert "asking for a new round" in errs[2]
    assert all("restarting" not in e for e in errs), "a membership change is not a failure"


def test_a_lost_node_is_detected_by_heartbeat_and_the_job_scales_down(ddprun, tmp_path):
    port = free_port()
    conf = ("join_timeout=30,last_call_timeout=0.3,keep_alive_interval=0.1,"
            "heartbeat_timeout=1")
    agents = []
    for _ in range(3):
        agents.append(start_elastic(ddprun, tmp_path, port, "2:3", {"FIRST_ROUND_S": "60"}, conf))
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"seen.0.{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline, "three workers did not start"
        time.sleep(0.02)
    t0 = time.monotonic()
    agents[2].kill()                           # a whole node, agent and (by its lifeline) workers
    agents[2].wait()
    errs = [a.communicate(timeout=60)[1] for a in agents[:2]]
    assert [a.returncode for a in agents[:2]] == [0, 0], errs
    assert time.monotonic() - t0 < 15
    assert any("sent no heartbeat" in e for e in errs)
    for rank in range(2):
        assert (tmp_path / f"seen.1.{rank}").read_text().split() == ["2", "2", str(rank), "0"]
    assert not (tmp_path / "seen.1.2").exists()


def test_static_backend_across_nodes_ranks_by_node_rank(ddprun, tmp_path):
    worker = tmp_path / "worker.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)
    port = free_port()
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    # node 0 is torchrun's default --node-rank, and 127.0.0.1 its default --master-addr, so
    # node 0's command is the design card's own: no --node-rank, no --master-addr
    node_args = {1: ["--node-rank", "1", "--master-addr", "127.0.0.1"], 0: []}
    agents = [subprocess.Popen([ddprun, "--nnodes", "2", *node_args[r], "--nproc-per-node", "2",
                                "--master-port", str(port), str(worker)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for r in (1, 0)]                      # node 1 first: it waits for node 0's store
    errs = [a.communicate(timeout=60)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs
    for rank in range(4):
        env_seen = load(tmp_path, rank)
        assert env_seen["GROUP_RANK"] == str(rank // 2) and env_seen["WORLD_SIZE"] == "4"
        assert env_seen["MASTER_PORT"] == str(port)


def test_kill_9_of_a_worker_restarts_every_node(ddprun, tmp_path):
    script = tmp_path / "k.sh"
    script.write_text("#!/bin/sh\necho $$ > \"$OUT_DIR/pid.$TORCHELASTIC_RESTART_COUNT.$RANK\"\n"
                      "[ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && exec sleep 60\nexit 0\n")
    script.chmod(0o755)
    agents = spawn_c10d_agents(ddprun, script, tmp_path, 2, 2, ["--max-restarts", "1"])
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pid.0.{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(int((tmp_path / "pid.0.2").read_text()), 9)   # a worker of node 1
    errs = [a.communicate(timeout=60)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs
    assert all((tmp_path / f"pid.1.{r}").exists() for r in range(4)), "every node restarted"
    assert "killed by signal 9" in errs[1]


def test_rdzv_conf_is_host_decides_who_hosts_the_store(ddprun, tmp_path):
    """torchrun's is_host: the node told false never hosts, even when it comes first and the
    endpoint is free; the one told true hosts; a true host whose port is taken fails clearly."""
    worker = tmp_path / "worker.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)
    port = free_port()
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}"]
    client = subprocess.Popen([ddprun, *common, "--rdzv-conf", "is_host=false,read_timeout=20",
                               str(worker)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)                                   # first, yet it must not take the endpoint
    host = subprocess.Popen([ddprun, *common, "--rdzv-conf", "is_host=true", str(worker)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errs = [p.communicate(timeout=60)[1] for p in (client, host)]
    assert [client.returncode, host.returncode] == [0, 0], errs
    assert "store at" in errs[0] and "store hosted on" in errs[1], errs
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        r = subprocess.run([ddprun, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            f"127.0.0.1:{busy}", "--rdzv-conf", "is_host=true", str(worker)],
                           capture_output=True, text=True, timeout=30)
    # the agent's own clean exit (1), not a crash, a sanitizer abort (134) or a worker's code
    assert r.returncode == 1 and "cannot host the job's store" in r.stderr, r.stderr


LOST_PEER_WORKER = r"""#!/bin/sh
echo "$GROUP_WORLD_SIZE $TORCHELASTIC_RESTART_COUNT" > "$OUT_DIR/seen.$DDPRUN_ATTEMPT.$RANK"
if [ "$DDPRUN_ATTEMPT" = 0 ]; then
    # round 0: wait until node 2 is gone, then fail as ddpworker does when a peer vanishes
    while [ ! -e "$OUT_DIR/lost" ]; do sleep 0.05; done
    exit 75
fi
exit "${LATER_EXIT:-0}"
"""


@pytest.mark.parametrize("lose_a_node", [True, False], ids=["node-lost", "no-node-lost"])
def test_a_lost_node_costs_no_restart(ddprun, tmp_path, lose_a_node):
    """--max-restarts 0: the peers of a vanished node fail with "peer failure" (75); the next
    round has a node fewer, so that was a membership change and the job goes on. When no node
    was lost, the same failure ends the job (its budget is spent)."""
    worker = tmp_path / "w.sh"
    worker.write_text(LOST_PEER_WORKER)
    worker.chmod(0o755)
    port = free_port()
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    # last call 2 s: all three must make round 0 even when a loaded machine starts them slowly
    conf = "join_timeout=30,last_call_timeout=2,keep_alive_interval=0.1,heartbeat_timeout=1"
    agents = []
    for _ in range(3):
        agents.append(subprocess.Popen(
            [ddprun, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost", "--rdzv-conf", conf,
             "--max-restarts", "0", str(worker)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"seen.0.{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline, "three workers did not start"
        time.sleep(0.02)
    survivors = agents
    if lose_a_node:
        agents[2].kill()
        agents[2].wait()
        survivors = agents[:2]
    (tmp_path / "lost").write_text("")
    errs = [a.communicate(timeout=60)[1] for a in survivors]
    if lose_a_node:
        assert [a.returncode for a in survivors] == [0, 0], errs
        assert any("does not count against --max-restarts" in e for e in errs), errs
        for rank in range(2):
            assert (tmp_path / f"seen.1.{rank}").read_text().split() == ["2", "0"]
    else:
        assert [a.returncode for a in survivors] == [75, 75, 75], errs
        assert all("the job failed (exit 75 " in e and "are used up" in e for e in errs), errs
        assert not (tmp_path / "seen.1.0").exists(), "no worker of a new round started"


FINISHING_WORKER = r"""#!/bin/sh
echo $$ > "$OUT_DIR/ran.$GROUP_RANK"
case " $LOST " in *" $GROUP_RANK "*) exec sleep 60 ;; esac
exit 0
"""


@pytest.mark.parametrize("lost", [[1], [1, 2]], ids=["one", "two-adjacent"])
def test_a_node_lost_while_the_others_are_in_the_exit_barrier_does_not_hold_them(ddprun, tmp_path,
                                                                                 lost):
    """Nodes that succeeded wait in the exit barrier; node 1 (or nodes 1 and 2, side by side in
    the ring of heartbeats) is killed (agent and workers) before its workers end. Its done never
    comes: the node that judges it lost counts it (and then judges the one after it), and the
    others leave within a few heartbeat timeouts, not at the barrier's (join_timeout=120)."""
    worker = tmp_path / "f.sh"
    worker.write_text(FINISHING_WORKER)
    worker.chmod(0o755)
    port = free_port()
    env = dict(os.environ, OUT_DIR=str(tmp_path), LOST=" ".join(map(str, lost)))
    conf = "join_timeout=120,keep_alive_interval=0.1,heartbeat_timeout=1"
    n = 2 + len(lost)
    done = [g for g in range(n) if g not in lost]
    agents = []
    for node in range(n):                  # the hints make node i group rank i
        agents.append(subprocess.Popen(
            [ddprun, "--nnodes", str(n), "--nproc-per-node", "1", "--node-rank", str(node),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fin",
             "--rdzv-conf", conf, str(worker)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        if node == 0:
            wait_listening(port, agents[0])
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ran.{g}").exists() for g in range(n)):
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.02)
    time.sleep(1.0)                         # the others are in the barrier by now
    assert all(agents[i].poll() is None for i in done), "the barrier waits for the lost"
    t0 = time.monotonic()
    for i in lost:
        agents[i].kill()
    for i in lost:
        agents[i].wait()
    try:
        errs = [agents[i].communicate(timeout=100)[1] for i in done]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [agents[i].returncode for i in done] == [0] * len(done), errs
    assert time.monotonic() - t0 < 20, "they waited for the barrier's timeout"
    assert any("counting it done" in e for e in errs), errs
    assert not any("not every node confirmed" in e for e in errs), errs


REPORT_WORKER = r"""#!/bin/sh
echo $$ > "$OUT_DIR/ran.$GROUP_RANK.$TORCHELASTIC_RESTART_COUNT"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
    if [ "$GROUP_RANK" = 1 ]; then
        while [ ! -e "$OUT_DIR/fail" ]; do sleep 0.05; done
        exit 1
    fi
    exec sleep 60
fi
exit 0
"""


def test_a_restart_report_the_store_did_not_take_is_sent_again(ddprun, tmp_path, start_store):
    """Node 1's worker fails while the job's store is frozen (SIGSTOP) for longer than one
    operation's bound (join_timeout + read_timeout = 5 s): its report fails. The others learn of
    the failure only through that report (node 1's agent lives, heartbeats ahead), so it is sent
    again each second until the store takes it; the job then restarts and succeeds. Before, node 1
    waited for the restart key forever and node 0's worker ran on."""
    import signal
    worker = tmp_path / "r.sh"
    worker.write_text(REPORT_WORKER)
    worker.chmod(0o755)
    store = start_store()
    conf = ("join_timeout=4,read_timeout=1,last_call_timeout=0.1,keep_alive_interval=0.2,"
            "heartbeat_timeout=60,is_host=false")
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    agents = [subprocess.Popen(
        [ddprun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
         "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", store.endpoint,
         "--rdzv-id", "report", "--rdzv-conf", conf, str(worker)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for node in range(2)]
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ran.{g}.0").exists() for g in range(2)):
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.02)
        os.kill(store.proc.pid, signal.SIGSTOP)
        try:
            (tmp_path / "fail").write_text("")
            time.sleep(8)
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
        errs = [a.communicate(timeout=60)[1] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], errs
    assert "(trying again in 1 s)" in errs[1], errs[1]
    assert all((tmp_path / f"ran.{g}.1").exists() for g in range(2)), "restarted together"
