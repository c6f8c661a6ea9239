#!/usr/bin/env bash
# Make sure podman has the Dockerfile's base image (python:3.11-slim-bookworm by default).
# In order: already in local storage; pulled from its registry; else made here from Debian
# packages (mmdebstrap | podman import): Debian bookworm's python3 is 3.11 (cp311 wheels), so
# the Dockerfile builds unchanged on it. The local stand-in is labelled
# org.edgegw.base=mmdebstrap so nobody mistakes it for the registry's image.
#   scripts/base-image.sh [IMAGE]      (needs root: mmdebstrap, podman)
set -euo pipefail
image=${1:-docker.io/library/python:3.11-slim-bookworm}
suite=bookworm

if podman image exists "$image"; then
    echo "base image $image: present"
    exit 0
fi
if [ "${EDGEGW_NO_PULL:-0}" != 1 ] && timeout "${EDGEGW_PULL_TIMEOUT:-60}" podman pull -q "$image" >/dev/null 2>&1; then
    echo "base image $image: pulled"
    exit 0
fi

echo "base image $image: no registry answered; making it from Debian $suite with mmdebstrap" >&2
command -v mmdebstrap >/dev/null || { echo "mmdebstrap missing: run scripts/install-podman.sh" >&2; exit 1; }
aptopts=()
# a mirror whose Release files are older than their Valid-Until (a frozen snapshot) needs the
# host's own leniency inside the image too, or apt-get in the Dockerfile's builder stage fails
if apt-config dump 2>/dev/null | grep -q '^Acquire::Check-Valid-Until "false"'; then
    aptopts+=(--aptopt='Acquire::Check-Valid-Until "false"')
fi
mirror=${EDGEGW_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${EDGEGW_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    "${aptopts[@]}" \
    "$suite" - \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" |
    podman import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        --change 'LABEL org.edgegw.base=mmdebstrap' \
        - "$image" >/dev/null
echo "base image $image: made locally ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
