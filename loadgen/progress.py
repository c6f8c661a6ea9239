"""Live progress on stderr: requests done and failed, the current rate, running TTFT p50/p99.

On a terminal one line is redrawn in place twice a second; anywhere else (CI logs, a pipe)
a plain line is printed every few seconds, so logs stay readable and small. stdout is left
to the report.
"""

from __future__ import annotations

import collections
import sys
from typing import TextIO

from loadgen.stats import percentile
from loadgen.types import RequestRecord

__all__ = ["Progress", "Tally"]

_RATE_WINDOW_S = 5.0


class Tally:
    """What the progress line needs, updated as each request ends."""

    __slots__ = ("done", "failed", "ttfts", "ends")

    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.ttfts: list[float] = []
        self.ends: collections.deque[float] = collections.deque()  # run-relative end times

    def add(self, record: RequestRecord, end: float) -> None:
        self.done += 1
        if record.error is not None:
            self.failed += 1
        elif record.ttft is not None:
            self.ttfts.append(record.ttft)
        self.ends.append(end)

    def rate(self, now: float) -> float:
        """Requests ended per second over the last few seconds."""
        ends = self.ends
        while ends and ends[0] < now - _RATE_WINDOW_S:
            ends.popleft()
        window = min(_RATE_WINDOW_S, now)
        return len(ends) / window if window > 0 else 0.0


class Progress:
    def __init__(self, stream: TextIO | None = None, total: int | None = None, label: str = "", interval: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.5 if self.tty else 5.0)
        self.total = total
        self.label = label
        self.drawn = False

    def line(self, tally: Tally, elapsed: float) -> str:
        total = f"/{self.total}" if self.total else ""
        text = f"{self.label}[{elapsed:7.1f}s] {tally.done}{total} done, {tally.failed} failed, {tally.rate(elapsed):.1f} req/s"
        if tally.ttfts:
            ttfts = sorted(tally.ttfts)
            text += f", TTFT p50 {percentile(ttfts, 50) * 1e3:.1f} ms p99 {percentile(ttfts, 99) * 1e3:.1f} ms"
        return text

    def show(self, tally: Tally, elapsed: float) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(tally, elapsed))
            self.drawn = True
        else:
            self.stream.write(self.line(tally, elapsed) + "\n")
        self.stream.flush()

    def close(self, tally: Tally, elapsed: float) -> None:
        """The final state, and the terminal's line left in place."""
        self.show(tally, elapsed)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
