"""Admission: what happens to a request before the pipeline sees it, once for HTTP and
WebSocket.

``AdmissionApp`` is pure ASGI middleware in front of the completion handlers, serving both
scope types as Starlette's own middleware does (``trustedhost.py``: configuration in
``__init__``, one decision per step in ``__call__``, an early refusal as a tiny response).

Per HTTP request, in order:

1. request id: the client's ``x-request-id`` when it is a safe token, else a new one;
2. draining: a gateway shutting down refuses new work (503 + ``Retry-After``);
3. tenant: the API key names one (``tenants.py``; 401 by ``auth.mode``), before the body
   is read;
4. body: read under ``limits.max_body_bytes`` (413 as soon as it is passed, a declared
   ``Content-Length`` over it at once) and ``limits.body_timeout_s``, *before* taking a slot,
   so that a client that sends slowly holds nothing that complete requests need;
5. ``Gate.admit``: an in-flight slot (at most ``limits.max_in_flight``, 503), the body
   parsed (400), the model allowed for the tenant (403), the request's ``Deadline``, the
   tenant's concurrency and rate limits (429 with ``Retry-After`` and the OpenAI
   ``x-ratelimit-*`` headers), the headers that go upstream;
6. the disconnect watcher: from here on, a client that leaves cancels the request task
   wherever it waits, and the reply is closed in the handler's ``finally``;

then the handler runs with a ``RequestContext`` in ``scope["edgegw"]``, and afterwards
``Gate.done`` settles the tenant's token estimate with the real usage, counts the request,
gives back what it held and hands it to the observer.

A WebSocket is admitted as a whole at its handshake (steps 1-3: draining closes it with
1013, no known key with 1008; the accept carries the socket's ``x-request-id``); each
message on it is then admitted like a request body (``Gate.admit_message``: step 4's size
limit, then step 5), and the handler keeps only its per-message loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

from gateway.admission.forwarding import HeaderPolicy
from gateway.admission.quota import check_quota
from gateway.admission.ratelimit import RateLimiter
from gateway.admission.tenants import Tenants
from gateway.core.context import ON_GONE, Held, RequestContext
from gateway.core.deadline import Deadline
from gateway.core.errors import (
    ClientGone,
    GatewayError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    UnsupportedMediaType,
    send_error,
)
from gateway.core.openai import LARGE, PASSTHROUGH, ParsedRequest, api_of_path, parse_request
from gateway.core.settings import Settings
from gateway.core.tenant import Tenant
from gateway.core.timeouts import Watch, watchdog
from gateway.observe import Metrics, Observer
from gateway.observe.usage import Usage

__all__ = ["SOCKET", "AdmissionApp", "Gate", "Generation", "Socket", "read_body", "request_id_of"]

logger = logging.getLogger("edgegw")

_SAFE_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")

# The scope key of an admitted WebSocket: its ``Socket`` (who it is for, its request id).
SOCKET = "edgegw.socket"


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == b"x-request-id" and _SAFE_ID.match(value):
            return value
    return os.urandom(16).hex().encode()  # a uuid4's randomness without building a UUID


class Socket:
    """An admitted WebSocket: the tenant its key named and the handshake's request id; the
    n-th message's request is ``<id>.<n>`` (the first is ``<id>``)."""

    __slots__ = ("tenant", "request_id")

    def __init__(self, tenant: Tenant, request_id: bytes) -> None:
        self.tenant = tenant
        self.request_id = request_id

    def message_id(self, number: int) -> bytes:
        return self.request_id if number == 1 else self.request_id + b"." + str(number).encode()


class Generation:
    """The requests admitted under one configuration: when a reload retires it, what only
    its requests may still use (a removed endpoint's pool, the old cache) is closed once
    ``drained`` (every one of them has finished)."""

    __slots__ = ("count", "_drained")

    def __init__(self) -> None:
        self.count = 0
        self._drained: asyncio.Event | None = None

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0 and self._drained is not None:
            self._drained.set()

    async def drained(self) -> None:
        if self.count:
            self._drained = self._drained or asyncio.Event()
            await self._drained.wait()


class Gate:
    """The gateway's own protection and the tenants' limits, shared by every admission (an
    HTTP request or a WebSocket message)."""

    __slots__ = (
        "settings", "metrics", "observer", "tracing", "headers", "tenants", "limiter", "in_flight", "draining", "shedding_until",
        "on_drain", "usage", "generation",
    )

    def __init__(self, settings: Settings, metrics: Metrics, observer: Observer, tracing=None, usage: Usage | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.observer = observer
        self.tracing = tracing  # gateway.observe.tracing.Tracing when traces are on
        self.headers = HeaderPolicy(settings.forward_headers.allow, settings.forward_headers.deny)
        self.tenants = Tenants(settings.auth, settings.tenants)
        self.limiter = RateLimiter(settings.rate_limits, metrics)
        self.in_flight = 0
        self.draining = False
        self.shedding_until = 0.0  # time.monotonic(): /readyz says not ready until then
        self.on_drain: set = set()  # callables told when draining starts (open WebSockets)
        self.usage = usage  # the tenants' usage (monthly quotas are checked against it)
        self.generation = Generation()  # the requests admitted since the last reload

    def reload(self, settings: Settings) -> RateLimiter | None:
        """Take a new configuration (``gateway.node.reload``): tenants and keys, limits,
        forwarded headers and, when ``rate_limits`` changed, a new limiter. Returns the old
        limiter for the caller to close once nothing uses it (None: kept). Raises
        ``ValueError`` (an unreadable keys_file) before anything has changed."""
        headers = HeaderPolicy(settings.forward_headers.allow, settings.forward_headers.deny)
        self.tenants.reload(settings.auth, settings.tenants)
        old = None
        if settings.rate_limits != self.settings.rate_limits:
            old, self.limiter = self.limiter, RateLimiter(settings.rate_limits, self.metrics)
        self.headers = headers
        self.settings = settings
        return old

    def next_generation(self) -> Generation:
        """Start counting the requests admitted from now on apart; the previous generation is
        returned, for the caller to wait until it has ``drained``."""
        old, self.generation = self.generation, Generation()
        return old

    def drain(self) -> None:
        """The gateway is shutting down: refuse new work, and tell whoever holds a long-lived
        connection (a WebSocket) to end it once what it is answering is done."""
        if not self.draining:
            self.draining = True
            for tell in list(self.on_drain):
                tell()

    @property
    def shedding(self) -> bool:
        return time.monotonic() < self.shedding_until

    def shed_for_capacity(self) -> None:
        """A request was turned away for lack of capacity: a load balancer should steer away
        for a moment (``/readyz`` answers 503)."""
        self.shedding_until = time.monotonic() + 1.0

    def check_open(self) -> None:
        if self.draining:
            raise Overloaded("the gateway is shutting down", retry_after=self.settings.limits.retry_after_s)

    def begin(self, scope: dict, request_id: bytes, api: str) -> RequestContext:
        ctx = RequestContext(scope, request_id, api)
        ctx.send_timeout = self.settings.limits.send_timeout_s
        ctx.count_usage = self.usage is not None and self.settings.usage.enabled
        if self.tracing is not None:
            self.tracing.begin(ctx)
        return ctx

    async def admit(self, ctx: RequestContext, kind: str | None, extra: list[tuple[bytes, bytes]] = ()) -> ParsedRequest:
        """Everything between the body and the pipeline (step 5 of the module docstring);
        ``done`` gives back what it took, whatever happened."""
        limits = self.settings.limits
        self.check_open()
        if self.in_flight >= limits.max_in_flight:
            raise Overloaded("the gateway is at its concurrency limit", retry_after=limits.retry_after_s)
        self.in_flight += 1
        ctx.held = Held.GATEWAY
        where = {"path": ctx.path, "content_type": ctx.headers.get("content-type")} if kind == PASSTHROUGH else {}
        ctx.generation = self.generation
        ctx.generation.count += 1
        if len(ctx.body) > LARGE:  # parsing and checking grow with the body: not on the event loop
            parsed = ctx.parsed = await asyncio.to_thread(parse_request, kind, ctx.body, **where)
        else:
            parsed = ctx.parsed = parse_request(kind, ctx.body, **where)
        ctx.model = parsed.model
        tenant = ctx.tenant
        tenant.check_model(parsed.model)
        ctx.deadline = Deadline.admit(ctx.headers, tenant.policy.budget_ms, ctx.arrival, limits.max_budget_ms)
        cap = tenant.policy.max_concurrency
        if cap is not None and tenant.in_flight >= cap:
            raise RateLimited(f"{tenant.in_flight} requests of this API key are in flight (at most {cap})", code="concurrency_limit_exceeded", retry_after=1.0)
        if self.usage is not None and tenant.policy.quota.monthly_tokens is not None:
            await check_quota(tenant, self.usage)
        charge = ctx.charge
        charge.prompt_tokens, charge.estimate = _estimate_tokens(parsed, self.settings)  # len() of the texts: cheap
        quota = await self.limiter.check(tenant, charge.estimate)
        if quota is not None:
            charge.rate_headers = quota.headers
            if not quota.allowed:
                raise RateLimited(
                    f"Rate limit reached for {quota.limit} per minute; retry after {quota.retry_after:.1f} s",
                    code=f"rate_limit_exceeded_{quota.limit}",
                    retry_after=max(1.0, quota.retry_after),
                )
        tenant.in_flight += 1
        ctx.held = Held.GATEWAY_AND_TENANT  # the tenant's only after the gateway's
        ctx.forward = [*extra, *self.headers.forward(ctx.raw_headers)]  # each endpoint adds its x-request-id
        return parsed

    async def admit_message(self, ctx: RequestContext, socket: Socket, body: bytes) -> ParsedRequest:
        """A WebSocket message's request, admitted as an HTTP request's body would be (its
        size, then ``admit``); always streamed."""
        ctx.tenant = socket.tenant
        limit = self.settings.limits.max_body_bytes
        if len(body) > limit:
            raise PayloadTooLarge(f"request of {len(body)} bytes exceeds the limit of {limit} bytes")
        ctx.body = body
        parsed = await self.admit(ctx, None, [(b"accept", b"text/event-stream")])
        if not parsed.stream:
            parsed = ctx.parsed = parsed.with_fields(stream=True)
        ctx.timing.mark("admit")
        return parsed

    def done(self, ctx: RequestContext) -> None:
        """Give back what ``admit`` took, settle the tenant's tokens, count the request, and
        hand its stages to the observer (histograms, SLOs, diagnosis, access log)."""
        held = ctx.held  # identity checks: Flag arithmetic is Python code on every request
        if held is not Held.NOTHING:  # the gateway's is taken first
            self.in_flight -= 1
            ctx.generation.leave()
        if held is Held.GATEWAY_AND_TENANT:
            ctx.tenant.in_flight -= 1
            if ctx.charge.usage is not None:
                self.limiter.settle(ctx.tenant, ctx.charge.usage - ctx.charge.estimate)
        ctx.held = Held.NOTHING
        delivery = ctx.delivery
        self.metrics.count(ctx.api, delivery.status, ctx.tenant.name if ctx.tenant is not None else "-")
        if delivery.gone:
            self.metrics.client_disconnects.inc()
        self.observer.finished(ctx)


def _estimate_tokens(parsed: ParsedRequest, settings: Settings) -> tuple[int, int]:
    """(prompt tokens, tokens charged at admission): the prompt's characters /
    ``chars_per_token``, plus the completion's ``max_tokens`` (or
    ``rate_limits.default_output_tokens``) for the charge."""
    prompt, _ = parsed.prompt_estimate(settings.routing.policy.chars_per_token)
    out = parsed.data.get("max_completion_tokens") or parsed.data.get("max_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 0:
        out = settings.rate_limits.default_output_tokens
    return prompt, prompt + out


class AdmissionApp:
    """ASGI middleware admitting HTTP requests and WebSockets to ``app`` (see the module
    docstring). ``api``: the metrics' label; ``kind``: the API a request body is for (None:
    each WebSocket message says; ``PASSTHROUGH``: the path says, and names the label)."""

    def __init__(self, app, gate: Gate, api: str, kind: str | None) -> None:
        self.app = app
        self.gate = gate
        self.api = api
        self.kind = kind

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await self._socket(scope, receive, send)
            return
        gate = self.gate
        limits = gate.settings.limits
        api = api_of_path(scope["path"]) if self.kind == PASSTHROUGH else self.api
        ctx = gate.begin(scope, request_id_of(scope["headers"]), api)
        delivery = ctx.delivery
        watcher = None
        try:
            gate.check_open()
            ctx.tenant = gate.tenants.identify(ctx.raw_headers)
            _check_content_type(ctx, self.kind == PASSTHROUGH)
            ctx.body = await read_body(scope, receive, limits.max_body_bytes, limits.body_timeout_s)
            await gate.admit(ctx, self.kind)
            ctx.timing.mark("admit")
            scope["edgegw"] = ctx
            if ON_GONE in scope:  # the listener calls it when the connection is lost
                scope[ON_GONE] = _on_gone(ctx, asyncio.current_task())
            else:
                watcher = _watch(receive, ctx, asyncio.current_task())
            await self.app(scope, receive, send)
        except GatewayError as exc:
            if not delivery.status:
                delivery.status = exc.status
                await send_error(send, exc, _refusal_headers(ctx, exc))
        except ClientGone:
            delivery.gone = True
            delivery.status = 499
        except asyncio.CancelledError:
            if not delivery.gone:
                raise
            asyncio.current_task().uncancel()  # the client left: this request ends here
            delivery.status = 499
        except Exception:  # a bug: answer like any other error, keep serving, log it
            logger.exception("request %s failed", ctx.request_id.decode())
            if not delivery.status:
                delivery.status = 500
                error = GatewayError("the gateway failed to handle this request")
                await send_error(send, error, _refusal_headers(ctx, error))
        finally:
            if watcher is not None:
                watcher.cancel()
            gate.done(ctx)

    async def _socket(self, scope, receive, send) -> None:
        """Admit a WebSocket at its handshake; its messages are admitted one by one."""
        if (await receive())["type"] != "websocket.connect":
            return
        gate = self.gate
        if gate.draining:
            await send({"type": "websocket.close", "code": 1013})  # try again later
            return
        try:
            tenant = gate.tenants.identify(scope["headers"])
        except GatewayError:
            await send({"type": "websocket.close", "code": 1008})  # policy violation: no (known) key
            return
        socket = Socket(tenant, request_id_of(scope["headers"]))
        await send({"type": "websocket.accept", "headers": [(b"x-request-id", socket.request_id)]})
        scope[SOCKET] = socket
        await self.app(scope, receive, send)


def _check_content_type(ctx: RequestContext, form: bool = False) -> None:
    """A body the gateway reads as JSON must say so (or say nothing); a pass-through API's
    may be a form (``form``: audio uploads)."""
    value = ctx.headers.get("content-type")
    media = "" if value is None else value.split(";", 1)[0].strip().lower()
    if form and media == "multipart/form-data":
        return
    if value is not None and media not in ("application/json", ""):
        raise UnsupportedMediaType(f"the request body must be JSON (Content-Type: application/json), not {value[:100]!r}")


def _refusal_headers(ctx: RequestContext, exc: GatewayError) -> list[tuple[bytes, bytes]]:
    why = f"target=none; why={exc.code or exc.type}".encode("ascii", "replace")
    return [(b"x-request-id", ctx.request_id), (b"x-edgegw-route", why), *ctx.charge.rate_headers]


def _on_gone(ctx: RequestContext, task: asyncio.Task):
    def gone() -> None:
        if not ctx.delivery.finished:
            ctx.delivery.gone = True
            task.cancel()

    return gone


def _watch(receive, ctx: RequestContext, task: asyncio.Task) -> asyncio.Task:
    """Cancel ``task`` when the client disconnects before its answer is complete."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not ctx.delivery.finished:
                    ctx.delivery.gone = True
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
    dog = watchdog()
    deadline = _BodyDeadline(asyncio.current_task(), dog.loop.time() + timeout)
    dog.add(deadline)
    try:
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
    except asyncio.CancelledError:
        if not deadline.expired:
            raise
        asyncio.current_task().uncancel()
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s") from None
    finally:
        dog.discard(deadline)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _BodyDeadline(Watch):
    __slots__ = ("task", "deadline", "expired")

    def __init__(self, task: asyncio.Task, deadline: float) -> None:
        self.task = task
        self.deadline = deadline
        self.expired = False

    def overdue(self, now: float) -> bool:
        return now >= self.deadline

    def expire(self) -> None:
        self.expired = True
        self.task.cancel()
