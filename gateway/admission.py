"""Admission: what happens to a request before the pipeline sees it, once for HTTP and
WebSocket.

``AdmissionApp`` is pure ASGI middleware in front of the completion endpoints (Starlette's
``trustedhost.py`` style: configuration in ``__init__``, one decision per step in
``__call__``, an early refusal as a tiny response). Per HTTP request, in order:

1. request id: the client's ``x-request-id`` when it is a safe token, else a new one;
2. draining: a gateway shutting down refuses new work (503 + ``Retry-After``);
3. body: read under ``limits.max_body_bytes`` (413 as soon as it is passed, a declared
   ``Content-Length`` over it at once) and ``limits.body_timeout_s``, *before* taking a slot,
   so that a client that sends slowly holds nothing that complete requests need;
4. in-flight slot: at most ``limits.max_in_flight`` requests are served at once (503);
5. the disconnect watcher: from here on, a client that leaves cancels the request task
   wherever it waits, and the reply is closed in the endpoint's ``finally``;

then the endpoint runs with a ``RequestContext`` in ``scope["edgegw"]``, and afterwards the
request is counted, its slot released and its access-log line written.

The WebSocket endpoint admits each message on a socket with the same ``Gate`` (draining,
body limit, slot) and the same ``RequestContext``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import uuid

from gateway.errors import ClientGone, GatewayError, InvalidRequest, Overloaded, PayloadTooLarge, RequestTimeout, send_error
from gateway.forwarding import HeaderPolicy
from gateway.observability import Metrics, Timing
from gateway.settings import Settings

__all__ = ["AdmissionApp", "Gate", "RequestContext", "read_body", "request_id_of"]

logger = logging.getLogger("edgegw")
access_log = logging.getLogger("edgegw.access")

_SAFE_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == b"x-request-id" and _SAFE_ID.match(value):
            return value
    return uuid.uuid4().hex.encode()


def _tenant_of(headers: dict[str, str], anonymous: str) -> str:
    """The cache's tenant: a digest of the API key (never the key itself), or ``anonymous``."""
    auth = headers.get("authorization") or headers.get("x-api-key")
    if not auth:
        return anonymous
    return "k:" + hashlib.blake2b(auth.encode(), digest_size=12).hexdigest()


class RequestContext:
    """One request as admitted: who asked, what for, and how it is going."""

    __slots__ = (
        "request_id", "timing", "raw_headers", "headers", "peer", "tenant", "budget_ms", "forward",
        "body", "api", "model", "via", "status", "gone", "finished",
    )

    def __init__(self, scope: dict, request_id: bytes, api: str) -> None:
        self.request_id = request_id
        self.timing = Timing()
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in self.raw_headers}
        client = scope.get("client")
        self.peer: str | None = client[0] if client else None
        self.tenant = "anonymous"
        self.budget_ms: float | None = None  # the TTFT budget when the request sends none
        self.forward: list[tuple[bytes, bytes]] = []  # the headers that go upstream
        self.body = b""
        self.api = api  # "chat" | "completions": the metrics' label
        self.model = "-"
        self.via = "-"  # what answered (the reply's label), for the access log
        self.status = 0  # the status sent (0: none yet)
        self.gone = False  # the client left before the answer was complete
        self.finished = False  # the last byte is being sent: a disconnect now changes nothing

    def responded(self) -> None:
        """The answer is complete but for its last send."""
        self.finished = True


class Gate:
    """The gateway's own protection: draining and the in-flight count, shared by every
    admission (HTTP request or WebSocket message)."""

    __slots__ = ("settings", "metrics", "headers", "in_flight", "draining")

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.headers = HeaderPolicy(settings.forward_headers.allow, settings.forward_headers.deny)
        self.in_flight = 0
        self.draining = False

    def check_open(self) -> None:
        if self.draining:
            raise Overloaded("the gateway is shutting down", retry_after=self.settings.limits.retry_after_s)

    def enter(self) -> None:
        """Take an in-flight slot, or raise ``Overloaded`` (503 + Retry-After)."""
        limits = self.settings.limits
        self.check_open()
        if self.in_flight >= limits.max_in_flight:
            raise Overloaded("the gateway is at its concurrency limit", retry_after=limits.retry_after_s)
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    def admit(self, ctx: RequestContext, extra: list[tuple[bytes, bytes]] = ()) -> None:
        """Fill in who the request is for and what goes upstream with it."""
        ctx.tenant = _tenant_of(ctx.headers, "anonymous")
        ctx.forward = [(b"x-request-id", ctx.request_id), *extra, *self.headers.forward(ctx.raw_headers)]

    def done(self, ctx: RequestContext) -> None:
        """Count the request and write its access-log line."""
        self.metrics.count(ctx.api, ctx.status)
        if ctx.gone:
            self.metrics.client_disconnects.inc()
        if self.settings.listen.access_log:
            access_log.info(
                "%s %s %s model=%s via=%s %.1fms",
                ctx.request_id.decode(),
                ctx.api,
                ctx.status,
                ctx.model,
                ctx.via,
                ctx.timing.elapsed() * 1000,
            )


class AdmissionApp:
    """ASGI middleware admitting HTTP requests to ``app`` (see the module docstring)."""

    def __init__(self, app, gate: Gate, api: str) -> None:
        self.app = app
        self.gate = gate
        self.api = api

    async def __call__(self, scope, receive, send) -> None:
        gate = self.gate
        limits = gate.settings.limits
        ctx = RequestContext(scope, request_id_of(scope["headers"]), self.api)
        entered = False
        watcher = None
        try:
            gate.check_open()
            ctx.body = await read_body(scope, receive, limits.max_body_bytes, limits.body_timeout_s)
            gate.enter()
            entered = True
            gate.admit(ctx)
            ctx.timing.mark("admit")
            scope["edgegw"] = ctx
            watcher = _watch(receive, ctx, asyncio.current_task())
            await self.app(scope, receive, send)
        except GatewayError as exc:
            if not ctx.status:
                ctx.status = exc.status
                await send_error(send, exc, _refusal_headers(ctx, exc))
        except ClientGone:
            ctx.gone = True
            ctx.status = 499
        except asyncio.CancelledError:
            if not ctx.gone:
                raise
            asyncio.current_task().uncancel()  # the client left: this request ends here
            ctx.status = 499
        except Exception:  # a bug: answer like any other error, keep serving, log it
            logger.exception("request %s failed", ctx.request_id.decode())
            if not ctx.status:
                ctx.status = 500
                error = GatewayError("the gateway failed to handle this request")
                await send_error(send, error, _refusal_headers(ctx, error))
        finally:
            if watcher is not None:
                watcher.cancel()
            if entered:
                gate.leave()
            gate.done(ctx)


def _refusal_headers(ctx: RequestContext, exc: GatewayError) -> list[tuple[bytes, bytes]]:
    why = f"target=none; why={exc.code or exc.type}".encode("ascii", "replace")
    return [(b"x-request-id", ctx.request_id), (b"x-edgegw-route", why)]


def _watch(receive, ctx: RequestContext, task: asyncio.Task) -> asyncio.Task:
    """Cancel ``task`` when the client disconnects before its answer is complete."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not ctx.finished:
                    ctx.gone = True
                    task.cancel()
                return

    return asyncio.get_running_loop().create_task(watch())


async def read_body(scope: dict, receive, limit: int, timeout: float) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes, and with 408
    when it has not all arrived ``timeout`` seconds after the headers."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise InvalidRequest("invalid Content-Length header", code="invalid_content_length") from None
            if declared > limit:
                raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
            break
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
