"""What a relay worker knows about the node it runs on (``listen.workers`` > 1, or
``edge.process``).

``edgegw serve`` then runs a supervising parent (``gateway.workers``) that makes a private
run directory (mode 0700) and hands each worker a ``Node``: the worker's number, how many
there are, and where the node's Unix sockets live. In that directory:

- ``engine.sock``: the node's one edge engine (``edge_engine.server`` in its own process),
  which every worker reaches through its HTTP/1.1 pool;
- ``worker-N.sock``: worker N's own listener, serving the same app as the public port; a
  worker asked for ``/metrics`` reads its siblings' counts from there (``gateway.metrics_node``).

A single-process gateway (the default) has no ``Node``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Node"]


@dataclass(frozen=True, slots=True)
class Node:
    index: int  # this worker's number, 0 .. workers - 1
    workers: int  # relay workers on the node
    rundir: str  # the node's private directory of Unix sockets

    @property
    def engine_socket(self) -> str:
        return os.path.join(self.rundir, "engine.sock")

    def worker_socket(self, index: int) -> str:
        return os.path.join(self.rundir, f"worker-{index}.sock")

    @property
    def siblings(self) -> list[str]:
        """The other workers' own sockets."""
        return [self.worker_socket(i) for i in range(self.workers) if i != self.index]
