"""Shared pieces of the container and chart tests: real podman, real images, real helm.

These tests run in ``make test-deploy`` (and so in ``.ci/run``), not in ``make test``: the
first image build on a fresh machine takes many minutes. The tools come from the project's
scripts: ``scripts/install-podman.sh`` (podman, mmdebstrap, containers.conf) and
``scripts/install-k8s-tools.sh`` (helm, kubernetes-validate, the ServiceMonitor schema).
A missing tool fails the test with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("TOOLS", ROOT / ".tools"))
IMAGE = os.environ.get("EDGEGW_TEST_IMAGE", "localhost/edgegw:test")
REDIS_IMAGE = "localhost/edgegw-test-redis:7"
BASE_IMAGE = os.environ.get("EDGEGW_BASE_IMAGE", "docker.io/library/python:3.11-slim-bookworm")
READY_ATTEMPTS = 900  # x 1 s: a bound that stops the wait, not a speed requirement (a busy 2-core machine loads slowly)


def need(tool: str, installer: str) -> str:
    path = shutil.which(tool) or (str(TOOLS / "bin" / tool) if (TOOLS / "bin" / tool).exists() else None)
    if path is None:
        pytest.fail(f"{tool} is not installed: run {installer}", pytrace=False)
    return path


def run(*args: str, check: bool = True, timeout: float = 3600, **kwargs) -> subprocess.CompletedProcess:
    """A command's result with its output as text; on failure, the output is in the message."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
        )
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_ready(base_url: str, alive) -> None:
    """Poll GET /readyz once a second until it answers 200; fail at once when ``alive()`` says
    the container or pod is gone, or after READY_ATTEMPTS tries."""
    for _ in range(READY_ATTEMPTS):
        try:
            if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        problem = alive()
        if problem:
            pytest.fail(problem, pytrace=False)
        time.sleep(1)
    pytest.fail(f"{base_url}/readyz never answered 200", pytrace=False)


@pytest.fixture(scope="session")
def podman() -> str:
    return need("podman", "scripts/install-podman.sh")


@pytest.fixture(scope="session")
def image(podman) -> str:
    """edgegw's image, built by scripts/build-image.sh (the base made locally when no registry
    answers; podman's layer cache makes a rebuild after a source change take seconds)."""
    run(str(ROOT / "scripts" / "build-image.sh"), IMAGE, cwd=ROOT)
    return IMAGE


@pytest.fixture(scope="session")
def redis_image(podman, image) -> str:
    """A Redis image for the chart's trial Redis (no registry to pull the chart's default from)."""
    run(
        podman, "build", "--format", "docker", "--layers", "--tag", REDIS_IMAGE,
        "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
        "--file", str(ROOT / "tests" / "deploy" / "redis.Containerfile"), str(ROOT / "tests" / "deploy"),
    )
    return REDIS_IMAGE


@pytest.fixture(scope="session")
def helm() -> str:
    return need("helm", "scripts/install-k8s-tools.sh")
