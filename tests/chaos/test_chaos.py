"""CI's share of the chaos suite: two minutes of random faults against a 2-node x 2-rank job
(tests/chaos/run.py), which must end bit-identical to an uninterrupted run, with no orphan
workers and no leaked ports. DDP_CHAOS_SECONDS changes the length (0 skips it)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SECONDS = float(os.environ.get("DDP_CHAOS_SECONDS", "120"))


@pytest.mark.skipif(SECONDS <= 0, reason="DDP_CHAOS_SECONDS=0")
def test_two_minutes_of_chaos_end_bit_identical(ddprun, tmp_path):
    report = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--duration", str(SECONDS),
                        "--ddprun", ddprun, "--report", str(report)],
                       capture_output=True, text=True, timeout=SECONDS * 8 + 900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads(report.read_text())
    assert summary["bit_identical"] and not summary["problems"], summary
    assert len(summary["faults"]) >= SECONDS / 10, "faults were injected throughout"
