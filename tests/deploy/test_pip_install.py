"""pip install, as a PyTorch user installs: the sdist of this checkout (`python -m build --sdist`,
scikit-build-core, pyproject.toml) pip-installed into a fresh virtual environment, with only PyPI
reachable. Then the environment holds ddprun, ddpworker, the man pages and the examples,
`ddprun --version` and `python -m ddprun --version` name the version CMakeLists.txt keeps, and the
installed ddprun trains one rank of the installed Fashion-MNIST example with the installed
ddpworker, no build tree in sight.

The build inside pip is the CPU one (DDPRUN_CUDA=OFF): compiling the CUDA backend adds about 35 s
on 2 cores here and cannot run without a GPU; test_install.py covers the CUDA library's install
layout. The whole module takes about a minute on 2 cores (venv, PyPI downloads, one C build)."""
import os
import re
import shutil
import subprocess
import tarfile

import pytest

from conftest import ROOT, clean_env

DATASET = "/usr/share/datasets/fashion-mnist"


def project_version():
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    return re.search(r"project\(ddprun VERSION ([0-9.]+)", text).group(1)


def sh(cmd, env, timeout=900, cwd=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n" + r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with ddprun pip-installed from this checkout's sdist; returns its path."""
    if not shutil.which("cmake"):
        pytest.skip("cmake is not on PATH")
    tmp = tmp_path_factory.mktemp("pip")
    env = clean_env(DDPRUN_CUDA="OFF", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    for k in ("DDPWORKER", "DDPWORKER_CUDA_LIB", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(k, None)
    v = tmp / "v"
    sh(["/usr/bin/python3", "-m", "venv", str(v)], env)
    py = str(v / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "build"], capture_output=True, text=True,
                       timeout=600, env=env)
    if r.returncode != 0:
        pytest.skip("cannot install `build` from PyPI: " + r.stderr[-2000:])
    dist = tmp / "dist"
    sh([py, "-m", "build", "--sdist", "--outdir", str(dist), ROOT], env)
    [sdist] = os.listdir(dist)
    assert sdist == f"ddprun-{project_version()}.tar.gz"
    with tarfile.open(dist / sdist) as t:
        names = t.getnames()
    top = f"ddprun-{project_version()}/"
    for rel in ("pyproject.toml", "CMakeLists.txt", "worker/report/tb_event.proto",
                "python/ddprun/__main__.py", "docs/ddprun.1"):
        assert top + rel in names, f"{rel} is not in the sdist"
    assert not [n for n in names if n.startswith(top + "build")], "a build tree went into the sdist"
    sh([py, "-m", "pip", "install", "-q", str(dist / sdist)], env)
    return v


def venv_env(v):
    """PATH: the venv and the system, nothing of the build tree."""
    env = clean_env(PATH=f"{v}/bin:/usr/bin:/bin")
    for k in ("DDPWORKER", "DDPWORKER_CUDA_LIB", "PYTHONPATH"):
        env.pop(k, None)
    return env


def test_the_environment_holds_the_programs_man_pages_and_examples(venv):
    for rel in ("bin/ddprun", "bin/ddpworker"):
        assert os.access(venv / rel, os.X_OK), f"{rel} is not installed"
    for rel in ("share/man/man1/ddprun.1", "share/man/man1/ddpworker.1",
                "share/man/man5/train.conf.5", "share/doc/ddprun/examples/fashion-mnist.conf"):
        assert (venv / rel).is_file(), f"{rel} is not installed"
    # man finds the pages from PATH (VENV/bin -> VENV/share/man)
    if shutil.which("man"):
        r = subprocess.run(["man", "-w", "ddprun"], capture_output=True, text=True,
                           env=venv_env(venv))
        assert r.stdout.strip() == str(venv / "share/man/man1/ddprun.1"), r.stdout + r.stderr


def test_version_and_python_m_ddprun(venv):
    env = venv_env(venv)
    out = sh(["ddprun", "--version"], env)
    assert out.splitlines()[0] == f"ddprun {project_version()}", out
    assert "backends: cpu only" in out, out  # DDPRUN_CUDA=OFF
    # python -m ddprun is the launcher itself, as python -m torch.distributed.run is torchrun
    assert sh([str(venv / "bin/python"), "-m", "ddprun", "--version"], env) == out
    got = sh([str(venv / "bin/python"), "-c",
              "import importlib.metadata as m; print(m.version('ddprun'))"], env)
    assert got.strip() == project_version()


def test_python_m_ddprun_passes_arguments_and_the_exit_status(venv):
    r = subprocess.run([str(venv / "bin/python"), "-m", "ddprun", "--no-such-flag"],
                       capture_output=True, text=True, env=venv_env(venv), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--no-such-flag" in r.stderr


def test_the_installed_ddprun_trains_one_rank_of_the_installed_example(venv, tmp_path):
    if not os.path.isdir(DATASET):
        pytest.skip(f"{DATASET} is missing (Debian's dataset-fashion-mnist)")
    example = venv / "share/doc/ddprun/examples/fashion-mnist.conf"
    metrics = tmp_path / "m.jsonl"
    out = sh([str(venv / "bin/python"), "-m", "ddprun", "--standalone", "--nproc-per-node", "1",
              str(example), "train.max_steps=20", "data.train_limit=1280", "data.test_limit=512",
              "train.log_interval=10", f"train.metrics_file={metrics}"], venv_env(venv),
             timeout=600, cwd=tmp_path)
    assert "ddpworker: done: 20 steps" in out, out
    events = [line for line in metrics.read_text().splitlines() if '"event":"final"' in line]
    assert len(events) == 1, metrics.read_text()
