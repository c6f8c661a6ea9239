"""The scripted fake upstream (``loadgen/fake_upstream.py``) on a thread: HTTP/1.1 under uvicorn, or
HTTP/2 cleartext with prior knowledge under hypercorn, each on its own event loop, on
127.0.0.1 and an ephemeral port. HTTP/2 needs the ``hypercorn_flow_control`` fixture
(tests/conftest.py), which the ``upstreams`` fixture uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn
from hypercorn.asyncio import serve
from hypercorn.config import Config

from loadgen.certificates import make_certificate
from loadgen.fake_upstream import FakeApp, Seen

__all__ = ["FakeApp", "FakeUpstream", "Seen", "StoppableServer", "free_port", "make_certificate"]


class StoppableServer(uvicorn.Server):
    """uvicorn's server run on a thread, which ``stop()`` (from any thread) wakes at once:
    uvicorn itself looks at ``should_exit`` every 0.1 s, and pauses 0.1 s more for open
    connections to hear of the shutdown, which every test paid for each server it started.
    With connections open the shutdown is uvicorn's own."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # each turn is a second at most: the Date header's refresh
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):  # no task of its own (the leak checks count tasks)
                    await self._wake.wait()

    async def shutdown(self, sockets=None) -> None:
        if self.server_state.connections or self.server_state.tasks:
            await super().shutdown(sockets)
            # a connection uvicorn's graceful shutdown left open when its time ran out (on a busy
            # machine: one whose request was still arriving) is closed here, while the loop
            # runs: else its bytes land after the loop is closed (RuntimeError in the
            # parser's callback) and uvloop cannot close the loop over its open handle (EBUSY)
            left = [c.transport for c in self.server_state.connections if c.transport is not None]
            for transport in left:
                transport.abort()
            if left:
                await asyncio.sleep(0)  # the transports' connection_lost callbacks run
            return
        # nobody connected: uvicorn's steps without its 0.1 s pause for connections to hear of it
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()

    def stop(self) -> None:
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                loop.call_soon_threadsafe(wake.set)


def started_by(make):
    """The body of a fixture that starts things: yields ``start(...)``, which builds one with
    ``make(...)``, starts it and returns it; stops every one started at the end."""
    started = []

    def start(*args, **kwargs):
        thing = make(*args, **kwargs).start()
        started.append(thing)
        return thing

    yield start
    for thing in started:
        thing.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeUpstream:
    """A fake server running in a thread; ``stop()`` ends it."""

    def __init__(
        self,
        protocol: str = "http1",
        models: list[str] | None = None,
        tls: tuple[str, str] | None = None,
        max_requests: int | None = None,
        **defaults: Any,
    ) -> None:
        self.protocol = protocol
        self.app = FakeApp(models or ["fake-model"], defaults)
        self.port = free_port()
        self.tls = tls  # (certfile, keyfile): serve https (ALPN h2 / http/1.1)
        self.max_requests = max_requests  # HTTP/2: GOAWAY after this many requests on a connection
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._server: uvicorn.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"fake-{protocol}-{self.port}")

    @property
    def requests(self) -> list[Seen]:
        return self.app.requests

    @property
    def gets(self) -> list[str]:
        return self.app.gets

    @property
    def defaults(self) -> dict[str, Any]:
        return self.app.defaults

    def start(self) -> FakeUpstream:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not (self._ready.is_set() or (self._server is not None and self._server.started)):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        if self.protocol == "http1":
            tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls else {}
            config = uvicorn.Config(
                self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off",
                timeout_graceful_shutdown=1,  # a hung scripted request must not outlive the test by long
                **tls,
            )
            self._server = StoppableServer(config)
            self._server.run()
        else:
            asyncio.run(self._serve_hypercorn())

    async def _serve_hypercorn(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.loglevel = "ERROR"
        config.accesslog = None
        config.errorlog = None
        # hypercorn leaves a stream whose app raised open until the connection idles out:
        # keep that short so a scripted mid-stream failure reaches the gateway quickly
        config.keep_alive_timeout = 1
        if self.tls:
            config.certfile, config.keyfile = self.tls
        if self.max_requests:
            config.keep_alive_max_requests = self.max_requests
        task = asyncio.create_task(serve(self.app, config, shutdown_trigger=self._stop.wait, mode="asgi"))
        for _ in range(500):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    break
            except OSError:
                await asyncio.sleep(0.01)
        self._ready.set()
        await task

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # graceful: every connection closed before the loop is
        elif self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
