"""The httpx API over the gateway's lean pools.

``httpx.AsyncClient(transport=PoolTransport(pool))`` gives the probes, model discovery and
anything else off the hot path the familiar client, on the same warm connections the relay
uses. The relay itself calls ``pool.request`` directly: httpx's request and response objects
cost more CPU than the pool underneath (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from gateway.core.errors import (
    GatewayError,
    PoolTimeout,
    UpstreamConnectError,
    UpstreamReadTimeout,
)
from gateway.upstream.base import Pool, UpstreamResponse

__all__ = ["PoolTransport", "get_read"]

_HOP_BY_HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade"}


async def get_read(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """``client.get(path)``, its body read, and the response let go of its stream: httpx
    binds the two in a reference cycle, with the pool's response under it, which only the
    garbage collector would free."""
    response = await client.get(path)
    response.stream = httpx.ByteStream(response.content)
    return response


class _BodyStream(httpx.AsyncByteStream):
    def __init__(self, response: UpstreamResponse, read_timeout: float) -> None:
        self._response = response
        self._timeout = read_timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                data = await self._response.body.read(self._timeout)
            except GatewayError as exc:
                raise httpx.RemoteProtocolError(exc.message) from exc
            if data is None:
                raise httpx.ReadTimeout(f"upstream sent nothing for {self._timeout:g} s")
            if not data:
                return
            yield data

    async def aclose(self) -> None:
        self._response.close()


class PoolTransport(httpx.AsyncBaseTransport):
    def __init__(self, pool: Pool, read_timeout: float) -> None:
        self._pool = pool
        self._read_timeout = read_timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        path = request.url.raw_path
        headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() not in _HOP_BY_HOP]
        try:
            response = await self._pool.request(request.method.encode(), path, headers, body)
        except PoolTimeout as exc:
            raise httpx.PoolTimeout(exc.message, request=request) from exc
        except UpstreamConnectError as exc:
            raise httpx.ConnectError(exc.message, request=request) from exc
        except UpstreamReadTimeout as exc:
            raise httpx.ReadTimeout(exc.message, request=request) from exc
        except GatewayError as exc:
            raise httpx.RemoteProtocolError(exc.message, request=request) from exc
        return httpx.Response(
            response.status,
            headers=response.headers,
            stream=_BodyStream(response, self._read_timeout),
            request=request,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()
