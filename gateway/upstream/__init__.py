"""Connection pools to inference servers, one ``Upstream`` per configured endpoint.

An endpoint's URL is a base URL the way OpenAI clients take one (the openai SDK's
``base_url``, vLLM's docs, LiteLLM's ``api_base``): ``http://host:8000/v1`` or
``https://host/openai/v1``; the API paths are appended to it (``<base>/chat/completions``,
``<base>/completions``, ``<base>/models``). A bare origin (``http://host:8000``) means
``http://host:8000/v1``. Health probes go to ``routing.health.probe_path`` on the origin
(vLLM's and SGLang's ``/health`` live there, outside ``/v1``).

``protocol`` picks the pool: ``http1`` (``H1Pool``), ``http2`` (``H2Pool``), ``http3``
(``H3Pool``; with ``fallback: http2``, a ``FallbackPool`` of an ``H3Pool`` and an
``H2Pool`` on the same origin).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httpx

from gateway.core.settings import EndpointSettings, endpoint_authorization
from gateway.upstream.base import Origin, Pool, Timeouts, UpstreamResponse
from gateway.upstream.body import Body
from gateway.upstream.http1 import H1Pool
from gateway.upstream.http2 import H2Pool
from gateway.upstream.fallback import FallbackPool
from gateway.upstream.http3 import H3Pool
from gateway.upstream.transport import PoolTransport, get_read

__all__ = [
    "Upstream", "UpstreamResponse", "Body", "Origin", "Pool", "PoolTransport", "H1Pool", "H2Pool", "H3Pool",
    "FallbackPool", "Timeouts",
]

_JSON = (b"content-type", b"application/json")
_API_PATHS = {"chat": b"/chat/completions", "completions": b"/completions"}


class Upstream:
    """One endpoint: its origin, its pool for requests, and an httpx client over a small
    pool of its own for probes and model discovery (its health and latency live in
    ``routing.HealthState``, keyed by ``url``).

    Must be created inside the running event loop (the pools bind to it).
    """

    def __init__(self, settings: EndpointSettings, cluster: str, *, high_water: int) -> None:
        parts = urlsplit(settings.url)
        secure = parts.scheme == "https"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if secure else 80)
        default_port = port == (443 if secure else 80)
        authority = (host if ":" not in host else f"[{host}]") + ("" if default_port else f":{port}")
        self.url = settings.url
        self.cluster = cluster
        self.protocol = settings.protocol
        self.settings = settings
        self.base = (parts.path.rstrip("/") or "/v1").encode()
        self.models_url = self.base.decode() + "/models"
        self.timeouts = Timeouts(
            settings.connect_timeout_s, settings.read_timeout_s, settings.write_timeout_s, settings.pool_timeout_s
        )
        origin = Origin(
            host, port, _ssl_context(settings) if secure else None, authority.encode(), parts.scheme.encode()
        )
        self.pool: Pool = _pool(settings, origin, self.timeouts, high_water)
        # probes and model discovery have connections of their own: a pool full of streams
        # whose clients read nothing must not make a healthy endpoint look dead
        self.control: Pool = _pool(settings, origin, self.timeouts, high_water, control=True)
        self.headers: list[tuple[bytes, bytes]] = [_JSON]
        authorization = endpoint_authorization(settings)
        if authorization:
            self.headers.append((b"authorization", authorization.encode()))
        self.client = httpx.AsyncClient(
            base_url=f"{parts.scheme}://{parts.netloc}",
            transport=PoolTransport(self.control, settings.read_timeout_s),
            timeout=httpx.Timeout(
                settings.read_timeout_s,
                connect=settings.connect_timeout_s,
                write=settings.write_timeout_s,
                pool=settings.pool_timeout_s,
            ),
            headers={"authorization": authorization} if authorization else None,
        )
        self._aside: asyncio.Event | None = None  # set while a probe or discovery is out (``aside``)

    async def aside(self, path: str, timeout: float) -> httpx.Response:
        """The gateway's own GET (a probe, model discovery) on the control pool, within
        ``timeout``. Call it only when no request is in flight here: until it is answered,
        requests to this endpoint wait for it (``request``), so the two never overlap at the
        server (llama.cpp's server ends its running generation for any new request)."""
        done = asyncio.Event()
        self._aside = done
        try:
            return await asyncio.wait_for(get_read(self.client, path), timeout)
        finally:
            if self._aside is done:
                self._aside = None
            done.set()

    async def request(
        self, kind: str, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        """POST ``body`` to the API of ``kind`` ("chat" or "completions") with ``headers``; the
        response headers must come within ``head_within`` seconds (default: the read timeout).
        A probe or discovery out at this endpoint (``aside``) is let finish first."""
        aside = self._aside
        if aside is not None:
            await aside.wait()  # bounded: ``aside`` ends within its own timeout
        return await self.pool.request(b"POST", self.base + _API_PATHS[kind], self.headers + headers, body, head_within)

    async def forward(
        self, path: bytes, content_type: bytes | None, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        """POST a pass-through API's ``body`` to ``<base><path>`` (``/embeddings``,
        ``/audio/transcriptions``...): JSON, or a form with its own ``content_type``."""
        own = self.headers if content_type is None else [(b"content-type", content_type), *self.headers[1:]]
        return await self.pool.request(b"POST", self.base + path, own + headers, body, head_within)

    async def aclose(self) -> None:
        await self.client.aclose()  # closes the control pool through the transport
        await self.pool.aclose()

    def __repr__(self) -> str:
        return f"<Upstream {self.url} {self.protocol} cluster={self.cluster}>"


def _pool(settings: EndpointSettings, origin: Origin, timeouts: Timeouts, high_water: int, control: bool = False) -> Pool:
    """The endpoint's pool for requests, or (``control``) its small one for probes and
    model discovery: two connections, none kept warm."""
    common = {"max_connections": settings.pool_size, "warm_connections": settings.warm_connections, "high_water": high_water}
    if control:
        common = {**common, "max_connections": 2, "warm_connections": 0}
    if settings.protocol == "http1":
        return H1Pool(origin, timeouts=timeouts, **common)
    if settings.protocol == "http2":
        return H2Pool(origin, timeouts=timeouts, **common)
    quic = {"ca_file": settings.ca_file, "early_data": settings.early_data}
    if settings.fallback is None:
        return H3Pool(origin, timeouts=timeouts, **quic, **common)
    # the QUIC handshake gets fallback_after_s; the HTTP/2 pool the endpoint's own timeouts
    quick = Timeouts(settings.fallback_after_s, timeouts.read, timeouts.write, timeouts.pool)
    return FallbackPool(H3Pool(origin, timeouts=quick, **quic, **common), H2Pool(origin, timeouts=timeouts, **common))


def _ssl_context(settings: EndpointSettings) -> ssl.SSLContext:
    """TCP's TLS context (for http3 it carries only the verify mode, and serves the HTTP/2 fallback)."""
    context = ssl.create_default_context(cafile=settings.ca_file)
    if not settings.verify_tls:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"] if settings.protocol == "http1" else ["h2"])
    return context
