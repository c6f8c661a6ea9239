"""The edge engine in this process: ``EdgeBackend``.

Imported only when ``edge.enabled`` is set and the engine runs in-process: the engine needs
torch (the ``engine`` extra), and a gateway that only relays should neither need it
installed nor pay for importing it. Preparing a request (chat template, tokenising: work
that grows with the prompt) runs on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from edge_engine import Engine, EngineError, OpenAIServing
from gateway.core.deadline import Deadline
from gateway.core.settings import EdgeSettings
from gateway.engine.base import edge_stats, engine_gauges, engine_request
from gateway.observe import GaugeSample
from gateway.replies import EngineReply, engine_error
from routing import EdgeStats

__all__ = ["EdgeBackend"]


class EdgeBackend:
    """The engine, its OpenAI seam, and what routing needs to know about it
    (``gateway.engine.EdgeEngine``)."""

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

    @property
    def structured_output(self) -> bool:
        """The engine has a grammar library (llguidance) to hold outputs to schemas and tools."""
        return self.engine.grammar is not None

    async def check(self, kind: str, data: dict) -> None:
        try:
            await asyncio.to_thread(self.serving.prepare, kind, data, checked=True)
        except EngineError as exc:
            raise engine_error(exc) from None

    async def reply(self, kind: str, data: dict, request_id: str, ping: float, rank: int, deadline: Deadline) -> EngineReply:
        """Prepare (off the event loop) and return the engine's reply."""
        try:
            prepared = await asyncio.to_thread(
                self.serving.prepare, kind, engine_request(data, rank), deadline=deadline.at, checked=True
            )
        except EngineError as exc:
            raise engine_error(exc) from None
        return EngineReply(self.serving, prepared, request_id, ping)

    def stats(self) -> EdgeStats:
        return edge_stats(self.engine.stats().as_dict(), self.engine.is_running)

    @property
    def structured_output(self) -> bool:
        return self.stats().structured_output

    def snapshot(self) -> dict:
        return self.engine.stats().as_dict()

    def gauges(self) -> Iterator[GaugeSample]:
        return engine_gauges(self.engine.stats().as_dict())
