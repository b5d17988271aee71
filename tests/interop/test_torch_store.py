"""Interop with Debian's torch 1.13, which speaks the legacy numbering: (a) PyTorch's own TCPStore
client against `ddprun store`; (b) our client (`ddprun store-client --legacy`) against PyTorch's
own TCPStore server. torch's TCPStore puts "/" in front of every key it sends, so keys crossing
sides carry it explicitly on our side."""
import datetime
import json
import subprocess
import sys
import threading
import time

import pytest

torch_dist = pytest.importorskip("torch.distributed")
TCPStore = torch_dist.TCPStore

from conftest import clean_env  # noqa: E402


def client(port, timeout_s=10):
    return TCPStore("127.0.0.1", port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def in_thread(fn, delay_s=0.0):
    """Run fn in a thread (after delay_s); the returned join() re-raises what it raised."""
    box = []

    def body():
        time.sleep(delay_s)                              # "another client, later": the point
        try:
            fn()
        except BaseException as e:                       # noqa: B902 - reported by join()
            box.append(e)

    t = threading.Thread(target=body)
    t.start()

    def join():
        t.join(60)
        assert not t.is_alive(), "thread still running"
        if box:
            raise box[0]
    return join


def our_cli(ddprun, port, *args, legacy=True, timeout_ms=None):
    cmd = [ddprun, "store-client", "--endpoint", f"127.0.0.1:{port}"]
    if legacy:
        cmd.append("--legacy")
    if timeout_ms:
        cmd += ["--timeout", str(timeout_ms)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60,
                          env=clean_env())


def our_ok(ddprun, port, *args, **kw):
    r = our_cli(ddprun, port, *args, **kw)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


# ---- (a) torch's client against our store ------------------------------------------------------

def test_torch_client_every_operation(store):
    s = client(store.port)
    s.set("k", "v1")
    assert s.get("k") == b"v1"
    assert s.add("c", 3) == 3 and s.add("c", 4) == 7 and s.add("c", -10) == -3
    assert s.get("c") == b"-3"
    assert s.compare_set("k", "v1", "v2") == b"v2"
    assert s.compare_set("k", "nope", "v3") == b"v2"
    assert s.get("k") == b"v2"
    assert s.compare_set("new", "", "z") == b"z"
    assert s.compare_set("absent", "x", "y") == b"x"    # torch's answer for a missing key
    assert s.num_keys() == 3
    assert s.delete_key("new") is True and s.delete_key("new") is False
    assert s.num_keys() == 2
    s.wait(["k", "c"])
    s.wait(["k"], datetime.timedelta(seconds=1))
    binary = bytes(range(256)) * 4 + b"\x00" * 100
    s.set("bin", binary)
    assert s.get("bin") == binary
    s.set("empty", b"")
    assert s.get("empty") == b""
    big = bytes(range(256)) * 4096                        # 1 MiB
    s.set("big", big)
    assert s.get("big") == big
    s.set("k", "overwritten")
    assert s.get("k") == b"overwritten"
    assert s.num_keys() == 5


def test_torch_wait_and_get_wake_on_another_clients_set(store):
    waiter, setter = client(store.port), client(store.port)
    join = in_thread(lambda: setter.set("late", "L"), delay_s=0.3)
    t0 = time.monotonic()
    waiter.wait(["late"])
    assert 0.2 < time.monotonic() - t0 < 5
    join()
    assert waiter.get("late") == b"L"
    join = in_thread(lambda: (setter.set("a", "1"), setter.set("b", "2")), delay_s=0.3)
    assert waiter.get("b") == b"2"                        # get blocks until the key exists
    waiter.wait(["a", "b"])
    join()


def test_torch_wait_timeout_then_the_same_client_goes_on(store):
    s = client(store.port)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imeout"):
        s.wait(["never"], datetime.timedelta(milliseconds=500))
    assert 0.4 < time.monotonic() - t0 < 5
    # torch 1.13 abandons the WAIT without a word to the server and keeps its connection.
    s.set("after", "1")
    assert s.get("after") == b"1"
    assert s.add("n", 5) == 5
    other = client(store.port)
    other.set("never", "now")                             # the abandoned wait answers no one
    assert s.get("never") == b"now"
    assert s.add("n", 1) == 6
    assert not store.lines("dropping client"), store.stderr()


def test_torch_get_timeout_on_a_missing_key(store):
    s = client(store.port, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imeout"):
        s.get("missing")
    assert time.monotonic() - t0 < 5


def test_many_torch_clients_count_together(store):
    def work():
        c = client(store.port)
        for _ in range(50):
            c.add("total", 1)
    joins = [in_thread(work) for _ in range(8)]
    for join in joins:
        join()
    assert client(store.port).get("total") == b"400"


def test_torch_idle_watch_connection_survives_short_timeouts(start_store):
    # torch 1.13's client opens a second connection (its watch-key listener) and never writes
    # to it; the store must leave it alone, however small its timeouts.
    store = start_store("--validate-timeout-ms", "200", "--frame-timeout-ms", "200")
    s = client(store.port)
    s.set("k", "v")
    time.sleep(1.0)                                       # several sweeps past both timeouts
    assert s.get("k") == b"v"
    assert s.add("n", 1) == 1
    assert not store.lines("dropping client"), store.stderr()


def test_torch_and_our_client_see_each_others_keys(store, ddprun):
    s = client(store.port)
    s.set("from-torch", "T")
    assert our_ok(ddprun, store.port, "get", "/from-torch") == "T\n"
    assert our_ok(ddprun, store.port, "get", "/from-torch", legacy=False) == "T\n"
    our_ok(ddprun, store.port, "set", "/from-legacy", "L")
    our_ok(ddprun, store.port, "set", "/from-current", "C", legacy=False)
    assert s.get("from-legacy") == b"L" and s.get("from-current") == b"C"
    assert our_ok(ddprun, store.port, "add", "/cnt", "2") == "2\n"
    assert s.add("cnt", 3) == 5


def test_torch_client_is_refused_by_a_store_with_a_secret(start_store, make_secret, ddprun):
    secret = make_secret()
    store = start_store("--secret-file", secret, "--validate-timeout-ms", "500")
    s = client(store.port, timeout_s=3)
    with pytest.raises(RuntimeError):
        s.set("x", "1")
        s.get("x")
    store.wait_log("dropping client 127.0.0.1:", "legacy-numbering client")
    r = subprocess.run([ddprun, "store-client", "--endpoint", store.endpoint, "--secret-file",
                        secret, "num-keys"], capture_output=True, text=True, timeout=60,
                       env=clean_env())
    assert (r.returncode, r.stdout) == (0, "0\n"), r.stderr


# ---- (b) our client against torch's server -----------------------------------------------------

TORCH_SERVER = r"""
import datetime, json, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=30))
print(s.port, flush=True)
for line in sys.stdin:
    op, *args = json.loads(line)
    try:
        if op == "set":
            s.set(args[0], args[1]); out = None
        elif op == "get":
            out = s.get(args[0]).decode("latin-1")
        elif op == "add":
            out = s.add(args[0], args[1])
        elif op == "num_keys":
            out = s.num_keys()
        elif op == "delete":
            out = s.delete_key(args[0])
        elif op == "wait":
            s.wait(args, datetime.timedelta(seconds=30)); out = None
        print(json.dumps(["ok", out]), flush=True)
    except Exception as e:
        print(json.dumps(["error", str(e)]), flush=True)
"""


class TorchServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", TORCH_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("torch's TCPStore server did not start")
        self.port = int(line)

    def send(self, *cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self):
        status, out = json.loads(self.proc.stdout.readline())
        assert status == "ok", out
        return out

    def call(self, *cmd):
        self.send(*cmd)
        return self.reply()


@pytest.fixture(scope="module")
def torch_server():
    srv = TorchServer()
    yield srv
    srv.proc.stdin.close()
    assert srv.proc.wait(timeout=30) == 0


def test_our_client_every_operation_against_torch(torch_server, ddprun):
    port, t = torch_server.port, torch_server
    t.call("set", "fromtorch", "T")
    assert our_ok(ddprun, port, "get", "/fromtorch") == "T\n"
    assert our_ok(ddprun, port, "add", "/cnt", "5") == "5\n"
    assert our_ok(ddprun, port, "add", "/cnt", "1") == "6\n"
    assert t.call("add", "cnt", 1) == 7
    assert our_ok(ddprun, port, "get", "/cnt") == "7\n"
    assert our_ok(ddprun, port, "compare-set", "/fromtorch", "T", "T2") == "T2\n"
    assert our_ok(ddprun, port, "compare-set", "/fromtorch", "T", "T3") == "T2\n"
    assert our_ok(ddprun, port, "compare-set", "/nothere", "x", "y") == "x\n"
    assert our_ok(ddprun, port, "compare-set", "/fresh", "", "F") == "F\n"
    assert t.call("get", "fromtorch") == "T2" and t.call("get", "fresh") == "F"
    assert our_ok(ddprun, port, "check", "/fromtorch", "/cnt") == "1\n"
    assert our_ok(ddprun, port, "check", "/fromtorch", "/nothere") == "0\n"
    assert our_ok(ddprun, port, "wait", "/fromtorch", "/cnt") == ""
    our_ok(ddprun, port, "set", "/tmp", "1")
    assert our_ok(ddprun, port, "delete", "/tmp") == "1\n"
    assert our_ok(ddprun, port, "delete", "/tmp") == "0\n"
    assert int(our_ok(ddprun, port, "num-keys")) == t.call("num_keys")
    assert t.call("delete", "fresh") is True
    assert our_ok(ddprun, port, "check", "/fresh") == "0\n"


def test_values_written_by_our_client_are_read_by_torch(torch_server, ddprun):
    port, t = torch_server.port, torch_server
    value = "".join(chr(32 + i % 95) for i in range(100_000))   # one argv string: <128 KiB
    our_ok(ddprun, port, "set", "/ours/big", value)
    our_ok(ddprun, port, "set", "/ours/utf8", "héllo wörld")
    assert t.call("get", "ours/big") == value
    assert t.call("get", "ours/utf8").encode("latin-1").decode() == "héllo wörld"
    t.call("set", "theirs/utf8", "ünïcode")
    assert our_ok(ddprun, port, "get", "/theirs/utf8") == "ünïcode\n"


def test_waits_cross_sides_in_both_directions(torch_server, ddprun):
    port, t = torch_server.port, torch_server
    # our client blocks until torch's side sets the key
    waiter = subprocess.Popen([ddprun, "store-client", "--legacy", "--endpoint",
                               f"127.0.0.1:{port}", "--timeout", "20000", "get", "/x/late"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env())
    time.sleep(0.3)                                       # let it block first: the point
    assert waiter.poll() is None, waiter.communicate()
    t.call("set", "x/late", "L")
    out, err = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (0, "L\n"), err
    # torch's side blocks until our client sets the key
    t.send("wait", "x/ours")
    our_ok(ddprun, port, "set", "/x/ours", "O")
    assert t.reply() is None
    assert t.call("get", "x/ours") == "O"


def test_our_client_timeout_against_torch_then_a_fresh_connection(torch_server, ddprun):
    port, t = torch_server.port, torch_server
    t0 = time.monotonic()
    r = our_cli(ddprun, port, "wait", "/never", timeout_ms=300)
    assert r.returncode == 1 and "timed out after 300 ms" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 10
    t.call("set", "after-timeout", "A")
    assert our_ok(ddprun, port, "get", "/after-timeout") == "A\n"


def test_our_current_numbering_client_fails_cleanly_on_a_legacy_server(torch_server, ddprun):
    # Without --legacy our VALIDATE + auth hello read to torch 1.13 as the start of a SET with a
    # huge key, so nothing answers: the client recognises a legacy store (it answers a legacy
    # CHECK) and says so, within the connect deadline and within --timeout, whichever is shorter.
    # the other deadline is the default of the flag not given (--timeout 30000, --connect-timeout
    # 10000): ending before midway between the two shows the shorter one acted, however loaded
    # the machine is
    keys_before = torch_server.call("num_keys")
    for flags, shorter_s, other_s in ((["--connect-timeout", "1500"], 1.5, 30.0),
                                      (["--timeout", "1000"], 1.0, 10.0)):
        t0 = time.monotonic()
        r = subprocess.run([ddprun, "store-client", "--endpoint", f"127.0.0.1:{torch_server.port}",
                            *flags, "num-keys"], capture_output=True, text=True, timeout=60,
                           env=clean_env())
        assert r.returncode == 1, r.stdout
        assert "speaks the legacy numbering of PyTorch <= 2.1" in r.stderr, r.stderr
        assert "--legacy" in r.stderr
        elapsed = time.monotonic() - t0
        assert elapsed < (shorter_s + other_s) / 2, (flags, elapsed)
    # torch's server is unharmed: it answers, our bytes added no key, and it still stores
    assert torch_server.call("num_keys") == keys_before
    torch_server.call("set", "unharmed", "yes")
    assert torch_server.call("num_keys") == keys_before + 1
