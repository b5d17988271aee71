#!/usr/bin/env bash
# A debian:12-slim stand-in made from Debian's own packages, for machines that cannot pull from a
# registry: debootstrap (minbase) into a temporary directory, imported into podman (or docker) as
# localhost/debian:12-slim. Needs root, debootstrap, and a Debian mirror (MIRROR, by default
# the one apt uses here; a local file:// mirror works offline).
#   deploy/container/make-base-image.sh [podman|docker]
#   podman build -f deploy/container/Containerfile.cpu --build-arg BASE=localhost/debian:12-slim ...
set -euo pipefail
engine=${1:-podman}
tag=localhost/debian:12-slim
mirror=${MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources \
                   2>/dev/null | head -n1)}
mirror=${mirror:-http://deb.debian.org/debian}
die() { echo "make-base-image.sh: $*" >&2; exit 1; }
command -v debootstrap >/dev/null || die "needs debootstrap (apt-get install debootstrap)"
command -v "$engine" >/dev/null || die "$engine is not installed"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "make-base-image.sh: debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$engine" import --change 'CMD ["bash"]' - "$tag"
echo "make-base-image.sh: $tag is ready"
