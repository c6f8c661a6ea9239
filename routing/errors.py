"""Errors raised by the routing package.

Hierarchy::

    RoutingError            base class; never raised itself
    ├── NoRoute             no target can serve this request now (gateway: 503/404)
    │   ├── UnknownModel    the requested model (after aliases) is served nowhere (404)
    │   └── Unservable      no target can honour what the request asks (structured
    │                       output, an API the edge lacks): 400 when the model was named, else 503
    ├── TableError          the routing config and the clusters do not fit (startup)
    └── InvalidTransition   a circuit-breaker transition outside its table (a bug)

The gateway translates these at its seam (``gateway/errors.py``); routing never
imports the gateway.
"""

from __future__ import annotations

__all__ = ["InvalidTransition", "NoRoute", "RoutingError", "TableError", "UnknownModel", "Unservable"]


class RoutingError(Exception):
    """Base class of every routing error."""


class NoRoute(RoutingError):
    """No healthy target can take the request.

    ``retry_after_s`` is the time until the first circuit breaker may half-open
    (a hint for ``Retry-After``), or ``None`` when unknown.
    """

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModel(NoRoute):
    """The requested model, after alias resolution, is not served by any target."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} is not served by this gateway")
        self.model = model


class Unservable(NoRoute):
    """No target can honour what the request asks: structured output (``param`` names the
    field) or an API the edge engine does not serve. ``explicit``: the client named a model
    that cannot (the client's error, 400); else nothing that could is available (503)."""

    def __init__(self, message: str, *, param: str | None, explicit: bool) -> None:
        super().__init__(message)
        self.param = param
        self.explicit = explicit


class TableError(RoutingError, ValueError):
    """The routing configuration does not match the cluster list (raised at startup)."""


class InvalidTransition(RoutingError):
    """A circuit breaker was asked for a transition its table does not allow (a bug)."""

    def __init__(self, state: object, event: object) -> None:
        super().__init__(f"no transition from {state} on {event}")
        self.state = state
        self.event = event
