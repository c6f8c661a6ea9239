"""The report as plain-text tables: what was run, throughput, latencies, errors, goodput,
edgegw's own figures when the server is an edgegw, the load generator's cost, and the
gate's verdict.

With ``--repeat K`` every figure shown is the median over the K runs (a latency table
cell is the median of that statistic), and a first table lists the headline figures of
each run so the spread is visible.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

from loadgen.result import STATS, BenchResult, Distribution, GateOutcome, Parameters, RunSummary

__all__ = ["render", "render_gate"]

_BUSY_CPU_SHARE = 0.8
_BUSY_LAG_MS = 10.0


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [str(row[0]).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return lines


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_distribution(dists: Sequence[Distribution]) -> Distribution:
    counts = [d.count for d in dists]
    return Distribution(
        count=int(statistics.median(counts)) if counts else 0,
        **{stat: _median([getattr(d, stat) for d in dists]) for stat in STATS},
    )


def _load(p: Parameters, runs: int) -> str:
    if p.num_prompts is not None:
        size = f"{p.num_prompts} requests"
    else:
        size = f"{p.duration_s:g} s"
    if p.request_rate is None:
        rate = "all at once"
    else:
        kind = "Poisson" if p.burstiness == 1 else f"gamma, burstiness {p.burstiness:g}"
        rate = f"{p.request_rate:g} req/s ({kind})"
    parts = [size, rate]
    if p.max_concurrency:
        parts.append(f"concurrency ≤ {p.max_concurrency}")
    if p.dataset:
        parts.append(f"dataset {p.dataset}")
    else:
        spread = f" ±{p.range_ratio:.0%}" if p.range_ratio else ""
        parts.append(f"prompts ~{p.input_len} words{spread}, max_tokens {p.output_len}{spread}")
    parts.append(f"seed {p.seed}")
    if runs > 1:
        parts.append(f"{runs} repetitions (medians shown)")
    return ", ".join(parts)


def _per_run(runs: Sequence[RunSummary], median: dict[str, float | None]) -> list[str]:
    header = ["per run", *(f"run {i}" for i in range(1, len(runs) + 1)), "median"]
    rows = [
        ["requests ok / failed", *(f"{r.completed} / {r.failed}" for r in runs), ""],
        ["request throughput (req/s)", *(_fmt(r.request_throughput) for r in runs), _fmt(median.get("request_throughput"))],
        ["p50 TTFT (ms)", *(_fmt(r.ttft_ms.p50) for r in runs), _fmt(median.get("p50_ttft_ms"))],
        ["p95 TTFT (ms)", *(_fmt(r.ttft_ms.p95) for r in runs), _fmt(median.get("p95_ttft_ms"))],
        ["p95 E2E (ms)", *(_fmt(r.e2e_ms.p95) for r in runs), _fmt(median.get("p95_e2e_ms"))],
    ]
    return _table(header, rows)


def _headline(runs: Sequence[RunSummary], median: dict[str, float | None]) -> list[str]:
    completed = sum(r.completed for r in runs)
    failed = sum(r.failed for r in runs)
    rows = [
        ["Duration (s)", _fmt(_median([r.duration_s for r in runs]))],
        ["Requests ok / failed", f"{completed} / {failed}" + (" (all runs)" if len(runs) > 1 else "")],
        ["Send rate (req/s)", _fmt(_median([r.send_rate for r in runs]))],
        ["Request throughput (req/s)", _fmt(median.get("request_throughput"))],
        ["Output throughput (tok/s)", _fmt(median.get("output_throughput"))],
    ]
    goodput = runs[0].goodput
    if goodput is not None:
        bounds = ", ".join(f"{k} ≤ {v:g} ms" for k, v in goodput.bounds_ms.items())
        share = _median([r.goodput.share for r in runs if r.goodput is not None])
        rows.append([f"Goodput (req/s; {bounds})", f"{_fmt(median.get('goodput'))} ({_fmt(share * 100, 1)} %)"])
    return _table(["", ""], rows)[1:]


def _latencies(runs: Sequence[RunSummary]) -> list[str]:
    rows = []
    for label, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        d = _median_distribution([getattr(r, attr) for r in runs])
        rows.append([label, *(_fmt(getattr(d, s)) for s in STATS), str(d.count)])
    return _table(["Latency (ms)", *STATS, "n"], rows)


def _errors(runs: Sequence[RunSummary]) -> list[str]:
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for run in runs:
        counts.update(run.errors)
        for kind, text in run.error_examples.items():
            examples.setdefault(kind, text)
    if not counts:
        return []
    rows = [[kind, str(n), examples.get(kind, "")[:100]] for kind, n in counts.most_common()]
    return _table(["Errors" + (" (all runs)" if len(runs) > 1 else ""), "count", "first message"], rows)


def _gateway(runs: Sequence[RunSummary]) -> list[str]:
    figures = [r.gateway for r in runs if r.gateway is not None]
    if not figures:
        return []
    lines = []
    names: dict[str, None] = {}
    for g in figures:
        names.update(dict.fromkeys(g.stages_ms))
    if names:
        rows = []
        for name in names:
            d = _median_distribution([g.stages_ms[name] for g in figures if name in g.stages_ms])
            rows.append([name, *(_fmt(getattr(d, s), 3) for s in ("mean", "p50", "p95", "p99", "max"))])
        own = _median_distribution([g.own_ms for g in figures])
        rows.append(["own (not upstream/engine)", *(_fmt(getattr(own, s), 3) for s in ("mean", "p50", "p95", "p99", "max"))])
        lines += _table(["edgegw Server-Timing (ms)", "mean", "p50", "p95", "p99", "max"], rows)
    routes: Counter[str] = Counter()
    cache: Counter[str] = Counter()
    for g in figures:
        routes.update(g.routes)
        cache.update(g.cache)
    if routes:
        total = sum(routes.values())
        lines.append("Routes (x-edgegw-route): " + ", ".join(f"{k} {100 * n / total:.1f} %" for k, n in routes.most_common()))
    if cache:
        total = sum(cache.values())
        lines.append("Cache (x-cache): " + ", ".join(f"{k} {100 * n / total:.1f} %" for k, n in cache.most_common()))
    return lines


def _client(runs: Sequence[RunSummary]) -> list[str]:
    cpu_ms = _median([r.client.cpu_ms_per_request for r in runs])
    share = _median([r.client.cpu_share for r in runs]) or 0.0
    lag = _median([r.client.lag_ms.p99 for r in runs])
    connections = max(r.client.connections for r in runs)
    lines = [
        f"Load generator: {_fmt(cpu_ms, 3)} ms CPU per request, {share * 100:.1f} % of a core, "
        f"lag p99 {_fmt(lag, 2)} ms, {connections} connection(s) opened"
    ]
    if share > _BUSY_CPU_SHARE or (lag is not None and lag > _BUSY_LAG_MS):
        lines.append(
            "warning: the load generator was busy; latencies may include its own queueing "
            "(lower the rate or concurrency, or run it on a quieter machine)"
        )
    return lines


def render(result: BenchResult) -> str:
    p = result.parameters
    runs = result.runs
    out = [f"edgegw bench: {p.base_url} ({p.endpoint}), model {p.model}, {'streaming' if p.stream else 'not streaming'}"]
    out.append(f"load: {_load(p, len(runs))}")
    if not runs:
        out.append("no run completed")
        return "\n".join(out) + "\n"
    server = next((r.server for r in runs if r.server), None)
    if server:
        out.append(f"server: {server}")
    if result.interrupted:
        out.append("INTERRUPTED: partial results")
    sections = [_headline(runs, result.median), _latencies(runs), _errors(runs), _gateway(runs), _client(runs)]
    if len(runs) > 1:
        sections.insert(0, _per_run(runs, result.median))
    for section in sections:
        if section:
            out.append("")
            out.extend(section)
    if result.gate is not None:
        out.append("")
        out.append(render_gate(result.gate).rstrip("\n"))
    return "\n".join(out) + "\n"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def _change(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value * 100:+.1f} %"


def render_gate(gate: GateOutcome) -> str:
    rows = []
    for row in gate.rows:
        show = _percent if row.metric == "error_rate" else _fmt
        verdict = "ok" if row.passed else "REGRESSED"
        rows.append([row.metric, show(row.baseline), show(row.current), _change(row.change), row.rule, verdict])
    lines = [f"Gate against {gate.baseline_file} (medians; worse is positive)"]
    lines += _table(["metric", "baseline", "this run", "change", "limit", "verdict"], rows)
    lines += [f"note: {note}" for note in gate.notes]
    lines.append("PASS" if gate.passed else "FAIL: regression beyond the limit")
    return "\n".join(lines) + "\n"
