"""One request as it crosses the rooms: ``RequestContext`` and the typed records each stage
writes into it.

Admission makes the context (``gateway.admission``): who asked (``tenant``), what for
(``parsed``), by when (``deadline``), with what was charged (``charge``) and held
(``held``). The pipeline notes what served it (``served``); the writers note what reached
the client (``delivery``); tracing keeps its spans in ``trace``. The observer reads it all
once, at the end (``gateway.observe.Observer.finished``).

Also here: the scope keys a listener uses to offer the request's task a shortcut
(``ON_GONE``: the listener reports a lost connection itself; ``WRITER``: a ``BodyWriter``
for the splice), so the listeners need nothing above this module.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.core.deadline import Deadline
from gateway.core.openai import ParsedRequest
from gateway.core.tenant import Tenant
from gateway.core.timing import Timing

__all__ = ["LISTENING", "ON_GONE", "WRITER", "BodyWriter", "Charge", "Delivery", "Held", "RequestContext", "Served", "Trace"]

# The scope key of a listener that reports a lost connection itself (gateway.ingress.http1):
# admission puts a callable there in place of a task waiting on ``receive``.
ON_GONE = "edgegw.on_gone"

# The scope key of a listener that offers a ``BodyWriter`` (gateway.ingress.http1).
WRITER = "edgegw.writer"

# The key, in the app's state (``scope["state"]``), by which the server says whether all its
# listeners are open (gateway.ingress.server): False while the TLS, admin and HTTP/3 ports
# are being opened after the first one answers, so that /readyz does not say ready before.
LISTENING = "edgegw.listening"


class BodyWriter(Protocol):
    """What a listener offers for the splice (``scope[WRITER]``): the next piece of a
    response body whose head went through ``send``, written now."""

    @property
    def writable(self) -> bool:
        """The client is there and its socket below its high-water mark."""

    def write(self, data: bytes) -> bool:
        """Write ``data`` (not empty); False when the client now accepts no more for the
        moment (or has gone)."""


class Held(enum.Flag):
    """What admission took for the request, given back at its end."""

    NOTHING = 0
    GATEWAY = enum.auto()  # one of the gateway's ``limits.max_in_flight``
    TENANT = enum.auto()  # one of the tenant's ``max_concurrency``
    GATEWAY_AND_TENANT = GATEWAY | TENANT  # named, so that the request path compares, not computes


@dataclass(slots=True)
class Charge:
    """What the tenant is charged: estimated at admission, settled with the real usage."""

    prompt_tokens: int = 0  # the prompt's size, estimated at admission
    estimate: int = 0  # tokens charged at admission (prompt + max_tokens)
    usage: int | None = None  # the answer's real total tokens, when it said
    prompt_used: int | None = None  # the answer's usage.prompt_tokens, when it said
    completion_used: int | None = None  # the answer's usage.completion_tokens, when it said
    rate_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-* for the response


@dataclass(slots=True)
class Served:
    """What answered the request."""

    via: str = "-"  # the reply's label (an endpoint URL, edge, cache, coalesced), for the access log
    target_kind: str = "none"  # edge | endpoint | cache | none
    target_stages: tuple[tuple[str, float], ...] = ()  # measured inside the target (Reply.stages)
    upstream_request_id: bytes | None = None  # the x-request-id the last upstream attempt was sent
    model: str | None = None  # the model that answered (an alias resolved by routing); None: as asked


@dataclass(slots=True)
class Delivery:
    """What reached the client, as the writers saw it."""

    status: int = 0  # the status sent (0: none yet)
    gone: bool = False  # the client left before the answer was complete
    finished: bool = False  # the last byte is being sent: a disconnect now changes nothing
    stalled: bool = False  # the client accepted nothing for send_timeout: ended as if gone
    ttft: float | None = None  # seconds from arrival to the first relayed event
    tokens: int = 0  # content events relayed (1 for a JSON answer)
    gaps: list[float] = field(default_factory=list)  # seconds between relayed events


@dataclass(slots=True)
class Trace:
    """The request's tracing state (``gateway.observe.tracing``), when traces are on."""

    trace_id: str | None = None  # of the client's traceparent, for the access log
    span: Any = None  # the server span
    client_spans: list = field(default_factory=list)  # a span per target the request was sent to


class RequestContext:
    """One request as admitted: who asked, what for, by when, and how it is going."""

    __slots__ = (
        "request_id", "api", "timing", "arrival", "wall_start", "raw_headers", "headers", "peer", "tenant", "deadline",
        "forward", "body", "parsed", "model", "send_timeout", "held", "charge", "served", "delivery", "trace", "path",
        "count_usage", "generation",
    )

    def __init__(self, scope: dict, request_id: bytes, api: str) -> None:
        self.request_id = request_id
        self.api = api  # "chat" | "completions" | "ws" | a pass-through API ("embeddings"...): the metrics' label
        self.path: str = scope.get("path", "")
        self.timing = Timing()
        self.arrival = time.monotonic()  # deadlines count from here
        self.wall_start = time.time_ns()  # spans start here
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in self.raw_headers}
        client = scope.get("client")
        self.peer: str | None = client[0] if client else None
        self.tenant: Tenant | None = None
        self.deadline: Deadline = _UNADMITTED  # admission sets the request's own
        self.forward: list[tuple[bytes, bytes]] = []  # the headers that go upstream
        self.body = b""
        self.parsed: ParsedRequest | None = None
        self.model = "-"
        self.send_timeout = 60.0  # limits.send_timeout_s (gateway.relay.Stall)
        self.held = Held.NOTHING
        self.charge = Charge()
        self.served = Served()
        self.delivery = Delivery()
        traceparent = self.headers.get("traceparent")
        self.trace = Trace(_trace_id(traceparent) if traceparent else None)
        self.count_usage = False  # usage.enabled: the answer's usage is read for the tenant's counts
        self.generation: Any = None  # the configuration it was admitted under (gateway.admission.Generation)

    @property
    def wants_usage(self) -> bool:
        """Whether the answer's usage must be read (the tenant's tokens are counted)."""
        return self.tenant is not None and (self.count_usage or self.tenant.policy.tokens_per_minute is not None)

    def responded(self) -> None:
        """The answer is complete but for its last send."""
        self.delivery.finished = True


_UNADMITTED = Deadline(None, "none", 0.0)  # no budget, nothing enforced: a request's until admission gives it its own


def _trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``), if valid."""
    if traceparent and len(traceparent) >= 55 and traceparent[2] == "-" and traceparent[35] == "-":
        trace_id = traceparent[3:35]
        if trace_id != "0" * 32 and all(c in "0123456789abcdef" for c in trace_id):
            return trace_id
    return None
