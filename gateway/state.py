"""What the running gateway holds: built once in the lifespan, passed to every endpoint."""

from __future__ import annotations

from gateway.caching import CacheLayer
from gateway.dispatch import Dispatcher
from gateway.observability import Metrics
from gateway.settings import Settings

__all__ = ["State"]


class State:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.dispatcher = Dispatcher(settings, metrics)
        self.cache = CacheLayer(settings.cache, metrics.registry)
        self.in_flight = 0
        self.draining = False
        self.started = False

    async def start(self) -> None:
        await self.dispatcher.start()
        self.metrics.watch(self.dispatcher.live_metrics)
        await self.cache.start()
        self.started = True

    async def aclose(self) -> None:
        await self.cache.aclose()
        await self.dispatcher.aclose()
