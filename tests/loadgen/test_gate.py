"""The regression gate on results built from hand-made records: directions, limits, the
error-rate floor, medians over repetitions, and comparisons that cannot be made."""

from __future__ import annotations

import pytest

from loadgen.gate import GateError, compare, known_metrics, resolve_metrics
from loadgen.report import render_gate
from loadgen.result import BenchResult, Environment, Parameters, median_metrics
from loadgen.stats import RunFacts, summarise
from loadgen.types import RequestRecord

PARAMETERS = Parameters(
    base_url="http://127.0.0.1:1/v1", endpoint="chat", model="m", num_prompts=20, duration_s=None, request_rate=10.0,
    burstiness=1.0, max_concurrency=None, stream=True, dataset=None, input_len=32, output_len=8, range_ratio=0.0, seed=0,
    timeout_s=30.0, warmup=1, repeat=1, goodput_ms={}, header_names=[], extra_body={},
)
ENVIRONMENT = Environment(edgegw_version="0", python="3", platform="p", host="h", cpus=2, started_at="t", command=[])


def run(scale: float, failed: int = 0, wall: float = 2.0):
    """20 requests whose TTFT and E2E are ``scale`` times a fixed spread."""
    records = [
        RequestRecord(i, 0.0, i * 0.1, streamed=True, ttft=scale * (0.05 + 0.001 * i), e2e=scale * (0.2 + 0.002 * i), output_tokens=8)
        for i in range(20 - failed)
    ]
    records += [RequestRecord(100 + i, 0.0, 0.0, error="http_503") for i in range(failed)]
    return summarise(records, RunFacts("t", wall, 0.1, 1, False, None))


def result(*runs, **parameters) -> BenchResult:
    return BenchResult(
        parameters=PARAMETERS.model_copy(update=parameters), environment=ENVIRONMENT, runs=list(runs), median=median_metrics(list(runs))
    )


def gate(baseline: BenchResult, current: BenchResult, metrics=("p95_ttft_ms", "p95_e2e_ms"), limit=0.10, errors=0.01):
    return compare(baseline, current, list(metrics), limit, errors, "last.json")


def test_thirty_percent_slower_fails_and_the_same_passes():
    base = result(run(1.0))
    slower = gate(base, result(run(1.3)))
    assert not slower.passed
    assert [(r.metric, r.passed) for r in slower.rows] == [("p95_ttft_ms", False), ("p95_e2e_ms", False), ("error_rate", True)]
    assert slower.rows[0].change == pytest.approx(0.30)
    assert gate(base, result(run(1.0))).passed
    assert gate(base, result(run(1.08))).passed  # within 10 %
    assert gate(base, result(run(0.5))).passed  # faster is never a regression


def test_rates_regress_downwards():
    base = result(run(1.0, wall=2.0))
    fewer = gate(base, result(run(1.0, wall=2.5)), metrics=["request_throughput"])
    assert not fewer.passed and fewer.rows[0].change == pytest.approx(0.2)
    assert gate(base, result(run(1.0, wall=1.0)), metrics=["request_throughput"]).passed


def test_failing_fast_does_not_pass_the_gate():
    outcome = gate(result(run(1.0)), result(run(0.8, failed=4)))
    assert [r.passed for r in outcome.rows] == [True, True, False]
    assert outcome.rows[-1].current == pytest.approx(0.2)
    assert not outcome.passed
    assert gate(result(run(1.0)), result(run(1.0, failed=4)), errors=0.25).passed


def test_the_gate_uses_medians_over_repetitions():
    base = result(run(1.0), run(1.02), run(0.98))
    one_noisy_run = result(run(1.0), run(1.6), run(1.01))  # the median run is not slower
    assert gate(base, one_noisy_run).passed
    assert not gate(base, result(run(1.3), run(1.6), run(1.0))).passed


def test_different_workloads_are_noted_not_failed():
    outcome = gate(result(run(1.0)), result(run(1.0), request_rate=20.0, model="other"))
    assert outcome.passed
    assert outcome.notes == ["model differs: baseline 'm', this run 'other'", "request_rate differs: baseline 10.0, this run 20.0"]


def test_metric_names_and_the_vllm_spelling():
    assert resolve_metrics("p95_ttft_ms, median_e2e_ms,goodput") == ["p95_ttft_ms", "p50_e2e_ms", "goodput"]
    assert "p99_gateway_ms" in known_metrics()
    with pytest.raises(GateError, match="unknown metric 'p95_ttft'"):
        resolve_metrics("p95_ttft")
    with pytest.raises(GateError, match="no figure for goodput"):
        gate(result(run(1.0)), result(run(1.0)), metrics=["goodput"])


def test_nothing_measured_now_is_a_regression():
    outcome = gate(result(run(1.0)), result(run(1.0, failed=20)))
    assert outcome.rows[0].current is None and not outcome.rows[0].passed


def test_the_gate_table_shows_both_runs_and_the_verdict():
    text = render_gate(gate(result(run(1.0)), result(run(1.3))))
    assert "Gate against last.json" in text
    row = next(line for line in text.splitlines() if line.startswith("p95_ttft_ms"))
    assert "+30.0 %" in row and "REGRESSED" in row
    assert text.rstrip().endswith("FAIL: regression beyond the limit")
