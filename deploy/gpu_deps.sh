#!/usr/bin/env bash
# The libraries a GPU machine (Ubuntu 24.04 with CUDA, cuDNN, NCCL, cmake, gcc, zlib, libcurl
# runtime, python3 + torch) lacks to build and test ddprun (protobuf-c's compiler protoc-c runs
# there from the sysroot, with Debian's libprotoc), as Debian packages unpacked into .deps/
# (ignored by git). OpenBLAS is there already. Run it here, once (--with-data adds Debian's
# Fashion-MNIST, 30 MB of the 64 MB a device call may carry); carry .deps/root, and there:
#   source deploy/gpu_deps.sh --env     # PKG_CONFIG_*, CMAKE_PREFIX_PATH, LD_LIBRARY_PATH, PATH
#   cmake -S . -B build && cmake --build build -j
# Debian 12's binaries run on Ubuntu 24.04 (older glibc). Nothing is installed system-wide.
# Not oneDNN (libdnnl2 is 40 MB, more than a call may carry beside the rest): ddpworker built there
# has the cpu backend's plain path, which is the reference the cuda backend is tested against.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps"

if [ "${1:-}" = "--env" ]; then
    sysroot="$root/root"
    export PKG_CONFIG_SYSROOT_DIR="$sysroot"
    export PKG_CONFIG_PATH="$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig:$sysroot/usr/share/pkgconfig"
    export CMAKE_PREFIX_PATH="$sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$sysroot/usr/sbin:$sysroot/sbin:$sysroot/usr/bin:$PATH"
    # OpenBLAS: the machine's own library where it has no development files (Debian's is 100 MB
    # unpacked, more than a call may carry); the headers travel, the .pc says where the library is
    if ! pkg-config --exists openblas; then
        pc="$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig/openblas.pc"
        printf 'Name: openblas\nDescription: the machine'"'"'s OpenBLAS\nVersion: 0.3\nCflags: -I/usr/include/x86_64-linux-gnu/openblas-pthread\nLibs: -l:libopenblas.so.0\n' >"$pc"
    fi
    return 0 2>/dev/null || exit 0
fi
set -euo pipefail

packages=(libuv1 libuv1-dev libsodium23 libsodium-dev libxxhash0 libxxhash-dev
          libcjson1 libcjson-dev libturbojpeg0 libturbojpeg0-dev libjpeg62-turbo libpng16-16 libpng-dev
          libcriterion3 libcriterion-dev libnanomsg5 libgit2-1.5 libboxfort-dev
          libhttp-parser2.9 libmbedcrypto7 libmbedtls14 libmbedx509-1 libssh2-1
          iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12
          pkgconf pkgconf-bin libpkgconf3 libopenblas-pthread-dev
          libprotobuf-c1 libprotobuf-c-dev protobuf-c-compiler libprotoc32 libprotobuf32
          libisal2 libisal-dev)
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
# the -dev packages' .so links are absolute (/usr/lib/...): point them into the sysroot, relatively,
# since the checkout lies elsewhere on the device machine
find "$root/root" -xtype l -lname '/*' | while read -r link; do
    ln -sfnr "$root/root$(readlink "$link")" "$link"
done
# libcriterion.so brings its own libraries; the .pc's Requires.private would ask for their .pc files
sed -i '/^Requires.private/d' "$root/root/usr/lib/x86_64-linux-gnu/pkgconfig/criterion.pc"
# OpenBLAS's headers travel, its library does not (see --env)
rm -rf "$root/root/usr/lib/x86_64-linux-gnu/openblas-pthread" "$root/root/usr/lib/x86_64-linux-gnu/pkgconfig/openblas"*.pc
# static libraries, docs and manuals are dead weight on the device
find "$root/root" \( -name '*.a' -o -path '*/share/doc/*' -o -path '*/share/man/*' \) -delete 2>/dev/null || true
echo "gpu_deps.sh: $(ls "$root/debs" | wc -l) packages in $root/root ($(du -sh "$root" | cut -f1))"
