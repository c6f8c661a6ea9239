"""The one interface both edge-engine backends implement, and what they share: how a
tenant's class becomes the engine's priority, how the engine's stats become routing's
``EdgeStats`` and the gauges of ``/metrics``.

The backends: ``local.EdgeBackend`` (the engine in this process; needs torch) and
``process.EdgeClient`` (the node's engine process behind a Unix socket; needs no torch).
Their errors are mapped by one table (``gateway.replies.engine.ENGINE_ERRORS``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from gateway.core.deadline import Deadline
from gateway.observe import GaugeSample
from gateway.replies import Reply
from routing import EdgeStats

__all__ = ["EdgeEngine", "edge_stats", "engine_gauges", "engine_request"]


class EdgeEngine(Protocol):
    """What the pipeline asks of the edge engine, wherever it runs."""

    model_name: str  # the model name clients ask for

    @property
    def structured_output(self) -> bool:
        """It honours ``response_format`` (JSON object / schema) and ``tools`` by constrained
        decoding; when False, routing keeps such requests off the edge."""

    @property
    def is_running(self) -> bool:
        """It can take requests now."""

    async def check(self, kind: str, data: dict) -> None:
        """Raise the gateway error the engine would answer ``data`` with, if any."""

    async def reply(self, kind: str, data: dict, request_id: str, ping: float, rank: int, deadline: Deadline) -> Reply:
        """The engine's reply to ``data`` (its status and headers in hand). ``rank`` is the
        tenant's priority class (0 interactive): the engine runs the more urgent classes
        first, preempts or parks less urgent sequences for them and keeps each class's
        ``edge.tpot_ms``, whatever the request body says. A request the engine predicts
        cannot start before ``deadline`` or keep its class's TPOT objective is refused at
        once (503, ``Overloaded``: the dispatcher tries the next target); one still waiting
        in the engine when ``deadline`` passes is dropped unrun (504 ``deadline_exceeded``)."""

    def stats(self) -> EdgeStats:
        """What routing needs to know about it, ``structured_output`` included."""

    @property
    def structured_output(self) -> bool:
        """The engine honours ``tools``, ``tool_choice`` and ``response_format`` (constrained
        decoding). False unless the engine's ``stats()`` says ``structured_output: true``:
        until then routing sends a request asking for structure elsewhere, or refuses it."""

    def snapshot(self) -> dict | None:
        """Its ``stats()`` as a dict (the dashboard's engine panel); None when unknown."""

    def gauges(self) -> Iterator[GaugeSample]:
        """Its gauges for /metrics."""

    async def aclose(self) -> None: ...


_CLASSES = ("interactive", "standard", "batch")  # by rank (gateway.core.tenant.PRIORITY_CLASSES)


def engine_request(data: dict, rank: int) -> dict:
    """The request body the engine gets: the client's, with the tenant's class as its
    ``priority`` (the engine has the same three classes, each its own TPOT objective)."""
    return {**data, "priority": _CLASSES[min(max(rank, 0), 2)]}


def edge_stats(stats: dict | None, healthy: bool) -> EdgeStats:
    """Routing's view of the engine from its ``stats()`` as a dict (None: nothing known)."""
    s = stats or {}
    return EdgeStats(
        queue_depth=s.get("num_waiting", 0),
        running=s.get("num_running", 0),
        kv_blocks_free=s.get("num_kv_blocks_free", 0),
        kv_blocks_total=s.get("num_kv_blocks_total", 0),
        block_size=s.get("block_size", 16),
        recent_ttft_ms=s.get("ttft_ms_p50"),
        recent_tpot_ms=s.get("tpot_ms_p50"),
        healthy=healthy,
        structured_output=s.get("structured_output") is True,  # the engine says so, or it has none
    )


def engine_gauges(stats: dict) -> Iterator[GaugeSample]:
    """The edge engine's gauges for /metrics from its ``stats()`` (as a dict)."""
    yield "edgegw_edge_waiting", "Sequences waiting in the edge engine.", {}, stats["num_waiting"]
    yield "edgegw_edge_running", "Sequences running in the edge engine.", {}, stats["num_running"]
    yield "edgegw_edge_kv_blocks_used", "KV cache blocks in use.", {}, stats["num_kv_blocks_used"]
    yield "edgegw_edge_kv_blocks_total", "KV cache blocks in the pool.", {}, stats["num_kv_blocks_total"]
    yield "edgegw_edge_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.", {}, stats["prefix_cache_hit_rate"]
    yield "edgegw_edge_preemptions", "Sequences preempted since start.", {}, stats["num_preemptions"]
    yield "edgegw_edge_finished", "Sequences run to their end since start (not those dropped or aborted).", {}, stats["num_requests_finished"]
    yield "edgegw_edge_deadline_drops", "Requests dropped unrun in the engine's queue, their deadline passed.", {}, stats["num_deadline_drops"]
    yield "edgegw_edge_refused", "Requests the engine refused at admission: budget or TPOT objective predicted unattainable.", {}, stats["num_refused"]
    yield "edgegw_edge_parked_rows", "Row-steps the engine left out to keep a class's TPOT objective.", {}, stats["num_parked_rows"]
    yield "edgegw_edge_step_per_row_seconds", "The engine's fitted step cost per decode row.", {}, stats["step_per_row_ms"] / 1e3
    if stats["ttft_ms_p50"] is not None:
        yield "edgegw_edge_ttft_p50_seconds", "Recent median TTFT of the engine.", {}, stats["ttft_ms_p50"] / 1e3
    if stats["tpot_ms_p50"] is not None:
        yield "edgegw_edge_tpot_p50_seconds", "Recent median time per output token.", {}, stats["tpot_ms_p50"] / 1e3
