"""One agent's etcd kv (launcher/etcd/rdzv_kv_etcd.c) through tests/tools/etcd_kv_probe, on a real
3-member etcd (tests/tools/etcd_cluster.py): a join's ticket looks at the round's closed key in the
same transaction, and the wait for closed that follows watches from the ticket's revision without a
range first; the wait for a rank record (written only after closed) watches from closed's revision.
Should etcd compact that history away in between, the watch is refused: the kv must read the key
and watch from there instead, and still see the key appear."""
from base64 import b64decode
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402
from lossy_proxy import LossyProxy  # noqa: E402


def compact_all(etcd):
    """Move etcd's revision on a few puts and compact everything before it."""
    for i in range(3):
        etcd.put(f"/other/{i}", "x")
    r = etcd.etcdctl("get", "/other/0", "-w", "json")
    assert r.returncode == 0, r.stderr
    revision = json.loads(r.stdout)["header"]["revision"]
    r = etcd.etcdctl("compact", str(revision))
    assert r.returncode == 0, r.stderr
    return revision


def test_waits_that_begin_at_a_compacted_revision_read_the_key_instead(build_dir, tmp_path):
    probe = os.path.join(build_dir, "tests", "tools", "etcd_kv_probe")
    if not os.access(probe, os.X_OK):
        pytest.skip(f"{probe} is not built")
    prefix = "/ddprun/compacted/r0"
    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        p = subprocess.Popen([probe, etcd.endpoints, prefix], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline() == "ticket 0\n", p.stderr.read()
            compacted = compact_all(etcd)  # the revision the ticket saw closed absent at is gone
            etcd.put(f"{prefix}/closed", "2")
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline() == "closed 2\n", p.stderr.read()
            assert compact_all(etcd) > compacted  # and closed's revision too
            etcd.put(f"{prefix}/rank/0", "{}")
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline() == "rank {}\n", p.stderr.read()
            assert p.wait(30) == 0, p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("times", [1, 2])
def test_an_add_whose_answer_was_lost_counts_once(build_dir, tmp_path, times):
    """An ADD (on etcd a compare-and-put of the count; a lost node's refund is one) whose answer
    is lost: etcd put the count, the client sends the same txn again (times=2: to the next
    member), finds the count moved and must know by its mark that it moved it, not add again."""
    probe = os.path.join(build_dir, "tests", "tools", "etcd_kv_probe")
    if not os.access(probe, os.X_OK):
        pytest.skip(f"{probe} is not built")
    key = "/ddprun/lost-add/failures"

    def is_the_add(path, body):
        try:
            put = json.loads(body)["success"][0]["request_put"]
            return path == "/v3/kv/txn" and b64decode(put["key"]).decode() == key
        except (ValueError, KeyError, IndexError, TypeError):
            return False

    with etcd_cluster_or_skip(tmp_path / "etcd") as etcd:
        etcd.put(key, "3")
        with LossyProxy(etcd.host, etcd.client_ports[0], is_the_add, times) as proxy:
            endpoints = ",".join([proxy.endpoint] + etcd.endpoints.split(",")[1:])
            r = subprocess.run([probe, endpoints, key, "add", "-1"], capture_output=True,
                               text=True, timeout=60)
        assert proxy.lost, proxy.seen
        assert r.returncode == 0, r.stderr
        assert r.stdout == "add 2\n", r.stdout + r.stderr
        assert etcd.get(key) == "2"
