"""`cpack -G DEB` of the build tree under test: ddprun_<version>_<arch>.deb (and ddprun-cuda_...
where the CUDA backend was built), whose Depends cover every library the binaries link; installed
with dpkg -i on this machine, `ddprun --version` and a one-rank training of the installed example
run from /usr, and dpkg --purge takes every file away again.

This machine may be someone's development machine: the test installs only when no ddprun package
is installed already, and always purges what it installed (also when a check fails)."""
import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, clean_env

PACKAGES = ("ddprun-cuda", "ddprun")  # purge order: the CUDA library's package depends on ddprun
DATASET = "/usr/share/datasets/fashion-mnist"


def run(*cmd, timeout=300, **kw):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)


def is_installed(package):
    r = run("dpkg-query", "-W", "-f", "${Status}", package)
    return r.returncode == 0 and "installed" in r.stdout.split()


def version_of_build(build_dir):
    cache = open(os.path.join(build_dir, "CMakeCache.txt")).read()
    return re.search(r"^CMAKE_PROJECT_VERSION:STATIC=(\S+)", cache, re.M).group(1)


@pytest.fixture(scope="module")
def debs(build_dir, tmp_path_factory):
    """{package name: .deb path} built by cpack from the build tree."""
    for tool in ("cpack", "dpkg-deb", "dpkg", "readelf"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed (cpack: cmake; dpkg-deb: dpkg; readelf: "
                        "binutils)")
    config = os.path.join(build_dir, "CPackConfig.cmake")
    if not os.path.exists(config):
        pytest.skip(f"{config} is missing: the build tree was configured without CPack")
    out = str(tmp_path_factory.mktemp("debs"))
    r = run("cpack", "-G", "DEB", "-B", out, "--config", config, cwd=build_dir, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return {run("dpkg-deb", "-f", p, "Package").stdout.strip(): p
            for p in glob.glob(os.path.join(out, "*.deb"))}


def has_cuda_lib(build_dir):
    return os.path.exists(os.path.join(build_dir, "worker", "libddpworker_cuda.so"))


def test_packages_are_named_and_filled_as_debian_expects(debs, build_dir):
    arch = run("dpkg", "--print-architecture").stdout.strip()
    version = version_of_build(build_dir)
    expected = {"ddprun"} | ({"ddprun-cuda"} if has_cuda_lib(build_dir) else set())
    assert set(debs) == expected
    for name, path in debs.items():
        assert os.path.basename(path) == f"{name}_{version}_{arch}.deb"
    files = run("dpkg-deb", "-c", debs["ddprun"]).stdout
    for f in ("./usr/bin/ddprun", "./usr/bin/ddpworker", "./usr/share/man/man1/ddpworker.1",
              "./usr/share/man/man5/train.conf.5", "./usr/lib/systemd/system/ddprun-store.service",
              "./usr/share/doc/ddprun/examples/fashion-mnist.conf",
              "./usr/share/ddprun/ddprun_plot.py"):
        assert f in files, f"{f} is not in ddprun's package:\n{files}"
    assert "libddpworker_cuda.so" not in files
    if "ddprun-cuda" in debs:
        cuda = run("dpkg-deb", "-c", debs["ddprun-cuda"]).stdout
        assert re.search(r"\./usr/lib/\S*ddprun/libddpworker_cuda\.so$", cuda, re.M), cuda
        assert run("dpkg-deb", "-f", debs["ddprun-cuda"], "Depends").stdout.strip() == \
            f"ddprun (= {version})"


def depends_of(deb):
    """Package names in a .deb's Depends (alternatives and versions dropped)."""
    text = run("dpkg-deb", "-f", deb, "Depends").stdout
    return {re.sub(r"[ (:].*", "", alt.strip()) for alt in re.split(r"[,|]", text) if alt.strip()}


def owners(soname):
    r = run("dpkg", "-S", "*/" + soname)
    return {line.split(":")[0].strip() for line in r.stdout.splitlines()}


def assert_covered(binaries, depends):
    """Every library the binaries link directly is in a package of depends (or one that a
    metapackage there, such as libopenblas0, depends on)."""
    covered = set(depends)
    for d in depends:
        deps = run("dpkg-query", "-W", "-f", "${Depends}", d).stdout
        covered |= {re.sub(r"[ (:].*", "", a.strip()) for a in re.split(r"[,|]", deps) if a.strip()}
    for binary in binaries:
        dynamic = run("readelf", "-d", str(binary)).stdout
        for soname in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic):
            if soname.startswith(("libasan", "libubsan")):
                continue  # a sanitizer build's; dpkg-shlibdeps declares them, the list does not
            found = owners(soname)
            assert found, f"{binary} links {soname}, which no installed package provides"
            assert found & covered, \
                f"{binary} links {soname} ({', '.join(sorted(found))}), not in Depends: {depends}"


def test_depends_cover_every_library_the_binaries_link(debs, tmp_path):
    root = tmp_path / "root"
    assert run("dpkg-deb", "-x", debs["ddprun"], str(root)).returncode == 0
    assert_covered([root / "usr/bin/ddprun", root / "usr/bin/ddpworker"],
                   depends_of(debs["ddprun"]))


def test_the_list_used_without_dpkg_shlibdeps_is_complete(build_dir):
    """deploy/CMakeLists.txt's Depends for machines without dpkg-dev, against the binaries."""
    for tool in ("readelf", "dpkg"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed")
    text = open(os.path.join(ROOT, "deploy", "CMakeLists.txt")).read()
    listed = re.search(r'CPACK_DEBIAN_MAIN_PACKAGE_DEPENDS\s+"([^"]+)"', text).group(1)
    listed = listed.replace("\\\n", "")  # CMake's line continuation
    # and what is appended when an optional part is built (libcurl4: the etcd backend)
    listed += "".join(re.findall(r'string\(APPEND CPACK_DEBIAN_MAIN_PACKAGE_DEPENDS "([^"]+)"\)',
                                 text))
    assert_covered([os.path.join(build_dir, "launcher", "ddprun"),
                    os.path.join(build_dir, "worker", "ddpworker")],
                   {d.strip() for d in listed.split(",")})


def test_installs_runs_and_purges_without_leftovers(debs, build_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("dpkg -i needs root")
    present = [p for p in PACKAGES if is_installed(p)]
    if present:
        pytest.skip(f"{', '.join(present)} is installed on this machine already: not replacing it")
    if run("dpkg", "--audit").stdout.strip():
        pytest.skip("dpkg --audit reports half-installed packages: not adding to them")
    files = []
    try:
        r = run("dpkg", "-i", *debs.values(), timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        for p in debs:
            files += run("dpkg", "-L", p).stdout.split("\n")
        files = [f for f in files if f]
        env = clean_env(PATH="/usr/bin:/bin")
        for k in ("DDPWORKER", "DDPWORKER_CUDA_LIB"):
            env.pop(k, None)

        v = run("ddprun", "--version", env=env)
        version = version_of_build(build_dir)
        assert v.returncode == 0 and v.stdout.startswith(f"ddprun {version}\n"), v.stdout + v.stderr
        assert shutil.which("ddprun", path=env["PATH"]) == "/usr/bin/ddprun"
        if "ddprun-cuda" in debs:
            w = run("ddpworker", "--version", env=env).stdout
            lib = r"/usr/lib/\S*ddprun/libddpworker_cuda\.so"
            assert re.search(rf"^cuda library: {lib} \(present\)$", w, re.M), w

        overrides = ["train.max_steps=5", "data.train_limit=640", "data.test_limit=200",
                     f"train.metrics_file={tmp_path}/m.jsonl"]
        if not os.path.exists(os.path.join(DATASET, "train-images-idx3-ubyte.gz")):
            overrides += ["data.kind=synthetic", "data.height=28", "data.width=28",
                          "data.channels=1"]
        t = run("ddprun", "--standalone", "--nproc-per-node", "1",
                "/usr/share/doc/ddprun/examples/fashion-mnist.conf", *overrides, env=env,
                cwd=str(tmp_path))
        assert t.returncode == 0, t.stdout + t.stderr
        final = [json.loads(line) for line in open(tmp_path / "m.jsonl")][-1]
        assert final["event"] == "final" and final["step"] == 5, final
        h = run("ddprun", "plot", "--help", env=env)
        assert "This script: /usr/share/ddprun/ddprun_plot.py" in " ".join(h.stdout.split()), \
            h.stdout + h.stderr
        p = run("ddprun", "plot", str(tmp_path / "m.jsonl"), "--csv", str(tmp_path / "m.csv"),
                env=env)
        assert p.returncode == 0 and "train_loss" in open(tmp_path / "m.csv").read(), p.stderr
    finally:
        installed = [p for p in PACKAGES if is_installed(p) or
                     run("dpkg-query", "-W", p).returncode == 0]
        if installed:
            r = run("dpkg", "--purge", *installed, timeout=600)
            assert r.returncode == 0, f"dpkg --purge {installed} failed:\n{r.stdout}{r.stderr}"
    for p in PACKAGES:
        assert run("dpkg-query", "-W", p).returncode != 0, f"dpkg still knows {p}"
    left = [f for f in files if os.path.lexists(f) and not os.path.isdir(f)]
    assert not left, f"left behind after dpkg --purge: {left}"
    for d in ("/usr/share/doc/ddprun", "/usr/share/ddprun"):
        assert not os.path.exists(d), f"{d} is left behind"
