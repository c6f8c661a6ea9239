"""engine/: the edge engine behind one interface (``EdgeEngine``), wherever it runs.

Owns: the in-process backend (``local.py``, imported only when the engine runs in this
process: it needs torch) and the client of the node's engine process (``process.py``), the
priority mapping, the stats builder and the gauges they share (``base.py``). Their replies
and the one map of the engine's errors are ``gateway.replies.engine``'s.

May import: ``gateway.replies``, ``gateway.upstream`` (the pool over the engine's socket),
``gateway.observe``, ``gateway.core``, ``routing``, ``edge_engine`` (``local.py`` only, and
``edge_engine.errors`` anywhere).
"""

from gateway.engine.base import EdgeEngine, edge_stats, engine_gauges, engine_request
from gateway.engine.process import EdgeClient

__all__ = ["EdgeClient", "EdgeEngine", "edge_stats", "engine_gauges", "engine_request"]
