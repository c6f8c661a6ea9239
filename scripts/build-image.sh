#!/usr/bin/env bash
# Build edgegw's image with podman, the way the tests and CI do:
#   scripts/build-image.sh [TAG] [more podman build arguments, e.g. --build-arg TORCH_VARIANT=cu128]
# - makes the base image locally when no registry answers (scripts/base-image.sh);
# - a directory holding the torch wheel (EDGEGW_WHEELS, default /opt/wheels) becomes the
#   `wheels` build context, so torch is not fetched from download.pytorch.org;
# - pip inside the build trusts EDGEGW_PIP_CA (default: the system bundle, which carries any
#   extra CA this machine's proxy needs), passed as a build secret: not stored in the image.
# Layers are cached (podman's --layers): a rebuild after a source change takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-localhost/edgegw:dev}
[ $# -gt 0 ] && shift
base=${EDGEGW_BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}
scripts/base-image.sh "$base"

args=(--format docker --layers --tag "$tag" --build-arg "BASE_IMAGE=$base")
wheels=${EDGEGW_WHEELS:-/opt/wheels}
if ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
    args+=(--build-context "wheels=$wheels")
fi
ca=${EDGEGW_PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
if [ -s "$ca" ]; then
    args+=(--secret "id=pip-ca,src=$ca")
fi
podman build "${args[@]}" "$@" .
