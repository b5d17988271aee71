"""ddprun installed by pip: the launcher and the trainer are programs (bin/ddprun, bin/ddpworker in
the environment's prefix); this package only finds them, so that `python3 -m ddprun ...` runs the
launcher as `python3 -m torch.distributed.run ...` runs torchrun."""
import os
import shutil
import sys
import sysconfig

__all__ = ["executable", "main"]


def executable(name="ddprun"):
    """The path of the installed program `name` (ddprun or ddpworker): the one this package was
    installed with (the environment's prefix, or the user scheme's for `pip install --user`), else
    the first on PATH. Raises FileNotFoundError when there is none."""
    prefixes = [sysconfig.get_path("data")]
    user = f"{os.name}_user"
    if user in sysconfig.get_scheme_names():
        prefixes.append(sysconfig.get_path("data", user))
    for prefix in prefixes:
        path = os.path.join(prefix, "bin", name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"ddprun: the {name} program is not installed next to this Python "
                            f"package ({sys.prefix}/bin) nor on PATH: reinstall with pip")


def main(argv=None):
    """Replace this process with the launcher, given argv (default: sys.argv[1:])."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        path = executable()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 127
    # exec, not a child: signals, the exit status and the terminal are the launcher's own
    os.execv(path, ["ddprun"] + args)
