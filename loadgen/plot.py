"""``--plot FILE.png | FILE.html``: TTFT and E2E distributions, and latency over time.

The three charts, from a result (also one read back from ``--save-result``):

1. TTFT histogram over every successful request of every run, p50/p95/p99 marked;
2. the same for E2E;
3. latency over time: each request's TTFT and E2E against its start time (seconds into
   its run), failed requests marked at the bottom; a drift or a stall shows here and
   nowhere else.

PNG is drawn with matplotlib (the optional ``bench`` extra); HTML is a single file of
inline SVG written here, with no script and no external resource, so it can be attached
to a CI job and opened anywhere.
"""

from __future__ import annotations

import os

from loadgen.charts import histogram, run_series, title
from loadgen.plot_html import html_page
from loadgen.result import BenchResult

__all__ = ["plot"]


def plot(result: BenchResult, path: str) -> None:
    extension = os.path.splitext(path)[1].lower()
    if extension == ".png":
        _png(result, path)
    elif extension in (".html", ".htm"):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(html_page(result))
    else:
        raise ValueError(f"--plot {path}: expected a .png or .html file")


def _png(result: BenchResult, path: str) -> None:
    # matplotlib is optional (the `bench` extra) and slow to import: only a PNG needs it
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise ValueError("--plot FILE.png needs matplotlib: pip install 'edgegw[bench]' (or use FILE.html)") from None
    series = run_series(result)
    fig, (ax_ttft, ax_e2e, ax_time) = pyplot.subplots(3, 1, figsize=(10, 11))
    fig.suptitle(title(result), fontsize=9)
    for ax, name, key in ((ax_ttft, "TTFT", "ttft_ms"), (ax_e2e, "E2E", "e2e_ms")):
        values = [v for s in series for v in getattr(s, key)]
        h = histogram(values)
        ax.stairs(h.counts, h.edges, fill=True, color="#4c72b0", alpha=0.8)
        for (label, x), color in zip(h.marks.items(), ("#2ca02c", "#ff7f0e", "#d62728")):
            ax.axvline(x, color=color, linestyle="--", linewidth=1, label=f"{label} {x:.1f} ms")
        ax.set_title(f"{name} distribution ({sum(h.counts)} successful requests, all runs)", fontsize=10)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
        if h.marks:
            ax.legend(fontsize=8)
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        ax_time.scatter(s.ok_start_s, s.e2e_ms, s=6, color=color, alpha=0.6, label=f"E2E {s.label}")
        ax_time.scatter(s.ok_start_s, s.ttft_ms, s=6, color=color, marker="^", alpha=0.4, label=f"TTFT {s.label}")
        if s.failed_start_s:
            ax_time.scatter(s.failed_start_s, [0] * len(s.failed_start_s), s=14, color="#d62728", marker="x", label=f"failed {s.label}")
    ax_time.set_title("latency over time", fontsize=10)
    ax_time.set_xlabel("request start (s into its run)")
    ax_time.set_ylabel("ms")
    ax_time.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
