"""HTTP/3 and TLS test helpers: certificates made at test time, the fake inference server
over HTTP/3, a gateway with its HTTPS and HTTP/3 listeners, and small clients.

- ``FakeH3Upstream``: ``tests.fakes.FakeApp`` served over HTTP/3 (UDP, 127.0.0.1) by the
  gateway's own HTTP/3 listener (hypercorn's HTTP/3 neither blocks a writer on flow
  control nor reports a client's reset, so it cannot stand in for an inference server
  here); ``stop(graceful=False)`` drops the socket without a CONNECTION_CLOSE, as a
  crashed server would; a new one can take the same port (a restart).
- ``IngressGateway``: the gateway app under ``gateway.ingress.Server`` in a thread, with
  ``listen.tls`` and ``listen.http3`` on free ports.
- ``client_pool(kind, port, ca_file)``: the gateway's own pools as HTTP/2 or HTTP/3
  clients (a pool that is not read withholds flow-control credit: a slow client).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from typing import Any

import pytest
from uvicorn.server import ServerState

from gateway.node.app import create_app
from gateway.node.cli import uvicorn_config
from gateway.ingress import H3Listener, Server, serve_http3
from gateway.core.settings import ListenSettings, Settings
from gateway.upstream import H2Pool, H3Pool, Origin, Timeouts
from tests.fakes import FakeApp, free_port, started_by


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _LoopThread:
    """An asyncio loop in a daemon thread, for servers the tests start and stop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def call(self, coro, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class FakeH3Upstream:
    """``FakeApp`` over HTTP/3 on 127.0.0.1 (the same script fields as ``FakeUpstream``)."""

    protocol = "http3"

    def __init__(self, tls: tuple[str, str], models: list[str] | None = None, port: int | None = None, **defaults: Any) -> None:
        self.app = FakeApp(models or ["fake-model"], defaults)
        self.tls = tls
        self.port = port or free_udp_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.server_state = ServerState()
        self._loop_thread: _LoopThread | None = None
        self._listener: H3Listener | None = None

    @property
    def requests(self):
        return self.app.requests

    @property
    def defaults(self) -> dict[str, Any]:
        return self.app.defaults

    def start(self) -> FakeH3Upstream:
        self._loop_thread = _LoopThread(f"fake-h3-{self.port}")
        certfile, keyfile = self.tls
        self._listener = self._loop_thread.call(
            serve_http3(self.app, "127.0.0.1", self.port, certfile, keyfile, server_state=self.server_state)
        )
        return self

    def stop(self, graceful: bool = True) -> None:
        if self._loop_thread is None:
            return
        listener = self._listener

        async def close() -> None:
            listener.close(graceful=graceful)
            await asyncio.sleep(0.05)

        self._loop_thread.call(close())
        self._loop_thread.stop()
        self._loop_thread = None


class IngressGateway:
    """The gateway app under ``gateway.ingress.Server`` (uvicorn + HTTPS + HTTP/3) in a thread."""

    def __init__(self, settings: Settings, tls: tuple[str, str]) -> None:
        certfile, keyfile = tls
        self.port = free_port()
        self.tls_port = free_port()
        self.h3_port = free_udp_port()
        listen = ListenSettings.model_validate(
            {
                **settings.listen.model_dump(),
                "port": self.port,
                "tls": {"port": self.tls_port, "certfile": certfile, "keyfile": keyfile},
                "http3": {"port": self.h3_port, "certfile": certfile, "keyfile": keyfile},
            }
        )
        self.settings = settings = settings.model_copy(update={"listen": listen})
        self.url = f"http://127.0.0.1:{self.port}"
        self.https_url = f"https://127.0.0.1:{self.tls_port}"
        self.h3_url = f"https://127.0.0.1:{self.h3_port}"
        self.app = create_app(settings)
        # as `edgegw serve` runs it: the HTTP/1.1 protocol with the limits, max_connections
        config = uvicorn_config(settings, self.app, host="127.0.0.1", port=self.port, log_level="error", timeout_graceful_shutdown=5)
        self.server = Server(config, settings.listen, high_water=settings.limits.stream_buffer_bytes)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"ingress-{self.port}")

    @property
    def state(self):
        return self.app.gateway

    def start(self, timeout: float = 20) -> IngressGateway:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not (self.server.started and self.server.http3 is not None):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def client_pool(
    kind: str, port: int, ca_file: str, *, high_water: int = 256 * 1024, early_data: bool = False, **timeouts: float
):
    """A client for the gateway's HTTPS (``h2``) or HTTP/3 (``h3``) listener: the gateway's
    own pool (create it inside the test's event loop)."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    origin = Origin("127.0.0.1", port, context, f"127.0.0.1:{port}".encode(), b"https")
    limits = Timeouts(timeouts.get("connect", 5), timeouts.get("read", 30), timeouts.get("write", 30), timeouts.get("pool", 5))
    if kind == "h2":
        return H2Pool(origin, max_connections=1, warm_connections=0, timeouts=limits, high_water=high_water)
    return H3Pool(
        origin, max_connections=1, warm_connections=0, timeouts=limits, high_water=high_water, ca_file=ca_file,
        early_data=early_data,
    )


async def fetch(pool, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, list, bytes]:
    """One whole request through ``pool``: status, headers, body."""
    method = b"POST" if body else b"GET"
    response = await pool.request(method, path.encode(), [(b"content-type", b"application/json"), *headers], body)
    try:
        return response.status, response.headers, await response.body.read_all(10, 1 << 26)
    finally:
        response.close()


@pytest.fixture
def h3_upstreams(certificate):
    """Start ``FakeH3Upstream``s (stopped at the end of the test)."""
    yield from started_by(lambda **defaults: FakeH3Upstream(certificate, **defaults))


@pytest.fixture
def ingress_gateways(certificate):
    """Start ``IngressGateway``s from a config dict (cache off, as the relay tests)."""
    yield from started_by(lambda config: IngressGateway(Settings.model_validate({"cache": {"backend": "off"}, **config}), certificate))
