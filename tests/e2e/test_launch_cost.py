"""What a worker's start and an agent's start pay for: every worker starts under ddprun-shim, a
small executable linked with libc alone (not the agent's libuv, libsodium, cJSON, ...), and libcurl
is loaded only by an agent on etcd (dlopen), with a clear error where it is missing. The times are
tests/bench/bench_launch.py's (docs/performance.md)."""
import os
import re
import subprocess

from conftest import clean_env, wait_until


def needed(path):
    """The shared libraries ldd lists for path, by name (the kernel's vDSO and the loader left out)."""
    r = subprocess.run(["ldd", path], capture_output=True, text=True, check=True)
    names = []
    for line in r.stdout.splitlines():
        name = line.split()[0]
        if name.startswith("linux-vdso") or "ld-linux" in name:
            continue
        names.append(os.path.basename(name))
    return names


def test_the_shim_is_linked_with_libc_alone(ddprun):
    shim = os.path.join(os.path.dirname(ddprun), "ddprun-shim")
    assert os.access(shim, os.X_OK), f"{shim} is not built"
    assert needed(shim) == ["libc.so.6"], needed(shim)


def test_workers_start_under_the_small_shim(ddprun, tmp_path):
    out = tmp_path / "parent"
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "2", "--no-python", "/bin/sh",
                        "-c", f'tr "\\0" " " < /proc/$PPID/cmdline > {out}.$LOCAL_RANK'],
                       capture_output=True, text=True, env=clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        parent = (tmp_path / f"parent.{rank}").read_text().split()
        assert os.path.basename(parent[0]) == "ddprun-shim" and parent[1:3] == ["__shim",
                                                                              parent[2]], parent


def test_libcurl_is_not_linked_and_is_named_where_missing(ddprun):
    assert not [n for n in needed(ddprun) if "curl" in n], needed(ddprun)
    r = subprocess.run([ddprun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                        "--rdzv-endpoint", "127.0.0.1:1", "/bin/true"], capture_output=True,
                       text=True, env=clean_env(DDPRUN_LIBCURL="/nonexistent/libcurl.so.4"),
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert re.search(r"--rdzv-backend etcd: libcurl \(/nonexistent/libcurl.so.4\) cannot be "
                     r"loaded .*install libcurl4", r.stderr), r.stderr


def test_the_shim_leaves_a_spares_handoff_socket_to_the_program(build_dir, tmp_path):
    """The shim passes DDPRUN_SPARE_FD to the program and keeps no copy: the agent must see the
    socket close when the program dies, even while the shim is still ending (a review found a
    spare whose program died after READY could still be handed a round)."""
    import socket
    shim = os.path.join(build_dir, "launcher", "ddprun-shim")
    agent_end, spare_end = socket.socketpair()
    lifeline_r, lifeline_w = os.pipe()
    fd = spare_end.fileno()
    proc = subprocess.Popen(
        ["/bin/bash", "-c", f'exec 3<&{lifeline_r}; exec "$@"', "bash", shim, "__shim",
         str(os.getpid()), "--", "/bin/sleep", "30"],
        pass_fds=(lifeline_r, fd), env=clean_env(DDPRUN_SPARE_FD=str(fd)), stderr=subprocess.PIPE,
        text=True)
    try:
        assert wait_until(lambda: len(children(proc.pid)) == 1 or proc.poll() is not None, 10)
        assert proc.poll() is None, f"the shim exited {proc.returncode}: {proc.stderr.read()}"
        program = children(proc.pid)[0]
        socket_link = os.readlink(f"/proc/{os.getpid()}/fd/{fd}")

        def held(pid):
            for n in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{n}") == socket_link:
                        return True
                except FileNotFoundError:  # closed since the listing
                    pass
            return False
        assert held(program), "the program did not get the handoff socket"
        # the shim closes its copy right after the fork: on a loaded machine the child can be
        # seen first
        assert wait_until(lambda: not held(proc.pid), 5), "the shim keeps the spare's handoff socket"
    finally:
        proc.kill()
        proc.wait()
        os.close(lifeline_w)
        os.close(lifeline_r)
        agent_end.close()
        spare_end.close()


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []
