"""What the charts show, independent of how they are drawn (``plot.py`` for PNG,
``plot_html.py`` for HTML): per-run series, histograms with their percentiles, a title."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.result import BenchResult
from loadgen.stats import percentile

__all__ = ["Histogram", "RunSeries", "histogram", "run_series", "title"]


@dataclass(frozen=True, slots=True)
class RunSeries:
    """One run's requests, as the charts need them."""

    label: str
    ok_start_s: list[float]
    ttft_ms: list[float]
    e2e_ms: list[float]
    failed_start_s: list[float]


@dataclass(frozen=True, slots=True)
class Histogram:
    edges: list[float]  # bins + 1 boundaries
    counts: list[int]
    marks: dict[str, float]  # p50 / p95 / p99


def run_series(result: BenchResult) -> list[RunSeries]:
    series = []
    for i, run in enumerate(result.runs, 1):
        s = run.samples
        ok = [j for j, e in enumerate(s.error) if e is None and s.e2e_ms[j] is not None]
        series.append(
            RunSeries(
                label=f"run {i}",
                ok_start_s=[s.start_s[j] for j in ok],
                ttft_ms=[s.ttft_ms[j] if s.ttft_ms[j] is not None else math.nan for j in ok],
                e2e_ms=[s.e2e_ms[j] for j in ok],
                failed_start_s=[s.start_s[j] for j, e in enumerate(s.error) if e is not None],
            )
        )
    return series


def histogram(values: Sequence[float], bins: int = 40) -> Histogram:
    finite = sorted(v for v in values if not math.isnan(v))
    if not finite:
        return Histogram([0.0, 1.0], [0], {})
    low, high = finite[0], finite[-1]
    if high == low:
        high = low + max(abs(low) * 0.01, 1e-3)
    width = (high - low) / bins
    counts = [0] * bins
    for v in finite:
        counts[min(bins - 1, int((v - low) / width))] += 1
    marks = {f"p{q}": percentile(finite, q) for q in (50, 95, 99)}
    return Histogram([low + i * width for i in range(bins + 1)], counts, marks)


def title(result: BenchResult) -> str:
    p = result.parameters
    load = f"{p.num_prompts} requests" if p.num_prompts is not None else f"{p.duration_s:g} s"
    rate = "unlimited rate" if p.request_rate is None else f"{p.request_rate:g} req/s"
    conc = f", concurrency ≤ {p.max_concurrency}" if p.max_concurrency else ""
    return f"{p.base_url} · {p.model} · {load}, {rate}{conc} · {result.environment.started_at}"
