"""The latency regression gate: this run's medians against a baseline result's medians.

A metric regresses by its relative change in the bad direction: up for latencies
(``*_ms``), down for rates (``request_throughput``, ``output_throughput``, ``goodput``).
The gate fails when any chosen metric regresses by more than ``--max-regression`` (0.10 =
10 %), or when this run's failed share exceeds ``--max-error-rate``: requests that fail
fast would otherwise make a broken release look quick. Medians over ``--repeat`` runs on
both sides keep one noisy run from deciding.

Workload parameters that differ between the two results (rate, concurrency, lengths,
model...) make the comparison doubtful; they are listed as notes, not failures, since a
deliberate change (a new model name) is legitimate.
"""

from __future__ import annotations

from loadgen.result import LATENCIES, STATS, BenchResult, GateOutcome, GateRow

__all__ = ["DEFAULT_METRICS", "GateError", "check_baseline", "compare", "known_metrics", "resolve_metrics"]

DEFAULT_METRICS = ("p95_ttft_ms", "p95_e2e_ms")
RATES = ("request_throughput", "output_throughput", "goodput")
_COMPARED_PARAMETERS = (
    "endpoint",
    "model",
    "stream",
    "num_prompts",
    "duration_s",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "dataset",
    "input_len",
    "output_len",
    "range_ratio",
    "seed",
    "goodput_ms",
    "extra_body",
)


class GateError(ValueError):
    """The comparison cannot be made (an unknown metric, one the baseline lacks)."""


def known_metrics() -> list[str]:
    latency = [f"{stat}_{name}_ms" for name in (*LATENCIES, "gateway") for stat in STATS]
    return latency + list(RATES)


def resolve_metrics(spec: str) -> list[str]:
    """``"p95_ttft_ms,median_e2e_ms"`` -> names; ``median_`` is read as ``p50_``
    (``vllm bench serve``'s spelling)."""
    known = set(known_metrics())
    names = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        if name.startswith("median_"):
            name = "p50_" + name[len("median_") :]
        if name not in known:
            raise GateError(f"unknown metric {raw.strip()!r}; known: {', '.join(known_metrics())}")
        names.append(name)
    if not names:
        raise GateError("no metric to compare")
    return names


def _change(metric: str, baseline: float, current: float) -> float | None:
    """Relative change, positive when worse; None when the baseline is zero."""
    if baseline == 0:
        return None
    delta = (current - baseline) / baseline
    return -delta if metric in RATES else delta


def _row(metric: str, baseline: float, current: float | None, max_regression: float) -> GateRow:
    rule = f"{'−' if metric in RATES else '+'}{max_regression:.0%} at most"
    if current is None:  # nothing measured now (every request failed): a regression
        return GateRow(metric=metric, baseline=baseline, current=None, change=None, rule=rule, passed=False)
    change = _change(metric, baseline, current)
    if change is None:
        passed = metric in RATES or current <= 0
    else:
        passed = change <= max_regression
    return GateRow(metric=metric, baseline=baseline, current=current, change=change, rule=rule, passed=passed)


def _error_row(baseline: BenchResult, current: BenchResult, max_error_rate: float) -> GateRow:
    now = current.median.get("error_rate")
    return GateRow(
        metric="error_rate",
        baseline=baseline.median.get("error_rate"),
        current=now,
        change=None,
        rule=f"≤ {max_error_rate:.1%}",
        passed=now is not None and now <= max_error_rate,
    )


def _notes(baseline: BenchResult, current: BenchResult) -> list[str]:
    old, new = baseline.parameters, current.parameters
    notes = []
    for name in _COMPARED_PARAMETERS:
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            notes.append(f"{name} differs: baseline {a!r}, this run {b!r}")
    return notes


def check_baseline(baseline: BenchResult, metrics: list[str], baseline_file: str) -> None:
    """Raise ``GateError`` unless the baseline has a figure for every metric (checked
    before a run, so that a useless baseline costs no load)."""
    missing = [m for m in metrics if baseline.median.get(m) is None]
    if missing:
        raise GateError(f"{baseline_file}: the baseline has no figure for {', '.join(missing)}")


def compare(
    baseline: BenchResult,
    current: BenchResult,
    metrics: list[str],
    max_regression: float,
    max_error_rate: float,
    baseline_file: str,
) -> GateOutcome:
    check_baseline(baseline, metrics, baseline_file)
    rows = [_row(m, baseline.median[m], current.median.get(m), max_regression) for m in metrics]
    rows.append(_error_row(baseline, current, max_error_rate))
    return GateOutcome(
        baseline_file=baseline_file,
        max_regression=max_regression,
        max_error_rate=max_error_rate,
        rows=rows,
        passed=all(row.passed for row in rows),
        notes=_notes(baseline, current),
    )
