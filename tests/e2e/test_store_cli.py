"""`ddprun store-client` end to end against `ddprun store`: every operation, both numberings,
exit codes, and that the man page documents every option of `ddprun store --help`."""
import os
import re
import subprocess
import threading
import time

import pytest

from conftest import ROOT


def run(ddprun, store, *args, legacy=False, timeout_ms=None):
    cmd = [ddprun, "store-client", "--endpoint", store.endpoint]
    if legacy:
        cmd.append("--legacy")
    if timeout_ms:
        cmd += ["--timeout", str(timeout_ms)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60)


def ok(ddprun, store, *args, **kw):
    r = run(ddprun, store, *args, **kw)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


@pytest.mark.parametrize("legacy", [False, True])
def test_every_operation(ddprun, store, legacy):
    p = "L/" if legacy else "C/"
    ok(ddprun, store, "set", p + "k", "v1", legacy=legacy)
    assert ok(ddprun, store, "get", p + "k", legacy=legacy) == "v1\n"
    assert ok(ddprun, store, "add", p + "n", "40", legacy=legacy) == "40\n"
    assert ok(ddprun, store, "add", p + "n", "2", legacy=legacy) == "42\n"
    assert ok(ddprun, store, "compare-set", p + "k", "v1", "v2", legacy=legacy) == "v2\n"
    assert ok(ddprun, store, "compare-set", p + "k", "zz", "v3", legacy=legacy) == "v2\n"
    assert ok(ddprun, store, "check", p + "k", p + "n", legacy=legacy) == "1\n"
    assert ok(ddprun, store, "check", p + "k", p + "absent", legacy=legacy) == "0\n"
    ok(ddprun, store, "wait", p + "k", p + "n", legacy=legacy)
    ok(ddprun, store, "append", p + "ap", "ab", legacy=legacy)
    ok(ddprun, store, "append", p + "ap", "cd", legacy=legacy)
    assert ok(ddprun, store, "get", p + "ap", legacy=legacy) == "abcd\n"
    ok(ddprun, store, "multi-set", p + "m1", "x", p + "m2", "y", legacy=legacy)
    assert ok(ddprun, store, "multi-get", p + "m1", p + "m2", legacy=legacy) == "x\ny\n"
    assert ok(ddprun, store, "delete", p + "m1", legacy=legacy) == "1\n"
    assert ok(ddprun, store, "delete", p + "m1", legacy=legacy) == "0\n"
    n = int(ok(ddprun, store, "num-keys", legacy=legacy))
    assert n >= 4
    if not legacy:
        assert ok(ddprun, store, "ping").startswith("pong ")
        ok(ddprun, store, "queue-push", "q", "first")
        ok(ddprun, store, "queue-push", "q", "second")
        assert ok(ddprun, store, "queue-len", "q") == "2\n"
        assert ok(ddprun, store, "queue-pop", "q") == "first\n"
        keys = ok(ddprun, store, "list-keys").split()
        assert "C/k" in keys and "C/ap" in keys and "q" not in keys
        ok(ddprun, store, "barrier", "solo", "1")


def test_get_blocks_until_another_client_sets(ddprun, store):
    threading.Timer(0.4, lambda: ok(ddprun, store, "set", "late", "here")).start()
    t0 = time.monotonic()
    assert ok(ddprun, store, "get", "late") == "here\n"
    assert 0.3 < time.monotonic() - t0 < 5


def test_queue_pop_blocks_until_a_push(ddprun, store):
    threading.Timer(0.3, lambda: ok(ddprun, store, "queue-push", "jobs", "j1")).start()
    assert ok(ddprun, store, "queue-pop", "jobs") == "j1\n"


def test_barrier_releases_all_arrivals(ddprun, store):
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        run(ddprun, store, "barrier", "b", "3").returncode)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [0, 0, 0]


def test_exit_codes(ddprun, store):
    r = run(ddprun, store, "wait", "never", timeout_ms=300)
    assert r.returncode == 1 and "timed out after 300 ms" in r.stderr
    assert store.endpoint in r.stderr
    r = run(ddprun, store, "get")
    assert r.returncode == 2 and "wrong number of arguments" in r.stderr
    r = run(ddprun, store, "frobnicate")
    assert r.returncode == 2 and "unknown operation" in r.stderr
    r = run(ddprun, store, "add", "k", "notanumber")
    assert r.returncode == 2
    r = subprocess.run([ddprun, "store-client", "--endpoint", "127.0.0.1:1", "--connect-timeout",
                        "300", "ping"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "could not connect within 300 ms" in r.stderr
    r = subprocess.run([ddprun, "store-client", "--endpoint", "[::1", "ping"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "[::1" in r.stderr


def test_ipv6_loopback(ddprun, start_store):
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6")
    port_file = os.path.join(start_store().tmp, "port6")
    proc = subprocess.Popen([ddprun, "store", "--host", "::1", "--port", "0", "--port-file",
                             port_file], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(port_file):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ep = f"[::1]:{open(port_file).read().strip()}"
        cli = [ddprun, "store-client", "--endpoint", ep]
        assert subprocess.run(cli + ["set", "v6", "yes"]).returncode == 0
        out = subprocess.run(cli + ["get", "v6"], capture_output=True, text=True)
        assert out.stdout == "yes\n"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_man_page_documents_every_store_option(ddprun):
    help_text = subprocess.run([ddprun, "store", "--help"], capture_output=True,
                               text=True).stdout
    options = set(re.findall(r"--[a-z][a-z-]+", help_text))
    with open(os.path.join(ROOT, "docs", "ddprun.1")) as f:
        man = f.read().replace("\\-", "-")
    missing = sorted(o for o in options if o not in man)
    assert not missing, f"docs/ddprun.1 lacks {missing}"
    assert len(options) >= 15


def test_a_silent_program_on_the_port_is_a_clear_error_not_a_hang(ddprun):
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "store-client", "--endpoint", f"127.0.0.1:{port}",
                        "--connect-timeout", "600000", "ping"], capture_output=True, text=True,
                       timeout=60)
    silent.close()
    assert r.returncode == 1
    assert "did not answer the handshake" in r.stderr and "another program" in r.stderr
    assert time.monotonic() - t0 < 20
