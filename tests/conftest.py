"""Shared pytest fixtures: the ddprun binary, a running `ddprun store`, raw protocol helpers.

Run with Debian's interpreter (torch 1.13 and pytest live there):
    /usr/bin/python3 -m pytest -q tests
The binary is $DDPRUN_BIN, else $DDP_BUILD_DIR/launcher/ddprun (relative to the repository root
unless absolute: the build tests/gpu/run.sh just made), else the newest of build/, build-test/ and
build-py/. The build tree (ddpworker, the test tools) is $DDP_BUILD_DIR when set, else the one the
binary came from.
"""
import os
import re
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAGIC = 0x3C85F7CE
SECRET_ENV = ("DDPRUN_STORE_SECRET", "DDPRUN_STORE_SECRET_FILE")

# ---- sanitizer reports fail the test ----------------------------------------------------------
# Under ddprun a worker that a sanitizer aborts is just a failed worker, restarted, and a report
# can sit in a log nobody reads (the GCC runtimes write it to stderr whatever log_path says). So a
# test fails, at its teardown, when a sanitizer's mark appears in
#  - the output of any process it ran through subprocess.run or Popen.communicate (an agent's
#    console carries its workers' output),
#  - its captured output (the processes that inherited pytest's stdout and stderr),
#  - any file under its tmp_path (logs the test wrote there, --log-dir), or under the TMPDIR it
#    gave its processes (ddprun's run directory of a run that failed: its per-rank logs).
# A report's own lines, not the words in a source file or a comment (a test may copy the tree,
# this file included, so the pattern is built from pieces): "==PID==ERROR: AddressSanitizer: ..."
# or LeakSanitizer, and UBSan's "file:LINE:COL" or "(binary+0xOFFSET)" followed by its phrase.
_UBSAN_PHRASE = b"runtime" + b" error: "
SANITIZER_REPORT = re.compile(rb"==\d+==ERROR: (?:AddressSanitizer|LeakSanitizer)|(?:\d|\)): " +
                              _UBSAN_PHRASE)
# files never worth reading for a report: data, snapshots, weights, archives
_SCAN_SKIP_SUFFIXES = (".ddps", ".safetensors", ".jpg", ".jpeg", ".png", ".gz", ".bin", ".params",
                       ".deb", ".tar", ".so", ".o", ".a", ".npy", ".pt", ".corrupt")
_SCAN_MAX_BYTES = 16 << 20


def sanitizer_reports_in(text):
    """The lines of text (str or bytes) that carry a sanitizer report's mark."""
    if isinstance(text, str):
        text = text.encode(errors="replace")
    return [line.decode(errors="replace") for line in text.splitlines()
            if SANITIZER_REPORT.search(line)]


def sanitizer_reports_under(root):
    """{path: marked lines} for the regular files under root (symlinks, FIFOs and large or binary
    data files are not read)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if (not stat.S_ISREG(st.st_mode) or st.st_size > _SCAN_MAX_BYTES or
                        name.endswith(_SCAN_SKIP_SUFFIXES)):
                    continue
                with open(path, "rb") as f:
                    lines = sanitizer_reports_in(f.read())
            except OSError:
                continue
            if lines:
                found[path] = lines
    return found


_sanitizer_hits = []  # (command, marked lines) seen by communicate() during the current test
_real_communicate = subprocess.Popen.communicate


def _communicate_and_scan(self, *args, **kwargs):
    out, err = _real_communicate(self, *args, **kwargs)
    lines = sanitizer_reports_in(out or "") + sanitizer_reports_in(err or "")
    if lines:
        _sanitizer_hits.append((self.args, lines))
    return out, err


subprocess.Popen.communicate = _communicate_and_scan  # subprocess.run goes through it too


@pytest.fixture(autouse=True)
def no_sanitizer_reports(tmp_path, monkeypatch):
    """Fails the test (at teardown) on a sanitizer report in what its processes printed or wrote."""
    del _sanitizer_hits[:]
    proc_tmp = tempfile.mkdtemp(prefix="ddp-test-tmp-")
    monkeypatch.setenv("TMPDIR", proc_tmp)  # children only: Python's own tempfile dir is cached
    yield
    problems = [f"output of {cmd}:\n" + "\n".join(lines[:20]) for cmd, lines in _sanitizer_hits]
    for root in (tmp_path, proc_tmp):
        problems += [f"{path}:\n" + "\n".join(lines[:20])
                     for path, lines in sanitizer_reports_under(root).items()]
    del _sanitizer_hits[:]
    if problems:
        pytest.fail("sanitizer report(s) during this test:\n" + "\n".join(problems),
                    pytrace=False)
    shutil.rmtree(proc_tmp, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose captured output (processes that inherited it) holds a sanitizer report fails."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call" or not rep.passed:
        return
    lines = sanitizer_reports_in("".join(text for name, text in rep.sections if "Captured" in name))
    if lines:
        rep.outcome = "failed"
        rep.longrepr = ("sanitizer report(s) in the test's captured output:\n" +
                        "\n".join(lines[:20]))


def env_build_dir():
    """$DDP_BUILD_DIR as an absolute path (relative ones are taken from the repository root), or
    None when unset."""
    env = os.environ.get("DDP_BUILD_DIR")
    return os.path.join(ROOT, env) if env else None


def find_ddprun():
    env = os.environ.get("DDPRUN_BIN")
    build = env_build_dir()
    if env:
        if not os.access(env, os.X_OK):
            pytest.exit(f"DDPRUN_BIN={env} is not an executable", returncode=2)
        if build and (os.path.realpath(os.path.dirname(os.path.dirname(env))) !=
                      os.path.realpath(build)):
            # the launcher of one build and the worker and tools of another: a mix nobody built
            pytest.exit(f"DDPRUN_BIN={env} is not the ddprun of DDP_BUILD_DIR="
                        f"{os.environ['DDP_BUILD_DIR']}: set one of them", returncode=2)
        return env
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


def environment_broken(reason):
    """A tool that deploy/setup.sh installs did not work at run time (Slurm did not start, no
    network namespaces, no tmpfs, no ::1): a failure, since on CI it means the environment broke,
    unless DDP_ALLOW_SKIP=1 says this machine may lack it (then a skip). Does not return."""
    if os.environ.get("DDP_ALLOW_SKIP") == "1":
        pytest.skip(reason)
    pytest.fail(f"{reason} (DDP_ALLOW_SKIP=1 makes this a skip on a machine that may lack it)",
                pytrace=False)


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
        assert not sanitizer_reports_in(self.stderr()), f"sanitizer report:\n{self.stderr()}"


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
