"""The gateway's errors and their OpenAI-shaped responses.

Every error the gateway answers with is a ``GatewayError``; the other packages' errors
(upstream transport failures, engine errors, cache errors) are translated into this tree
at the seam where they are caught, so that the HTTP layer has one mapping to statuses.

GatewayError                       -> {"error": {"message", "type", "param", "code"}}
├── InvalidRequest          400    malformed JSON, missing or invalid fields
├── AuthenticationError     401    missing or unknown API key
├── PermissionDenied        403    the tenant may not use this model
├── ModelNotFound           404    no cluster and no engine serves the model
├── RequestTimeout          408    the request body did not arrive within limits.body_timeout_s
├── PayloadTooLarge         413    request body over limits.max_body_bytes
├── UnsupportedMediaType    415    a request body that says it is not JSON
├── RateLimited             429    tenant over its rate or concurrency (Retry-After)
│   └── InsufficientQuota          tenant over its monthly token quota (no retry)
├── UpstreamError           502    upstream broke or answered nonsense
│   └── UpstreamConnectError       could not open (or reuse) a connection
├── Overloaded              503    the gateway or a target is at capacity (Retry-After)
├── NoHealthyUpstream       503    every endpoint of the cluster is down (Retry-After)
├── UpstreamTimeout         504    no byte from the upstream within the read timeout
└── DeadlineExceeded        504    the request's own deadline passed before it could start

``ClientGone`` is not a ``GatewayError``: nobody is left to answer.

Upstream transport errors (``UpstreamConnectError``, ``UpstreamProtocolError``,
``UpstreamReadTimeout``, ``PoolTimeout``) are raised by ``gateway.upstream`` and are
subclasses of the above, so a caller that only cares about the status can ignore them.
"""

from __future__ import annotations

import math

import orjson

__all__ = [
    "GatewayError",
    "InvalidRequest",
    "AuthenticationError",
    "PermissionDenied",
    "ModelNotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "UnsupportedMediaType",
    "ClientGone",
    "RateLimited",
    "InsufficientQuota",
    "UpstreamError",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "Overloaded",
    "NoHealthyUpstream",
    "PoolTimeout",
    "UpstreamTimeout",
    "UpstreamReadTimeout",
    "DeadlineExceeded",
    "error_body",
    "send_error",
]

_JSON = (b"content-type", b"application/json")


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        # rounded up: a client that waits what it was told must not come back too early
        return [(b"retry-after", str(max(1, math.ceil(self.retry_after - 1e-9))).encode())]


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class InsufficientQuota(RateLimited):
    """OpenAI's answer to an account past its quota: 429 ``insufficient_quota``, which clients
    must not retry (``x-should-retry: false``, which the OpenAI SDKs read)."""

    type = "insufficient_quota"
    code = "insufficient_quota"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"x-should-retry", b"false")]


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "overloaded"


class NoHealthyUpstream(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_upstream"


class PoolTimeout(NoHealthyUpstream):
    code = "upstream_pool_timeout"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class UpstreamReadTimeout(UpstreamTimeout):
    pass


class DeadlineExceeded(GatewayError):
    """The request's deadline (``x-latency-budget-ms`` or its tenant's budget) passed while it
    waited in the gateway's queue or the engine's, or before its upstream sent headers."""

    status = 504
    type = "server_error"
    code = "deadline_exceeded"


class ClientGone(Exception):
    """The client disconnected while its request was being read (not an error to answer)."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


async def send_error(send, exc: GatewayError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer an HTTP request with ``exc`` as an OpenAI-shaped JSON error."""
    body = exc.body()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers, *exc.headers()],
        }
    )
    await send({"type": "http.response.body", "body": body})
