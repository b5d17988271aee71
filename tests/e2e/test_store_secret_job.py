"""A job under the store's shared secret (docs/protocol.md, "Authentication"): the agents, their
workers (the store, the ring's handshake) and `ddprun status` prove it to an outside `ddprun store
--secret-file`; an agent that hosts the store requires it of everyone. Before, the agents ignored
--store-secret-file's environment twins and were refused by such a store ("set
DDPRUN_STORE_SECRET_FILE", though it was set), and a hosted store was open to anyone."""
import os
import subprocess

import pytest

from conftest import clean_env

CONF = """[model]
name = mlp
width = 16
[data]
kind = synthetic
height = 8
width = 8
channels = 1
train_limit = 256
test_limit = 64
[train]
batch_size = 32
epochs = 1
[snapshot]
dir =
"""


def write_conf(tmp_path):
    path = tmp_path / "job.conf"
    path.write_text(CONF)
    return str(path)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_two_node_job_on_a_store_that_requires_the_secret(ddprun, tmp_path, start_store,
                                                            make_secret, how):
    secret = make_secret("the-job-secret-0123456789")
    store = start_store("--secret-file", secret)
    conf = write_conf(tmp_path)
    if how == "flag":
        flags, env = ["--store-secret-file", secret], clean_env()
    else:
        flags, env = [], clean_env(DDPRUN_STORE_SECRET_FILE=secret)
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", store.endpoint, "--rdzv-id", f"secret-{how}",
            "--rdzv-conf", "last_call_timeout=0.2", "--local-addr", "127.0.0.1"]
    jobs = [subprocess.Popen([ddprun, *rdzv, "--node-rank", str(node), *flags, conf],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True) for node in range(2)]
    outs = []
    try:
        for job in jobs:
            outs.append(job.communicate(timeout=240)[0])
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, 9)
                job.wait()
    for job, out in zip(jobs, outs):
        assert job.returncode == 0, out
    assert not store.lines("refused"), store.stderr()

    status = [ddprun, "status", "--rdzv-endpoint", store.endpoint, "--rdzv-id",
              f"secret-{how}", "--json"]
    shown = subprocess.run(status + (["--store-secret-file", secret] if how == "flag" else []),
                           capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert '"nodes"' in shown.stdout, shown.stdout
    refused = subprocess.run(status, capture_output=True, text=True, timeout=60, env=clean_env())
    assert refused.returncode != 0
    assert "requires a shared secret" in refused.stderr, refused.stderr


def test_a_hosted_store_requires_the_secret_of_everyone(ddprun, tmp_path, make_secret):
    """The agent's own store (--standalone) under --store-secret-file: its workers connect with
    the secret they are given (DDPRUN_STORE_SECRET_FILE), a client without it is refused."""
    secret = make_secret("the-job-secret-0123456789")
    script = tmp_path / "probe.sh"
    script.write_text(f"""#!/bin/sh
ep="$MASTER_ADDR:$MASTER_PORT"
test "$DDPRUN_STORE_SECRET_FILE" = "{secret}" || exit 5
env -u DDPRUN_STORE_SECRET -u DDPRUN_STORE_SECRET_FILE {ddprun} store-client --endpoint "$ep" \\
    ping 2>"$1/without.err" && exit 3
{ddprun} store-client --endpoint "$ep" ping || exit 4
exit 0
""")
    script.chmod(0o755)
    job = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--store-secret-file",
                          secret, "--no-python", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env=clean_env(DDPRUN_STORE_SECRET="an-agent-env-secret-0123456789"))
    assert job.returncode == 0, job.stdout + job.stderr
    assert "requires a shared secret" in (tmp_path / "without.err").read_text()


def test_a_secret_too_short_is_refused_before_anything_starts(ddprun, tmp_path, make_secret):
    secret = make_secret("short")
    job = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "1", "--store-secret-file",
                          secret, write_conf(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=clean_env())
    assert job.returncode == 2, job.stdout + job.stderr
    assert secret in job.stderr and "at least 16" in job.stderr, job.stderr
