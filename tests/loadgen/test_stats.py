"""Percentiles, the per-request definitions (TPOT, goodput) and a run's summary, on
records built by hand: no sockets, no clock."""

from __future__ import annotations

import random

import numpy
import pytest

from loadgen.stats import RunFacts, describe, meets, percentile, summarise
from loadgen.types import ErrorKind, RequestRecord


def record(i: int, ttft: float = 0.1, e2e: float = 0.5, tokens: int = 5, error: str | None = None, **kw) -> RequestRecord:
    r = RequestRecord(index=i, ready=i * 0.1, start=i * 0.1, error=error, streamed=True, ttft=ttft, e2e=e2e, output_tokens=tokens, **kw)
    return r


def facts(wall: float = 2.0) -> RunFacts:
    return RunFacts("2026-11-30T00:00:00+00:00", wall, cpu=0.5, connections=3, interrupted=False, server=None)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_interpolates_like_numpy(n):
    rng = random.Random(n)
    values = sorted(rng.expovariate(1.0) for _ in range(n))
    for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)), rel=1e-12)


def test_describe_reports_milliseconds_and_an_empty_distribution_is_all_none():
    d = describe([0.001, 0.002, 0.003, 0.004])
    assert (d.count, d.mean, d.p50, d.max) == (4, pytest.approx(2.5), pytest.approx(2.5), pytest.approx(4.0))
    empty = describe([])
    assert empty.count == 0 and empty.p99 is None and empty.mean is None


def test_tpot_excludes_the_first_token_and_needs_two():
    assert record(0, ttft=0.1, e2e=0.5, tokens=5).tpot == pytest.approx(0.1)
    assert record(0, tokens=1).tpot is None
    assert RequestRecord(0, 0, 0, ttft=0.2, e2e=0.2, output_tokens=5, streamed=False).tpot is None  # whole answers
    assert record(0, error="http_500").tpot is None


@pytest.mark.parametrize(
    "bounds,expected",
    [
        pytest.param({"ttft": 100}, True, id="ttft-met-at-the-bound"),
        pytest.param({"ttft": 99}, False, id="ttft-missed"),
        pytest.param({"tpot": 100, "e2e": 500}, True, id="tpot-and-e2e-met"),
        pytest.param({"e2e": 499}, False, id="e2e-missed"),
    ],
)
def test_goodput_bounds(bounds, expected):
    assert meets(record(0, ttft=0.1, e2e=0.5, tokens=5), bounds) is expected


def test_a_failed_request_never_meets_goodput_and_a_single_token_meets_any_tpot():
    assert not meets(record(0, error=ErrorKind.TIMEOUT), {"ttft": 10_000})
    assert meets(record(0, tokens=1), {"tpot": 0.001})


def test_summary_counts_errors_by_kind_and_keeps_latencies_of_successes_only():
    records = [record(i) for i in range(6)]
    records += [record(6, error="http_503", detail="busy"), record(7, error="http_503"), record(8, error=ErrorKind.TIMEOUT, ttft=9, e2e=9)]
    summary = summarise(records, facts(wall=2.0), {"ttft": 150})
    assert (summary.requests, summary.completed, summary.failed) == (9, 6, 3)
    assert summary.errors == {"http_503": 2, "timeout": 1}
    assert summary.error_examples["http_503"] == "busy"
    assert summary.ttft_ms.count == 6 and summary.ttft_ms.max == pytest.approx(100.0)
    assert summary.request_throughput == pytest.approx(3.0)
    assert summary.output_throughput == pytest.approx(15.0)
    assert summary.goodput.requests == 6 and summary.goodput.share == pytest.approx(6 / 9)
    assert summary.metrics()["error_rate"] == pytest.approx(3 / 9)
    assert summary.samples.error.count(None) == 6 and len(summary.samples.start_s) == 9


def test_itl_pools_every_gap_of_every_stream():
    a = record(0, itl=[0.01, 0.01, 0.03])
    b = record(1, itl=[0.02])
    summary = summarise([a, b], facts())
    assert summary.itl_ms.count == 4
    assert summary.itl_ms.mean == pytest.approx(17.5)
    assert summary.itl_ms.max == pytest.approx(30.0)


def test_gateway_figures_come_from_edgegw_headers():
    timing = 'admit;dur=0.100, cache;dur=0.050, route;dur=0.020, pool;dur=0.030, upstream;dur=40.0;desc="first byte, attempt 2", total;dur=40.3'
    records = [
        record(0, server_timing="cache;dur=0.05, total;dur=0.2", route="target=cache; model=m", x_cache="HIT"),
        record(1, server_timing=timing, route="target=endpoint; cluster=central; endpoint=http://x; model=m", x_cache="MISS"),
    ]
    g = summarise(records, facts()).gateway
    assert g is not None and g.responses == 2
    assert list(g.stages_ms) == ["cache", "admit", "route", "pool", "upstream", "total"]  # as first seen, total last
    assert g.stages_ms["upstream"].count == 1 and g.stages_ms["upstream"].p50 == pytest.approx(40.0)
    assert g.own_ms.max == pytest.approx(0.2)  # admit + cache + route + pool; upstream and total excluded
    assert g.routes == {"cache": 1, "cluster:central": 1}
    assert g.cache_hit_share == pytest.approx(0.5)


def test_no_gateway_figures_from_a_plain_server():
    assert summarise([record(0)], facts()).gateway is None
