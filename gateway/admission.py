"""Admission: what happens to a request before the pipeline sees it, once for HTTP and
WebSocket.

``AdmissionApp`` is pure ASGI middleware in front of the completion endpoints (Starlette's
``trustedhost.py`` style: configuration in ``__init__``, one decision per step in
``__call__``, an early refusal as a tiny response). Per HTTP request, in order:

1. request id: the client's ``x-request-id`` when it is a safe token, else a new one;
2. draining: a gateway shutting down refuses new work (503 + ``Retry-After``);
3. tenant: the API key names one (``gateway.tenants``; 401 by ``auth.mode``), before the
   body is read;
4. body: read under ``limits.max_body_bytes`` (413 as soon as it is passed, a declared
   ``Content-Length`` over it at once) and ``limits.body_timeout_s``, *before* taking a slot,
   so that a client that sends slowly holds nothing that complete requests need;
5. ``Gate.admit``: an in-flight slot (at most ``limits.max_in_flight``, 503), the body
   parsed (400), the model allowed for the tenant (403), the tenant's concurrency and
   rate limits (429 with ``Retry-After`` and the OpenAI ``x-ratelimit-*`` headers), the
   headers that go upstream;
6. the disconnect watcher: from here on, a client that leaves cancels the request task
   wherever it waits, and the reply is closed in the endpoint's ``finally``;

then the endpoint runs with a ``RequestContext`` in ``scope["edgegw"]``, and afterwards
``Gate.done`` settles the tenant's token estimate with the real usage, counts the request,
releases what it held and writes its access-log line.

The WebSocket endpoint admits each message on a socket through the same ``Gate.admit``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

from gateway.errors import (
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
from gateway.forwarding import HeaderPolicy
from gateway.observability import Metrics, Observer, Timing
from gateway.timeouts import Watch, watchdog
from gateway.openai import LARGE, ParsedRequest, parse_request
from gateway.ratelimit import RateLimiter
from gateway.settings import Settings
from gateway.tenants import Tenant, Tenants
from routing import estimate_prompt_tokens

__all__ = ["AdmissionApp", "Gate", "RequestContext", "read_body", "request_id_of"]

logger = logging.getLogger("edgegw")

_SAFE_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == b"x-request-id" and _SAFE_ID.match(value):
            return value
    return os.urandom(16).hex().encode()  # a uuid4's randomness without building a UUID


class RequestContext:
    """One request as admitted: who asked, what for, and how it is going."""

    __slots__ = (
        "request_id", "timing", "arrival", "raw_headers", "headers", "peer", "tenant", "forward", "body",
        "parsed", "api", "model", "via", "status", "gone", "finished", "rate_headers", "token_estimate",
        "usage_tokens", "send_timeout", "stalled", "target_kind", "ttft", "tokens", "gaps", "prompt_tokens",
        "target_stages", "wall_start", "span", "client_spans", "trace_id", "_admitted",
    )

    def __init__(self, scope: dict, request_id: bytes, api: str) -> None:
        self.request_id = request_id
        self.timing = Timing()
        self.arrival = time.monotonic()  # deadlines count from here
        self.wall_start = time.time_ns()  # spans start here
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in self.raw_headers}
        client = scope.get("client")
        self.peer: str | None = client[0] if client else None
        self.tenant: Tenant | None = None
        self.forward: list[tuple[bytes, bytes]] = []  # the headers that go upstream
        self.body = b""
        self.parsed: ParsedRequest | None = None
        self.api = api  # "chat" | "completions": the metrics' label
        self.model = "-"
        self.via = "-"  # what answered (the reply's label), for the access log
        self.status = 0  # the status sent (0: none yet)
        self.gone = False  # the client left before the answer was complete
        self.finished = False  # the last byte is being sent: a disconnect now changes nothing
        self.rate_headers: list[tuple[bytes, bytes]] = []  # x-ratelimit-* for the response
        self.token_estimate = 0  # tokens charged at admission
        self.usage_tokens: int | None = None  # the answer's real usage, when it said
        self.send_timeout = 60.0  # limits.send_timeout_s (gateway.relay.Stall)
        self.stalled = False  # the client accepted nothing for send_timeout: ended as if gone
        self.target_kind = "none"  # what served it: edge | endpoint | cache | none
        self.ttft: float | None = None  # seconds from arrival to the first relayed event
        self.tokens = 0  # content events relayed (1 for a JSON answer)
        self.gaps: list[float] = []  # seconds between relayed events
        self.prompt_tokens = 0  # the prompt's size, estimated at admission
        self.target_stages: tuple[tuple[str, float], ...] = ()  # measured inside the target (Reply.stages)
        self.span = None  # the server span, when traces are on (gateway.tracing)
        self.client_spans: list = []  # a span per target the request was sent to
        self.trace_id = _trace_id(self.headers.get("traceparent"))  # for the access log
        self._admitted = 0  # what Gate.admit took: 1 the gateway's slot, 2 also the tenant's

    @property
    def budget_ms(self) -> float | None:
        """The tenant's TTFT budget (the request's ``x-latency-budget-ms`` still wins)."""
        return self.tenant.policy.budget_ms if self.tenant is not None else None

    @property
    def wants_usage(self) -> bool:
        """Whether the answer's usage must be read (the tenant's tokens are counted)."""
        return self.tenant is not None and self.tenant.policy.tokens_per_minute is not None

    def responded(self) -> None:
        """The answer is complete but for its last send."""
        self.finished = True


class Gate:
    """The gateway's own protection: draining and the in-flight count, shared by every
    admission (HTTP request or WebSocket message)."""

    __slots__ = (
        "settings", "metrics", "observer", "tracing", "headers", "tenants", "limiter", "in_flight", "draining", "shedding_until",
    )

    def __init__(self, settings: Settings, metrics: Metrics, observer: Observer, tracing=None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.observer = observer
        self.tracing = tracing  # gateway.tracing.Tracing when traces are on
        self.headers = HeaderPolicy(settings.forward_headers.allow, settings.forward_headers.deny)
        self.tenants = Tenants(settings.auth, settings.tenants)
        self.limiter = RateLimiter(settings.rate_limits, metrics)
        self.in_flight = 0
        self.draining = False
        self.shedding_until = 0.0  # time.monotonic(): /readyz says not ready until then

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

    def identify(self, ctx: RequestContext) -> None:
        ctx.tenant = self.tenants.identify(ctx.raw_headers)

    async def admit(self, ctx: RequestContext, kind: str | None, extra: list[tuple[bytes, bytes]] = ()) -> ParsedRequest:
        """Everything between the body and the pipeline (steps 5 of the module docstring);
        ``done`` gives back what it took, whatever happened."""
        limits = self.settings.limits
        ctx.send_timeout = limits.send_timeout_s
        self.check_open()
        if self.in_flight >= limits.max_in_flight:
            raise Overloaded("the gateway is at its concurrency limit", retry_after=limits.retry_after_s)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        ctx._admitted = 1
        if len(ctx.body) > LARGE:  # parsing and checking grow with the body: not on the event loop
            parsed = ctx.parsed = await asyncio.to_thread(parse_request, kind, ctx.body)
        else:
            parsed = ctx.parsed = parse_request(kind, ctx.body)
        ctx.model = parsed.model
        tenant = ctx.tenant
        tenant.check_model(parsed.model)
        cap = tenant.policy.max_concurrency
        if cap is not None and tenant.in_flight >= cap:
            raise RateLimited(f"{tenant.in_flight} requests of this API key are in flight (at most {cap})", code="concurrency_limit_exceeded", retry_after=1.0)
        ctx.prompt_tokens, ctx.token_estimate = _estimate_tokens(parsed, self.settings)  # len() of the texts: cheap
        quota = await self.limiter.check(tenant, ctx.token_estimate)
        if quota is not None:
            ctx.rate_headers = quota.headers
            if not quota.allowed:
                raise RateLimited(
                    f"Rate limit reached for {quota.limit} per minute; retry after {quota.retry_after:.1f} s",
                    code=f"rate_limit_exceeded_{quota.limit}",
                    retry_after=max(1.0, quota.retry_after),
                )
        tenant.in_flight += 1
        ctx._admitted = 2
        ctx.forward = [(b"x-request-id", ctx.request_id), *extra, *self.headers.forward(ctx.raw_headers)]
        return parsed

    def done(self, ctx: RequestContext) -> None:
        """Give back what ``admit`` took, settle the tenant's tokens, count the request, and
        hand its stages to the observer (histograms, SLOs, diagnosis, access log)."""
        if ctx._admitted:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            if ctx._admitted == 2:
                ctx.tenant.in_flight -= 1
                if ctx.usage_tokens is not None:
                    self.limiter.settle(ctx.tenant, ctx.usage_tokens - ctx.token_estimate)
            ctx._admitted = 0
        self.metrics.count(ctx.api, ctx.status, ctx.tenant.name if ctx.tenant is not None else "-")
        if ctx.gone:
            self.metrics.client_disconnects.inc()
        self.observer.finished(ctx)


def _estimate_tokens(parsed: ParsedRequest, settings: Settings) -> tuple[int, int]:
    """(prompt tokens, tokens charged at admission): the prompt's characters /
    ``chars_per_token``, plus the completion's ``max_tokens`` (or
    ``rate_limits.default_output_tokens``) for the charge."""
    prompt, _ = estimate_prompt_tokens(parsed.data, settings.routing.policy.chars_per_token)
    out = parsed.data.get("max_completion_tokens") or parsed.data.get("max_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 0:
        out = settings.rate_limits.default_output_tokens
    return prompt, prompt + out


class AdmissionApp:
    """ASGI middleware admitting HTTP requests to ``app`` (see the module docstring)."""

    def __init__(self, app, gate: Gate, api: str, kind: str) -> None:
        self.app = app
        self.gate = gate
        self.api = api
        self.kind = kind

    async def __call__(self, scope, receive, send) -> None:
        gate = self.gate
        limits = gate.settings.limits
        ctx = RequestContext(scope, request_id_of(scope["headers"]), self.api)
        if gate.tracing is not None:
            gate.tracing.begin(ctx)
        watcher = None
        try:
            gate.check_open()
            gate.identify(ctx)
            _check_content_type(ctx)
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
            gate.done(ctx)


def _trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``), if valid."""
    if traceparent and len(traceparent) >= 55 and traceparent[2] == "-" and traceparent[35] == "-":
        trace_id = traceparent[3:35]
        if trace_id != "0" * 32 and all(c in "0123456789abcdef" for c in trace_id):
            return trace_id
    return None


def _check_content_type(ctx: RequestContext) -> None:
    """A body the gateway reads as JSON must say so (or say nothing)."""
    value = ctx.headers.get("content-type")
    if value is not None and value.split(";", 1)[0].strip().lower() not in ("application/json", ""):
        raise UnsupportedMediaType(f"the request body must be JSON (Content-Type: application/json), not {value[:100]!r}")


def _refusal_headers(ctx: RequestContext, exc: GatewayError) -> list[tuple[bytes, bytes]]:
    why = f"target=none; why={exc.code or exc.type}".encode("ascii", "replace")
    return [(b"x-request-id", ctx.request_id), (b"x-edgegw-route", why), *ctx.rate_headers]


# The scope key of a listener that reports a lost connection itself (gateway.ingress.http1):
# admission puts a callable there in place of a task waiting on ``receive``.
ON_GONE = "edgegw.on_gone"


def _on_gone(ctx: RequestContext, task: asyncio.Task):
    def gone() -> None:
        if not ctx.finished:
            ctx.gone = True
            task.cancel()

    return gone


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
