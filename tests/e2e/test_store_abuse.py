"""Abuse of `ddprun store` by hostile or broken peers.

After each: a healthy client still gets its PING answered and the store still runs; the fixture's
teardown SIGTERMs it and asserts exit 0, so a crash anywhere fails the test. A dropped peer must
be logged on one line naming its address and the limit it broke.
"""
import random
import re
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import (clean_env, closed_now, connect, healthy_ping, is_closed_by_peer, ping,
                      raise_fd_limit, recv_exact, s_bytes, send_quietly, try_ping, validate,
                      wait_until)

KEY_LIMIT = 8 * 1024
VALUE_LIMIT = 8 * 1024 * 1024
FRAME_TIMEOUT_S = 30  # STORE_DEFAULT_FRAME_TIMEOUT_MS: how long a partial frame may wait

# Legacy numbering (torch 1.9-2.1): no VALIDATE, SET=0 ... GETNUMKEYS=6 WATCH_KEY=7 DELETE_KEY=8.
L_SET, L_GET, L_ADD, L_WAIT, L_GETNUMKEYS, L_WATCH_KEY = 0, 2, 3, 5, 6, 7


def peer(sock):
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def keys(*names):
    return struct.pack("<Q", len(names)) + b"".join(s_bytes(n) for n in names)


def cli(ddprun, store, *args, secret_file=None, env=None):
    cmd = [ddprun, "store-client", "--endpoint", store.endpoint]
    if secret_file:
        cmd += ["--secret-file", secret_file]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60,
                          env=env if env is not None else clean_env())


# ---- malformed input ---------------------------------------------------------------------------

def test_random_garbage(store):
    rng = random.Random(1234)
    for i in range(60):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096)))
        with connect(store.port) as s:
            if i % 2:
                junk = validate() + junk     # garbage in the current numbering's decoder too
            for at in range(0, len(junk), 700):
                if not send_quietly(s, junk[at:at + 700]):
                    break
    healthy_ping(store.port)
    assert store.alive()


@pytest.mark.parametrize("frame", [validate() + b"\x63", validate() + b"\xff",
                                   bytes([13]) + struct.pack("<I", 1)],   # PING is not legacy
                         ids=["current-0x63", "current-0xff", "legacy-13"])
def test_unknown_opcode_is_dropped_at_once_and_logged(store, frame):
    with connect(store.port) as s:
        s.sendall(frame)
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "unknown operation")
    healthy_ping(store.port)


def test_wrong_magic_and_double_validate(store):
    with connect(store.port) as s:
        # 0x00 without the magic reads as a legacy SET whose key length is 0xDEADBEEF...
        s.sendall(b"\x00" + struct.pack("<I", 0xDEADBEEF) + b"\x00" * 4)
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "key longer than the key-size limit")
    with connect(store.port) as s:
        s.sendall(validate() + validate())
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "VALIDATE sent twice")
    healthy_ping(store.port)


def test_truncated_frames_then_close(store):
    frames = [validate() + b"\x01" + s_bytes("key")[:5],
              validate() + b"\x01" + s_bytes("key") + struct.pack("<Q", 100) + b"abc",
              validate() + b"\x04" + s_bytes("key") + b"\x01\x00",
              validate()[:3], b"\x00",
              validate() + b"\x06" + struct.pack("<Q", 2) + s_bytes("a"),
              bytes([L_SET]) + s_bytes("key") + struct.pack("<Q", 10) + b"12345",
              bytes([L_ADD]) + s_bytes("key")]
    for frame in frames:
        with connect(store.port) as s:
            s.sendall(frame)
    healthy_ping(store.port)
    with connect(store.port) as s:   # nothing of the truncated writes reached the table
        s.sendall(validate() + b"\x05" + keys("key") + b"\x07")
        assert recv_exact(s, 1) == b"\x01"                       # CHECK: not ready
        assert struct.unpack("<q", recv_exact(s, 8))[0] == 0     # GETNUMKEYS


@pytest.mark.parametrize("frame,why,limit", [
    (validate() + b"\x03" + struct.pack("<Q", 1 << 63),
     "key longer than the key-size limit", f"key {KEY_LIMIT} B"),
    (validate() + b"\x01" + struct.pack("<Q", 0xFFFFFFFFFFFFFFFF),
     "key longer than the key-size limit", f"key {KEY_LIMIT} B"),
    (validate() + b"\x01" + s_bytes("k") + struct.pack("<Q", VALUE_LIMIT + 1),
     "value longer than the value-size limit", f"value {VALUE_LIMIT} B"),
    (validate() + b"\x02" + s_bytes("k") + s_bytes("") + struct.pack("<Q", 1 << 62),
     "value longer than the value-size limit", f"value {VALUE_LIMIT} B"),
    (validate() + b"\x06" + struct.pack("<Q", 10 ** 9),
     "more keys in one request than the per-op limit", "16384 keys/op"),
    (bytes([L_GET]) + struct.pack("<Q", 1 << 63),
     "key longer than the key-size limit", f"key {KEY_LIMIT} B"),
    (bytes([L_SET]) + s_bytes("k") + struct.pack("<Q", VALUE_LIMIT + 1),
     "value longer than the value-size limit", f"value {VALUE_LIMIT} B"),
], ids=["get-key-2^63", "set-key-2^64-1", "set-value-8MiB+1", "cas-value-2^62", "wait-10^9-keys",
        "legacy-get-key-2^63", "legacy-set-value-8MiB+1"])
def test_absurd_lengths_are_dropped_at_once(store, frame, why, limit):
    with connect(store.port, source="127.0.0.3") as s:
        name = peer(s)
        t0 = time.monotonic()
        s.sendall(frame)
        # at once means before the frame timeout, the only other reason to drop this client: the
        # bound is a third of it, not a guess at a loaded machine's speed
        assert is_closed_by_peer(s, timeout=FRAME_TIMEOUT_S / 3)
        assert time.monotonic() - t0 < FRAME_TIMEOUT_S / 3, "dropped only after a timeout"
    line = store.wait_log(f"dropping client {name}", why)
    assert name.startswith("127.0.0.3:") and limit in line, line
    healthy_ping(store.port)


def test_appends_and_multi_gets_cannot_grow_past_the_limits(start_store):
    store = start_store("--max-value-bytes", "1000", "--max-output-bytes", "100000")
    with connect(store.port) as s:
        s.sendall(validate() + b"\x09" + s_bytes("ap") + s_bytes("x" * 600) +
                  b"\x09" + s_bytes("ap") + s_bytes("x" * 600))
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "APPEND", "value-size limit (1000 bytes)")
    with connect(store.port) as s:   # 200 keys naming one value would multiply it 200 times
        s.sendall(validate() + b"\x01" + s_bytes("v") + s_bytes("y" * 1000) +
                  b"\x0a" + keys(*["v"] * 200))
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "MULTI_GET", "output limit of 100000")
    with connect(store.port) as s:   # both values are still whole
        s.sendall(validate() + b"\x0a" + keys("ap", "v"))
        assert recv_exact(s, 8 + 600 + 8 + 1000) == s_bytes("x" * 600) + s_bytes("y" * 1000)


def test_add_on_non_integer_drops_only_that_client(store):
    with connect(store.port) as s:
        s.sendall(validate() + b"\x01" + s_bytes("txt") + s_bytes("hello"))
        s.sendall(b"\x04" + s_bytes("txt") + struct.pack("<q", 1))
        assert is_closed_by_peer(s)
        store.wait_log(f"dropping client {peer(s)}", "not a 64-bit integer")
    healthy_ping(store.port)


# ---- slow and silent peers ---------------------------------------------------------------------

def test_slowloris_partial_frame_expires(start_store):
    store = start_store("--frame-timeout-ms", "1000")
    with connect(store.port) as slow:
        t0 = time.monotonic()
        slow.sendall(validate() + b"\x01" + s_bytes("key") + struct.pack("<Q", 1000) + b"x" * 10)
        healthy_ping(store.port)                         # others are served meanwhile
        assert is_closed_by_peer(slow, timeout=10)
        assert 0.9 < time.monotonic() - t0 < 5
        line = store.wait_log(f"dropping client {peer(slow)}", "partial frame")
    assert "1000 ms" in line, line
    healthy_ping(store.port)


def test_slow_sender_that_completes_each_frame_in_time_is_served(start_store):
    # The timeout bounds one partial frame, not the connection: 1.5 s of slow frames is fine.
    store = start_store("--frame-timeout-ms", "1000")
    with connect(store.port) as s:
        s.sendall(validate())
        for nonce in range(5):
            frame = b"\x01" + s_bytes(f"slow{nonce}") + s_bytes("v" * 50) + ping(nonce)
            half = len(frame) // 2
            s.sendall(frame[:half])
            time.sleep(0.15)                             # the slowness under test
            s.sendall(frame[half:])
            assert struct.unpack("<I", recv_exact(s, 4))[0] == nonce
            time.sleep(0.15)
    assert not store.lines("dropping client")
    healthy_ping(store.port)


def test_unfinished_validate_expires_but_idle_connections_stay(start_store):
    store = start_store("--validate-timeout-ms", "800", "--frame-timeout-ms", "2000")
    t0 = time.monotonic()
    silent = connect(store.port)                         # torch 1.13's watch-key connection
    idle = connect(store.port)
    idle.sendall(validate())                             # validated, then nothing for a while
    half = connect(store.port)
    half.sendall(b"\x00\xce")                            # a VALIDATE that never completes
    assert is_closed_by_peer(half, timeout=10)
    assert 0.7 < time.monotonic() - t0 < 5
    store.wait_log(f"dropping client {peer(half)}", "not validated within 800 ms")
    # Idle connections are cheap and must be left alone, past both timeouts (2 s + sweeps).
    left = t0 + 2.8 - time.monotonic()
    assert not is_closed_by_peer(silent, timeout=max(left, 0.1))
    assert not closed_now(idle)
    silent.settimeout(10)
    idle.settimeout(10)
    silent.sendall(validate() + ping(99))
    assert struct.unpack("<I", recv_exact(silent, 4))[0] == 99
    idle.sendall(ping(98))
    assert struct.unpack("<I", recv_exact(idle, 4))[0] == 98
    assert len(store.lines("dropping client")) == 1, store.stderr()
    for s in (silent, idle, half):
        s.close()


# ---- connection limits -------------------------------------------------------------------------

def test_thousands_of_connections_per_peer_limit(start_store):
    n, limit = 3000, 1000
    if raise_fd_limit(n + 200) < n + 200:
        pytest.skip("cannot raise RLIMIT_NOFILE")
    store = start_store("--max-connections-per-peer", str(limit))
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", store.port))
            socks.append(s)
        healthy_ping(store.port)                         # from 127.0.0.1: another peer
        line = store.wait_log("refusing connection from 127.0.0.2:",
                              "per-address connection limit reached")
        assert f"({limit})" in line, line
        refused = wait_until(lambda: sum(closed_now(s) for s in socks) >= n - limit, timeout=20)
        refused = sum(closed_now(s) for s in socks)
        assert refused == n - limit, f"{refused} connections refused, want {n - limit}"
        assert all(not closed_now(s) for s in socks[:limit]), "the first ones must be kept"
    finally:
        for s in socks:
            s.close()
    # Every slot is given back once those connections are gone.
    assert wait_until(lambda: try_ping(store.port, source="127.0.0.2"), timeout=10)
    healthy_ping(store.port)


def test_total_connection_limit(start_store):
    store = start_store("--max-connections", "50")
    socks = [connect(store.port, source="127.0.0.4") for _ in range(50)]
    extra = connect(store.port, source="127.0.0.5")
    assert is_closed_by_peer(extra, timeout=5)
    line = store.wait_log(f"refusing connection from {peer(extra)}", "connection limit reached")
    assert "(50)" in line, line
    assert not try_ping(store.port), "a 51st connection must be refused"
    for s in socks[:10]:
        s.close()
    assert wait_until(lambda: try_ping(store.port), timeout=10), "room again once others left"
    for s in socks[10:]:
        s.close()


# ---- memory limits -----------------------------------------------------------------------------

def test_client_that_never_reads_replies_is_dropped(start_store):
    store = start_store("--max-output-bytes", "1048576")
    other = connect(store.port)                          # well-behaved, connected throughout
    other.sendall(validate() + b"\x01" + s_bytes("big") + s_bytes(b"x" * 1_000_000) + ping(1))
    assert struct.unpack("<I", recv_exact(other, 4))[0] == 1
    with connect(store.port) as hog:
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.sendall(validate())
        get = b"\x03" + s_bytes("big")
        for _ in range(200):
            if not send_quietly(hog, get * 10):
                break                                    # dropped while we were still writing
        other.sendall(ping(2))                           # others carry on meanwhile
        assert struct.unpack("<I", recv_exact(other, 4))[0] == 2
        assert is_closed_by_peer(hog, timeout=10), store.stderr()
        store.wait_log(f"dropping client {peer(hog)}", "above the output limit of 1048576 bytes")
    other.sendall(b"\x03" + s_bytes("big"))
    assert recv_exact(other, 8 + 1_000_000) == s_bytes(b"x" * 1_000_000)
    other.close()
    healthy_ping(store.port)


def test_total_buffer_limit_drops_the_big_sender_only(start_store):
    store = start_store("--max-total-buffer-bytes", "65536")
    with connect(store.port) as s:
        send_quietly(s, validate() + b"\x01" + s_bytes("big") + s_bytes(b"z" * 200_000))
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "buffer more than 65536 bytes")
    healthy_ping(store.port)
    with connect(store.port) as s:                       # small requests still fit
        s.sendall(validate() + b"\x01" + s_bytes("small") + s_bytes("ok") + b"\x03" +
                  s_bytes("small"))
        assert recv_exact(s, 10) == s_bytes("ok")


def test_store_byte_budget_drops_the_writer_and_keeps_earlier_keys(start_store, ddprun):
    store = start_store("--max-store-bytes", "100000")
    assert cli(ddprun, store, "set", "kept", "value").returncode == 0
    with connect(store.port) as s:
        s.sendall(validate())
        for i in range(100):
            if not send_quietly(s, b"\x01" + s_bytes(f"fill/{i}") + s_bytes(b"y" * 5000)):
                break
        assert is_closed_by_peer(s)
        line = store.wait_log(f"dropping client {peer(s)}", "refused: the store holds")
    assert "limit 100000" in line, line
    assert cli(ddprun, store, "get", "kept").stdout == "value\n"
    assert cli(ddprun, store, "get", "fill/0").stdout == "y" * 5000 + "\n"
    n = int(cli(ddprun, store, "num-keys").stdout)
    assert 2 <= n <= 20, n                               # 100000 bytes hold at most 19 fills
    healthy_ping(store.port)


# ---- waits -------------------------------------------------------------------------------------

def test_wait_then_disconnect_is_cleaned_up(start_store, ddprun):
    # Each abandoned wait holds a table entry (73 bytes here) until its connection goes: were they
    # not released, 4096 bytes would be used up after ~56 of these 200.
    store = start_store("--max-store-bytes", "4096")
    for i in range(200):
        with connect(store.port) as s:
            s.sendall(validate() + b"\x06" + keys(f"gone/{i:04d}") + ping(i))
            assert struct.unpack("<I", recv_exact(s, 4))[0] == i   # the WAIT is registered

    def big_set_fits():
        try:
            with connect(store.port) as s:
                s.sendall(validate() + b"\x01" + s_bytes("gone/0000") + s_bytes(b"b" * 3000) +
                          ping(1))
                return recv_exact(s, 4) == struct.pack("<I", 1)
        except ConnectionError:
            return False
    assert wait_until(big_set_fits, timeout=10), store.stderr()
    assert cli(ddprun, store, "get", "gone/0000").stdout == "b" * 3000 + "\n"
    assert cli(ddprun, store, "delete", "gone/0000").stdout == "1\n"
    with connect(store.port) as s:   # a live waiter on a key of the dead ones gets STOP_WAITING
        s.sendall(validate() + b"\x06" + keys("gone/0003") + ping(7))
        assert struct.unpack("<I", recv_exact(s, 4))[0] == 7
        assert cli(ddprun, store, "set", "gone/0003", "c").returncode == 0
        assert recv_exact(s, 1) == b"\x00"
    assert not store.lines("dropping client")
    healthy_ping(store.port)


def test_second_wait_while_pending_is_a_protocol_error(store):
    with connect(store.port) as s:
        w = b"\x06" + keys("never")
        s.sendall(validate() + w + w)
        assert is_closed_by_peer(s)
        store.wait_log(f"dropping client {peer(s)}", "previous WAIT is still pending")
    healthy_ping(store.port)


def test_legacy_wait_after_an_abandoned_wait_replaces_it(store, ddprun):
    # torch 1.13 gives up on a WAIT at its timeout without telling the server, then goes on
    # using the connection; its next get() starts with another WAIT.
    with connect(store.port) as s:
        s.sendall(bytes([L_WAIT]) + keys("never"))
        s.sendall(bytes([L_WAIT]) + keys("k2"))
        assert cli(ddprun, store, "set", "k2", "v").returncode == 0
        assert recv_exact(s, 1) == b"\x00"
        assert cli(ddprun, store, "set", "never", "now").returncode == 0
        s.sendall(bytes([L_GETNUMKEYS]))   # a stale STOP_WAITING for "never" would come first
        assert struct.unpack("<q", recv_exact(s, 8))[0] == 2
    assert not store.lines("dropping client")
    healthy_ping(store.port)


def test_many_pipelined_requests_in_one_send(store):
    with connect(store.port) as s:
        batch = validate()
        for i in range(2000):
            batch += b"\x04" + s_bytes("ctr") + struct.pack("<q", 1)
        batch += ping(5)
        s.sendall(batch)
        replies = recv_exact(s, 2000 * 8 + 4)
        assert list(struct.unpack("<2000q", replies[:16000])) == list(range(1, 2001))
        assert struct.unpack("<I", replies[16000:])[0] == 5
    with connect(store.port) as s:                       # the same in the legacy numbering
        s.sendall(b"".join(bytes([L_ADD]) + s_bytes("lctr") + struct.pack("<q", 2)
                           for _ in range(500)) + bytes([L_GETNUMKEYS]))
        replies = recv_exact(s, 501 * 8)
        assert list(struct.unpack("<501q", replies)) == list(range(2, 1001, 2)) + [2]


def test_legacy_idle_second_connection_and_watch_key_refused(store):
    idle = connect(store.port)
    with connect(store.port) as s:
        s.sendall(bytes([L_WATCH_KEY]) + s_bytes("k"))
        assert is_closed_by_peer(s)
        store.wait_log(f"dropping client {peer(s)}", "WATCH_KEY")
    assert not is_closed_by_peer(idle, timeout=0.5)
    idle.close()
    healthy_ping(store.port)


def test_sigterm_with_clients_in_every_state_exits_0(store):
    waiting = connect(store.port)
    waiting.sendall(validate() + b"\x06" + keys("never") + ping(1))
    assert struct.unpack("<I", recv_exact(waiting, 4))[0] == 1
    partial = connect(store.port)
    partial.sendall(validate() + b"\x01" + s_bytes("k") + struct.pack("<Q", 100))
    silent = connect(store.port)
    unread = connect(store.port)
    unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    unread.sendall(validate() + b"\x01" + s_bytes("v") + s_bytes(b"q" * 100_000) +
                   b"\x03" + s_bytes("v") * 50)
    healthy_ping(store.port)
    store.stop()                                         # asserts exit 0
    for s in (waiting, partial, silent, unread):
        assert is_closed_by_peer(s, timeout=5)
        s.close()


def test_sigint_stops_the_store_cleanly(store):
    store.proc.send_signal(2)
    assert store.proc.wait(timeout=10) == 0
    store.wait_log("stopping")


# ---- shared secret -----------------------------------------------------------------------------

@pytest.fixture
def secret_store(start_store, make_secret):
    secret = make_secret()
    store = start_store("--secret-file", secret, "--validate-timeout-ms", "800")
    return store, secret


def test_secret_same_secret_works(secret_store, ddprun):
    store, secret = secret_store
    r = cli(ddprun, store, "set", "a", "1", secret_file=secret)
    assert r.returncode == 0, r.stderr
    r = cli(ddprun, store, "get", "a", env=clean_env(DDPRUN_STORE_SECRET_FILE=secret))
    assert (r.returncode, r.stdout) == (0, "1\n"), r.stderr
    r = cli(ddprun, store, "ping", env=clean_env(DDPRUN_STORE_SECRET="s3cret-s3cret-s3cret"))
    assert r.returncode == 0 and r.stdout.startswith("pong"), r.stderr


def test_secret_missing_on_the_client(secret_store, ddprun):
    store, _ = secret_store
    r = cli(ddprun, store, "num-keys")
    assert r.returncode == 1
    assert "requires a shared secret" in r.stderr and "--store-secret-file" in r.stderr, r.stderr
    assert store.endpoint in r.stderr


def test_secret_wrong_on_the_client(secret_store, ddprun, make_secret):
    store, _ = secret_store
    r = cli(ddprun, store, "set", "x", "1", secret_file=make_secret("another-secret-here"))
    assert r.returncode == 1 and "rejected our shared secret" in r.stderr, r.stderr
    store.wait_log("dropping client 127.0.0.1:", "authentication failed")
    assert cli(ddprun, store, "check", "x", secret_file=secret_store[1]).stdout == "0\n"


def test_secret_on_the_client_only_is_refused(store, ddprun, make_secret):
    r = cli(ddprun, store, "ping", secret_file=make_secret())
    assert r.returncode == 1 and "runs without a shared secret" in r.stderr, r.stderr


def test_secret_pytorch_style_client_is_dropped(secret_store, ddprun):
    store, secret = secret_store
    with connect(store.port) as s:                       # current numbering: VALIDATE then SET
        send_quietly(s, validate() + b"\x01" + s_bytes("x") + s_bytes("y"))
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "SET before authentication refused")
    with connect(store.port) as s:                       # legacy numbering cannot authenticate
        send_quietly(s, bytes([L_GET]) + s_bytes("a"))
        assert is_closed_by_peer(s, timeout=5)
        store.wait_log(f"dropping client {peer(s)}", "legacy-numbering client")
    assert cli(ddprun, store, "num-keys", secret_file=secret).stdout == "0\n"


def test_secret_silent_or_stalled_handshakes_expire(secret_store):
    store, _ = secret_store
    t0 = time.monotonic()
    silent = connect(store.port)
    hello = connect(store.port)                          # asks for the challenge, never answers
    hello.sendall(validate() + b"\xd0\x01")
    assert recv_exact(hello, 1) == b"\x01"               # CHALLENGE (+ nonce)
    for s in (silent, hello):
        assert is_closed_by_peer(s, timeout=10)
        store.wait_log(f"dropping client {peer(s)}", "not authenticated within 800 ms")
        s.close()
    assert 0.7 < time.monotonic() - t0 < 5
    assert not try_ping(store.port), "an unauthenticated PING must not be answered"
    store.wait_log("PING before authentication refused")


# ---- command line ------------------------------------------------------------------------------

def test_port_in_use_is_a_clear_error(store, ddprun):
    t0 = time.monotonic()
    r = subprocess.run([ddprun, "store", "--host", "127.0.0.1", "--port", str(store.port)],
                       capture_output=True, text=True, timeout=10, env=clean_env())
    assert r.returncode == 1, r.stderr  # ddprun(1): the store cannot start (not a crash, not 134)
    assert "in use" in r.stderr and str(store.port) in r.stderr, r.stderr
    assert time.monotonic() - t0 < 5
    healthy_ping(store.port)


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port"),
    (["--bogus"], "unknown option --bogus"),
    (["--max-key-bytes", "abc"], "--max-key-bytes"),
    (["--max-connections", "0"], "--max-connections"),
    (["--frame-timeout-ms", "-5"], "--frame-timeout-ms"),
    (["--max-frame-bytes", "100"], "--max-frame-bytes"),
    (["--port"], "needs a value"),
    (["extra"], "unexpected argument"),
    (["--log-level", "loud"], "--log-level"),
    (["--secret-file", "/nonexistent/secret"], "/nonexistent/secret"),
])
def test_bad_flags_exit_2_with_one_line(ddprun, args, needle):
    r = subprocess.run([ddprun, "store", "--port", "0"] + args, capture_output=True, text=True,
                       timeout=10, env=clean_env())
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_short_secret_is_refused(ddprun, make_secret):
    r = subprocess.run([ddprun, "store", "--port", "0", "--secret-file", make_secret("short")],
                       capture_output=True, text=True, timeout=10, env=clean_env())
    assert r.returncode == 2 and "at least 16" in r.stderr, r.stderr


def test_out_of_file_descriptors_refuses_new_clients_counts_them_and_serves_the_connected(
        ddprun, tmp_path):
    """With RLIMIT_NOFILE at 300 (hard), the store keeps a reserve of descriptors: clients past
    its budget are refused, each counted and logged, and the connected ones keep being served."""
    import resource
    port_file, log_path = tmp_path / "port", tmp_path / "store.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [ddprun, "store", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)],
            stdout=log, stderr=log, env=clean_env(),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300)))
    try:
        assert wait_until(lambda: port_file.exists() and port_file.read_text().strip())
        port = int(port_file.read_text())
        first = connect(port)
        first.sendall(validate())
        socks = []
        for _ in range(400):                      # more than the store has descriptors for
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1)                             # refusals are immediate; the accepted stay open
        refused = sum(closed_now(s) for s in socks)
        assert refused >= 100, f"{refused} of {len(socks)} refused"
        first.sendall(ping(0x77))                 # the first client is still served
        assert recv_exact(first, 4) == struct.pack("<I", 0x77)
        for s in socks:
            s.close()
        first.close()
        assert wait_until(lambda: try_ping(port)), "and new clients again once descriptors free up"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    text = log_path.read_text()
    assert "file descriptors nearly used up" in text, text[-2000:]
    dropped = int(re.search(r"(\d+) clients dropped", text).group(1))
    assert dropped >= refused > 0, text[-2000:]
