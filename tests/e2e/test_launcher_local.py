"""The launcher on one node: torchrun's environment, supervision, restarts, signals, logs, exit codes.
Workers are small shell scripts that record what they saw into files the test then reads."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ENV_DUMP = r"""#!/bin/sh
out="$OUT_DIR/rank$RANK.attempt$TORCHELASTIC_RESTART_COUNT.json"
/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS"]
d = {k: os.environ.get(k) for k in keys}
d["pid"] = os.getpid(); d["pgid"] = os.getpgid(0)
json.dump(d, open(sys.argv[1], "w"))
PY
echo "hello from rank $RANK"
echo "warning from rank $RANK" >&2
if [ "$RANK" = "${FAIL_RANK:-none}" ]; then
    # FAIL_AFTER_RANK: fail only once that rank has written its dump of this attempt (else the
    # agent may stop it before it does), for at most 30 s
    n=0
    while [ -n "${FAIL_AFTER_RANK:-}" ] && [ $n -lt 600 ] &&
          [ ! -e "$OUT_DIR/rank$FAIL_AFTER_RANK.attempt$TORCHELASTIC_RESTART_COUNT.json" ]; do
        sleep 0.05; n=$((n + 1))
    done
    if [ "$TORCHELASTIC_RESTART_COUNT" -lt "${FAIL_ATTEMPTS:-1000}" ]; then exit "${FAIL_CODE:-3}"; fi
fi
exit 0
"""

SLEEPER = r"""#!/bin/sh
echo $$ > "$OUT_DIR/pid$RANK"
trap 'echo "rank $RANK got TERM"; echo term > "$OUT_DIR/term$RANK"; exit 7' TERM
sleep 60 &
echo $! > "$OUT_DIR/child$RANK"
wait
"""

STUBBORN = r"""#!/bin/sh
trap '' TERM
echo $$ > "$OUT_DIR/pid$RANK"
while :; do sleep 1; done
"""


@pytest.fixture
def script(tmp_path):
    def make(text, name="worker.sh"):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
        return str(path)
    return make


def launch(ddprun, args, tmp_path, env=None, timeout=60, **kw):
    e = dict(os.environ, OUT_DIR=str(tmp_path))
    e.update(env or {})
    return subprocess.run([ddprun] + args, capture_output=True, text=True, env=e,
                          timeout=timeout, **kw)


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive; nor is one reaped between the kill and the read (ESRCH)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_environment_of_every_worker(ddprun, script, tmp_path):
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "4", "--role", "trainer",
                        script(ENV_DUMP)], tmp_path)
    assert r.returncode == 0, r.stderr
    envs = [json.load(open(tmp_path / f"rank{i}.attempt0.json")) for i in range(4)]
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    run_ids = {e["TORCHELASTIC_RUN_ID"] for e in envs}
    assert len(run_ids) == 1
    pgids = set()
    for i, e in enumerate(envs):
        assert e["RANK"] == str(i) and e["LOCAL_RANK"] == str(i) and e["ROLE_RANK"] == str(i)
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "4"
        assert e["ROLE_WORLD_SIZE"] == "4" and e["ROLE_NAME"] == "trainer"
        assert e["GROUP_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{i}/error.json")
        assert e["OMP_NUM_THREADS"] == "1"
        pgids.add(e["pgid"])
    assert len(pgids) == 4, "each worker runs in a process group of its own"
    for i in range(4):
        assert f"[0/{i}]: hello from rank {i}" in r.stdout
        assert f"[0/{i}]: warning from rank {i}" in r.stderr


def test_a_lone_worker_keeps_every_thread_as_under_torchrun(ddprun, script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([ddprun, "--standalone", script(ENV_DUMP)], capture_output=True, text=True,
                       env=dict(env, OUT_DIR=str(tmp_path)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.load(open(tmp_path / "rank0.attempt0.json"))["OMP_NUM_THREADS"] is None


def test_omp_num_threads_is_kept_when_set(ddprun, script, tmp_path):
    r = launch(ddprun, ["--standalone", script(ENV_DUMP)], tmp_path, env={"OMP_NUM_THREADS": "7"})
    assert r.returncode == 0
    assert json.load(open(tmp_path / "rank0.attempt0.json"))["OMP_NUM_THREADS"] == "7"


def test_failure_restarts_every_worker_until_the_budget(ddprun, script, tmp_path):
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                        script(ENV_DUMP)], tmp_path,
               env={"FAIL_RANK": "1", "FAIL_CODE": "5", "FAIL_AFTER_RANK": "0"})
    assert r.returncode == 5, r.stderr
    for attempt in range(3):  # every worker, rank 0 too, ran in every attempt
        for rank in range(2):
            assert (tmp_path / f"rank{rank}.attempt{attempt}.json").exists(), (rank, attempt)
    assert not (tmp_path / "rank1.attempt3.json").exists()
    assert "root cause: node 0 rank 1" in r.stderr and "exited with 5 on attempt 3 of 3" in r.stderr
    assert "warning from rank 1" in r.stderr.split("root cause")[1], "its last stderr lines"


def test_recovers_when_a_restart_succeeds(ddprun, script, tmp_path):
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                        script(ENV_DUMP)], tmp_path, env={"FAIL_RANK": "0", "FAIL_ATTEMPTS": "2"})
    assert r.returncode == 0, r.stderr
    env = json.load(open(tmp_path / "rank0.attempt2.json"))
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"


def test_permanent_exit_codes_are_not_retried(ddprun, script, tmp_path):
    r = launch(ddprun, ["--standalone", "--max-restarts", "5", script(ENV_DUMP)], tmp_path,
               env={"FAIL_RANK": "0", "FAIL_CODE": "78"})
    assert r.returncode == 78
    assert not (tmp_path / "rank0.attempt1.json").exists()
    assert "not retried" in r.stderr


def test_missing_program_is_exit_127_and_not_retried(ddprun, tmp_path):
    r = launch(ddprun, ["--standalone", "--max-restarts", "3", str(tmp_path / "nope")], tmp_path)
    assert r.returncode == 127
    assert "cannot run" in r.stderr and "attempt 1 of 4" in r.stderr


def test_killed_worker_is_128_plus_signal(ddprun, script, tmp_path):
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "2", script(SLEEPER)],
                            env=dict(os.environ, OUT_DIR=str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: (tmp_path / "pid1").exists())
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "was killed by signal 9 (Killed)" in err
    # the log names the worker's own pid, not that of ddprun's shim in front of it
    killed = int((tmp_path / "pid1").read_text())
    assert f"(pid {killed})" in err and f"pid {killed})" in err.split("root cause:")[1], err
    assert (tmp_path / "term0").exists(), "the other worker was stopped with SIGTERM"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_workers_and_agent_exits_128_plus_signal(ddprun, script, tmp_path, signum):
    sleeper = SLEEPER.replace("exit 7' TERM", "exit 7' TERM INT")  # the marker says TERM for both
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "2", script(sleeper)],
                            env=dict(os.environ, OUT_DIR=str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: (tmp_path / "child0").exists() and (tmp_path / "child1").exists())
    children = [int((tmp_path / f"child{i}").read_text()) for i in range(2)]
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()
    assert "[0/1]: rank 1 got TERM" in out
    assert wait_for(lambda: not any(alive(c) for c in children)), "grandchildren left behind"


def test_agent_sigkill_leaves_no_worker_behind(ddprun, script, tmp_path):
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "3", script(SLEEPER)],
                            env=dict(os.environ, OUT_DIR=str(tmp_path)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert wait_for(lambda: all((tmp_path / f"child{i}").exists() for i in range(3)))
    pids = [int((tmp_path / f"{kind}{i}").read_text()) for kind in ("pid", "child")
            for i in range(3)]
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=5), \
        [p for p in pids if alive(p)]


def test_a_killed_agents_run_directory_is_removed_by_the_next_agent(ddprun, script, tmp_path):
    """Without --log-dir: a success removes its run directory, a failure keeps it (its error
    files), and an agent killed with SIGKILL leaves one that the next agent removes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, OUT_DIR=str(tmp_path), TMPDIR=str(tmp))
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "1", script(SLEEPER)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for(lambda: (tmp_path / "child0").exists())
    proc.kill()
    proc.wait()
    killed = list(tmp.glob("ddprun-*"))
    assert len(killed) == 1, killed
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                        script(ENV_DUMP)], tmp_path, env={"TMPDIR": str(tmp), "FAIL_RANK": "0"})
    assert r.returncode == 3, r.stderr
    assert "removed 1 run directory of agents that were killed" in r.stderr, r.stderr
    assert not killed[0].exists()
    failed = list(tmp.glob("ddprun-*"))
    assert len(failed) == 1 and (failed[0] / "attempt_0").is_dir(), failed
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "1", script(ENV_DUMP)], tmp_path,
               env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert "agents that were killed" not in r.stderr, r.stderr
    assert list(tmp.glob("ddprun-*")) == failed, "the failed run's directory is kept"


def test_worker_ignoring_sigterm_is_killed_after_the_shutdown_timeout(ddprun, script, tmp_path):
    proc = subprocess.Popen([ddprun, "--standalone", "--shutdown-timeout", "0.5",
                             script(STUBBORN)], env=dict(os.environ, OUT_DIR=str(tmp_path)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: (tmp_path / "pid0").exists())
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert 0.4 < time.monotonic() - t0 < 5
    assert not alive(int((tmp_path / "pid0").read_text()))


CHATTY = r"""import sys
line = "x" * 1000 + "\n"
while True:
    sys.stdout.write(line)
"""


def test_a_console_that_stops_reading_cannot_wedge_the_agent(ddprun, tmp_path):
    # the agent's stdout is a pipe nobody reads (a stalled `| tee`, a terminal on XOFF): its loop
    # still answers SIGTERM, stops the workers and exits (it blocked in write(2) before, and only
    # SIGKILL ended it)
    program = tmp_path / "chatty.py"
    program.write_text(CHATTY)
    fifo = tmp_path / "console"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read
    try:
        with open(fifo, "w") as console:
            proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "2",
                                     "--shutdown-timeout", "2", str(program)], stdout=console,
                                    stderr=subprocess.PIPE, text=True)
        time.sleep(3)  # the pipe is full long before
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("the agent did not exit on SIGTERM with its console stalled")
    finally:
        os.close(reader)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 12


def test_redirects_without_a_log_dir_keep_the_output(ddprun, script, tmp_path):
    # the output --redirects takes off the console lives only in the run directory: kept after a
    # success too, and said where (it was removed with the scratch directory)
    r = launch(ddprun, ["--standalone", "--redirects", "3", script(ENV_DUMP)], tmp_path,
               env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "hello from rank 0" not in r.stdout
    found = re.search(r"kept in (\S+)", r.stderr)
    assert found, r.stderr
    logs = list(glob.glob(f"{found.group(1)}/attempt_0/0/stdout.log"))
    assert logs and "hello from rank 0" in open(logs[0]).read(), os.listdir(found.group(1))


def test_log_dir_redirects_tee_and_filter(ddprun, script, tmp_path):
    logs = tmp_path / "logs"
    r = launch(ddprun, ["--master-port", "0", "--nproc-per-node", "3", "--rdzv-id", "job7", "--log-dir",
                        str(logs), "--redirects", "1:3", "--local-ranks-filter", "0,1",
                        script(ENV_DUMP)], tmp_path)
    assert r.returncode == 0, r.stderr
    runs = list(logs.glob("job7_*"))
    assert len(runs) == 1 and str(runs[0]) in r.stderr, (runs, r.stderr)  # named at the start
    for rank in range(3):
        d = runs[0] / "attempt_0" / str(rank)
        assert (d / "stdout.log").read_text() == f"hello from rank {rank}\n"
        assert (d / "stderr.log").read_text() == f"warning from rank {rank}\n"
    assert "[0/0]: hello from rank 0" in r.stdout
    assert "hello from rank 1" not in r.stdout, "rank 1's output is redirected to files only"
    assert "rank 2" not in r.stdout + r.stderr.replace("3 worker(s)", ""), "filtered out"


def test_a_rerun_in_the_same_log_dir_names_its_own_root_cause(ddprun, script, tmp_path):
    """Two runs of one --rdzv-id in one --log-dir: the second's worker fails without an error
    file, and the summary must not show the first run's (it did: "its error: ... FROM RUN
    ONE"); each run keeps its own directory, as torchrun's."""
    logs = tmp_path / "logs"
    first = script('#!/bin/sh\nprintf \'{"message": {"message": "RuntimeError: OLD ERROR FROM '
                   'RUN ONE"}}\' > "$TORCHELASTIC_ERROR_FILE"\nexit 3\n', "first.sh")
    second = script("#!/bin/sh\necho second run failing >&2\nexit 4\n", "second.sh")
    args = ["--master-port", "0", "--nproc-per-node", "1", "--rdzv-id", "again", "--log-dir",
            str(logs)]
    r = launch(ddprun, args + [first], tmp_path)
    assert r.returncode == 3 and "OLD ERROR FROM RUN ONE" in r.stderr, r.stderr
    r = launch(ddprun, args + [second], tmp_path)
    assert r.returncode == 4, r.stderr
    assert "OLD ERROR" not in r.stderr, r.stderr
    assert "second run failing" in r.stderr, r.stderr
    assert len(list(logs.glob("again_*/attempt_0/0/stderr.log"))) == 2, list(logs.rglob("*"))


def test_a_run_id_with_a_slash_has_its_folders_under_the_log_dir(ddprun, script, tmp_path):
    logs = tmp_path / "logs"
    r = launch(ddprun, ["--master-port", "0", "--nproc-per-node", "1", "--rdzv-id", "team/run1",
                        "--log-dir", str(logs), script(ENV_DUMP)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert list(logs.glob("team/run1_*/attempt_0/0/stdout.log")), list(logs.rglob("*"))


def test_python_scripts_run_under_python_exec(ddprun, tmp_path):
    py = tmp_path / "hello.py"
    py.write_text("import os, sys\nprint('py', os.environ['RANK'], sys.argv[1:])\n")
    r = launch(ddprun, ["--standalone", "--nproc-per-node", "2", str(py), "--lr", "0.1"],
               tmp_path, env={"PYTHON_EXEC": sys.executable})
    assert r.returncode == 0, r.stderr
    assert "[0/1]: py 1 ['--lr', '0.1']" in r.stdout


def test_static_backend_uses_master_port(ddprun, script, tmp_path):
    from conftest import free_port
    port = free_port()
    r = launch(ddprun, ["--nnodes", "1", "--master-port", str(port), script(ENV_DUMP)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.load(open(tmp_path / "rank0.attempt0.json"))["MASTER_PORT"] == str(port)


@pytest.mark.parametrize("args,needle", [
    (["--bogus", "x"], "unknown option --bogus"),
    (["--nproc-per-node", "zero", "x"], "--nproc-per-node"),
    (["--nnodes", "3:2", "x"], "--nnodes"),
    (["--standalone"], "no program given"),
    (["--rdzv-backend", "etcd", "x"], "--rdzv-backend"),
    (["--rdzv-conf", "bogus=1", "x"], "unknown key 'bogus'"),
    (["--nnodes", "2", "--node-rank", "2", "x"], "is not below --nnodes"),
    (["--max-restarts", "-1", "x"], "--max-restarts"),
    (["--signals-to-handle", "SIGFOO", "x"], "SIGFOO"),
    (["--start-method", "thread", "x"], "--start-method"),
    (["--rdzv-conf", "store_type=file", "x"], "store_type=file"),
    (["--rdzv-conf", "is_host=maybe", "x"], "is_host=maybe"),
])
def test_bad_flags_exit_2_with_one_line(ddprun, args, needle):
    r = subprocess.run([ddprun] + args, capture_output=True, text=True, timeout=10)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_both_spellings_and_pet_environment(ddprun):
    r = subprocess.run([ddprun, "--nproc_per_node=3", "--max-restarts", "4", "--dry-run", "x"],
                       capture_output=True, text=True, env=dict(os.environ, PET_NPROC_PER_NODE="7",
                                                                 PET_ROLE="from-env"))
    assert r.returncode == 0, r.stderr
    assert "nproc_per_node: 3" in r.stdout, "the command line beats PET_*"
    assert "role: from-env" in r.stdout and "max_restarts: 4" in r.stdout
    r = subprocess.run([ddprun, "--nproc-per-node", "cpu", "--dry-run", "x"], capture_output=True,
                       text=True)
    assert f"nproc_per_node: {os.cpu_count()}" in r.stdout
    bad = subprocess.run([ddprun, "--dry-run", "x"], capture_output=True, text=True,
                         env=dict(os.environ, PET_NNODES="zero"))
    assert bad.returncode == 2 and "PET_NNODES" in bad.stderr


def test_help_lists_every_flag_and_the_man_page_documents_them(ddprun):
    from conftest import ROOT
    import re
    r = subprocess.run([ddprun, "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    flags = set(re.findall(r"--[a-z][a-z-]+", r.stdout))
    for f in ("--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--max-restarts", "--tee",
              "--local-ranks-filter", "--signals-to-handle", "--shutdown-timeout", "--standalone"):
        assert f in flags
    man = open(os.path.join(ROOT, "docs", "ddprun.1")).read().replace("\\-", "-")
    missing = sorted(f for f in flags if f not in man)
    assert not missing, f"docs/ddprun.1 lacks {missing}"


def test_a_process_left_behind_outside_the_group_cannot_wedge_the_agent(ddprun, script,
                                                                       tmp_path):
    # The worker starts a daemon in a session of its own (out of reach of the group SIGKILL) that
    # keeps the worker's stdout open, then exits: the agent must still finish, and the daemon not
    # outlive its worker (it did: the shim, its subreaper, now kills it).
    leaver = script("#!/bin/sh\nsetsid sh -c 'echo $$ > \"$OUT_DIR/daemon\"; exec sleep 30' &\n"
                    "sleep 0.2\necho done\n", name="leaver.sh")
    t0 = time.monotonic()
    r = launch(ddprun, ["--standalone", leaver], tmp_path, timeout=30)
    took = time.monotonic() - t0
    daemon = int((tmp_path / "daemon").read_text())
    left = wait_for(lambda: not alive(daemon), timeout=5)
    if not left:
        os.kill(daemon, signal.SIGKILL)
    assert r.returncode == 0, r.stderr
    assert took < 10, f"the agent waited {took:.1f} s for the daemon's pipe"
    assert left, "a process in a session of its own outlived its worker"


ESCAPER = r"""#!/bin/sh
setsid sh -c 'echo $$ > "$OUT_DIR/escaped$RANK"; exec sleep 60' < /dev/null > /dev/null 2>&1 &
exec sleep 60
"""


def test_agent_sigkill_leaves_no_process_that_left_the_group_behind(ddprun, script, tmp_path):
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "2", script(ESCAPER)],
                            env=dict(os.environ, OUT_DIR=str(tmp_path)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert wait_for(lambda: all((tmp_path / f"escaped{i}").exists() for i in range(2)))
    time.sleep(0.1)  # the pid is written before the exec
    escaped = [int((tmp_path / f"escaped{i}").read_text()) for i in range(2)]
    proc.kill()
    proc.wait()
    gone = wait_for(lambda: not any(alive(p) for p in escaped), timeout=5)
    for p in escaped:
        if alive(p):
            os.kill(p, signal.SIGKILL)
    assert gone, "processes in sessions of their own outlived their agent"


SESSION_LEADER = r"""import os, signal, sys, time
os.setsid()
def on_term(signum, frame):
    open(os.path.join(os.environ["OUT_DIR"], "term%s" % os.environ["RANK"]), "w").write("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(os.environ["OUT_DIR"], "ready%s" % os.environ["RANK"]), "w").write("")
while True:
    time.sleep(0.1)
"""


def test_sigterm_reaches_a_program_that_left_its_process_group(ddprun, tmp_path):
    # torchrun signals its worker process itself: a program in a session of its own still gets
    # SIGTERM (to save its state), not only the SIGKILL after the shutdown timeout
    program = tmp_path / "leader.py"
    program.write_text(SESSION_LEADER)
    proc = subprocess.Popen([ddprun, "--standalone", "--nproc-per-node", "2", "--shutdown-timeout",
                             "20", str(program)], env=dict(os.environ, OUT_DIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: all((tmp_path / f"ready{i}").exists() for i in range(2)), timeout=30)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists(), err
    assert time.monotonic() - t0 < 15, "the workers waited for the shutdown timeout's SIGKILL"


FD_CHECK = r"""import os, sys
try:
    os.fstat(int(os.environ["INHERITED_FD"]))
    state = "open"
except OSError:
    state = "closed"
open(os.path.join(os.environ["OUT_DIR"], "fd%s" % os.environ["RANK"]), "w").write(state)
"""


def test_workers_inherit_no_descriptor_of_the_agent_beyond_stdio(ddprun, tmp_path):
    # as torchrun's close_fds: a descriptor the agent holds without close-on-exec (libcurl's
    # sockets to etcd; here one its own parent passed it) does not reach the workers
    program = tmp_path / "fds.py"
    program.write_text(FD_CHECK)
    held = os.open(str(tmp_path), os.O_RDONLY)
    try:
        r = launch(ddprun, ["--standalone", "--nproc-per-node", "2", str(program)], tmp_path,
                   env={"INHERITED_FD": str(held)}, pass_fds=(held,))
    finally:
        os.close(held)
    assert r.returncode == 0, r.stderr
    assert [(tmp_path / f"fd{i}").read_text() for i in range(2)] == ["closed", "closed"]


@pytest.mark.parametrize("make_bad", ["missing_parent_is_a_file", "under_proc"])
def test_log_dir_that_cannot_be_created_is_an_error_of_its_own(ddprun, tmp_path, make_bad):
    if make_bad == "missing_parent_is_a_file":
        (tmp_path / "file").write_text("")
        log_dir = tmp_path / "file" / "logs"
    else:
        log_dir = "/proc/ddprun-no-such-dir"
    r = subprocess.run([ddprun, "--standalone", "--log-dir", str(log_dir), "--nproc-per-node", "1",
                        "/bin/sh", "-c", f"touch {tmp_path}/ran"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 73, r.stderr
    assert f"--log-dir {log_dir}" in r.stderr
    assert not (tmp_path / "ran").exists(), "nothing runs without its logs"


def test_workers_that_cannot_start_are_a_failure_not_a_success(ddprun, tmp_path):
    from conftest import free_port
    # the run directory can be made, but a worker's own directory cannot: a tmpfs of 3 inodes
    # (its root, the run directory, attempt_0)
    logs = tmp_path / "logs"
    logs.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=3", "tmpfs",
                            str(logs)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (not root?): {mount.stderr.strip()}")
    try:
        r = subprocess.run([ddprun, "--nnodes", "1", "--rdzv-id", "myjob", "--master-port",
                            str(free_port()), "--log-dir", str(logs), "--nproc-per-node", "1",
                            "/bin/true"], capture_output=True, text=True, timeout=30)
    finally:
        subprocess.run(["umount", "-l", str(logs)], capture_output=True)
    assert r.returncode == 127, r.stderr
    assert "attempt_0/0: No space left on device" in r.stderr, r.stderr


def test_torchrun_flags_that_scripts_pass_are_accepted(ddprun):
    r = subprocess.run([ddprun, "--start-method", "forkserver", "--run-path", "--rdzv-conf",
                        "read_timeout=7,is_host=true,store_type=tcp,join_timeout=9", "--dry-run", "x"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert "start_method: forkserver" in r.stdout
    assert "join_timeout=9," in r.stdout and "read_timeout=7,is_host=true" in r.stdout


def test_start_timeout_defaults_to_ddpworker_only(ddprun):
    for prog, want in (("train.conf", "start_timeout: 120"), ("train.py", "start_timeout: 0")):
        r = subprocess.run([ddprun, "--dry-run", prog], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0 and want in r.stdout, r.stdout + r.stderr
    r = subprocess.run([ddprun, "--start-timeout", "5", "--dry-run", "train.conf"],
                       capture_output=True, text=True, timeout=10)
    assert "start_timeout: 5" in r.stdout


STUCK_AT_START = r"""#!/bin/sh
# attempt 0 never reports progress (stuck in start-up); attempt 1 reports and finishes
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exec sleep 60; fi
/usr/bin/python3 -c "import os, struct; open(os.environ['DDPRUN_PROGRESS_FILE'], 'wb').write(struct.pack('<Q', 1))"
echo "attempt $TORCHELASTIC_RESTART_COUNT done" > "$OUT_DIR/done"
"""


def test_a_worker_stuck_before_its_first_progress_is_restarted(ddprun, script, tmp_path):
    start = time.monotonic()
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                        "--start-timeout", "1", "--hang-timeout", "30", script(STUCK_AT_START)],
                       env=dict(os.environ, OUT_DIR=str(tmp_path)), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "reported no progress for" in r.stderr and "--start-timeout" in r.stderr, r.stderr
    assert (tmp_path / "done").read_text().strip() == "attempt 1 done"
    assert time.monotonic() - start < 20, "found by the start bound, not by a 60 s sleep"
