"""The node's edge engine process as a gateway backend: ``EdgeClient`` and its ``EngineStreamReply``.

With ``listen.workers`` > 1 (or ``edge.process``) the engine runs once per node, in its own
process (``gateway.workers.run_engine``: ``edge_engine.server`` on ``engine.sock`` in the
node's run directory), and each relay worker reaches it through the gateway's lean HTTP/1.1
pool over that Unix socket, as an ordinary upstream:

- cancellation: closing an unfinished reply closes its connection; the engine server sees
  the disconnect and drops the sequence (waiting or running) at its next step;
- backpressure: the reply's body is the pool's bounded ``Body``; a slow client stops the
  socket being read, and the engine's sequence pauses once ``edge.max_pending_outputs``
  tokens are unread;
- deadlines: what is left of the request's budget goes as ``x-latency-budget-ms``; the
  engine drops a request still waiting when it passes (504 ``deadline_exceeded``);
- priority: the tenant's class goes in the body's ``priority``, as in-process;
- the engine's own stages (queue, prefill, decode) come back with the answer, as
  ``Reply.stages``, for the stage histogram, the access log and the trace;
- routing's view of the engine (queue depth, KV blocks, recent TTFT/TPOT): ``GET /stats``
  polled every ``STATS_INTERVAL_S`` on a connection of its own; the engine counts as down
  when it has not answered for ``STALE_AFTER_S``.

Needs no torch: a relay worker never loads the model. Engine errors arrive as OpenAI-shaped
JSON with the engine's status and are translated into ``gateway.errors`` here, as
``gateway.edge.engine_error`` does in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterator

import orjson

from gateway.errors import GatewayError, InvalidRequest, NoHealthyUpstream, Overloaded, UpstreamError, UpstreamTimeout
from gateway.observability import Sample
from gateway.relay import EventReader
from gateway.replies import JSON, SSE, Reply
from gateway.settings import Settings
from gateway.upstream import H1Pool, Origin, Timeouts, UpstreamResponse
from routing import EdgeStats

__all__ = ["EdgeClient", "EngineStreamReply"]

logger = logging.getLogger("edgegw.edge")

STATS_INTERVAL_S = 0.05
STALE_AFTER_S = 2.0
READ_TIMEOUT_S = 300.0  # a sequence's tokens come one step of the whole batch apart; prefill may queue
_PATHS = {"chat": b"/v1/chat/completions", "completion": b"/v1/completions"}
_JSON_BODY = (b"content-type", b"application/json")
_VALIDATE = (b"x-validate-only", b"1")
_MAX_ERROR_BYTES = 64 * 1024
_STAGES_HEADER = b"x-engine-stages"
_STAGES_COMMENT = b": x-engine-stages "
_STAGES_EVENT = re.compile(rb"(?m)^: x-engine-stages ([^\r\n]*)\r?\n\r?\n")


def _error(status: int, body: bytes, retry_after: bytes | None) -> GatewayError:
    """The gateway error for the engine server's error response (``EngineError.to_dict()``)."""
    try:
        error = orjson.loads(body)["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, param, code = f"the edge engine answered {status}", None, None
    if status == 400:
        return InvalidRequest(message, param=param, code=code)
    if status == 503 and retry_after is not None:  # its queue is full
        return Overloaded(message, code=code, retry_after=float(retry_after))
    if status == 503:
        return NoHealthyUpstream(message, code=code, retry_after=1.0)
    if status == 504:
        return UpstreamTimeout(message, code="deadline_exceeded")
    return UpstreamError(message, code=code or "engine_error")


def _stages(value: bytes | None) -> tuple[tuple[str, float], ...]:
    """``queue=S;prefill=S;decode=S`` (the engine server's ``x-engine-stages``) as ``Reply.stages``."""
    if not value:
        return ()
    try:
        return tuple((f"engine_{name.decode().strip()}", float(seconds)) for name, _, seconds in (p.partition(b"=") for p in value.split(b";")))
    except ValueError:
        return ()


class EngineStreamReply(Reply):
    """The engine process's answer, relayed from its HTTP response as it arrives. Closing it
    early (``aclose``) closes the connection, which drops the engine's sequence. The engine's
    stage times (``stages``) come in a header of a whole answer, or in a comment just before
    a stream's end, which is taken out of the stream."""

    label = "edge"

    def __init__(self, response: UpstreamResponse, stream: bool, ping: float, read_timeout: float, max_event: int, limit: int) -> None:
        self.response = response
        self.headers = [SSE if stream else JSON]
        self.stages = ()
        self._reader = EventReader(response.body, ping, read_timeout, max_event)
        self._timeout = read_timeout
        self._limit = limit

    async def read_body(self) -> bytes:
        body = await self.response.body.read_all(self._timeout, self._limit)
        self.stages = _stages(self.response.header(_STAGES_HEADER))
        return body

    async def next_events(self) -> bytes | None:
        while True:
            events = await self._reader.next()
            if not events:
                return events
            events = self._take_stages(events)
            if events:
                return events

    def hand_over(self, on_events: Callable[[bytes], None] | None) -> bool:
        if on_events is None:
            return self._reader.hand_over(None)

        def arrived(events: bytes) -> None:
            events = self._take_stages(events)
            if events:
                on_events(events)

        return self._reader.hand_over(arrived)

    def _take_stages(self, events: bytes) -> bytes:
        """``events`` without the engine's stage comment, whose times are kept in ``stages``."""
        if _STAGES_COMMENT not in events:
            return events
        match = _STAGES_EVENT.search(events)
        if match is None:
            return events
        self.stages = _stages(match.group(1))
        return events[: match.start()] + events[match.end() :]

    @property
    def in_event(self) -> bool:
        return self._reader.in_event

    async def aclose(self) -> None:
        self.response.close()
        if self.slot is not None:
            self.slot.release()


class EdgeClient:
    """The engine process behind a Unix socket: replies, the stats routing needs, gauges.
    Has ``EdgeBackend``'s interface (``gateway.edge``)."""

    def __init__(self, settings: Settings, path: str) -> None:
        edge, limits = settings.edge, settings.limits
        self.path = path
        self.model_name = edge.served_name
        self._limits = limits
        self._read_timeout = READ_TIMEOUT_S
        timeouts = Timeouts(connect=3.0, read=READ_TIMEOUT_S, write=30.0, pool=5.0)
        origin = Origin("localhost", 0, None, b"localhost", b"http", uds=path)
        most = (edge.max_concurrency or edge.max_num_seqs) + 8  # the gateway's queue holds the rest
        self.pool = H1Pool(origin, max_connections=most, warm_connections=2, timeouts=timeouts, high_water=limits.stream_buffer_bytes)
        self._control = H1Pool(origin, max_connections=1, warm_connections=0, timeouts=timeouts, high_water=64 * 1024)
        self._stats: dict | None = None
        self._stats_at = -math.inf
        self._poller: asyncio.Task | None = None

    @classmethod
    async def start(cls, settings: Settings, path: str) -> EdgeClient:
        client = cls(settings, path)
        await client.pool.warm()
        await client._poll_once()
        if client._stats is None:
            logger.warning("the edge engine on %s does not answer yet", path)
        client._poller = asyncio.get_running_loop().create_task(client._poll())
        return client

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self._control.aclose()
        await self.pool.aclose()

    # -- what routing and /metrics read ------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self._poll_once()

    async def _poll_once(self) -> None:
        try:
            response = await self._control.request(b"GET", b"/stats", [], b"", 1.0)
            try:
                body = await response.body.read_all(1.0, _MAX_ERROR_BYTES)
            finally:
                response.close()
            if response.status == 200:
                self._stats = orjson.loads(body)
                self._stats_at = time.monotonic()
        except (GatewayError, orjson.JSONDecodeError):
            pass  # stale stats: the engine counts as down after STALE_AFTER_S

    @property
    def is_running(self) -> bool:
        return time.monotonic() - self._stats_at < STALE_AFTER_S

    def stats(self) -> EdgeStats:
        s = self._stats or {}
        return EdgeStats(
            queue_depth=s.get("num_waiting", 0),
            running=s.get("num_running", 0),
            kv_blocks_free=s.get("num_kv_blocks_free", 0),
            kv_blocks_total=s.get("num_kv_blocks_total", 0),
            block_size=s.get("block_size", 16),
            recent_ttft_ms=s.get("ttft_ms_p50"),
            recent_tpot_ms=s.get("tpot_ms_p50"),
            healthy=self.is_running,
        )

    def snapshot(self) -> dict | None:
        """The engine's last ``stats()`` as a dict (the dashboard's engine panel)."""
        return self._stats

    def gauges(self) -> Iterator[Sample]:
        if self._stats is not None:
            yield from engine_gauges(self._stats)

    # -- requests ----------------------------------------------------------------------

    async def check(self, kind: str, data: dict) -> None:
        """Raise the gateway error the engine would answer ``data`` with, if any."""
        response = await self._post(kind, data, [_VALIDATE])
        response.close()

    async def reply(
        self, kind: str, data: dict, request_id: str, ping: float, rank: int = 0, deadline: float | None = None
    ) -> EngineStreamReply:
        """Send the request to the engine; its reply once the engine has its first token (or,
        not streaming, its answer). ``rank`` and ``deadline`` as ``EdgeBackend.reply``."""
        data = {**data, "priority": "interactive" if rank == 0 else "batch"}
        headers = [(b"x-request-id", request_id.encode()), (_STAGES_HEADER, b"1")]
        if deadline is not None:
            left = max(0.001, deadline - time.monotonic())
            headers.append((b"x-latency-budget-ms", b"%d" % max(1, math.floor(left * 1000))))
        response = await self._post(kind, data, headers)
        limits = self._limits
        return EngineStreamReply(
            response, data.get("stream") is True, ping, self._read_timeout, limits.max_event_bytes, limits.max_response_bytes
        )

    async def _post(self, kind: str, data: dict, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        try:
            response = await self.pool.request(b"POST", _PATHS[kind], [_JSON_BODY, *headers], orjson.dumps(data))
        except GatewayError as exc:
            if self._stats is None:  # it has never answered: the node is still loading the model
                raise NoHealthyUpstream("the edge engine is loading its model; retry shortly", retry_after=5.0) from None
            raise NoHealthyUpstream(f"the edge engine cannot be reached: {exc.message}", retry_after=1.0) from None
        if response.status < 300:
            return response
        try:
            body = await response.body.read_all(5.0, _MAX_ERROR_BYTES)
        except GatewayError:
            body = b""
        finally:
            response.close()
        raise _error(response.status, body, response.header(b"retry-after"))


def engine_gauges(stats: dict) -> Iterator[Sample]:
    """The edge engine's gauges for /metrics from its ``stats()`` (as a dict)."""
    yield "edgegw_edge_waiting", "Sequences waiting in the edge engine.", {}, stats["num_waiting"]
    yield "edgegw_edge_running", "Sequences running in the edge engine.", {}, stats["num_running"]
    yield "edgegw_edge_kv_blocks_used", "KV cache blocks in use.", {}, stats["num_kv_blocks_used"]
    yield "edgegw_edge_kv_blocks_total", "KV cache blocks in the pool.", {}, stats["num_kv_blocks_total"]
    yield "edgegw_edge_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.", {}, stats["prefix_cache_hit_rate"]
    yield "edgegw_edge_preemptions", "Sequences preempted since start.", {}, stats["num_preemptions"]
    yield "edgegw_edge_finished", "Sequences run to their end since start (not those dropped or aborted).", {}, stats["num_requests_finished"]
    yield "edgegw_edge_deadline_drops", "Requests dropped unrun in the engine's queue, their deadline passed.", {}, stats["num_deadline_drops"]
    if stats["ttft_ms_p50"] is not None:
        yield "edgegw_edge_ttft_p50_seconds", "Recent median TTFT of the engine.", {}, stats["ttft_ms_p50"] / 1e3
    if stats["tpot_ms_p50"] is not None:
        yield "edgegw_edge_tpot_p50_seconds", "Recent median time per output token.", {}, stats["tpot_ms_p50"] / 1e3
