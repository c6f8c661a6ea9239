"""The HTML plot: one self-contained page of inline SVG (no script, no stylesheet or font
from elsewhere), with the headline figures and the three charts of ``plot.py``.

Inline SVG inside HTML needs no ``xmlns``, so the page names no URL but the benchmarked
one, as text. Large runs are thinned to a few thousand points in the time chart (one request
in k, said in the caption) to keep the file small; the histograms use every
request.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from loadgen.charts import Histogram, RunSeries, histogram, run_series, title
from loadgen.result import STATS, BenchResult

__all__ = ["html_page"]

_WIDTH, _HEIGHT = 860, 280
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 16, 44
_MAX_POINTS = 6000
_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
_MARK_COLORS = {"p50": "#2ca02c", "p95": "#ff7f0e", "p99": "#d62728"}

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 900px; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; } tr:nth-child(even) { background: #f4f4f4; }
svg { background: #fff; border: 1px solid #ddd; } .axis { stroke: #555; } .grid { stroke: #e6e6e6; }
svg text { font: 11px system-ui, sans-serif; fill: #333; } figcaption { color: #555; font-size: 12px; }
"""


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    span = high - low
    if span <= 0:
        return [low]
    magnitude = 10 ** math.floor(math.log10(span / count))
    step = magnitude
    for m in (1, 2, 2.5, 5, 10):
        step = m * magnitude
        if span / step <= count:
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


class _Frame:
    """Data coordinates to SVG pixels, and the axes drawn for them."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1

    def x(self, v: float) -> float:
        return _LEFT + (v - self.x0) / (self.x1 - self.x0) * (_WIDTH - _LEFT - _RIGHT)

    def y(self, v: float) -> float:
        return _HEIGHT - _BOTTOM - (v - self.y0) / (self.y1 - self.y0) * (_HEIGHT - _TOP - _BOTTOM)

    def axes(self, x_label: str, y_label: str) -> list[str]:
        out = []
        for t in _ticks(self.y0, self.y1):
            y = self.y(t)
            out.append(f'<line class="grid" x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
            out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_num(t)}</text>')
        for t in _ticks(self.x0, self.x1):
            x = self.x(t)
            out.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{_HEIGHT - _BOTTOM}" y2="{_HEIGHT - _BOTTOM + 4}"/>')
            out.append(f'<text x="{x:.1f}" y="{_HEIGHT - _BOTTOM + 16}" text-anchor="middle">{_num(t)}</text>')
        base = _HEIGHT - _BOTTOM
        out.append(f'<line class="axis" x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{base}" y2="{base}"/>')
        out.append(f'<line class="axis" x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{base}"/>')
        out.append(f'<text x="{(_LEFT + _WIDTH - _RIGHT) / 2}" y="{_HEIGHT - 8}" text-anchor="middle">{html.escape(x_label)}</text>')
        out.append(f'<text transform="translate(14 {(_TOP + base) / 2}) rotate(-90)" text-anchor="middle">{html.escape(y_label)}</text>')
        return out


def _svg(parts: Sequence[str], label: str) -> str:
    body = "\n".join(parts)
    return f'<svg role="img" aria-label="{html.escape(label)}" width="{_WIDTH}" height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}">\n{body}\n</svg>'


def _histogram_svg(name: str, h: Histogram) -> str:
    frame = _Frame((h.edges[0], h.edges[-1]), (0, max(h.counts) * 1.1 if any(h.counts) else 1))
    parts = frame.axes(f"{name} (ms)", "requests")
    for count, left, right in zip(h.counts, h.edges, h.edges[1:]):
        if not count:
            continue
        x, y = frame.x(left), frame.y(count)
        w = max(frame.x(right) - x - 1, 1)
        tip = f"{_num(left)}–{_num(right)} ms: {count}"
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{frame.y(0) - y:.1f}" fill="#4c72b0"><title>{tip}</title></rect>')
    for i, (label, value) in enumerate(h.marks.items()):
        x = frame.x(value)
        color = _MARK_COLORS.get(label, "#333")
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_HEIGHT - _BOTTOM}" stroke="{color}" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{_WIDTH - _RIGHT - 4}" y="{_TOP + 14 + 14 * i}" text-anchor="end" style="fill: {color}">{label} {value:.1f} ms</text>')
    return _svg(parts, f"{name} distribution")


def _timeline_svg(series: list[RunSeries]) -> tuple[str, int]:
    points = sum(len(s.ok_start_s) for s in series)
    stride = max(1, math.ceil(points / _MAX_POINTS))
    x_max = max([0.0, *(t for s in series for t in s.ok_start_s + s.failed_start_s)])
    y_max = max([0.0, *(v for s in series for v in s.e2e_ms)])
    frame = _Frame((0, x_max or 1), (0, y_max * 1.05 or 1))
    parts = frame.axes("request start (s into its run)", "latency (ms)")
    for i, s in enumerate(series):
        color = _COLORS[i % len(_COLORS)]
        for t, e2e, ttft in list(zip(s.ok_start_s, s.e2e_ms, s.ttft_ms))[::stride]:
            parts.append(f'<circle cx="{frame.x(t):.1f}" cy="{frame.y(e2e):.1f}" r="2" fill="{color}" fill-opacity="0.6"/>')
            if not math.isnan(ttft):
                parts.append(f'<rect x="{frame.x(t) - 1.5:.1f}" y="{frame.y(ttft) - 1.5:.1f}" width="3" height="3" fill="{color}" fill-opacity="0.35"/>')
        for t in s.failed_start_s[::stride]:
            x, y = frame.x(t), frame.y(0)
            parts.append(f'<path d="M{x - 3:.1f} {y - 3:.1f}l6 6m0 -6l-6 6" stroke="#d62728"/>')
    legend = ", ".join(f'<tspan fill="{_COLORS[i % len(_COLORS)]}">{html.escape(s.label)}</tspan>' for i, s in enumerate(series))
    parts.append(f'<text x="{_LEFT + 8}" y="{_TOP + 12}">● E2E ▪ TTFT ✕ failed: {legend}</text>')
    return _svg(parts, "latency over time"), stride


def _summary_table(result: BenchResult) -> str:
    runs = result.runs
    median = result.median
    rows = [
        ("requests ok / failed", f"{sum(r.completed for r in runs)} / {sum(r.failed for r in runs)}"),
        ("request throughput (req/s)", _cell(median.get("request_throughput"))),
        ("output throughput (tok/s)", _cell(median.get("output_throughput"))),
    ]
    if median.get("goodput") is not None:
        rows.append(("goodput (req/s)", _cell(median.get("goodput"))))
    head = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    lat = ["<tr><th>latency (ms)</th>" + "".join(f"<th>{s}</th>" for s in STATS) + "</tr>"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = "".join(f"<td>{_cell(median.get(f'{s}_{name}_ms'))}</td>" for s in STATS)
        lat.append(f"<tr><td>{name.upper()}</td>{cells}</tr>")
    note = f"<p>Medians over {len(runs)} runs.</p>" if len(runs) > 1 else ""
    return f"<table>{head}</table>\n<h2>Latency</h2>{note}\n<table>{''.join(lat)}</table>"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def html_page(result: BenchResult) -> str:
    series = run_series(result)
    ttft = histogram([v for s in series for v in s.ttft_ms])
    e2e = histogram([v for s in series for v in s.e2e_ms])
    timeline, stride = _timeline_svg(series)
    thinned = f" (one request in {stride} shown)" if stride > 1 else ""
    heading = html.escape(title(result))
    interrupted = "<p><strong>Interrupted: partial results.</strong></p>" if result.interrupted else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>edgegw bench</title><style>{_STYLE}</style></head>
<body>
<h1>edgegw bench</h1>
<p>{heading}</p>{interrupted}
{_summary_table(result)}
<h2>TTFT distribution</h2>
<figure>{_histogram_svg("TTFT", ttft)}<figcaption>{sum(ttft.counts)} successful requests, all runs.</figcaption></figure>
<h2>E2E distribution</h2>
<figure>{_histogram_svg("E2E", e2e)}<figcaption>{sum(e2e.counts)} successful requests, all runs.</figcaption></figure>
<h2>Latency over time</h2>
<figure>{timeline}<figcaption>Each request at its start time{thinned}.</figcaption></figure>
</body></html>
"""
