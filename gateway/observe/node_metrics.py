"""``/metrics`` on a node of workers: the node's totals from each worker's own counts.

A worker asked for ``/metrics`` reads its siblings' expositions from their own Unix sockets
(``gateway.node.Siblings``) and answers the sum (``node_families``); asked with
``WORKER_SCOPE`` it answers its own counts only.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["WORKER_SCOPE", "SiblingExpositions", "node_families"]

WORKER_SCOPE = (b"x-edgegw-metrics", b"worker")  # asks a worker for its own counts only
_NODE_WIDE = "edgegw_edge_"  # gauges every worker reads from the same place (the engine): taken once


class _Node(Protocol):
    index: int
    workers: int


class SiblingExpositions(Protocol):
    """Where the other workers' expositions come from (``gateway.node.Siblings``)."""

    node: _Node

    async def exposition(self, index: int) -> str | None: ...


async def node_families(siblings: SiblingExpositions, local: str) -> list[Metric]:
    """The node's metric families: this worker's (``local``, its exposition) and its
    siblings', read from their own sockets. Counters, histograms and summaries are summed;
    gauges keep one series per worker, labelled ``worker``, except the engine's, which are
    the node's already; the ``_created`` times, one worker's, are left out. A sibling that
    does not answer (being replaced) is left out too, and ``edgegw_workers_scraped`` says
    how many were counted."""
    node = siblings.node
    others = [i for i in range(node.workers) if i != node.index]
    texts = await asyncio.gather(*(siblings.exposition(i) for i in others))
    workers = [(str(node.index), local)]
    for index, text in zip(others, texts):
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
