"""tests/tools/etcd_cluster.py itself: the cluster the etcd rendezvous tests stand on comes up, loses
and re-elects a leader, takes a member back, and enforces TLS and auth as configured."""
import os
import ssl
import stat
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from etcd_cluster import etcd_cluster_or_skip  # noqa: E402


def test_three_members_fail_over_and_rejoin(tmp_path):
    with etcd_cluster_or_skip(tmp_path) as c:
        assert c.endpoints == ",".join(u.split("://")[1] for u in c.urls)
        assert len(c.urls) == 3 and all(u.startswith("http://127.0.0.1:") for u in c.urls)
        c.put("job/a", "1")
        c.put("job/b", "two")
        assert c.get("job/a") == "1" and c.get("job/none") is None
        assert c.get_prefix("job/") == {"job/a": "1", "job/b": "two"}

        old = c.leader()
        assert old in (0, 1, 2)
        t0 = time.monotonic()
        c.kill(old)
        new = c.wait_leader(timeout=5, not_=old)
        print(f"new leader after {time.monotonic() - t0:.2f} s")
        assert new != old
        survivors = [u for i, u in enumerate(c.urls) if i != old]
        r = c.etcdctl("put", "job/c", "after", endpoints=survivors)
        assert r.returncode == 0, r.stderr
        for url in survivors:  # each survivor answers on its own
            r = c.etcdctl("get", "job/c", "--print-value-only", endpoints=[url])
            assert r.stdout.strip() == "after", r.stderr
        r = c.etcdctl("--dial-timeout", "1s", "get", "job/c", endpoints=[c.urls[old]])
        assert r.returncode != 0  # the killed member is really gone

        c.restart(old)
        assert c.alive(old)
        # Its data dir was kept: it catches up on what it missed, as a member of the same cluster.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            r = c.etcdctl("get", "job/c", "--print-value-only", "--consistency", "s",
                          endpoints=[c.urls[old]])
            if r.stdout.strip() == "after":
                break
            time.sleep(0.05)
        assert r.stdout.strip() == "after", r.stderr
        r = c.etcdctl("member", "list")
        assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 3, r.stdout

        c.stop(new)
        assert c.procs[new].returncode is not None and not c.alive(new)
        assert c.wait_leader(timeout=5, not_=new) != new
    assert not any(c.alive(i) for i in range(3))
    assert all(os.path.getsize(tmp_path / f"member-{i}.log") > 0 for i in range(3))


def test_tls_cluster_needs_the_certificates(tmp_path):
    with etcd_cluster_or_skip(tmp_path, tls=True) as c:
        assert all(u.startswith("https://127.0.0.1:") for u in c.urls)
        c.put("k", "v")
        assert c.get("k") == "v"
        quick = ("--dial-timeout", "1s", "--command-timeout", "1s")  # a refusal, not a wait
        r = c.etcdctl(*quick, "get", "k", tls=False)
        assert r.returncode != 0
        # The CA alone is not enough either: members demand a client certificate.
        r = c.etcdctl(*quick, "--cacert", c.cacert, "get", "k", tls=False)
        assert r.returncode != 0
        san = subprocess.run(["openssl", "x509", "-in", c.cert.replace("client", "server"),
                              "-noout", "-ext", "subjectAltName"], capture_output=True, text=True)
        assert "IP Address:127.0.0.1" in san.stdout and "DNS:localhost" in san.stdout, san.stdout
        # The JSON gateway over https with the client cert, as a libcurl client will use it.
        ctx = ssl.create_default_context(cafile=c.cacert)
        ctx.load_cert_chain(c.cert, c.key)
        req = urllib.request.Request(c.urls[0] + "/v3/kv/range", data=b'{"key":"aw=="}')
        with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
            assert b'"value":"dg=="' in resp.read()


def test_auth_cluster_needs_the_password(tmp_path):
    with etcd_cluster_or_skip(tmp_path, auth_password="s3cret pass") as c:
        assert c.user == "root"
        assert open(c.password_file).read() == "s3cret pass"
        assert stat.S_IMODE(os.stat(c.password_file).st_mode) == 0o600
        c.put("k", "v")
        assert c.get("k") == "v"
        r = c.etcdctl("get", "k", auth=False)
        assert r.returncode != 0 and "user name is empty" in r.stderr, r.stderr
        r = c.etcdctl("--user", "root", "--password", "wrong", "get", "k", auth=False)
        assert r.returncode != 0 and "authentication failed" in r.stderr, r.stderr
