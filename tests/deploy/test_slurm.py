"""ddprun inside a Slurm allocation: the SLURM_* environment becomes the rendezvous (c10d, the job
id, the first node as endpoint) and flags and PET_* variables still win (--dry-run); two agents
given a two-node allocation's environment on loopback train as one job; and a real one-node
Slurm (Debian's slurmctld and slurmd, started here on free ports with a configuration of their
own) runs deploy/slurm/train.sbatch through sbatch. The last is skipped, with the reason, where
Slurm is not installed or does not start."""
import os
import random
import shutil
import socket
import subprocess
import time

import pytest

from conftest import ROOT, clean_env, environment_broken

SBATCH = os.path.join(ROOT, "deploy", "slurm", "train.sbatch")
EXAMPLE = os.path.join(ROOT, "docs", "examples", "fashion-mnist.conf")


def slurm_env(**values):
    env = {k: v for k, v in clean_env().items() if not k.startswith(("SLURM_", "PET_"))}
    env.pop("DDPRUN_SLURM", None)
    env.update(values)
    return env


ALLOCATION = dict(SLURM_JOB_ID="123456", SLURM_NNODES="4", SLURM_NODEID="2",
                  SLURM_JOB_NODELIST="gpu-[07-09],login1")


def dry_run(ddprun, *args, **env):
    r = subprocess.run([ddprun, *args, "--dry-run", "train.conf"], capture_output=True, text=True,
                       timeout=60, env=slurm_env(**env))
    return r.returncode, dict(line.split(": ", 1) for line in r.stdout.splitlines()
                              if ": " in line), r.stderr


def test_an_allocation_needs_no_rendezvous_flags(ddprun):
    rc, cfg, err = dry_run(ddprun, "--nproc-per-node", "4", **ALLOCATION)
    assert rc == 0, err
    assert cfg["rdzv_backend"] == "c10d"
    assert cfg["rdzv_endpoint"] == "gpu-07:29856"  # 29400 + job id % 1000
    assert cfg["rdzv_id"] == "123456"
    assert cfg["nnodes"] == "4:4" and cfg["node_rank"] == "2" and cfg["nproc_per_node"] == "4"
    assert cfg["slurm"] == "job 123456, 4 node(s), this node 2"
    # under srun, the step's nodes
    rc, cfg, err = dry_run(ddprun, **ALLOCATION, SLURM_STEP_NODELIST="gpu-[08-09]",
                           SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    assert rc == 0, err
    assert cfg["rdzv_endpoint"].startswith("gpu-08:") and cfg["nnodes"] == "2:2"


def test_flags_and_pet_variables_win_over_the_allocation(ddprun):
    rc, cfg, err = dry_run(ddprun, "--rdzv-endpoint", "head:1234", "--rdzv-id", "mine",
                           "--nnodes", "2:4", "--node-rank", "0", **ALLOCATION)
    assert rc == 0, err
    assert (cfg["rdzv_endpoint"], cfg["rdzv_id"], cfg["nnodes"], cfg["node_rank"]) == \
        ("head:1234", "mine", "2:4", "0")
    rc, cfg, err = dry_run(ddprun, **ALLOCATION, PET_RDZV_ID="from-pet")
    assert rc == 0 and cfg["rdzv_id"] == "from-pet", err
    rc, cfg, err = dry_run(ddprun, "--rdzv-backend", "static", **ALLOCATION)
    assert rc == 0, err  # static: node 0 hosts at the first node, this node's rank from Slurm
    assert cfg["rdzv_endpoint"] == cfg["master"] == "gpu-07:29856" and cfg["node_rank"] == "2"
    rc, cfg, err = dry_run(ddprun, "--standalone", **ALLOCATION)
    assert rc == 0 and cfg["rdzv_endpoint"].startswith("127.0.0.1:") and cfg["nnodes"] == "1:1"
    rc, cfg, err = dry_run(ddprun, **ALLOCATION, DDPRUN_SLURM="0")
    assert rc == 0 and cfg["rdzv_backend"] == "static" and cfg["slurm"] == "none", err
    rc, cfg, err = dry_run(ddprun)
    assert rc == 0 and cfg["slurm"] == "none" and cfg["rdzv_id"] == "none", err


@pytest.mark.parametrize("name,value,message", [
    ("SLURM_JOB_NODELIST", "gpu-[09-07]", "SLURM_JOB_NODELIST='gpu-[09-07]': the range 09-07"),
    ("SLURM_JOB_NODELIST", "gpu[1,2", "'[' at position 3 is not closed"),
    ("SLURM_NNODES", "many", "SLURM_NNODES='many' is not a whole number"),
    ("SLURM_STEP_NUM_TASKS", "16", "srun started 16 tasks on 4 nodes"),
])
def test_a_malformed_allocation_is_a_usage_error_naming_the_variable(ddprun, name, value,
                                                                      message):
    env = dict(ALLOCATION, **{name: value})
    if name == "SLURM_STEP_NUM_TASKS":
        env["SLURM_STEP_NUM_NODES"] = "4"
    rc, _, err = dry_run(ddprun, **env)
    assert rc == 2 and message in err, err


def free_job_id():
    """A job id whose rendezvous port (29400 + id % 1000) is free on 127.0.0.1 now."""
    for _ in range(100):
        job = random.randrange(1000, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 29400 + job % 1000))
                return str(job)
            except OSError:
                continue
    pytest.skip("no free port in 29400-30399")


def test_two_nodes_of_an_allocation_meet_without_flags(ddprun, tmp_path):
    """What srun does on two nodes, on loopback: each agent sees its SLURM_NODEID."""
    script = tmp_path / "worker.sh"
    script.write_text('#!/bin/sh\necho "$RANK $WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RUN_ID" '
                      f'> {tmp_path}/rank$RANK\n')
    script.chmod(0o755)
    job = free_job_id()
    agents = [subprocess.Popen(
        [ddprun, "--nproc-per-node", "2", "--local-addr", "127.0.0.1", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=slurm_env(SLURM_JOB_ID=job, SLURM_NNODES="2", SLURM_NODEID=str(node),
                      SLURM_JOB_NODELIST="127.0.0.1,localhost"))
        for node in (0, 1)]
    outs = []
    for a in agents:
        try:
            outs.append(a.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)
    lines = sorted((tmp_path / f"rank{r}").read_text().split() for r in range(4))
    assert [line[:2] for line in lines] == [[str(r), "4"] for r in range(4)], lines
    assert {line[3] for line in lines} == {job}
    assert sorted(line[2] for line in lines) == ["0", "0", "1", "1"]


# ---- a real Slurm --------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """SLURM_CONF of a one-node cluster (this machine) run by slurmctld and slurmd started here;
    auth/none (Debian's Slurm 22.05 ships the plugin), so no munge key is needed."""
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
               if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing: Debian's slurmctld, "
                    "slurmd and slurm-client)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their user: it needs root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=ddptest Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen([shutil.which(name) or f"/usr/sbin/{name}", "-D", *args],
                                stdout=open(d / f"{name}.out", "w"), stderr=subprocess.STDOUT,
                                env=env)
               for name, args in (("slurmctld", ["-i"]), ("slurmd", []))]
    try:
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline and "idle" not in state:
            time.sleep(0.5)
            if any(p.poll() is not None for p in daemons):
                break
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                   env=env).stdout
        if "idle" not in state:
            logs = "".join((d / f).read_text()[-600:] for f in ("slurmctld.out", "slurmd.out")
                           if (d / f).exists())
            environment_broken(f"the test's Slurm did not start (node state '{state.strip()}'): "
                               f"{logs}")
        yield env, d
    finally:
        for p in daemons:
            if p.poll() is None:
                p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_sbatch_runs_the_example_through_srun_and_ddprun(ddprun, slurm_cluster, tmp_path):
    env, _ = slurm_cluster
    env = dict(env, DDPRUN=ddprun, NPROC="2", LOG_DIR=str(tmp_path / "logs"))
    metrics = tmp_path / "m.jsonl"
    overrides = ["train.max_steps=4", "data.train_limit=640", "data.test_limit=200",
                 f"train.metrics_file={metrics}"]
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        overrides += ["data.kind=synthetic", "data.height=28", "data.width=28", "data.channels=1"]
    r = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--chdir={tmp_path}",
                        f"--output={tmp_path}/job-%j.out", "--export=ALL", SBATCH, EXAMPLE,
                        *overrides],
                       capture_output=True, text=True, timeout=600, env=env)
    out = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert r.returncode == 0, r.stdout + r.stderr + out
    job = r.stdout.split()[-1]
    assert f"run {job}: 2 worker(s), store hosted on" in out, out  # the job id is the rdzv id
    assert '"event":"final"' in out and '"step":4' in out, out
    assert list((tmp_path / "logs").glob(f"{job}_*/attempt_0")), \
        "ddprun's logs are not under the job's id"
