"""From a run's request records to its ``RunSummary``: percentiles, throughput, goodput,
errors, the gateway's own time, and the load generator's cost.

Definitions (``openai.py`` measures the raw times):

- TTFT: request start -> first content token (non-streaming: the whole answer);
- TPOT: (E2E − TTFT) / (output tokens − 1), streamed requests with 2+ tokens;
- ITL: the gaps between consecutive content chunks, all of a run's streams pooled;
- E2E: request start -> last byte;
- throughput: completed requests (and their output tokens) per second of the run's wall
  time, from its first request to the end of its last;
- goodput: requests that met every ``--goodput`` bound, per second of the same wall time.

Latency figures cover the requests that succeeded; failures are counted by kind.
Percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from loadgen.gateway_headers import own_ms, parse_route, parse_server_timing
from loadgen.result import ClientFigures, Distribution, GatewayFigures, Goodput, RunSummary, Samples
from loadgen.types import RequestRecord

__all__ = ["RunFacts", "describe", "percentile", "summarise"]


def percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of already sorted values, interpolated linearly."""
    if not ordered:
        raise ValueError("no values")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Iterable[float], scale: float = 1e3) -> Distribution:
    """Count, mean, p50/p90/p95/p99 and max; seconds in, milliseconds out by default."""
    ordered = sorted(v * scale for v in values)
    if not ordered:
        return Distribution()
    return Distribution(
        count=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
        max=ordered[-1],
    )


class RunFacts:
    """What the runner knows about a run besides its records."""

    __slots__ = ("started_at", "wall", "cpu", "connections", "interrupted", "server")

    def __init__(self, started_at: str, wall: float, cpu: float, connections: int, interrupted: bool, server: str | None) -> None:
        self.started_at = started_at
        self.wall = wall
        self.cpu = cpu
        self.connections = connections
        self.interrupted = interrupted
        self.server = server


def summarise(records: list[RequestRecord], facts: RunFacts, goodput_ms: dict[str, float] | None = None) -> RunSummary:
    records = sorted(records, key=lambda r: r.start)
    ok = [r for r in records if r.error is None]
    wall = facts.wall
    errors = Counter(r.error for r in records if r.error is not None)
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error not in examples:
            examples[r.error] = r.detail
    output_tokens = sum(r.output_tokens for r in ok)
    reported_input = [r.input_tokens for r in ok if r.input_tokens is not None]
    return RunSummary(
        started_at=facts.started_at,
        duration_s=wall,
        interrupted=facts.interrupted,
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(errors.most_common()),
        error_examples=examples,
        send_rate=_send_rate(records),
        request_throughput=len(ok) / wall if wall > 0 else 0.0,
        output_throughput=output_tokens / wall if wall > 0 else 0.0,
        total_input_tokens=sum(reported_input) if reported_input else None,
        total_output_tokens=output_tokens,
        ttft_ms=describe(r.ttft for r in ok if r.ttft is not None),
        tpot_ms=describe(t for r in ok if (t := r.tpot) is not None),
        itl_ms=describe(gap for r in ok for gap in r.itl),
        e2e_ms=describe(r.e2e for r in ok if r.e2e is not None),
        goodput=_goodput(records, goodput_ms, wall) if goodput_ms else None,
        client=_client(records, facts),
        gateway=_gateway(records),
        server=facts.server,
        samples=_samples(records),
    )


def _send_rate(records: list[RequestRecord]) -> float | None:
    if len(records) < 2:
        return None
    span = records[-1].start - records[0].start
    return (len(records) - 1) / span if span > 0 else None


def meets(record: RequestRecord, bounds_ms: dict[str, float]) -> bool:
    """Whether a request succeeded within every bound (a TPOT that does not apply, with a
    single output token, is met)."""
    if record.error is not None:
        return False
    for name, bound in bounds_ms.items():
        value = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}[name]
        if value is None:
            if name == "tpot":
                continue
            return False
        if value * 1e3 > bound:
            return False
    return True


def _goodput(records: list[RequestRecord], bounds_ms: dict[str, float], wall: float) -> Goodput:
    good = sum(1 for r in records if meets(r, bounds_ms))
    return Goodput(
        bounds_ms=bounds_ms,
        requests=good,
        per_s=good / wall if wall > 0 else 0.0,
        share=good / len(records) if records else 0.0,
    )


def _client(records: list[RequestRecord], facts: RunFacts) -> ClientFigures:
    return ClientFigures(
        cpu_s=facts.cpu,
        cpu_ms_per_request=facts.cpu / len(records) * 1e3 if records else None,
        cpu_share=facts.cpu / facts.wall if facts.wall > 0 else 0.0,
        lag_ms=describe(max(0.0, r.lag) for r in records),
        connections=facts.connections,
    )


def _gateway(records: list[RequestRecord]) -> GatewayFigures | None:
    timed = [(r, parse_server_timing(r.server_timing)) for r in records if r.server_timing is not None]
    routes = Counter(parse_route(r.route) for r in records if r.route is not None)
    cache = Counter(r.x_cache.strip().upper() for r in records if r.x_cache is not None)
    if not timed and not routes and not cache:
        return None
    names: dict[str, None] = {}  # stage names in first-seen order, total last
    for _, stages in timed:
        names.update(dict.fromkeys(stages))
    if names.pop("total", 0) is None:
        names["total"] = None
    answered = sum(cache.values())
    return GatewayFigures(
        responses=len(timed),
        stages_ms={n: describe((s[n] for _, s in timed if n in s), scale=1.0) for n in names},
        own_ms=describe((own for _, s in timed if (own := own_ms(s)) is not None), scale=1.0),
        routes=dict(routes.most_common()),
        cache=dict(cache.most_common()),
        cache_hit_share=cache.get("HIT", 0) / answered if answered else None,
    )


def _samples(records: list[RequestRecord]) -> Samples:
    return Samples(
        start_s=[r.start for r in records],
        ttft_ms=[r.ttft * 1e3 if r.error is None and r.ttft is not None else None for r in records],
        e2e_ms=[r.e2e * 1e3 if r.error is None and r.e2e is not None else None for r in records],
        output_tokens=[r.output_tokens for r in records],
        error=[r.error for r in records],
    )
