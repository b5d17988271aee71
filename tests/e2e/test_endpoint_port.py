"""A local rendezvous endpoint whose port is taken by something that does not listen: every agent
would be a client of a store nobody hosts. Each says so at once, naming the holder (process and
socket, from /proc/net/tcp, inet_diag and /proc/<pid>/fd), and the join's error names it again when
join_timeout ends it. A port held by another agent's listening store is the normal case: silent."""
import os
import socket
import subprocess
import time

from conftest import clean_env, free_port

JOIN_TIMEOUT_S = 4


def agents_at(ddprun, port, n=2):
    args = [ddprun, "--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "taken",
            "--rdzv-conf", f"join_timeout={JOIN_TIMEOUT_S}", "/bin/true"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env()) for _ in range(n)]
    outs = [p.communicate(timeout=60) for p in procs]
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)], time.monotonic() - t0


def check_named(results, took, holder):
    for rc, err in results:
        assert rc != 0, err
        warn = [line for line in err.splitlines() if "nothing listens there" in line]
        assert warn, f"no warning naming the holder:\n{err}"
        assert f"pid {os.getpid()} " in warn[0] and holder in warn[0], warn[0]
        assert f"held by pid {os.getpid()} " in err.splitlines()[-1], err
    assert took < JOIN_TIMEOUT_S + 10, f"{took:.1f} s: within join_timeout={JOIN_TIMEOUT_S}s"


def test_port_bound_by_a_socket_that_does_not_listen(ddprun):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, neither listening nor connected
        results, took = agents_at(ddprun, s.getsockname()[1])
    check_named(results, took, "a socket bound to it, neither listening nor connected")


def test_port_used_as_the_own_end_of_a_connection(ddprun):
    with socket.socket() as listener, socket.socket() as conn:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = listener.getsockname()[1]
        conn.bind(("127.0.0.1", 0))  # as an ephemeral port of an outgoing connection would be
        conn.connect(listener.getsockname())
        accepted, _ = listener.accept()
        with accepted:
            results, took = agents_at(ddprun, conn.getsockname()[1])
    check_named(results, took, f"a connection to 127.0.0.1:{target}, "
                               "ESTABLISHED, not listening")


def test_a_listening_store_is_no_warning(ddprun):
    results, _ = agents_at(ddprun, free_port())
    for rc, err in results:
        assert rc == 0, err
        assert "nothing listens" not in err, err
