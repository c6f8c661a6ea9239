"""The node's edge engine process as a gateway backend: ``EdgeClient``.

With ``listen.workers`` > 1 (or ``edge.process``) the engine runs once per node, in its own
process (``gateway.node.workers.run_engine``: ``edge_engine.server`` on ``engine.sock`` in the
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
- whether it can hold outputs to a schema or to tool calls (``structured_output``): from its
  stats, False until it has answered;
- routing's view of the engine (queue depth, KV blocks, recent TTFT/TPOT): ``GET /stats``
  polled every ``STATS_INTERVAL_S`` on a connection of its own; the engine counts as down
  when it has not answered for ``STALE_AFTER_S``.

Needs no torch: a relay worker never loads the model. Engine errors arrive as OpenAI-shaped
JSON with the engine's status: ``engine_error_of`` turns them back into the engine's own
errors, which the one table maps as it does in-process (``gateway.replies.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator

import orjson

from gateway.core.deadline import Deadline
from gateway.core.errors import GatewayError, NoHealthyUpstream
from gateway.core.settings import Settings
from gateway.engine.base import edge_stats, engine_gauges, engine_request
from gateway.observe import GaugeSample
from gateway.replies import STAGES_HEADER, EngineStreamReply, engine_error, engine_error_of
from gateway.upstream import H1Pool, Origin, Timeouts, UpstreamResponse
from routing import EdgeStats

__all__ = ["EdgeClient"]

logger = logging.getLogger("edgegw.edge")

STATS_INTERVAL_S = 0.05
STALE_AFTER_S = 2.0
READ_TIMEOUT_S = 300.0  # a sequence's tokens come one step of the whole batch apart; prefill may queue
_PATHS = {"chat": b"/v1/chat/completions", "completions": b"/v1/completions"}
_JSON_BODY = (b"content-type", b"application/json")
_VALIDATE = (b"x-validate-only", b"1")
_MAX_ERROR_BYTES = 64 * 1024


class EdgeClient:
    """The engine process behind a Unix socket: replies, the stats routing needs, gauges
    (``gateway.engine.EdgeEngine``)."""

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

    @property
    def structured_output(self) -> bool:
        """What the engine process says of itself in its stats (False until it has answered)."""
        return bool(self._stats and self._stats.get("structured_output"))

    def stats(self) -> EdgeStats:
        return edge_stats(self._stats, self.is_running)

    @property
    def structured_output(self) -> bool:
        return self.stats().structured_output

    def snapshot(self) -> dict | None:
        """The engine's last ``stats()`` as a dict (the dashboard's engine panel)."""
        return self._stats

    def gauges(self) -> Iterator[GaugeSample]:
        if self._stats is not None:
            yield from engine_gauges(self._stats)

    # -- requests ----------------------------------------------------------------------

    async def check(self, kind: str, data: dict) -> None:
        """Raise the gateway error the engine would answer ``data`` with, if any."""
        response = await self._post(kind, data, [_VALIDATE])
        response.close()

    async def reply(self, kind: str, data: dict, request_id: str, ping: float, rank: int, deadline: Deadline) -> EngineStreamReply:
        """Send the request to the engine; its reply once the engine has its first token (or,
        not streaming, its answer)."""
        data = engine_request(data, rank)
        headers = [(b"x-request-id", request_id.encode()), (STAGES_HEADER, b"1")]
        budget = deadline.header(time.monotonic())
        if budget is not None:
            headers.append((b"x-latency-budget-ms", budget))
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
        raise engine_error(engine_error_of(response.status, body, response.header(b"retry-after")))
