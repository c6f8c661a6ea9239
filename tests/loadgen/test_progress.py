"""Live progress: redrawn in place on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

from loadgen.progress import Progress, Tally
from loadgen.types import RequestRecord


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def tally(n: int, failed: int = 0) -> Tally:
    t = Tally()
    for i in range(n):
        t.add(RequestRecord(i, 0, 0, ttft=0.010 * (i + 1)), end=i * 0.1)
    for i in range(failed):
        t.add(RequestRecord(n + i, 0, 0, error="timeout"), end=n * 0.1)
    return t


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    progress = Progress(out, total=200, label="run 1/3 ")
    assert progress.interval == 5.0
    progress.show(tally(100, failed=2), 10.0)
    progress.close(tally(100, failed=2), 10.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0] == "run 1/3 [   10.0s] 102/200 done, 2 failed, 10.4 req/s, TTFT p50 505.0 ms p99 990.1 ms"


def test_one_line_redrawn_on_a_terminal():
    out = Terminal()
    progress = Progress(out)
    assert progress.interval == 0.5
    progress.show(tally(3), 1.0)
    progress.show(tally(4), 2.0)
    progress.close(tally(4), 2.0)
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 3 and text.endswith("\n") and text.count("\n") == 1


def test_the_current_rate_counts_the_last_seconds_only():
    t = Tally()
    for i in range(50):
        t.add(RequestRecord(i, 0, 0, ttft=0.01), end=0.1 * i)  # 10/s over the first 5 s
    assert t.rate(5.0) == 10.0
    assert t.rate(20.0) == 0.0
