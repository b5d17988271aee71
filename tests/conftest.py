"""Shared pytest fixtures: the ddprun binary, a running `ddprun store`, raw protocol helpers.

Run with Debian's interpreter (torch 1.13 and pytest live there):
    /usr/bin/python3 -m pytest -q tests
The binary is $DDPRUN_BIN, else $DDP_BUILD_DIR/launcher/ddprun (relative to the repository root
unless absolute: the build tests/gpu/run.sh just made), else the newest of build/, build-test/ and
build-py/. The build tree (ddpworker, the test tools) is $DDP_BUILD_DIR when set, else the one the
binary came from.
"""
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
SECRET_ENV = ("DDPRUN_STORE_SECRET", "DDPRUN_STORE_SECRET_FILE")


def env_build_dir():
    """$DDP_BUILD_DIR as an absolute path (relative ones are taken from the repository root), or
    None when unset."""
    env = os.environ.get("DDP_BUILD_DIR")
    return os.path.join(ROOT, env) if env else None


def find_ddprun():
    env = os.environ.get("DDPRUN_BIN")
    if env:
        if not os.access(env, os.X_OK):
            pytest.exit(f"DDPRUN_BIN={env} is not an executable", returncode=2)
        return env
    build = env_build_dir()
    if build:
        path = os.path.join(build, "launcher", "ddprun")
        if not os.access(path, os.X_OK):
            pytest.exit(f"DDP_BUILD_DIR={os.environ['DDP_BUILD_DIR']}: {path} is not built",
                        returncode=2)
        return path
    built = [p for p in (os.path.join(ROOT, d, "launcher", "ddprun")
                         for d in ("build", "build-test", "build-py")) if os.access(p, os.X_OK)]
    if not built:
        pytest.exit("ddprun is not built: run deploy/setup.sh (or cmake -B build && make -C build) "
                    "or set DDPRUN_BIN", returncode=2)
    return max(built, key=os.path.getmtime)


@pytest.fixture(scope="session")
def ddprun():
    return find_ddprun()


@pytest.fixture(scope="session")
def build_dir(ddprun):
    """$DDP_BUILD_DIR, else the build tree the ddprun binary came from (ddpworker and the test
    tools live there)."""
    return env_build_dir() or os.path.dirname(os.path.dirname(os.path.abspath(ddprun)))


def built_tool(build_dir, name):
    """tests/tools/<name> of the build tree; the test skips when it is not built."""
    path = os.path.join(build_dir, "tests", "tools", name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not built")
    return path


@pytest.fixture(scope="session")
def ddpworker(build_dir):
    path = os.path.join(build_dir, "worker", "ddpworker")
    if not os.access(path, os.X_OK):
        pytest.exit(f"{path} is not built", returncode=2)
    return path


def clean_env(**extra):
    """This environment without a store secret (the store and its client would both pick one up
    from DDPRUN_STORE_SECRET*), plus extra."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(extra)
    return env


def wait_until(predicate, timeout=10.0, interval=0.02):
    """Poll predicate until it returns something truthy (returned) or timeout passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class Store:
    """A `ddprun store` process on 127.0.0.1 with a free port; stderr captured to a file."""

    def __init__(self, ddprun, args, tmp, env=None):
        self.tmp = tmp
        self.port_file = os.path.join(tmp, "port")
        self.log_path = os.path.join(tmp, "store.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [ddprun, "store", "--host", "127.0.0.1", "--port", "0", "--port-file",
             self.port_file] + list(args), stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=self.log, env=env if env is not None else clean_env())
        deadline = time.monotonic() + 20
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"store exited {self.proc.returncode}: " + self.stderr())
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("store did not write its port file within 20 s: " +
                                   self.stderr())
            time.sleep(0.01)
        self.port = int(open(self.port_file).read())
        self.endpoint = f"127.0.0.1:{self.port}"

    def stderr(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def lines(self, *needles):
        """Log lines that contain every needle."""
        return [line for line in self.stderr().splitlines() if all(n in line for n in needles)]

    def wait_log(self, *needles, timeout=10.0):
        """Wait for one log line holding every needle; returns that line."""
        found = wait_until(lambda: self.lines(*needles), timeout)
        if not found:
            raise AssertionError(f"no log line with {needles!r} within {timeout}s:\n"
                                 f"{self.stderr()}")
        return found[0]

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """SIGTERM; the store must exit 0 (it never crashed, it shut down cleanly)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("store ignored SIGTERM for 20 s:\n" + self.stderr())
        finally:
            self.log.close()
        assert rc == 0, f"store exited {rc} (crashed or failed to shut down):\n{self.stderr()}"


@pytest.fixture
def start_store(ddprun):
    """start_store(*args, env=None) -> Store; every store is SIGTERMed at teardown and must have
    exited 0."""
    stores = []

    def start(*args, env=None):
        store = Store(ddprun, args, tempfile.mkdtemp(prefix="ddpstore-"), env=env)
        stores.append(store)
        return store

    yield start
    failures = []
    for store in stores:
        try:
            store.stop()
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.fixture
def store(start_store):
    return start_store()


@pytest.fixture
def make_secret(tmp_path):
    """make_secret(text) -> path of a 0600 file holding text (a store secret)."""
    count = [0]

    def make(text="s3cret-s3cret-s3cret"):
        count[0] += 1
        path = tmp_path / f"secret-{count[0]}"
        path.write_text(text + "\n")
        os.chmod(path, 0o600)
        return str(path)

    return make


# ---- raw protocol helpers (current numbering unless said otherwise) -----------------------------

def s_bytes(b):
    """A protocol string: u64 LE length + bytes."""
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


def send_quietly(sock, data):
    """sendall that tolerates the server having closed the connection already; returns whether
    everything was sent."""
    try:
        sock.sendall(data)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def try_ping(port, nonce=0xC0FFEE, source="127.0.0.1"):
    """A fresh, well-behaved client: VALIDATE + PING; True if the nonce came back."""
    try:
        with connect(port, source=source) as s:
            s.sendall(validate() + ping(nonce))
            return struct.unpack("<I", recv_exact(s, 4))[0] == nonce
    except (ConnectionError, socket.timeout):
        return False


def healthy_ping(port, nonce=0xC0FFEE, source="127.0.0.1"):
    """A fresh, well-behaved client must get its PING answered with the same nonce."""
    with connect(port, source=source) as s:
        s.sendall(validate() + ping(nonce))
        assert struct.unpack("<I", recv_exact(s, 4))[0] == nonce


def is_closed_by_peer(sock, timeout=10.0):
    """True once the server closed this connection (EOF or reset) within timeout; bytes it sends
    meanwhile are discarded."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def closed_now(sock):
    """Non-blocking: has the server closed this connection already?"""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


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
