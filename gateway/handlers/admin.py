"""The admin API (``gateway.admission.admin`` decides who reaches it):

- ``POST /admin/reload``: read the configuration file again and apply it
  (``gateway.node.reload``); 200 with what was applied and what needs a restart, 400 with
  the error (naming the key and line) when the new configuration is refused, 202 on a node
  of workers (the parent reloads every process).
- ``GET /admin/usage?from=&to=&tenant=``: requests and tokens per tenant and model over a
  time range, from the hourly counts (``gateway.observe.usage``): ``from`` and ``to`` as
  ISO 8601 (``2025-06-01``, ``2025-06-01T12:00:00Z``) or Unix seconds; default from the
  start of this month (UTC) to now. Buckets are hours: the range is widened to whole hours,
  and the answer says which.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from urllib.parse import parse_qs

import orjson

from gateway.core.errors import error_body
from gateway.observe.node_metrics import WORKER_SCOPE

__all__ = ["ReloadApp", "UsageApp", "parse_time"]

_JSON = (b"content-type", b"application/json")


async def _send(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class ReloadApp:
    """``POST /admin/reload``; ``reload(why)`` answers (status, JSON payload)."""

    def __init__(self, reload: Callable[[str], Awaitable[tuple[int, dict]]]) -> None:
        self.reload = reload

    async def __call__(self, scope, receive, send) -> None:
        status, payload = await self.reload("POST /admin/reload")
        if status >= 400:
            body = error_body(payload.get("error") or "the configuration was refused", "invalid_request_error", None, "invalid_configuration")
        else:
            body = orjson.dumps(payload)
        await _send(send, status, body)


def parse_time(value: str, name: str) -> float:
    """A Unix time from ``value``: Unix seconds, or ISO 8601 (a date, or a time; UTC when
    it names no offset). ``ValueError`` naming the parameter otherwise."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise ValueError(f"{name}: not a time: {value[:40]!r} (ISO 8601, e.g. 2025-06-01T00:00:00Z, or Unix seconds)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class UsageApp:
    """``GET /admin/usage``; ``query(start, end, tenant, worker_only)`` answers the rows
    (``Usage.query``, or on a node of workers without Redis, the sum of every worker's;
    ``worker_only``: a sibling asks for this worker's own)."""

    def __init__(self, query: Callable[[float, float, str | None, bool], Awaitable[list[dict]]], source: Callable[[], str]) -> None:
        self.query = query
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        now = time.time()
        month = datetime.fromtimestamp(now, timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        try:
            start = parse_time(params["from"][0], "from") if "from" in params else month.timestamp()
            end = parse_time(params["to"][0], "to") if "to" in params else now
            if end < start:
                raise ValueError("to: must not be before from")
            tenant = params["tenant"][0] if "tenant" in params else None
            rows = await self.query(start, end, tenant, WORKER_SCOPE in scope["headers"])
        except ValueError as exc:
            param = str(exc).partition(":")[0] if str(exc).startswith(("from", "to")) else None
            await _send(send, 400, error_body(str(exc), "invalid_request_error", param, "invalid_range"))
            return
        except RuntimeError as exc:
            await _send(send, 503, error_body(str(exc), "server_error", None, "usage_unavailable"))
            return
        first = start - start % 3600
        last = end - end % 3600 + 3600
        payload = {"object": "usage", "from": _iso(first), "to": _iso(last), "bucket": "1h", "source": self.source(), "data": rows}
        await _send(send, 200, orjson.dumps(payload))
