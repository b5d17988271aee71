"""`ddprun store-client` end to end against `ddprun store`: every operation in both numberings,
blocking operations woken by another client, exit codes (0 done, 1 failed or timed out, 2 usage),
and that the man page documents every option of `ddprun store --help`."""
import os
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest

from conftest import ROOT, clean_env, environment_broken, free_port, wait_until


def run(ddprun, endpoint, *args, legacy=False, timeout_ms=None, extra=()):
    if not isinstance(endpoint, str):
        endpoint = endpoint.endpoint
    cmd = [ddprun, "store-client", "--endpoint", endpoint] + list(extra)
    if legacy:
        cmd.append("--legacy")
    if timeout_ms:
        cmd += ["--timeout", str(timeout_ms)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60,
                          env=clean_env())


def ok(ddprun, store, *args, **kw):
    r = run(ddprun, store, *args, **kw)
    assert r.returncode == 0, (args, r.stderr)
    assert r.stderr == "", r.stderr
    return r.stdout


def later(delay_s, fn):
    """Run fn in a thread after delay_s; join() re-raises what it raised."""
    box = []

    def body():
        time.sleep(delay_s)                              # the other client comes later: the point
        try:
            fn()
        except BaseException as e:                       # noqa: B902 - reported by join()
            box.append(e)

    t = threading.Thread(target=body)
    t.start()

    def join():
        t.join(30)
        assert not t.is_alive()
        if box:
            raise box[0]
    return join


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
def test_every_operation(ddprun, store, legacy):
    p = "L/" if legacy else "C/"

    def do(*args):
        return ok(ddprun, store, *args, legacy=legacy)

    assert do("set", p + "k", "v1") == ""
    assert do("get", p + "k") == "v1\n"
    assert do("add", p + "n", "40") == "40\n"
    assert do("add", p + "n", "2") == "42\n"
    assert do("add", p + "n", "-50") == "-8\n"
    assert do("get", p + "n") == "-8\n"                 # ADD stores decimal text
    assert do("compare-set", p + "k", "v1", "v2") == "v2\n"
    assert do("compare-set", p + "k", "zz", "v3") == "v2\n"
    assert do("compare-set", p + "fresh", "", "f") == "f\n"
    assert do("compare-set", p + "absent", "x", "y") == "x\n"
    assert do("check", p + "k", p + "n") == "1\n"
    assert do("check", p + "k", p + "absent") == "0\n"
    assert do("wait", p + "k", p + "n") == ""
    do("append", p + "ap", "ab")
    do("append", p + "ap", "cd")
    assert do("get", p + "ap") == "abcd\n"
    do("multi-set", p + "m1", "x", p + "m2", "héllo wörld")
    assert do("multi-get", p + "m1", p + "m2", p + "missing") == "x\nhéllo wörld\n\n"
    do("set", p + "empty", "")
    assert do("get", p + "empty") == "\n"
    assert do("delete", p + "m1") == "1\n"
    assert do("delete", p + "m1") == "0\n"
    assert do("check", p + "m1") == "0\n"
    # k n fresh ap m2 empty from this run, plus whatever the other numbering's run left
    assert int(do("num-keys")) >= 6


def test_operations_of_the_current_numbering_only(ddprun, store):
    assert re.fullmatch(r"pong \d+ us\n", ok(ddprun, store, "ping"))
    ok(ddprun, store, "queue-push", "q", "first")
    ok(ddprun, store, "queue-push", "q", "second")
    assert ok(ddprun, store, "queue-len", "q") == "2\n"
    assert ok(ddprun, store, "queue-pop", "q") == "first\n"
    assert ok(ddprun, store, "queue-len", "q") == "1\n"
    assert ok(ddprun, store, "queue-len", "nothing") == "0\n"
    ok(ddprun, store, "set", "lk/a", "1")
    ok(ddprun, store, "set", "lk/b", "2")
    listed = ok(ddprun, store, "list-keys").split()
    assert "lk/a" in listed and "lk/b" in listed and "q" not in listed   # queues are not keys
    ok(ddprun, store, "barrier", "solo", "1")


@pytest.mark.parametrize("op", [["ping"], ["queue-push", "q", "v"], ["queue-pop", "q"],
                                ["queue-len", "q"], ["list-keys"], ["barrier", "b", "1"]],
                         ids=lambda op: op[0])
def test_legacy_numbering_lacks_the_newer_operations(ddprun, store, op):
    t0 = time.monotonic()
    r = run(ddprun, store, *op, legacy=True)
    assert r.returncode == 2
    assert f"{op[0]} is not part of the legacy protocol numbering" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 5                    # said at once, not after a WAIT
    assert ok(ddprun, store, "num-keys") == "0\n"


def test_get_and_wait_block_until_another_client_sets(ddprun, store):
    join = later(0.4, lambda: ok(ddprun, store, "set", "late", "here"))
    t0 = time.monotonic()
    assert ok(ddprun, store, "get", "late", timeout_ms=20000) == "here\n"
    assert 0.3 < time.monotonic() - t0 < 10
    join()
    join = later(0.3, lambda: ok(ddprun, store, "multi-set", "w1", "1", "w2", "2"))
    assert ok(ddprun, store, "wait", "w1", "w2", "late", legacy=True, timeout_ms=20000) == ""
    join()


def test_queue_pop_blocks_until_a_push(ddprun, store):
    join = later(0.3, lambda: ok(ddprun, store, "queue-push", "jobs", "j1"))
    assert ok(ddprun, store, "queue-pop", "jobs", timeout_ms=20000) == "j1\n"
    join()
    assert ok(ddprun, store, "queue-len", "jobs") == "0\n"


def test_barrier_releases_all_arrivals(ddprun, store):
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        run(ddprun, store, "barrier", "b", "3", timeout_ms=20000).returncode)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [0, 0, 0]
    assert ok(ddprun, store, "get", "b") == "3\n"


@pytest.mark.parametrize("op,what", [(["wait", "never"], "WAIT on 'never' timed out after 300 ms"),
                                     (["get", "never"], "timed out after 300 ms"),
                                     (["queue-pop", "never"], "timed out after 300 ms"),
                                     (["barrier", "never", "2"], "timed out after 300 ms")],
                         ids=["wait", "get", "queue-pop", "barrier"])
def test_timeouts_exit_1(ddprun, store, op, what):
    t0 = time.monotonic()
    r = run(ddprun, store, *op, timeout_ms=300)
    assert r.returncode == 1 and what in r.stderr, r.stderr
    assert store.endpoint in r.stderr
    assert time.monotonic() - t0 < 10
    assert ok(ddprun, store, "num-keys") == ("1\n" if op[0] == "barrier" else "0\n")


@pytest.mark.parametrize("op", [["num-keys"], ["add", "k", "1"], ["check", "k"], ["multi-get", "k"],
                                ["delete", "k"], ["compare-set", "k", "a", "b"]],
                         ids=["num-keys", "add", "check", "multi-get", "delete", "compare-set"])
def test_a_store_that_never_answers_is_a_timeout_with_a_message(ddprun, op):
    # The legacy numbering has no handshake, so the op itself is what times out.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        endpoint = f"127.0.0.1:{mute.getsockname()[1]}"
        r = run(ddprun, endpoint, *op, legacy=True, timeout_ms=300)
    assert r.returncode == 1
    assert "timed out" in r.stderr and endpoint in r.stderr, r.stderr


def test_usage_errors_exit_2_without_connecting(ddprun):
    nowhere = f"127.0.0.1:{free_port()}"               # nothing listens: usage must win
    cases = [
        ([], "no operation given"),
        (["frobnicate"], "unknown operation frobnicate"),
        (["get"], "wrong number of arguments for get"),
        (["set", "k"], "wrong number of arguments for set"),
        (["num-keys", "extra"], "wrong number of arguments for num-keys"),
        (["add", "k", "notanumber"], "not a 64-bit integer: notanumber"),
        (["add", "k", "99999999999999999999"], "not a 64-bit integer"),
        (["barrier", "b", "3x"], "not a 64-bit integer: 3x"),
        (["multi-set", "a", "1", "b"], "multi-set needs key/value pairs"),
        (["--timeout", "abc", "ping"], "timeouts are milliseconds"),
        (["--connect-timeout", "0", "ping"], "timeouts are milliseconds"),
        (["--bogus", "ping"], "unknown option --bogus"),
        (["--legacy", "queue-pop", "q"], "not part of the legacy protocol numbering"),
        (["--secret-file", "/nonexistent/secret", "ping"], "/nonexistent/secret"),
    ]
    for args, needle in cases:
        t0 = time.monotonic()
        r = subprocess.run([ddprun, "store-client", "--endpoint", nowhere] + args,
                           capture_output=True, text=True, timeout=30, env=clean_env())
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert time.monotonic() - t0 < 5, (args, "usage errors must not wait for a store")
    for endpoint in ("[::1", "host:99999", "host:port"):
        r = subprocess.run([ddprun, "store-client", "--endpoint", endpoint, "ping"],
                           capture_output=True, text=True, timeout=30, env=clean_env())
        assert r.returncode == 2 and f"'{endpoint}'" in r.stderr, (endpoint, r.stderr)
    r = subprocess.run([ddprun, "store-client", "--endpoint"], capture_output=True, text=True,
                       timeout=30, env=clean_env())
    assert r.returncode == 2 and "missing value" in r.stderr, r.stderr


def test_help_exits_0_and_lists_every_operation(ddprun):
    r = subprocess.run([ddprun, "store-client", "--help"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("usage: ddprun store-client")
    for op in ("set", "get", "add", "compare-set", "append", "check", "wait", "num-keys",
               "delete", "multi-get", "multi-set", "ping", "queue-push", "queue-pop",
               "queue-len", "list-keys", "barrier"):
        assert re.search(rf"\b{op}\b", r.stdout), op


def test_nothing_listening_is_exit_1_after_the_connect_timeout(ddprun):
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "store-client", "--endpoint", f"127.0.0.1:{free_port()}",
                        "--connect-timeout", "300", "ping"], capture_output=True, text=True,
                       timeout=30, env=clean_env())
    assert r.returncode == 1 and "could not connect within 300 ms" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 10


def test_connect_retries_until_the_store_comes_up(ddprun, tmp_path):
    port = free_port()
    client = subprocess.Popen([ddprun, "store-client", "--endpoint", f"127.0.0.1:{port}",
                               "--connect-timeout", "20000", "ping"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=clean_env())
    time.sleep(0.5)                                      # the client is retrying meanwhile
    assert client.poll() is None, client.communicate()
    port_file = tmp_path / "port"
    server = subprocess.Popen([ddprun, "store", "--host", "127.0.0.1", "--port", str(port),
                               "--port-file", str(port_file)], stderr=subprocess.PIPE,
                              env=clean_env())
    try:
        out, err = client.communicate(timeout=30)
        assert client.returncode == 0 and out.startswith("pong"), err
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0


def test_ipv6_loopback(ddprun, tmp_path):
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6")
    port_file = tmp_path / "port6"
    proc = subprocess.Popen([ddprun, "store", "--host", "::1", "--port", "0", "--port-file",
                             str(port_file)], stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        if not wait_until(lambda: port_file.exists() or proc.poll() is not None):
            pytest.fail("store on ::1 did not start")
        if proc.poll() is not None:
            err = proc.stderr.read()
            if "address not available" in err.lower() or "cannot assign" in err.lower():
                environment_broken("::1 is not configured here")
            pytest.fail(err)
        ep = f"[::1]:{port_file.read_text().strip()}"
        assert ok(ddprun, ep, "set", "v6", "yes") == ""
        assert ok(ddprun, ep, "get", "v6") == "yes\n"
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
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([ddprun, "store-client", "--endpoint", f"127.0.0.1:{port}",
                            "--connect-timeout", "600000", "ping"], capture_output=True,
                           text=True, timeout=60, env=clean_env())
    assert r.returncode == 1
    assert "did not answer the handshake" in r.stderr and "another program" in r.stderr
    assert time.monotonic() - t0 < 20


def test_a_value_over_the_limit_is_refused_by_our_client_and_logged_by_the_store(ddprun,
                                                                                 start_store):
    store = start_store("--max-value-bytes", "100")
    r = run(ddprun, store, "set", "k", "v" * 101, extra=["--max-value-bytes", "100"])
    assert r.returncode == 1
    assert "a value of 101 bytes for 'k' is over the store's limit of 100 bytes" in r.stderr
    assert ok(ddprun, store, "check", "k").strip() == "0", "nothing was sent"
    ok(ddprun, store, "set", "k", "v" * 100, extra=["--max-value-bytes", "100"])
    # a client that does not know the limit is dropped, and the store names it and why
    r = run(ddprun, store, "set", "k2", "v" * 101)
    assert r.returncode == 1
    assert wait_until(lambda: "value longer than the value-size limit" in store.stderr())
    assert re.search(r"dropping client 127\.0\.0\.1:\d+: value longer", store.stderr())


def test_legacy_and_a_secret_file_are_refused_together(ddprun, make_secret):
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "store-client", "--endpoint", f"127.0.0.1:{free_port()}",
                        "--legacy", "--secret-file", make_secret(), "get", "k"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 2, r.stderr
    assert "the legacy numbering (torch <= 2.1) has no authentication" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 5, "a usage error, found before connecting"


def test_output_that_cannot_be_written_is_a_failure(ddprun, store):
    cli = [ddprun, "store-client", "--endpoint", store.endpoint]
    assert subprocess.run(cli + ["set", "k", "v" * 100], env=clean_env(), timeout=30).returncode == 0
    for op in (["get", "k"], ["multi-get", "k"], ["add", "n", "1"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run(cli + op, stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=30, env=clean_env())
        assert r.returncode == 1, (op, r.stderr)
        assert "writing the output failed: No space left on device" in r.stderr, (op, r.stderr)


def test_a_resolver_that_never_answers_is_bounded_by_the_connect_timeout(ddprun, tmp_path):
    """The store's host name looked up from a DNS server that never answers (a UDP socket that
    reads and stays silent, named by a resolv.conf mounted over the system's in a mount namespace
    of the client's own): the lookup ends at --connect-timeout, saying so, not after the system
    resolver's 5 s x 2 attempts."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a mount namespace")
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        silent.bind(("127.0.0.153", 53))
    except OSError as e:
        pytest.skip(f"no silent DNS server at 127.0.0.153:53: {e}")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.153\noptions timeout:5 attempts:2\n")
    script = (f'mount --bind {conf} /etc/resolv.conf && exec "$@"')
    t0 = time.monotonic()
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", ddprun, "store-client",
                        "--endpoint", "ddprun-test-unresolvable.example:29400",
                        "--connect-timeout", "1500", "ping"],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    elapsed = time.monotonic() - t0
    silent.close()
    assert r.returncode == 1, r.stderr
    assert "could not resolve the host within 1500 ms" in r.stderr, r.stderr
    assert elapsed < 5, f"{elapsed:.1f} s"
