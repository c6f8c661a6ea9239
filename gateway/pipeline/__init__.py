"""pipeline/: what answers an admitted request, and how it is opened.

Owns: the flow (``flow.py``: cache plan, hit, coalesce, route, open, cascade, record), the
exact-response cache on the gateway's path (``caching.py``), routing's decision applied
(``dispatch.py``: admission by predicted wait, fallbacks, hedging), the queue in front of
every target (``queue.py``: priority classes, weighted fair queueing, deadlines) and the
fleet (``fleet.py``: the pools, the edge engine, the GeoIP database, routing's table and
live health, probes and model discovery), and the fleet under a reloaded configuration
(``refleet.py``).

May import: ``gateway.engine``, ``gateway.replies``, ``gateway.upstream``,
``gateway.observe``, ``gateway.core``, ``routing``, ``cache``. Not admission (the request
arrives admitted, in its ``RequestContext``) nor the relay (it hands back an ``Answer``).
"""

from gateway.pipeline.caching import BYPASS, HIT, MISS, CacheLayer, Lookup, Recorder
from gateway.pipeline.dispatch import Dispatcher, Opened
from gateway.pipeline.fleet import ClusterPool, Fleet, HealthFeed
from gateway.pipeline.flow import Pipeline
from gateway.pipeline.queue import QueueDeadline, Slot, TargetQueue

__all__ = [
    "BYPASS",
    "HIT",
    "MISS",
    "CacheLayer",
    "ClusterPool",
    "Dispatcher",
    "Fleet",
    "HealthFeed",
    "Lookup",
    "Opened",
    "Pipeline",
    "QueueDeadline",
    "Recorder",
    "Slot",
    "TargetQueue",
]
