"""Shared pytest fixtures: the ddprun binary, a running `ddprun store`, raw protocol helpers."""
import os
import resource
import signal
import socket
import struct
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAGIC = 0x3C85F7CE


def find_ddprun():
    env = os.environ.get("DDPRUN_BIN")
    if env:
        return env
    for build in ("build", "build-test"):
        path = os.path.join(ROOT, build, "launcher", "ddprun")
        if os.access(path, os.X_OK):
            return path
    pytest.exit("ddprun is not built: run deploy/setup.sh or set DDPRUN_BIN", returncode=2)


@pytest.fixture(scope="session")
def ddprun():
    return find_ddprun()


class Store:
    """A `ddprun store` process on 127.0.0.1 with a free port; stderr captured to a file."""

    def __init__(self, ddprun, args, tmp):
        self.tmp = tmp
        self.port_file = os.path.join(tmp, "port")
        self.log_path = os.path.join(tmp, "store.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [ddprun, "store", "--host", "127.0.0.1", "--port", "0", "--port-file",
             self.port_file] + list(args), stderr=self.log)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise RuntimeError("store exited: " + self.stderr())
            if time.monotonic() > deadline:
                raise RuntimeError("store did not start")
            time.sleep(0.01)
        self.port = int(open(self.port_file).read())
        self.endpoint = f"127.0.0.1:{self.port}"

    def stderr(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def wait_log(self, needle, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.stderr():
                return self.stderr()
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not logged within {timeout}s:\n{self.stderr()}")

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """SIGTERM; the store must exit 0 (it never crashed, it shut down cleanly)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=20)
        self.log.close()
        assert rc == 0, f"store exited {rc}:\n{self.stderr()}"


@pytest.fixture
def start_store(ddprun):
    stores = []

    def start(*args):
        store = Store(ddprun, args, tempfile.mkdtemp(prefix="ddpstore-"))
        stores.append(store)
        return store

    yield start
    for store in stores:
        store.stop()


@pytest.fixture
def store(start_store):
    return start_store()


# ---- raw protocol helpers (current numbering unless said otherwise) -----------------------------

def s_bytes(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def validate():
    return b"\x00" + struct.pack("<I", MAGIC)


def ping(nonce=0x1234):
    return b"\x0d" + struct.pack("<I", nonce)


def connect(port, source="127.0.0.1", timeout=10.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                 source_address=(source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def healthy_ping(port, nonce=0xC0FFEE):
    """A fresh, well-behaved client: VALIDATE + PING must be answered with the same nonce."""
    with connect(port) as s:
        s.sendall(validate() + ping(nonce))
        assert struct.unpack("<I", recv_exact(s, 4))[0] == nonce


def is_closed_by_peer(sock, timeout=10.0):
    """True once the server closed this connection (EOF or reset) within timeout."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def free_port(host="127.0.0.1"):
    """A port that was free a moment ago (for agents that must agree on a fixed endpoint)."""
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def raise_fd_limit(n):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
