"""Abuse of the store by hostile or broken peers. After each: a healthy client still gets its PING
answered, and the store still runs (the fixture's teardown asserts a clean exit 0 on SIGTERM)."""
import os
import random
import socket
import struct
import subprocess
import time

import pytest

from conftest import (connect, healthy_ping, is_closed_by_peer, ping, raise_fd_limit, recv_exact,
                      s_bytes, validate)


def test_random_garbage(store):
    rng = random.Random(1234)
    for i in range(50):
        with connect(store.port) as s:
            s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096))))
            time.sleep(0.001)
    healthy_ping(store.port)
    assert store.alive()


def test_unknown_opcode_is_dropped_and_logged(store):
    with connect(store.port) as s:
        s.sendall(validate() + b"\x63")
        assert is_closed_by_peer(s)
    store.wait_log("unknown operation")
    healthy_ping(store.port)


def test_first_request_must_be_validate(store):
    with connect(store.port) as s:
        s.sendall(b"\x00" + struct.pack("<I", 0xDEADBEEF))   # wrong magic: a legacy SET
        s.sendall(b"x" * 64)
        s.sendall(validate())
    with connect(store.port) as s:
        s.sendall(validate() + validate())
        assert is_closed_by_peer(s)
    healthy_ping(store.port)


def test_truncated_frames_then_close(store):
    frames = [validate() + b"\x01" + s_bytes("key")[:5],
              validate() + b"\x01" + s_bytes("key") + struct.pack("<Q", 100) + b"abc",
              validate()[:3], b"\x00", validate() + b"\x06" + struct.pack("<Q", 2) + s_bytes("a")]
    for frame in frames:
        with connect(store.port) as s:
            s.sendall(frame)
    healthy_ping(store.port)
    with connect(store.port) as s:   # the table was not touched by the truncated SETs
        s.sendall(validate() + b"\x05" + struct.pack("<Q", 1) + s_bytes("key"))
        assert recv_exact(s, 1) == b"\x01"


@pytest.mark.parametrize("frame,limit", [
    (b"\x03" + struct.pack("<Q", 1 << 63), "key longer than the key-size limit"),
    (b"\x01" + s_bytes("k") + struct.pack("<Q", 8 * 1024 * 1024 + 1),
     "value longer than the value-size limit"),
    (b"\x06" + struct.pack("<Q", 10 ** 9), "more keys in one request than the per-op limit"),
    (b"\x01" + struct.pack("<Q", 0xFFFFFFFFFFFFFFFF), "key longer than the key-size limit"),
])
def test_absurd_lengths_are_dropped_at_once(store, frame, limit):
    with connect(store.port, source="127.0.0.3") as s:
        t0 = time.monotonic()
        s.sendall(validate() + frame)
        assert is_closed_by_peer(s, timeout=5)
        assert time.monotonic() - t0 < 2, "dropped only after a timeout"
    log = store.wait_log(limit)
    assert "127.0.0.3:" in log, "the log line names the peer"
    healthy_ping(store.port)


def test_slowloris_partial_frame_expires(start_store):
    store = start_store("--frame-timeout-ms", "1000")
    with connect(store.port) as slow:
        slow.sendall(validate() + b"\x01" + s_bytes("key") + struct.pack("<Q", 1000) + b"x" * 10)
        healthy_ping(store.port)                         # others are served meanwhile
        t0 = time.monotonic()
        assert is_closed_by_peer(slow, timeout=10)
        assert 0.5 < time.monotonic() - t0 < 5
    store.wait_log("partial frame")
    healthy_ping(store.port)


def test_slow_but_progressing_sender_within_timeout_is_served(start_store):
    store = start_store("--frame-timeout-ms", "3000")
    with connect(store.port) as s:
        frame = validate() + b"\x01" + s_bytes("slow") + s_bytes("v" * 200) + ping(7)
        for i in range(0, len(frame), 40):
            s.sendall(frame[i:i + 40])
            time.sleep(0.05)
        assert struct.unpack("<I", recv_exact(s, 4))[0] == 7


def test_unfinished_validate_expires_but_silent_connection_stays(start_store):
    store = start_store("--validate-timeout-ms", "800", "--frame-timeout-ms", "60000")
    silent = connect(store.port)
    half = connect(store.port)
    half.sendall(b"\x00\xce")                            # a VALIDATE that never completes
    assert is_closed_by_peer(half, timeout=10)
    store.wait_log("not validated within 800 ms")
    # torch 1.13 keeps an idle second connection forever: it must be left alone
    assert not is_closed_by_peer(silent, timeout=1.5)
    silent.sendall(validate() + ping(99))
    assert struct.unpack("<I", recv_exact(silent, 4))[0] == 99
    silent.close()
    half.close()


def closed_now(sock):
    """Non-blocking: has the server closed this connection already?"""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_thousands_of_connections_per_peer_limit(start_store):
    n = 3000
    if raise_fd_limit(n + 200) < n + 200:
        pytest.skip("cannot raise RLIMIT_NOFILE")
    store = start_store("--max-connections-per-peer", "1000")
    socks, refused = [], 0
    for i in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", store.port))
        socks.append(s)
    healthy_ping(store.port)                             # from 127.0.0.1: another peer
    store.wait_log("per-address connection limit reached")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        refused = sum(1 for s in socks if closed_now(s))
        if refused >= n - 1000:
            break
        time.sleep(0.1)
    assert refused == n - 1000, f"{refused} connections refused, want {n - 1000}"
    for s in socks:
        s.close()
    healthy_ping(store.port)


def test_total_connection_limit(start_store):
    store = start_store("--max-connections", "50")
    socks = [connect(store.port, source="127.0.0.4") for _ in range(50)]
    extra = connect(store.port, source="127.0.0.5")
    assert is_closed_by_peer(extra, timeout=5)
    store.wait_log("connection limit reached")
    for s in socks[:10]:
        s.close()
    time.sleep(0.2)
    healthy_ping(store.port)                             # room again once others left
    for s in socks[10:]:
        s.close()


def test_client_that_never_reads_replies(start_store):
    store = start_store("--max-output-bytes", "1048576")
    with connect(store.port) as s:
        s.sendall(validate() + b"\x01" + s_bytes("big") + s_bytes(b"x" * 1_000_000) + ping(1))
        recv_exact(s, 4)                                 # the SET is done before the GETs start
    with connect(store.port) as hog:
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        get = b"\x03" + s_bytes("big")
        hog.sendall(validate())
        try:
            for _ in range(200):
                hog.sendall(get * 10)
        except (ConnectionResetError, BrokenPipeError):
            pass
        healthy_ping(store.port)
        assert is_closed_by_peer(hog, timeout=10), store.stderr()
    store.wait_log("above the output limit")
    healthy_ping(store.port)


def test_store_byte_budget_keeps_earlier_keys(start_store, ddprun):
    store = start_store("--max-store-bytes", "100000")
    cli = [ddprun, "store-client", "--endpoint", store.endpoint]
    assert subprocess.run(cli + ["set", "kept", "value"]).returncode == 0
    with connect(store.port) as s:
        s.sendall(validate())
        try:
            for i in range(100):
                s.sendall(b"\x01" + s_bytes(f"fill/{i}") + s_bytes(b"y" * 5000))
        except (ConnectionResetError, BrokenPipeError):
            pass                                         # dropped while we were still writing
        assert is_closed_by_peer(s)
    store.wait_log("refused: the store holds")
    out = subprocess.run(cli + ["get", "kept"], capture_output=True, text=True)
    assert out.stdout == "value\n"
    healthy_ping(store.port)


def test_wait_then_disconnect_is_cleaned_up(store, ddprun):
    for _ in range(20):
        with connect(store.port) as s:
            s.sendall(validate() + b"\x06" + struct.pack("<Q", 2) + s_bytes("w1") + s_bytes("w2"))
    cli = [ddprun, "store-client", "--endpoint", store.endpoint]
    assert subprocess.run(cli + ["set", "w1", "a"]).returncode == 0
    assert subprocess.run(cli + ["set", "w2", "b"]).returncode == 0
    with connect(store.port) as s:   # a live waiter still gets its STOP_WAITING
        s.sendall(validate() + b"\x06" + struct.pack("<Q", 1) + s_bytes("w3"))
        subprocess.run(cli + ["set", "w3", "c"], check=True)
        assert recv_exact(s, 1) == b"\x00"
    healthy_ping(store.port)


def test_second_wait_while_pending_is_a_protocol_error(store):
    with connect(store.port) as s:
        w = b"\x06" + struct.pack("<Q", 1) + s_bytes("never")
        s.sendall(validate() + w + w)
        assert is_closed_by_peer(s)
    store.wait_log("previous WAIT is still pending")
    healthy_ping(store.port)


def test_many_pipelined_requests_in_one_send(store):
    with connect(store.port) as s:
        batch = validate()
        for i in range(2000):
            batch += b"\x04" + s_bytes("ctr") + struct.pack("<q", 1)
        batch += ping(5)
        s.sendall(batch)
        replies = recv_exact(s, 2000 * 8 + 4)
        values = struct.unpack("<2000q", replies[:16000])
        assert list(values) == list(range(1, 2001))
        assert struct.unpack("<I", replies[16000:])[0] == 5


def test_legacy_client_idle_second_connection_and_watch_key_refused(store):
    idle = connect(store.port)
    with connect(store.port) as s:                       # legacy numbering: WATCH_KEY = 7
        s.sendall(b"\x07" + s_bytes("k"))
        assert is_closed_by_peer(s)
    store.wait_log("WATCH_KEY")
    assert not is_closed_by_peer(idle, timeout=0.5)
    idle.close()
    healthy_ping(store.port)


def test_add_on_non_integer_drops_only_that_client(store):
    with connect(store.port) as s:
        s.sendall(validate() + b"\x01" + s_bytes("txt") + s_bytes("hello"))
        s.sendall(b"\x04" + s_bytes("txt") + struct.pack("<q", 1))
        assert is_closed_by_peer(s)
    store.wait_log("not a 64-bit integer")
    healthy_ping(store.port)


def _secret(tmp_path, text="s3cret-s3cret-s3cret"):
    path = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return str(path)


def test_secret_refuses_unauthenticated_peers(start_store, ddprun, tmp_path):
    secret = _secret(tmp_path)
    store = start_store("--secret-file", secret, "--validate-timeout-ms", "800")
    cli = [ddprun, "store-client", "--endpoint", store.endpoint]
    ok = subprocess.run(cli + ["--secret-file", secret, "set", "a", "1"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    none = subprocess.run(cli + ["num-keys"], capture_output=True, text=True)
    assert none.returncode == 1 and "requires a shared secret" in none.stderr
    wrong = subprocess.run(cli + ["--secret-file", _secret(tmp_path, "another-secret-here"),
                                  "num-keys"], capture_output=True, text=True)
    assert wrong.returncode == 1 and "rejected our shared secret" in wrong.stderr
    store.wait_log("authentication failed")
    with connect(store.port) as s:                       # PyTorch-style: VALIDATE then SET
        s.sendall(validate() + b"\x01" + s_bytes("x") + s_bytes("y"))
        assert is_closed_by_peer(s)
    store.wait_log("SET before authentication refused")
    with connect(store.port) as s:                       # legacy numbering cannot authenticate
        s.sendall(b"\x02" + s_bytes("a"))
        assert is_closed_by_peer(s)
    store.wait_log("legacy-numbering client")
    with connect(store.port) as s:                       # silent: must authenticate in time
        assert is_closed_by_peer(s, timeout=10)
    store.wait_log("not authenticated within 800 ms")
    got = subprocess.run(cli + ["--secret-file", secret, "get", "a"], capture_output=True,
                         text=True)
    assert got.stdout == "1\n", got.stderr


def test_port_in_use_is_a_clear_error(store, ddprun):
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "store", "--host", "127.0.0.1", "--port", str(store.port)],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 1
    assert "in use" in r.stderr and str(store.port) in r.stderr
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port"),
    (["--bogus"], "unknown option --bogus"),
    (["--max-key-bytes", "abc"], "--max-key-bytes"),
    (["--port"], "needs a value"),
    (["extra"], "unexpected argument"),
    (["--log-level", "loud"], "--log-level"),
    (["--secret-file", "/nonexistent/secret"], "/nonexistent/secret"),
])
def test_bad_flags_exit_2_with_one_line(ddprun, args, needle):
    r = subprocess.run([ddprun, "store"] + args, capture_output=True, text=True, timeout=10)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_short_secret_is_refused(ddprun, tmp_path):
    r = subprocess.run([ddprun, "store", "--secret-file", _secret(tmp_path, "short")],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "at least 16" in r.stderr
