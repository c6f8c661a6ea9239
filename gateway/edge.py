"""The in-process edge engine as a gateway backend: ``EdgeBackend`` and its ``EngineReply``.

Imported only when ``edge.enabled`` is set: the engine needs torch (the ``engine`` extra),
and a gateway that only relays should neither need it installed nor pay for importing it
(which is also why ``EngineReply`` lives here and not beside the other kinds of ``Reply``).
Engine errors are translated into ``gateway.errors`` here. Preparing a request (chat
template, tokenising: work that grows with the prompt) runs on a worker thread, never on
the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from edge_engine import DeadlineExceededError, Engine, EngineError, EngineOverloadedError, InvalidRequestError, OpenAIServing
from edge_engine.serving import PreparedRequest
from gateway.edge_client import engine_gauges
from gateway.errors import GatewayError, InvalidRequest, NoHealthyUpstream, Overloaded, UpstreamError, UpstreamTimeout
from gateway.observability import Sample
from gateway.relay import DONE, sse_event
from gateway.replies import JSON, SSE, Paced, Reply
from gateway.settings import EdgeSettings
from routing import EdgeStats

__all__ = ["EdgeBackend", "EngineReply", "engine_error"]


def engine_error(exc: EngineError) -> GatewayError:
    if isinstance(exc, InvalidRequestError):
        return InvalidRequest(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, EngineOverloadedError):
        return Overloaded(exc.message, code=exc.code, retry_after=exc.retry_after)
    if isinstance(exc, DeadlineExceededError):  # dropped in the engine's queue, never run
        return UpstreamTimeout(exc.message, code="deadline_exceeded")
    if exc.status_code == 503:
        return NoHealthyUpstream(exc.message, code=exc.code, retry_after=1.0)
    return UpstreamError(exc.message, code=exc.code or "engine_error")


class EngineReply(Reply):
    """The edge engine's answer. Streams pull one chunk at a time from the engine's
    iterator; cancelling (``aclose``) removes the sequence and frees its KV blocks."""

    label = "edge"

    def __init__(self, serving: OpenAIServing, prepared: PreparedRequest, request_id: str, ping: float) -> None:
        self._serving = serving
        self._prepared = prepared
        self._request_id = request_id
        self._ping = ping
        self.headers = [SSE if prepared.stream else JSON]
        self._chunks: Paced | None = None
        self._done = False

    async def read_body(self) -> bytes:
        try:
            return await self._serving.complete(self._prepared, self._request_id)
        except EngineError as exc:
            raise engine_error(exc) from None

    async def next_events(self) -> bytes | None:
        if self._done:
            return b""
        if self._chunks is None:
            self._chunks = Paced(self._serving.stream(self._prepared, self._request_id), self._ping)
        try:
            chunk = await self._chunks.next()
        except StopAsyncIteration:
            self._done = True
            return DONE
        except EngineError as exc:
            self._done = True
            raise engine_error(exc) from None
        if chunk is Paced.QUIET:
            return None
        return sse_event(chunk)

    @property
    def stages(self) -> tuple[tuple[str, float], ...]:
        times = self._prepared.times
        if times is None:  # not ended (or ended in an error)
            return ()
        return (("engine_queue", times.queue), ("engine_prefill", times.prefill), ("engine_decode", times.decode))

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()
        if self.slot is not None:
            self.slot.release()


class EdgeBackend:
    """The engine, its OpenAI seam, and what routing needs to know about it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.serving = OpenAIServing(engine, engine.model_name)
        self.model_name = engine.model_name

    @classmethod
    async def start(cls, settings: EdgeSettings) -> EdgeBackend:
        engine = await asyncio.to_thread(Engine, settings.engine_config())
        await engine.start()
        return cls(engine)

    async def aclose(self) -> None:
        await self.engine.close()

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    async def check(self, kind: str, data: dict) -> None:
        """Raise the gateway error the engine would answer ``data`` with, if any."""
        try:
            await asyncio.to_thread(self.serving.prepare, kind, data, checked=True)
        except EngineError as exc:
            raise engine_error(exc) from None

    async def reply(
        self, kind: str, data: dict, request_id: str, ping: float, rank: int = 0, deadline: float | None = None
    ) -> EngineReply:
        """Prepare (off the event loop) and return the engine's reply. ``rank`` is the
        tenant's priority class (0 interactive): the engine runs interactive sequences first
        and preempts batch ones for them, whatever the request body says. ``deadline``
        (``time.monotonic()``, the request's budget): a sequence still waiting in the engine
        when it passes is dropped unrun (504 ``deadline_exceeded``)."""
        data = {**data, "priority": "interactive" if rank == 0 else "batch"}
        try:
            prepared = await asyncio.to_thread(self.serving.prepare, kind, data, deadline=deadline, checked=True)
        except EngineError as exc:
            raise engine_error(exc) from None
        return EngineReply(self.serving, prepared, request_id, ping)

    def stats(self) -> EdgeStats:
        stats = self.engine.stats()
        return EdgeStats(
            queue_depth=stats.num_waiting,
            running=stats.num_running,
            kv_blocks_free=stats.num_kv_blocks_free,
            kv_blocks_total=stats.num_kv_blocks_total,
            block_size=stats.block_size,
            recent_ttft_ms=stats.ttft_ms_p50,
            recent_tpot_ms=stats.tpot_ms_p50,
            healthy=self.engine.is_running,
        )

    def snapshot(self) -> dict:
        """The engine's ``stats()`` as a dict (the dashboard's engine panel)."""
        return self.engine.stats().as_dict()

    def gauges(self) -> Iterator[Sample]:
        return engine_gauges(self.engine.stats().as_dict())
