"""What a user reads when a peer dies: rank 0 of two ddpworkers (with snapshots, so the ranks
agree on stop signals after every step) says its peer is gone, not that agreeing on a stop signal
failed; no stop signal was sent."""
import os
import subprocess
import time

from conftest import clean_env

EXIT_PEER_FAILURE = 75

CONF = """[model]
name = mlp
width = 16
[data]
kind = synthetic
height = 8
width = 8
channels = 1
train_limit = 4096
test_limit = 64
[train]
batch_size = 8
epochs = 1000
log_interval = 1
collective_timeout = 30
[snapshot]
every = 1000000
"""


def test_a_killed_peer_is_reported_as_gone(ddpworker, store, tmp_path):
    conf = tmp_path / "pair.conf"
    conf.write_text(CONF)
    run_id = f"gone-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    for rank in range(2):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                        TORCHELASTIC_RUN_ID=run_id)
        procs.append(subprocess.Popen([ddpworker, str(conf), f"snapshot.dir={tmp_path / 'snap'}"],
                                      env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    try:
        for _ in range(20):  # some steps, so the kill lands in the loop's collectives
            line = procs[0].stdout.readline()
            assert line, "rank 0 ended before training"
        procs[1].kill()
        _, err = procs[0].communicate(timeout=30)
        assert procs[0].returncode == EXIT_PEER_FAILURE, err
        assert "ddpworker: rank 0: a peer is gone (it exited, was killed, or its node failed): " \
               "ring: " in err and "rank 1 (127.0.0.1:" in err, err
        assert "noticed at: " in err and "failed:" not in err, err
    finally:
        for p in procs:
            p.kill()
            p.communicate()
