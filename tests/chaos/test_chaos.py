"""CI's share of the chaos suite: two minutes of random faults against a 2-node x 2-rank job
(tests/chaos/run.py), half of it rendezvousing on the c10d store and half on a 3-member etcd (with
etcd's own faults: its leader or a follower killed, a member frozen), each of which must end
bit-identical to an uninterrupted run, with no orphan workers and no leaked ports. Every CI run
draws a new seed, so that each explores new histories; the seed is printed first and a failure
names the command that replays it. DDP_CHAOS_SECONDS changes the total length (0 skips it),
DDP_CHAOS_SEED fixes the seed."""
import json
import os
import random
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SECONDS = float(os.environ.get("DDP_CHAOS_SECONDS", "120"))
HAS_ETCD = os.access("/usr/bin/etcd", os.X_OK) and os.access("/usr/bin/etcdctl", os.X_OK)


@pytest.mark.skipif(SECONDS <= 0, reason="DDP_CHAOS_SECONDS=0")
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_minute_of_chaos_ends_bit_identical(ddprun, tmp_path, backend):
    if backend == "etcd" and not HAS_ETCD:
        pytest.skip("etcd is missing (Debian: apt-get install etcd-server etcd-client)")
    seconds = SECONDS / 2
    seed = int(os.environ.get("DDP_CHAOS_SEED") or random.randrange(1 << 30))
    replay = (f"tests/chaos/run.py --duration {seconds:g} --seed {seed} --rdzv-backend {backend} "
              f"--keep")
    print(f"chaos seed {seed} on {backend}; replay: {replay}", flush=True)
    report = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--duration", str(seconds),
                        "--seed", str(seed), "--rdzv-backend", backend, "--ddprun", ddprun,
                        "--report", str(report)],
                       capture_output=True, text=True, timeout=seconds * 8 + 900)
    assert r.returncode == 0, (f"seed {seed} on {backend} failed; replay: {replay}\n" +
                               r.stdout[-4000:] + r.stderr[-4000:])
    summary = json.loads(report.read_text())
    assert summary["bit_identical"] and not summary["problems"], (summary, replay)
    assert len(summary["faults"]) >= seconds / 10, ("faults were injected throughout", replay)
