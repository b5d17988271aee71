#!/usr/bin/env bash
# Install what ddprun needs from Debian (only what is missing), then configure and build.
#   deploy/setup.sh [--tests] [--build-dir DIR] [-- extra cmake args]
# --tests also installs the test tools (Criterion, pytest, Debian's torch for the interop tests,
# clang + libFuzzer, clang-format (tests/tools/check_format.sh), etcd for the etcd backend, Slurm and munge for a real one-node Slurm, venv for
# the tests that pip-install ddprun and TensorBoard from PyPI into virtual environments). Safe to run again: installed packages are left alone, the build is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
build_dir=build
cmake_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) with_tests=1 ;;
        --build-dir) build_dir="$2"; shift ;;
        --) shift; cmake_args=("$@"); break ;;
        *) echo "setup.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift
done

packages=(build-essential cmake pkg-config libuv1-dev libsodium-dev libxxhash-dev
          zlib1g-dev libopenblas-dev libturbojpeg0-dev libcjson-dev libpng-dev libcurl4-openssl-dev
          libprotobuf-c-dev protobuf-c-compiler libisal-dev libdnnl-dev dataset-fashion-mnist)
if [ "$with_tests" = 1 ]; then
    packages+=(libcriterion-dev python3 python3-pytest python3-torch python3-torchvision python3-matplotlib python3-yaml python3-venv clang clang-format libclang-rt-14-dev iproute2
              etcd-server etcd-client openssl slurmctld slurmd slurm-client munge)
fi

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup.sh: installing ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo_cmd[@]}" apt-get update -qq
    "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cmake_args[@]}"
cmake --build "$build_dir" -j "$(nproc)"
