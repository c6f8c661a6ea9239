"""Errors raised by the edge engine.

Hierarchy::

    EngineError                   something went wrong inside the engine (-> HTTP 500)
    ├── InvalidRequestError       bad input: names the parameter (-> HTTP 400)
    ├── EngineOverloadedError     waiting queue full, or the request's TTFT budget / its class's
    │                             TPOT objective predicted unattainable (-> HTTP 503 + Retry-After)
    ├── DeadlineExceededError     the request's deadline passed before it started (-> HTTP 504)
    └── EngineClosedError         the engine is not running (-> HTTP 503)

The gateway translates these at its seam; ``edge_engine.server`` does the same for the
standalone server.
"""

from __future__ import annotations

__all__ = [
    "DeadlineExceededError",
    "EngineClosedError",
    "EngineError",
    "EngineOverloadedError",
    "InvalidRequestError",
]


class EngineError(Exception):
    """A failure inside the engine (a model step raised, the engine stopped, ...)."""

    status_code = 500
    type = "server_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param: str | None = None

    def to_dict(self) -> dict:
        """The OpenAI-shaped error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(EngineError):
    """The request can never be served as asked; ``param`` names the offending field."""

    status_code = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


class EngineOverloadedError(EngineError):
    """The engine cannot take the request now; retry after ``retry_after`` seconds.

    ``code``: ``engine_overloaded`` (the waiting queue is at its configured limit),
    ``deadline_unattainable`` (its first token is predicted after its deadline) or
    ``tpot_unattainable`` (its class's time-per-output-token objective could not be kept)."""

    status_code = 503
    type = "server_error"

    def __init__(self, message: str, retry_after: int = 1, code: str = "engine_overloaded") -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class DeadlineExceededError(EngineError):
    """The request's deadline (a ``time.monotonic()`` value) passed while it was still
    waiting: it was dropped without running, since an answer after the deadline is of no use
    to the caller and the compute is better spent on the requests still in time."""

    status_code = 504
    type = "server_error"

    def __init__(self, message: str = "the request's deadline passed before the edge engine could start it") -> None:
        super().__init__(message, code="deadline_exceeded")


class EngineClosedError(EngineError):
    """The engine's step thread is not running (not started, or closed)."""

    status_code = 503
    type = "server_error"

    def __init__(self, message: str = "the edge engine is not running") -> None:
        super().__init__(message, code="engine_closed")
