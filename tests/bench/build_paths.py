"""Where the benchmarks find the binaries: $DDP_BUILD_DIR, else build/, else build-test/."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_path(*parts):
    for build in (os.environ.get("DDP_BUILD_DIR", "build"), "build", "build-test"):
        path = os.path.join(ROOT, build, *parts)
        if os.access(path, os.X_OK):
            return path
    sys.exit(f"{os.path.basename(sys.argv[0])}: {parts[-1]} is not built (deploy/setup.sh)")
