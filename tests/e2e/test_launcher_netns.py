"""Two nodes on real addresses: the store host in this network namespace, a second agent in its
own namespace behind a veth link. Partitioning the link (`ip link set down`) must end the job on
the cut-off node (exit 75, workers stopped) while the host scales down and finishes alone; also
when the cut-off node's worker fails right after the cut (its agent then waits on the store for
the round's end, and must notice the store's silence instead of waiting forever: no FIN ever
comes through a link that is down). Needs root and iproute2; skipped otherwise."""
import os
import shutil
import subprocess
import time

import pytest

from conftest import environment_broken, free_port

WORKER = r"""#!/bin/sh
echo "$GROUP_WORLD_SIZE $WORLD_SIZE $MASTER_ADDR" > "$OUT_DIR/seen.$DDPRUN_ATTEMPT.$RANK"
trap 'echo stopped > "$OUT_DIR/stopped.$RANK"; exit 143' TERM
if [ "$DDPRUN_ATTEMPT" = "0" ]; then
    # FAIL_AFTER_CUT: rank 1 fails once the test has cut the link
    i=0
    while [ $i -lt 600 ]; do
        [ -n "$FAIL_AFTER_CUT" ] && [ "$RANK" = 1 ] && [ -e "$OUT_DIR/cut" ] && exit 1
        sleep 0.1; i=$((i+1))
    done
fi
exit 0
"""


def ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip"] + list(args)
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def veth_pair():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2")
    tag = f"{os.getpid() % 10000}"
    ns, host_if, ns_if = f"ddp{tag}", f"ddph{tag}", f"ddpn{tag}"
    net = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        environment_broken(f"network namespaces unavailable: {e.stderr.decode().strip()}")
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{net}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("addr", "add", f"{net}.2/24", "dev", ns_if, ns=ns)
        ip("link", "set", ns_if, "up", ns=ns)
        ip("link", "set", "lo", "up", ns=ns)
        yield {"ns": ns, "host_if": host_if, "host_addr": f"{net}.1"}
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("fails", [False, True], ids=["running", "worker-fails-after-the-cut"])
def test_partitioned_node_leaves_and_the_host_scales_down(ddprun, tmp_path, veth_pair, fails):
    worker = tmp_path / "w.sh"
    worker.write_text(WORKER)
    worker.chmod(0o755)
    port = free_port(veth_pair["host_addr"])
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"{veth_pair['host_addr']}:{port}", "--rdzv-id", "netns",
              "--rdzv-conf", "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.1,"
                             "heartbeat_timeout=1", "--shutdown-timeout", "2", str(worker)]
    env = dict(os.environ, OUT_DIR=str(tmp_path), FAIL_AFTER_CUT="1" if fails else "")
    host = subprocess.Popen([ddprun] + common, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.1)
    other = subprocess.Popen(["ip", "netns", "exec", veth_pair["ns"], ddprun] + common, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not ((tmp_path / "seen.0.0").exists() and (tmp_path / "seen.0.1").exists()):
        assert time.monotonic() < deadline, "the two nodes did not start together"
        assert host.poll() is None and other.poll() is None
        time.sleep(0.02)
    assert (tmp_path / "seen.0.1").read_text().split() == ["2", "2", veth_pair["host_addr"]]
    t0 = time.monotonic()
    ip("link", "set", veth_pair["host_if"], "down")          # the partition
    (tmp_path / "cut").write_text("")
    try:
        _, other_err = other.communicate(timeout=60)
        _, host_err = host.communicate(timeout=60)
    finally:  # an agent that never leaves must not outlive the test
        for p in (other, host):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert other.returncode == 75, other_err
    assert "took no heartbeat" in other_err
    assert fails or (tmp_path / "stopped.1").exists(), "the cut-off node stopped its worker"
    assert host.returncode == 0, host_err
    assert "sent no heartbeat" in host_err
    assert (tmp_path / "seen.1.0").read_text().split()[:2] == ["1", "1"], "scaled down to one"
    assert time.monotonic() - t0 < 30
