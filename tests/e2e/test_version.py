"""`ddprun --version` and `ddpworker --version`: the CMake project version, the git commit the build
was configured from ("unknown" outside a git checkout), and what the build has: cpu only, or the
cuda backend with the CUDA, cuDNN and NCCL versions, exactly when libddpworker_cuda.so was built."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT


def project_version():
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    return re.search(r"project\(ddprun VERSION ([0-9.]+)", text).group(1)


def version_of(binary):
    r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("program", ["ddprun", "ddpworker"])
def test_version_names_version_commit_backends_and_collectives(program, ddprun, ddpworker,
                                                                build_dir):
    out = version_of(ddprun if program == "ddprun" else ddpworker)
    lines = dict(line.split(": ", 1) for line in out.splitlines()[1:])
    assert out.splitlines()[0] == f"{program} {project_version()}", out
    commit = lines["commit"]
    if subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode == 0:
        assert re.fullmatch(r"[0-9a-f]{12}", commit), out
        known = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", commit + "^{commit}"])
        assert known.returncode == 0, f"{commit} is not a commit of {ROOT}"
    else:
        assert commit == "unknown", out
    has_cuda = os.path.exists(os.path.join(build_dir, "worker", "libddpworker_cuda.so"))
    if has_cuda:
        cuda = r"cuda \(CUDA [0-9.]+, cuDNN \d+\.\d+\.\d+\)"
        assert re.fullmatch(r"cpu( \(OpenBLAS [0-9.]+\))?, " + cuda, lines["backends"]), out
        nccl = r"(, nccl \(NCCL \d+\.\d+\.\d+\))?"
        assert re.fullmatch(r"null, ring" + nccl, lines["collectives"]), out
    else:
        assert lines["backends"].startswith("cpu only"), out
        assert lines["collectives"] == "null, ring", out
    if program == "ddpworker" and has_cuda:
        assert lines["cuda library"] == os.path.join(build_dir, "worker",
                                                     "libddpworker_cuda.so") + " (present)", out


def test_both_programs_describe_the_same_build(ddprun, ddpworker):
    a = version_of(ddprun).splitlines()[1:]
    b = [line for line in version_of(ddpworker).splitlines()[1:]
         if not line.startswith("cuda library")]
    assert a == b


def test_ddpworker_says_when_the_cuda_library_is_missing(ddpworker, build_dir, tmp_path):
    if not os.path.exists(os.path.join(build_dir, "worker", "libddpworker_cuda.so")):
        pytest.skip("this build has no cuda backend")
    lone = tmp_path / "ddpworker"  # a copy without the library next to it nor under ../lib
    shutil.copy(ddpworker, lone)
    out = version_of(str(lone))
    assert "missing: install ddprun-cuda" in out, out


def test_the_commit_is_unknown_outside_a_git_checkout(tmp_path):
    """The source tree copied out of git (as a release tarball) configures with commit unknown,
    or the one given with -DDDP_GIT_COMMIT."""
    if not shutil.which("cmake"):
        pytest.skip("cmake is not on PATH")
    src = tmp_path / "src"

    def ignore(directory, names):  # git's files and the build trees at the top
        top = os.path.samefile(directory, ROOT)
        return [n for n in names if n in (".git", "__pycache__") or
                (top and (n.startswith("build") or n == ".deps"))]
    shutil.copytree(ROOT, src, ignore=ignore)
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "b"), "-DDDP_BUILD_TESTS=OFF",
                        "-DCMAKE_CUDA_COMPILER=NOTFOUND"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    generated = open(tmp_path / "b" / "common" / "build_info.c").read()
    assert '.git_commit = "unknown"' in generated
    assert ".has_cuda_backend = false" in generated
    # a build without a checkout (a container) can be told the commit
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "b"),
                        "-DDDP_GIT_COMMIT=0123456789ab"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    generated = open(tmp_path / "b" / "common" / "build_info.c").read()
    assert '.git_commit = "0123456789ab"' in generated
