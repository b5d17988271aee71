"""A real etcd v3 cluster on loopback for the tests and benchmarks (python3 stdlib only).

    with EtcdCluster(workdir, members=3, tls=False, auth_password=None) as c:
        c.start()
        ddprun ... --rdzv-backend etcd --rdzv-endpoint c.endpoints ...
        c.kill(c.leader())

Each member logs to workdir/member-<i>.log and keeps its data in workdir/member-<i>.data, so a
member restarted with restart(i) rejoins with its own raft log. close() kills every member and
leaves workdir alone (the logs are what one reads after a failure).
"""
import json
from base64 import b64decode
import os
import signal
import socket
import subprocess
import time

ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"
START_TIMEOUT_S = 20


def free_port(host="127.0.0.1"):
    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def log_tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"({path}: {e})"


def etcd_cluster_or_skip(tmp_path, **kw):
    """An EtcdCluster under tmp_path, started; the test skips when etcd is not installed."""
    import pytest
    for tool in (ETCD, ETCDCTL):
        if not os.access(tool, os.X_OK):
            pytest.skip(f"{tool} is missing (Debian: apt-get install etcd-server etcd-client)")
    if kw.get("tls") and not any(os.access(os.path.join(d, "openssl"), os.X_OK)
                                 for d in os.environ.get("PATH", "/usr/bin").split(":")):
        pytest.skip("openssl is missing (it makes the TLS test certificates)")
    return EtcdCluster(str(tmp_path), **kw).start()


class EtcdCluster:
    def __init__(self, workdir, members=3, tls=False, auth_password=None, host="127.0.0.1"):
        self.host = host  # where the members listen (the chaos harness: an address a netns reaches)
        self.workdir = os.path.abspath(workdir)
        self.members = members
        self.tls = tls
        self.auth_password = auth_password
        self.user = "root" if auth_password else None
        self.password_file = None
        self.cacert = self.cert = self.key = None
        self.procs = [None] * members
        self.client_ports = []
        self.peer_ports = []
        self.auth_enabled = False
        os.makedirs(self.workdir, exist_ok=True)

    # ---- addresses ----------------------------------------------------------------------------

    @property
    def scheme(self):
        return "https" if self.tls else "http"

    @property
    def urls(self):
        return [f"{self.scheme}://{self.host}:{p}" for p in self.client_ports]

    @property
    def endpoints(self):
        """For --rdzv-endpoint: host:port,host:port,... without a scheme."""
        return ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def _name(self, i):
        return f"member-{i}"

    def _initial_cluster(self):
        return ",".join(f"{self._name(i)}=http://{self.host}:{p}"
                        for i, p in enumerate(self.peer_ports))

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self):
        if self.tls:
            self._make_certs()
        # Ports from bind(0) are free when picked but may be taken before etcd binds them: such a
        # start fails with "address already in use", and the whole cluster is tried again on new
        # ports (the members' data dirs are fresh, so nothing of the failed try survives).
        for attempt in range(3):
            self.client_ports = [free_port(self.host) for _ in range(self.members)]
            self.peer_ports = [free_port(self.host) for _ in range(self.members)]
            if len(set(self.client_ports + self.peer_ports)) < 2 * self.members:
                continue
            for i in range(self.members):
                self._wipe(i)
                self._launch(i, "new")
            try:
                self._wait_healthy()
                break
            except RuntimeError:
                in_use = any("address already in use" in log_tail(self._log(i), 200)
                             for i in range(self.members))
                self.close()
                if not in_use or attempt == 2:
                    raise
        if self.auth_password is not None:
            self._enable_auth()
        return self

    def _log(self, i):
        return os.path.join(self.workdir, f"{self._name(i)}.log")

    def _data(self, i):
        return os.path.join(self.workdir, f"{self._name(i)}.data")

    def _wipe(self, i):
        subprocess.run(["rm", "-rf", self._data(i)], check=True)

    def _launch(self, i, state):
        pp = self.peer_ports[i]
        cmd = [ETCD, "--name", self._name(i), "--data-dir", self._data(i),
               "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
               "--listen-peer-urls", f"http://{self.host}:{pp}",
               "--initial-advertise-peer-urls", f"http://{self.host}:{pp}",
               "--initial-cluster", self._initial_cluster(), "--initial-cluster-state", state,
               "--initial-cluster-token", f"ddprun-test-{os.getpid()}-{self.peer_ports[0]}",
               # A lost leader is replaced within about a second instead of the default's ~2 s.
               "--heartbeat-interval", "50", "--election-timeout", "500",
               "--logger", "zap", "--log-outputs", "stderr"]
        if self.tls:
            cmd += ["--cert-file", self._server_cert, "--key-file", self._server_key,
                    "--client-cert-auth", "--trusted-ca-file", self.cacert]
        log = open(self._log(i), "ab")
        # Its own process group: a test that kills agents by group never takes etcd with them.
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        log.close()

    def _wait_healthy(self, indices=None, timeout=START_TIMEOUT_S):
        indices = range(self.members) if indices is None else indices
        deadline = time.monotonic() + timeout
        pending = list(indices)
        while pending:
            for i in list(pending):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"etcd {self._name(i)} exited with {self.procs[i].returncode}:"
                                       f"\n{log_tail(self._log(i))}")
                r = self.etcdctl("endpoint", "health", endpoints=[self.urls[i]], timeout=5)
                if r.returncode == 0:
                    pending.remove(i)
            if pending and time.monotonic() > deadline:
                i = pending[0]
                raise RuntimeError(f"etcd {self._name(i)} at {self.urls[i]} not healthy after "
                                   f"{timeout} s:\n{log_tail(self._log(i))}")
            if pending:
                time.sleep(0.1)

    def alive(self, i):
        return self.procs[i] is not None and self.procs[i].poll() is None

    def kill(self, i):
        if self.alive(i):
            self.procs[i].kill()
        if self.procs[i] is not None:
            self.procs[i].wait()

    def stop(self, i, timeout=10):
        if self.alive(i):
            self.procs[i].send_signal(signal.SIGTERM)
            try:
                self.procs[i].wait(timeout)
            except subprocess.TimeoutExpired:
                self.procs[i].kill()
                self.procs[i].wait()

    def restart(self, i):
        """Start member i again on its old ports and data dir; returns once it is healthy."""
        self.kill(i)
        self._launch(i, "existing")
        self._wait_healthy([i])

    def close(self):
        for i in range(self.members):
            self.kill(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- clients ------------------------------------------------------------------------------

    def etcdctl(self, *args, endpoints=None, auth=True, tls=True, timeout=30, input=None):
        """etcdctl with ETCDCTL_API=3, the live endpoints, and the TLS and auth flags as configured.
        auth=False / tls=False leave the password / all certificates out (to see them refused)."""
        eps = endpoints or [u for i, u in enumerate(self.urls) if self.alive(i)] or self.urls
        cmd = [ETCDCTL, "--endpoints", ",".join(eps), "--dial-timeout", "2s",
               "--command-timeout", "5s"]
        if self.tls and tls:
            cmd += ["--cacert", self.cacert, "--cert", self.cert, "--key", self.key]
        if self.auth_enabled and auth:
            cmd += ["--user", self.user, "--password", self.auth_password]
        env = dict(os.environ, ETCDCTL_API="3")
        for k in [k for k in env if k.startswith("ETCDCTL_") and k != "ETCDCTL_API"]:
            del env[k]  # flags only: a stray ETCDCTL_ENDPOINTS in the caller's env would conflict
        try:
            return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True,
                                  timeout=timeout, input=input)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, e.stdout or "", e.stderr or "timed out")

    def put(self, key, value):
        r = self.etcdctl("put", key, value)
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl put {key}: {r.stderr.strip()}")

    def get(self, key):
        """The value of key as str, or None when it is absent."""
        return self._range(key, False).get(key)

    def get_prefix(self, prefix):
        """{key: value} of every key under prefix."""
        return self._range(prefix, True)

    def _range(self, key, is_prefix):
        r = self.etcdctl("get", key, "-w", "json", *(["--prefix"] if is_prefix else []))
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl get {key}: {r.stderr.strip()}")
        kvs = json.loads(r.stdout).get("kvs", [])
        return {b64decode(kv["key"]).decode(): b64decode(kv.get("value", "")).decode()
                for kv in kvs}

    def leader(self):
        """Index of the leader as the live members see it, or None while there is none (an election
        is under way, or the members still name one that is dead)."""
        live = [i for i in range(self.members) if self.alive(i)]
        ids, leaders = {}, set()
        for i in live:
            r = self.etcdctl("endpoint", "status", "-w", "json", endpoints=[self.urls[i]],
                             timeout=5)
            if r.returncode != 0:
                continue
            st = json.loads(r.stdout)[0]["Status"]
            ids[st["header"]["member_id"]] = i
            # proto3's JSON leaves out zeros: no "leader" while a member knows of none (an election)
            leaders.add(st.get("leader", 0))
        if len(leaders) != 1 or 0 in leaders:
            return None
        return ids.get(leaders.pop())

    def wait_leader(self, timeout=10, not_=None):
        """The leader's index once the live members agree on one (other than not_)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.leader()
            if i is not None and i != not_:
                return i
            time.sleep(0.05)
        raise RuntimeError(f"no etcd leader within {timeout} s")

    # ---- TLS and auth -------------------------------------------------------------------------

    def _openssl(self, *args):
        r = subprocess.run(["openssl", *args], cwd=self.pki, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr}")

    def _make_certs(self):
        self.pki = os.path.join(self.workdir, "pki")
        os.makedirs(self.pki, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
                      "-subj", "/CN=ddprun-test-ca",
                      "-addext", "basicConstraints=critical,CA:TRUE",
                      "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        # clientAuth on the server cert too: etcd 3.4's JSON gateway dials its own gRPC port with
        # the server's cert, which --client-cert-auth then checks as a client cert.
        # The client's has no CN: etcd's JSON gateway (what ddprun speaks) refuses a client
        # certificate with a CN, which it could not map to a user ("CommonName of client sending a
        # request against gateway will be ignored"); users then come from user= and a password.
        for name, subj, eku in (("server", "/CN=localhost", "serverAuth,clientAuth"),
                                ("client", "/O=ddprun-test-client", "clientAuth")):
            with open(os.path.join(self.pki, f"{name}.ext"), "w") as f:
                f.write(f"extendedKeyUsage={eku}\n")
                if name == "server":
                    f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
            self._openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                          "-subj", subj)
            self._openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                          "-CAcreateserial", "-days", "7", "-out", f"{name}.crt",
                          "-extfile", f"{name}.ext")
        p = lambda f: os.path.join(self.pki, f)
        self.cacert, self.cert, self.key = p("ca.crt"), p("client.crt"), p("client.key")
        self._server_cert, self._server_key = p("server.crt"), p("server.key")

    def _enable_auth(self):
        steps = [("user", "add", "root", "--new-user-password", self.auth_password),
                 ("role", "add", "root"), ("user", "grant-role", "root", "root"),
                 ("auth", "enable")]
        for step in steps:
            r = self.etcdctl(*step)
            if r.returncode != 0 and "already exists" not in r.stderr:
                raise RuntimeError(f"etcdctl {' '.join(step[:2])}: {r.stderr.strip()}")
        self.auth_enabled = True
        self.password_file = os.path.join(self.workdir, "password")
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.auth_password)
        os.chmod(self.password_file, 0o600)
