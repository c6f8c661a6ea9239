"""What a relay worker knows about the node it runs on (``listen.workers`` > 1, or
``edge.process``).

``edgegw serve`` then runs a supervising parent (``gateway.node.workers``) that makes a private
run directory (mode 0700) and hands each worker a ``Node``: the worker's number, how many
there are, and where the node's Unix sockets live. In that directory:

- ``engine.sock``: the node's one edge engine (``edge_engine.server`` in its own process),
  which every worker reaches through its HTTP/1.1 pool;
- ``worker-N.sock``: worker N's own listener, serving the same app as the public port; a
  worker asked for ``/metrics`` reads its siblings' counts from there (``Siblings``) and
  answers the node's totals (``gateway.observe.node_metrics``).

A single-process gateway (the default) has no ``Node``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import GatewayError
from gateway.observe.node_metrics import WORKER_SCOPE
from gateway.upstream import H1Pool, Origin, Timeouts

__all__ = ["BEAT_S", "Node", "Siblings"]

BEAT_S = 0.5


@dataclass(frozen=True, slots=True)
class Node:
    index: int  # this worker's number, 0 .. workers - 1
    workers: int  # relay workers on the node
    rundir: str  # the node's private directory of Unix sockets
    # shared with the parent: the worker's event loop writes time.monotonic() here every
    # ``BEAT_S`` (``beat``); the parent replaces a worker whose last beat is too old
    heartbeat: Any = None

    def beat(self) -> None:
        """Note, from the event loop, that it runs; and again in ``BEAT_S`` seconds."""
        if self.heartbeat is not None:
            self.heartbeat.value = time.monotonic()
            asyncio.get_running_loop().call_later(BEAT_S, self.beat)

    @property
    def engine_socket(self) -> str:
        return os.path.join(self.rundir, "engine.sock")

    def worker_socket(self, index: int) -> str:
        return os.path.join(self.rundir, f"worker-{index}.sock")


# -- the other workers' own sockets (the node's /metrics) ----------------------------------------

_FETCH_TIMEOUT_S = 2.0
_MAX_EXPOSITION_BYTES = 16 << 20


class Siblings:
    """This worker's way to the other workers' own sockets: a kept-alive connection to each
    through the gateway's lean HTTP/1.1 pool (``Origin(uds=...)``), opened on first use; a
    sibling being replaced is reconnected by the pool."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._pools: dict[int, H1Pool] = {}

    async def exposition(self, index: int) -> str | None:
        """Worker ``index``'s own /metrics exposition; None if it does not answer."""
        return await self.get(index, b"/metrics")

    async def get(self, index: int, target: bytes) -> str | None:
        """Worker ``index``'s own answer to ``GET target`` (asked with ``WORKER_SCOPE``); None
        if it does not answer 200."""
        pool = self._pools.get(index)
        if pool is None:
            origin = Origin("localhost", 0, None, b"localhost", b"http", uds=self.node.worker_socket(index))
            timeouts = Timeouts(connect=_FETCH_TIMEOUT_S, read=_FETCH_TIMEOUT_S, write=_FETCH_TIMEOUT_S, pool=_FETCH_TIMEOUT_S)
            pool = self._pools[index] = H1Pool(origin, max_connections=1, warm_connections=0, timeouts=timeouts, high_water=1 << 20)
        try:
            response = await pool.request(b"GET", target, [WORKER_SCOPE], b"")
            try:
                body = await response.body.read_all(_FETCH_TIMEOUT_S, _MAX_EXPOSITION_BYTES)
            finally:
                response.close()
        except GatewayError:
            return None
        return body.decode() if response.status == 200 else None

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()
        self._pools.clear()
