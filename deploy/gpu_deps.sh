#!/usr/bin/env bash
# The libraries a GPU machine (Ubuntu 24.04 with CUDA, cuDNN, NCCL, cmake, gcc, zlib, libcurl
# runtime, python3 + torch) lacks to build and test ddprun, as Debian packages unpacked into .deps/
# (ignored by git). OpenBLAS is there already. Run it here, once (--with-data adds Debian's
# Fashion-MNIST, 30 MB of the 64 MB a device call may carry); carry .deps/root, and there:
#   source deploy/gpu_deps.sh --env     # PKG_CONFIG_*, CMAKE_PREFIX_PATH, LD_LIBRARY_PATH, PATH
#   cmake -S . -B build && cmake --build build -j
# Debian 12's binaries run on Ubuntu 24.04 (older glibc). Nothing is installed system-wide.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps"

if [ "${1:-}" = "--env" ]; then
    sysroot="$root/root"
    export PKG_CONFIG_SYSROOT_DIR="$sysroot"
    export PKG_CONFIG_PATH="$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig:$sysroot/usr/share/pkgconfig"
    export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$sysroot/usr/sbin:$sysroot/sbin:$sysroot/usr/bin:$PATH"
    return 0 2>/dev/null || exit 0
fi

packages=(libuv1 libuv1-dev libsodium23 libsodium-dev libinih1 libinih-dev libxxhash0 libxxhash-dev
          libcjson1 libcjson-dev
          libcriterion3 libcriterion-dev libnanomsg5 libgit2-1.5 libboxfort-dev
          libhttp-parser2.9 libmbedcrypto7 libmbedtls14 libmbedx509-1 libssh2-1
          iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12)
[ "${1:-}" = "--with-data" ] && packages+=(dataset-fashion-mnist)
mkdir -p "$root/debs" "$root/root"
cd "$root/debs"
missing=()
for p in "${packages[@]}"; do
    compgen -G "${p}_*.deb" >/dev/null || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] || apt-get download "${missing[@]}"
rm -rf "$root/root"
mkdir -p "$root/root"
for p in "${packages[@]}"; do dpkg -x "$(compgen -G "${p}_*.deb" | head -1)" "$root/root"; done
# the -dev packages' .so links are absolute (/usr/lib/...): point them into the sysroot
find "$root/root" -xtype l -lname '/*' | while read -r link; do
    ln -sfn "$root/root$(readlink "$link")" "$link"
done
# static libraries, docs and manuals are dead weight on the device
find "$root/root" \( -name '*.a' -o -path '*/share/doc/*' -o -path '*/share/man/*' \) -delete 2>/dev/null || true
echo "gpu_deps.sh: $(ls "$root/debs" | wc -l) packages in $root/root ($(du -sh "$root" | cut -f1))"
