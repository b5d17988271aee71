"""`cmake --install` of the build tree under test, into a temporary DESTDIR with the prefix
/opt/ddprun (not /usr: nothing may depend on the prefix): what lands where, and that the installed
ddprun runs the installed example with the installed ddpworker (and it finds the installed CUDA
library) with no build tree in sight. Also: ddpworker(1) covers every command, environment
variable and exit code, the man pages render, the systemd units verify, the bash completion
completes."""
import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, clean_env

PREFIX = "/opt/ddprun"
DATASET = "/usr/share/datasets/fashion-mnist"


def cmake_install(build_dir, prefix, destdir=None):
    env = dict(os.environ)
    env.pop("DESTDIR", None)
    if destdir:
        env["DESTDIR"] = destdir
    r = subprocess.run(["cmake", "--install", build_dir, "--prefix", prefix], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def installed(build_dir, tmp_path_factory):
    """The install root: DESTDIR + PREFIX."""
    if not shutil.which("cmake"):
        pytest.skip("cmake is not on PATH")
    destdir = str(tmp_path_factory.mktemp("destdir"))
    cmake_install(build_dir, PREFIX, destdir)
    return destdir + PREFIX


def installed_env(root):
    """An environment that cannot reach the build tree: no DDPWORKER, a PATH of system dirs."""
    env = clean_env(PATH="/usr/bin:/bin")
    for k in ("DDPWORKER", "DDPWORKER_CUDA_LIB"):
        env.pop(k, None)
    return env


def has_cuda_lib(build_dir):
    return os.path.exists(os.path.join(build_dir, "worker", "libddpworker_cuda.so"))


def test_install_puts_every_file_in_place(installed, build_dir):
    for rel in ("bin/ddprun", "bin/ddpworker", "libexec/ddprun/ddprun-shim"):
        assert os.access(os.path.join(installed, rel), os.X_OK), f"{rel} is not installed"
    for rel in ("share/man/man1/ddprun.1", "share/man/man1/ddpworker.1",
                "share/man/man5/train.conf.5", "share/bash-completion/completions/ddprun",
                "share/doc/ddprun/README.md", "lib/systemd/system/ddprun-store.service",
                "share/ddprun/ddprun_plot.py",
                "lib/systemd/system/ddprun@.service"):
        assert os.path.isfile(os.path.join(installed, rel)), f"{rel} is not installed"
    shipped = sorted(os.path.basename(p)
                     for p in glob.glob(os.path.join(ROOT, "docs/examples/*.conf")))
    got = sorted(os.listdir(os.path.join(installed, "share/doc/ddprun/examples")))
    assert got == shipped
    cuda = glob.glob(os.path.join(installed, "lib*", "**", "ddprun", "libddpworker_cuda.so"),
                     recursive=True)
    assert bool(cuda) == has_cuda_lib(build_dir), \
        f"libddpworker_cuda.so installed: {cuda}, built: {has_cuda_lib(build_dir)}"


def test_systemd_units_name_the_installed_ddprun(installed):
    for unit in ("ddprun-store.service", "ddprun@.service"):
        text = open(os.path.join(installed, "lib/systemd/system", unit)).read()
        execs = re.findall(r"^ExecStart=(\S+)", text, re.M)
        assert execs == [PREFIX + "/bin/ddprun"], f"{unit}: ExecStart {execs}"


def test_systemd_units_verify(build_dir, tmp_path):
    """systemd's own check (it wants ExecStart's binary to exist: an install without DESTDIR)."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    prefix = str(tmp_path / "prefix")
    cmake_install(build_dir, prefix)
    units = os.path.join(prefix, "lib/systemd/system")
    # a template is verified through an instance
    shutil.copy(os.path.join(units, "ddprun@.service"), os.path.join(units, "ddprun@job.service"))
    for unit in ("ddprun-store.service", "ddprun@job.service"):
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", os.path.join(units, unit)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{unit}: {r.stdout}{r.stderr}"


def example_overrides(tmp_path):
    """Five steps of the example, on Debian's Fashion-MNIST when present (as after setup.sh),
    else on synthetic images of its shape."""
    o = ["train.max_steps=5", "train.log_interval=1", "data.train_limit=640",
         "data.test_limit=200", "train.backend=cpu", f"train.metrics_file={tmp_path}/m.jsonl"]
    if not os.path.exists(os.path.join(DATASET, "train-images-idx3-ubyte.gz")):
        o += ["data.kind=synthetic", "data.height=28", "data.width=28", "data.channels=1"]
    return o


def test_installed_ddprun_trains_the_installed_example(installed, tmp_path):
    example = os.path.join(installed, "share/doc/ddprun/examples/fashion-mnist.conf")
    r = subprocess.run([os.path.join(installed, "bin/ddprun"), "--standalone", "--nproc-per-node",
                        "1", example, *example_overrides(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=installed_env(installed), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    final = [e for e in events if e["event"] == "final"]
    assert final and final[0]["step"] == 5, events
    assert len([e for e in events if e["event"] == "train"]) == 5
    # ddprun plot runs the installed script (not the source tree's) on the run's metrics
    plot = os.path.join(installed, "bin/ddprun")
    r = subprocess.run([plot, "plot", "--help"], capture_output=True, text=True,
                       env=installed_env(installed))
    assert f"This script: {installed}/share/ddprun/ddprun_plot.py" in " ".join(r.stdout.split()), \
        r.stdout + r.stderr
    r = subprocess.run([plot, "plot", str(tmp_path / "m.jsonl"), "--csv", str(tmp_path / "m.csv")],
                       capture_output=True, text=True, env=installed_env(installed))
    assert r.returncode == 0, r.stderr
    assert "train_loss" in (tmp_path / "m.csv").read_text()


def test_installed_ddpworker_finds_the_installed_cuda_library(installed, build_dir, tmp_path):
    """Without the library: the error names where it looked (under the prefix, not the build
    tree). With it: it loads (then trains on a GPU machine, or says there is no GPU)."""
    example = os.path.join(installed, "share/doc/ddprun/examples/fashion-mnist.conf")
    o = [x for x in example_overrides(tmp_path) if not x.startswith("train.backend")]
    r = subprocess.run([os.path.join(installed, "bin/ddpworker"), example, "train.backend=cuda",
                        *o], capture_output=True, text=True, timeout=300,
                       env=installed_env(installed), cwd=str(tmp_path))
    if has_cuda_lib(build_dir):
        assert "cuda needs" not in r.stderr, r.stderr
        assert r.returncode == 0 or "no GPU is visible" in r.stderr, r.stdout + r.stderr
    else:
        assert r.returncode == 78, r.stdout + r.stderr
        assert f"{installed}/lib" in r.stderr, r.stderr
        assert "ddprun/libddpworker_cuda.so" in r.stderr, r.stderr


def man_page_text(path):
    return open(path).read().replace("\\-", "-")


def test_ddpworker_man_page_covers_commands_environment_and_exit_codes(ddpworker):
    page = man_page_text(os.path.join(ROOT, "docs", "ddpworker.1"))
    usage = subprocess.run([ddpworker, "--help"], capture_output=True, text=True).stdout
    commands = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|inspect)\b", usage))
    assert {"--keys", "inspect"} <= commands, usage
    missing = [c for c in commands if c not in page]
    assert not missing, f"docs/ddpworker.1 lacks the commands {missing}"
    codes = {int(v) for v in re.findall(r"DDP_EXIT_\w+\s*=\s*(\d+)",
                                        open(os.path.join(ROOT, "proto/exit_codes.h")).read())}
    documented = {int(v) for v in re.findall(r"^\.B (\d+)$", page, re.M)}
    assert codes - documented == set(), f"docs/ddpworker.1 lacks exit codes {codes - documented}"
    sources = [p for ext in ("c", "cu")
               for p in glob.glob(os.path.join(ROOT, "worker", "**", "*." + ext), recursive=True)]
    names = set()
    for path in sources + [os.path.join(ROOT, "common", "store_auth.h")]:
        text = open(path).read()
        names |= set(re.findall(r'(?:getenv|env_long)\("([A-Z_0-9]+)"', text))
        names |= set(re.findall(r'#define \w+_ENV\s+"([A-Z_0-9]+)"', text))
    assert {"RANK", "WORLD_SIZE", "DDPWORKER_CUDA_LIB"} <= names, names
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", page))
    assert not missing, f"docs/ddpworker.1 lacks the environment variables {missing}"


def test_man_pages_render(installed):
    if not shutil.which("man"):
        pytest.skip("man is not installed")
    for page in ("man1/ddprun.1", "man1/ddpworker.1", "man5/train.conf.5"):
        r = subprocess.run(["man", "--warnings", "-l", os.path.join(installed, "share/man", page)],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, MANWIDTH="100", LC_ALL="C.UTF-8"))
        assert r.returncode == 0 and "SYNOPSIS" in r.stdout, r.stderr
        if page.endswith("ddpworker.1"):  # this one is new: held to no warnings at all
            assert r.stderr == "", r.stderr


def complete(installed, words, cwd):
    """COMPREPLY of the installed completion for COMP_WORDS=words (the last one being completed)."""
    script = ('source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _ddprun; '
              'printf "%s\\n" "${COMPREPLY[@]}"')
    r = subprocess.run(["bash", "-c", script, "bash",
                        os.path.join(installed, "share/bash-completion/completions/ddprun"),
                        *words], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_bash_completion(installed, tmp_path):
    ddprun = os.path.join(installed, "bin/ddprun")
    (tmp_path / "a.conf").write_text("[train]\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.txt").write_text("")
    assert "--nproc-per-node" in complete(installed, [ddprun, "--npr"], tmp_path)
    assert complete(installed, [ddprun, "--rdzv-backend", ""], tmp_path) == {"c10d", "static"}
    programs = complete(installed, [ddprun, "--nproc-per-node", "2", ""], tmp_path)
    assert programs >= {"a.conf", "b.py"}
    assert "c.txt" not in complete(installed, [ddprun, "--nproc-per-node", "2", ""], tmp_path)
    keys = complete(installed, [ddprun, "a.conf", "optim.l"], tmp_path)
    assert "optim.lr=" in keys, keys
    assert complete(installed, [ddprun, "store", "--po"], tmp_path) == {"--port", "--port-file"}
    assert complete(installed, [ddprun, "st"], tmp_path) == {"store", "store-client", "status"}
    assert "--json" in complete(installed, [ddprun, "status", "--"], tmp_path)
    (tmp_path / "r.jsonl").write_text("")
    assert complete(installed, [ddprun, "plot", ""], tmp_path) == {"r.jsonl"}
    assert complete(installed, [ddprun, "plot", "r.jsonl", "--c"], tmp_path) == {"--csv"}
