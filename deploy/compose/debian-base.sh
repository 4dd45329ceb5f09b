#!/usr/bin/env bash
# Make a base image for the Dockerfile from Debian's own archive, for an engine that cannot
# pull python:3.11-slim (no Docker Hub): Debian bookworm (minbase) with python3 3.11 and its
# venv module, imported as delaymq-base:bookworm. Run as root; needs debootstrap.
#
#   deploy/compose/debian-base.sh && BASE_IMAGE=delaymq-base:bookworm deploy/compose/smoke.sh
#
# MIRROR=... picks the archive (default http://deb.debian.org/debian); IMAGE=... the tag.
# EXTRA_CA_DIR=/usr/local/share/ca-certificates copies that folder's *.crt into the image's
# trust store, for a network that reaches PyPI through a TLS-inspecting proxy (the build's
# pip install fetches the wheel's dependencies).
set -euo pipefail

mirror="${MIRROR:-http://deb.debian.org/debian}"
image="${IMAGE:-delaymq-base:bookworm}"
rootfs="$(mktemp -d /tmp/delaymq-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror"
if [[ -n "${EXTRA_CA_DIR:-}" ]]; then
    cp "$EXTRA_CA_DIR"/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates
fi
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$image"
docker run --rm "$image" python3 -c 'import sys, venv; print("python", sys.version.split()[0], "with venv")'
echo "debian-base: made $image"
