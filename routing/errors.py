"""Errors raised by the routing package.

Hierarchy::

    RoutingError            base class; never raised itself
    ├── NoRoute             no target can serve this request now (gateway: 503/404)
    │   └── UnknownModel    the requested model (after aliases) is served nowhere (404)
    ├── TableError          the routing config and the clusters do not fit (startup)
    └── InvalidTransition   a circuit-breaker transition outside its table (a bug)

The gateway translates these at its seam (``gateway/errors.py``); routing never
imports the gateway.
"""

from __future__ import annotations

__all__ = ["InvalidTransition", "NoRoute", "RoutingError", "TableError", "UnknownModel"]


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


class TableError(RoutingError, ValueError):
    """The routing configuration does not match the cluster list (raised at startup)."""


class InvalidTransition(RoutingError):
    """A circuit breaker was asked for a transition its table does not allow (a bug)."""

    def __init__(self, state: object, event: object) -> None:
        super().__init__(f"no transition from {state} on {event}")
        self.state = state
        self.event = event
