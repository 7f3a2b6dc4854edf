#!/usr/bin/env bash
# A base for the Dockerfile made from Debian's packages, for hosts that
# cannot pull python:3.11-slim: debootstrap of Debian 12 with Python 3.11
# and its venv module, into the folder named (skipped when it is there).
# The host's CA bundle goes in too, so the build reaches PyPI through
# whatever TLS proxy the host itself trusts. The image test imports the
# folder (DEVPLUGIN_IMAGE_BASE_ROOTFS) and builds on it.
set -euo pipefail
target="${1:?usage: scripts/image-base.sh FOLDER}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if [ ! -x "$target/usr/bin/python3" ]; then
    rm -rf "$target"
    mkdir -p "$(dirname "$target")"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$target" "$mirror" >"$target.log" 2>&1 \
        || { tail -20 "$target.log" >&2; exit 1; }
fi
cp /etc/ssl/certs/ca-certificates.crt "$target/etc/ssl/certs/ca-certificates.crt"
echo "$target"
