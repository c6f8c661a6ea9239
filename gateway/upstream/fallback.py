"""``FallbackPool``: an HTTP/3 endpoint's pool when QUIC may be blocked (``fallback:
http2``): HTTP/3 first, HTTP/2 over TLS on the same origin when QUIC cannot be established."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.core.errors import GatewayError, UpstreamConnectError
from gateway.upstream.base import Pool, UpstreamResponse
from gateway.upstream.http3 import H3Pool

__all__ = ["FallbackPool"]

logger = logging.getLogger("edgegw.upstream")


class FallbackPool:
    """HTTP/3 first, HTTP/2 (TLS, ALPN) when QUIC cannot be established.

    The first connection failure of the QUIC pool (a handshake that does not finish within
    the HTTP/3 pool's connect timeout, or an ICMP error) switches requests to the fallback
    pool at once; QUIC is tried again in the background every ``retry_s`` seconds, and
    requests go back to it once a connection is up."""

    protocol = "http3"

    def __init__(self, primary: H3Pool, fallback: Pool, *, retry_s: float = 30.0) -> None:
        self._loop = asyncio.get_running_loop()
        self.primary = primary
        self.fallback = fallback
        self._retry_s = retry_s
        self._probe: asyncio.Task | None = None
        self._closed = False

    @property
    def using_fallback(self) -> bool:
        return self._probe is not None

    async def request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        if self._probe is None:
            started = time.perf_counter()
            try:
                return await self.primary.request(method, path, headers, body, head_within)
            except UpstreamConnectError as exc:
                if self._closed:
                    raise
                self._fall_back(exc.message)
            tried = time.perf_counter() - started
            if head_within is not None:
                head_within = max(0.001, head_within - tried)
            response = await self.fallback.request(method, path, headers, body, head_within)
            response.pool_wait += tried  # the QUIC attempt was time spent getting a connection
            return response
        return await self.fallback.request(method, path, headers, body, head_within)

    async def warm(self) -> None:
        await self.primary.warm()
        if self.primary.num_connections == 0 and not self._closed:
            self._fall_back("no QUIC connection at start-up")
            await self.fallback.warm()

    async def aclose(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
        await asyncio.gather(self.primary.aclose(), self.fallback.aclose())

    @property
    def num_connections(self) -> int:
        return self.primary.num_connections + self.fallback.num_connections

    def __repr__(self) -> str:
        mode = "fallback" if self._probe is not None else "quic"
        return f"<FallbackPool {mode} {self.primary!r} {self.fallback!r}>"

    def _fall_back(self, why: str) -> None:
        if self._probe is None:
            logger.warning("%s: HTTP/3 unavailable (%s); using HTTP/2 and retrying QUIC every %g s",
                           self.primary._origin, why, self._retry_s)
            self._probe = self._loop.create_task(self._retry_quic())

    async def _retry_quic(self) -> None:
        while True:
            await asyncio.sleep(self._retry_s)
            try:
                if not self.primary.num_connections:
                    await self.primary._open()
            except GatewayError:
                continue
            logger.info("%s: HTTP/3 is back", self.primary._origin)
            self._probe = None
            return
