"""What a relay worker knows about the node it runs on (``listen.workers`` > 1, or
``edge.process``).

``edgegw serve`` then runs a supervising parent (``gateway.workers``) that makes a private
run directory (mode 0700) and hands each worker a ``Node``: the worker's number, how many
there are, and where the node's Unix sockets live. In that directory:

- ``engine.sock``: the node's one edge engine (``edge_engine.server`` in its own process),
  which every worker reaches through its HTTP/1.1 pool;
- ``worker-N.sock``: worker N's own listener, serving the same app as the public port; a
  worker asked for ``/metrics`` reads its siblings' counts from there and answers the node's
  totals (``node_families``).

A single-process gateway (the default) has no ``Node``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["BEAT_S", "WORKER_SCOPE", "Node", "node_families"]

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

    @property
    def siblings(self) -> list[str]:
        """The other workers' own sockets."""
        return [self.worker_socket(i) for i in range(self.workers) if i != self.index]


# -- /metrics: the node's totals ------------------------------------------------------------

WORKER_SCOPE = (b"x-edgegw-metrics", b"worker")  # asks a worker for its own counts only
_NODE_WIDE = "edgegw_edge_"  # gauges every worker reads from the same place (the engine): taken once
_FETCH_TIMEOUT_S = 2.0


async def node_families(node: Node, local: str) -> list[Metric]:
    """The node's metric families: this worker's (``local``, its exposition) and its
    siblings', read from their own sockets. Counters, histograms and summaries are summed;
    gauges keep one series per worker, labelled ``worker``, except the engine's, which are
    the node's already; the ``_created`` times, one worker's, are left out. A sibling that
    does not answer (being replaced) is left out too, and ``edgegw_workers_scraped`` says
    how many were counted."""
    texts = await asyncio.gather(*(_fetch(path) for path in node.siblings))
    workers = [(str(node.index), local)]
    for index, text in zip((i for i in range(node.workers) if i != node.index), texts):
        if text is not None:
            workers.append((str(index), text))
    merged: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple], float] = {}
    for worker, text in workers:
        for family in text_string_to_metric_families(text):
            node_wide = family.name.startswith(_NODE_WIDE)
            if family.name.endswith("_created") or (node_wide and worker != str(node.index)):
                continue
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type)
            per_worker = family.type in ("gauge", "info", "stateset") and not node_wide
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = {**sample.labels, "worker": worker} if per_worker else dict(sample.labels)
                key = (family.name, sample.name, tuple(sorted(labels.items())))
                values[key] = values.get(key, 0.0) + sample.value
    for (family_name, sample_name, labels), value in values.items():
        merged[family_name].add_sample(sample_name, dict(labels), value)
    scraped = Metric("edgegw_workers_scraped", "Workers whose counts this /metrics answer includes.", "gauge")
    scraped.add_sample("edgegw_workers_scraped", {}, len(workers))
    return [*merged.values(), scraped]


async def _fetch(path: str) -> str | None:
    """A sibling's own exposition, over its Unix socket; None if it does not answer."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), _FETCH_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        name, value = WORKER_SCOPE
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: worker\r\n%s: %s\r\nconnection: close\r\n\r\n" % (name, value))
        response = await asyncio.wait_for(reader.read(), _FETCH_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    return body.decode()
