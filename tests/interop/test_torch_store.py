"""Interop with Debian's torch 1.13 (legacy numbering): PyTorch's own TCPStore client against our
store, and our client (`ddprun store-client --legacy`) against PyTorch's own server.
PyTorch's client puts "/" in front of every key, so keys crossing sides carry it explicitly."""
import datetime
import subprocess
import sys
import threading
import time

import pytest

torch_dist = pytest.importorskip("torch.distributed")
TCPStore = torch_dist.TCPStore


def client(port, timeout_s=10):
    return TCPStore("127.0.0.1", port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def test_torch_client_every_operation(store):
    s = client(store.port)
    s.set("k", "v1")
    assert s.get("k") == b"v1"
    assert s.add("c", 3) == 3 and s.add("c", 4) == 7
    assert s.get("c") == b"7"
    assert s.compare_set("k", "v1", "v2") == b"v2"
    assert s.compare_set("k", "nope", "v3") == b"v2"
    assert s.compare_set("new", "", "z") == b"z"
    assert s.compare_set("absent", "x", "y") == b"x"
    assert s.num_keys() == 3
    assert s.delete_key("new") is True and s.delete_key("new") is False
    assert s.num_keys() == 2
    s.wait(["k", "c"])
    binary = bytes(range(256)) * 4
    s.set("bin", binary)
    assert s.get("bin") == binary
    big = b"x" * (1 << 20)
    s.set("big", big)
    assert s.get("big") == big


def test_torch_wait_wakes_on_another_clients_set(store):
    waiter, setter = client(store.port), client(store.port)
    threading.Timer(0.3, lambda: setter.set("late", "L")).start()
    t0 = time.monotonic()
    waiter.wait(["late"])
    assert 0.2 < time.monotonic() - t0 < 5
    assert waiter.get("late") == b"L"


def test_torch_wait_timeout(store):
    s = client(store.port)
    with pytest.raises(RuntimeError, match="[Tt]imeout"):
        s.wait(["never"], datetime.timedelta(milliseconds=500))
    other = client(store.port)        # the store is unharmed by the abandoned WAIT
    other.set("after", "1")
    assert other.get("after") == b"1"


def test_many_torch_clients_count_together(store):
    def work():
        c = client(store.port)
        for _ in range(50):
            c.add("total", 1)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert client(store.port).get("total") == b"400"


TORCH_SERVER = r"""
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=30))
s.set("fromtorch", "T")
print(s.port, flush=True)
s.wait(["fromours"])
print("SEES", s.get("fromours").decode(), s.get("cnt").decode(), flush=True)
sys.stdin.read()
"""


def test_our_client_against_torch_server(ddprun):
    srv = subprocess.Popen([sys.executable, "-c", TORCH_SERVER], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(srv.stdout.readline())
        cli = [ddprun, "store-client", "--legacy", "--endpoint", f"127.0.0.1:{port}"]

        def ok(*args):
            r = subprocess.run(cli + list(args), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (args, r.stderr)
            return r.stdout

        assert ok("get", "/fromtorch") == "T\n"
        assert ok("add", "/cnt", "5") == "5\n"
        assert ok("add", "/cnt", "1") == "6\n"
        assert ok("compare-set", "/fromtorch", "T", "T2") == "T2\n"
        assert ok("compare-set", "nothere", "x", "y") == "x\n"
        assert ok("check", "/fromtorch", "/cnt") == "1\n"
        assert ok("check", "nothere") == "0\n"
        ok("wait", "/fromtorch", "/cnt")
        ok("set", "tmp", "1")
        assert ok("delete", "tmp") == "1\n"
        assert ok("delete", "tmp") == "0\n"
        assert ok("num-keys") == "2\n"
        r = subprocess.run(cli + ["--timeout", "300", "wait", "never"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "timed out" in r.stderr
        assert ok("get", "/fromtorch") == "T2\n"     # the connection after a timeout is fresh
        ok("set", "/fromours", "O")
        assert srv.stdout.readline().split() == ["SEES", "O", "6"]
    finally:
        srv.stdin.close()
        srv.wait(timeout=30)
