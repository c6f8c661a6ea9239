"""Shared fixtures: fake upstreams and gateways on 127.0.0.1, ephemeral ports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import httpx._transports.default as httpx_transports
import orjson
import pytest
import redis
import uvicorn
import yaml

from gateway.node.app import create_app
from gateway.node.cli import uvicorn_config
from gateway.core.settings import Settings
from loadgen.fake_upstream import honour_h2_flow_control
from tests.fakes import FakeUpstream, StoppableServer, free_port, make_certificate, started_by

ROOT = Path(__file__).resolve().parent.parent


def _one_default_ssl_context():
    """Every httpx client (and every ``httpx.get``/``httpx.post``, the openai SDK's too) builds
    an SSL context with certifi's bundle when it is made, even for ``http://``: tens to
    hundreds of milliseconds on this machine each time, a large share of the suite's time.
    The tests' clients share one default context instead (httpx only reads it; a client that
    passes its own ``verify`` or ``cert`` still gets its own)."""
    create = httpx_transports.create_ssl_context
    shared = create()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared
        return create(verify=verify, cert=cert, trust_env=trust_env)

    httpx_transports.create_ssl_context = create_ssl_context


_one_default_ssl_context()


# Test files whose session fixtures are shared with other files: each group runs on one
# pytest-xdist worker, which starts those fixtures once (not once per worker).
SHARED_SESSION_FIXTURES = {
    # llama.cpp's servers, the engine server and an edgegw tier (tests/realworld/conftest.py)
    "tests/realworld/": "tests/realworld/",
    # the real SmolLM2 engine, loaded once (smollm_engine, tests/edge_engine/conftest.py)
    "tests/edge_engine/test_real_model": "tests/edge_engine/test_real_model*.py",
}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: this conftest also loads without it
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs the suite on two pytest-xdist workers with ``--dist loadfile``: the
    tests of one file run on one worker, which sets up a module-scoped fixture (a model
    loaded, a gateway with the edge engine) once. Here loadfile also keeps the files of each
    entry of ``SHARED_SESSION_FIXTURES`` on one worker. Any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixturesFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((unit for prefix, unit in SHARED_SESSION_FIXTURES.items() if path.startswith(prefix)), path)

    return SharedFixturesFileScheduling(config, log)


class GatewayThread:
    """The gateway app under uvicorn, on its own event loop in a thread."""

    def __init__(self, settings: Settings) -> None:
        port = free_port()
        settings = settings.model_copy(update={"listen": settings.listen.model_copy(update={"port": port})})
        self.settings = settings
        self.url = f"http://127.0.0.1:{port}"
        self.app = create_app(settings)
        config = uvicorn_config(settings, self.app, log_level="error")  # as `edgegw serve` runs it
        self.server = StoppableServer(config)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"gateway-{port}")

    def _run(self) -> None:
        self.server.run()

    @property
    def state(self):
        return self.app.gateway

    def start(self, timeout: float = 20) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(15)


class GatewayProcess:
    """``python -m gateway serve --config FILE`` as a child process (for signals and memory)."""

    def __init__(self, config: dict | None, tmp_path: Path, args: list[str] = ()) -> None:
        """Serve ``config`` (written to a file), or, with ``config=None``, the command line
        ``args`` (e.g. ``--upstream URL``), on a free port."""
        port = free_port()
        argv = [sys.executable, "-m", "gateway", "serve", *args]
        if config is not None:
            config = {**config, "listen": {**config.get("listen", {}), "host": "127.0.0.1", "port": port}}
            path = tmp_path / f"gateway-{port}.yaml"
            path.write_text(yaml.safe_dump(config))
            argv += ["--config", str(path)]
        else:
            argv += ["--host", "127.0.0.1", "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp_path / f"gateway-{port}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )

    def start(self, timeout: float = 30) -> GatewayProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("gateway process did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """A tiny random Llama (tests/edge_engine/tiny.py), built once a session: its GGUF file
    and its Hugging Face directory."""
    from tests.edge_engine.tiny import build_tiny_model  # torch and transformers: only when asked for

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_paths) -> str:
    """The tiny Llama's GGUF file, for gateway tests that need an edge engine but not the
    real model."""
    return str(tiny_paths[0])


@pytest.fixture(scope="session")
def built_kernels() -> str:
    """The edge engine's compiled kernels (what ``edgegw build-kernels`` does; nothing to do
    when the build is up to date), for the tests of the int4 modes.  Where the compiler is
    missing this fails with ``KernelBuildError``'s message, which says what to install: those
    tests are not skipped."""
    from edge_engine import kernels  # torch: only when asked for

    return kernels.build()


@pytest.fixture(scope="session")
def hypercorn_flow_control():
    """HTTP/2 fakes under hypercorn honour the client's flow-control window (loadgen/fake_upstream.py
    says why hypercorn does not by itself)."""
    honour_h2_flow_control(True)
    yield
    honour_h2_flow_control(False)


@pytest.fixture
def upstreams(hypercorn_flow_control):
    yield from started_by(lambda protocol="http1", **defaults: FakeUpstream(protocol, **defaults))


def cluster(*fakes: FakeUpstream, name: str = "central", models=("fake-model",), **endpoint) -> dict:
    return {
        "name": name,
        "models": list(models),
        "endpoints": [{"url": f.url, "protocol": f.protocol, **endpoint} for f in fakes],
    }


@pytest.fixture
def gateways():
    # cache off unless asked: relay tests see every request upstream
    yield from started_by(lambda config: GatewayThread(Settings.model_validate({"cache": {"backend": "off"}, **config})))


@pytest.fixture
def gateway_processes(tmp_path):
    yield from started_by(lambda config: GatewayProcess({"cache": {"backend": "off"}, **config}, tmp_path))





@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own (a test may kill it): (port, process)."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("private redis-server did not start") from None
            time.sleep(0.02)
    client.close()
    yield port, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate (its own CA) for 127.0.0.1: (certfile, keyfile)."""
    return make_certificate(tmp_path_factory.mktemp("tls"))


def ws_answer(ws) -> list[dict]:
    """The messages of one WebSocket answer, up to its ``done`` or ``error``."""
    messages = []
    while True:
        message = orjson.loads(ws.recv(timeout=10))
        messages.append(message)
        if message.get("type") in ("done", "error"):
            return messages
