"""Interop with torch >= 2.2 (current numbering: VALIDATE first, PING, queues, LIST_KEYS, BARRIER).

Needs an interpreter whose torch is >= 2.2: $DDP_TORCH_PYTHON, else `python3` on PATH if its torch
qualifies (on the GPU machine: torch 2.11). Skipped otherwise, e.g. in CI where only Debian's
torch 1.13 exists (tests/interop/test_torch_store.py covers that one, legacy numbering).
torch >= 2.2 clients prefix every key with "/", so keys crossing sides carry it explicitly.
"""
import os
import shutil
import subprocess

import pytest


def modern_torch_python():
    candidates = [os.environ.get("DDP_TORCH_PYTHON"), shutil.which("python3")]
    probe = ("import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0]"
             ".split('.')[:2]); sys.exit(0 if v >= (2, 2) else 1)")
    for py in filter(None, candidates):
        try:
            if subprocess.run([py, "-c", probe], capture_output=True, timeout=120).returncode == 0:
                return py
        except (OSError, subprocess.TimeoutExpired):
            continue
    pytest.skip("no torch >= 2.2 interpreter (set DDP_TORCH_PYTHON)")


@pytest.fixture(scope="module")
def torch_py():
    return modern_torch_python()


CLIENT_SCRIPT = r"""
import datetime, sys, threading, time
from torch.distributed import TCPStore
port = int(sys.argv[1])
T = datetime.timedelta(seconds=10)
s = TCPStore("127.0.0.1", port, is_master=False, timeout=T)
s2 = TCPStore("127.0.0.1", port, is_master=False, timeout=T)
s.set("k", "v1"); assert s.get("k") == b"v1"
assert s.add("c", 3) == 3 and s.add("c", 4) == 7
assert s.compare_set("k", "v1", "v2") == b"v2"
assert s.compare_set("k", "nope", "v3") == b"v2"
assert s.compare_set("fresh", "", "z") == b"z"
assert s.compare_set("absent", "x", "y") == b"x"
assert s.check(["k", "c"]) and not s.check(["absent"])
assert s.delete_key("fresh") and not s.delete_key("fresh")
s.append("ap", "a"); s.append("ap", "b"); assert s.get("ap") == b"ab"
s.multi_set(["m1", "m2"], ["x", "y"]); assert s.multi_get(["m1", "m2"]) == [b"x", b"y"]
big = bytes(range(256)) * 4096
s.set("big", big); assert s.get("big") == big
threading.Thread(target=lambda: (time.sleep(0.3), s2.set("late", "L"))).start()
t0 = time.monotonic(); assert s.get("late") == b"L"; assert time.monotonic() - t0 < 5
try:
    s.wait(["never"], datetime.timedelta(milliseconds=300))
    raise SystemExit("wait did not time out")
except SystemExit:
    raise
except Exception as e:
    assert "timeout" in str(e).lower(), e
s.set("after", "1"); assert s.get("after") == b"1"   # the connection survived the cancelled wait
n = s.num_keys()
if hasattr(s, "queue_push"):
    s.queue_push("q", "a"); s.queue_push("q", "b"); assert s.queue_len("q") == 2
    assert s.queue_pop("q") == b"a"
    threading.Thread(target=lambda: (time.sleep(0.3), s2.queue_push("q2", "late"))).start()
    assert s.queue_pop("q2") == b"late"
if hasattr(s, "list_keys"):
    keys = set(s.list_keys())
    assert {"k", "c", "after", "big"} <= keys, keys   # the client strips its "/" prefix
    assert len(keys) == n, (len(keys), n)
if hasattr(s, "barrier"):
    th = threading.Thread(target=lambda: s2.barrier("bar", 2)); th.start()
    time.sleep(0.2); s.barrier("bar", 2); th.join(10); assert not th.is_alive()
s.set("shared", "from-torch")
print("OK", n)
"""


def test_modern_torch_client_against_our_store(torch_py, ddprun, store):
    r = subprocess.run([torch_py, "-W", "ignore", "-c", CLIENT_SCRIPT, str(store.port)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().startswith("OK")
    cli = [ddprun, "store-client", "--endpoint", store.endpoint]
    got = subprocess.run(cli + ["get", "/shared"], capture_output=True, text=True, timeout=30)
    assert got.stdout == "from-torch\n", got.stderr


TORCH_SERVER = r"""
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=30))
s.set("fromtorch", "T")
print(s.port, flush=True)
s.wait(["fromours"])
print("SEES", s.get("fromours").decode(), s.add("cnt", 0), flush=True)
sys.stdin.read()   # live until the test closes our stdin
"""


def test_our_client_against_modern_torch_server(torch_py, ddprun):
    srv = subprocess.Popen([torch_py, "-W", "ignore", "-c", TORCH_SERVER], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(srv.stdout.readline())
        cli = [ddprun, "store-client", "--endpoint", f"127.0.0.1:{port}", "--timeout", "5000"]

        def run(*args):
            r = subprocess.run(cli + list(args), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (args, r.stderr)
            return r.stdout

        assert run("get", "/fromtorch") == "T\n"
        assert run("add", "/cnt", "5") == "5\n"
        assert run("compare-set", "/fromtorch", "T", "T2") == "T2\n"
        assert run("check", "/fromtorch") == "1\n"
        assert run("ping").startswith("pong")
        run("multi-set", "/a", "1", "/b", "2")
        assert run("multi-get", "/a", "/b") == "1\n2\n"
        assert run("delete", "/a") == "1\n"
        run("set", "/fromours", "O")
        assert srv.stdout.readline().split() == ["SEES", "O", "5"]
        timed_out = subprocess.run(cli[:-2] + ["--timeout", "300", "wait", "/never"],
                                   capture_output=True, text=True, timeout=60)
        assert timed_out.returncode == 1 and "timed out" in timed_out.stderr
        assert run("get", "/fromours") == "O\n"
    finally:
        srv.stdin.close()
        srv.wait(timeout=30)
