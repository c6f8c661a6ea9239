"""The stage clock of one request, rendered as a ``Server-Timing`` header.

Made with the request (``RequestContext.timing``), marked by each stage as it ends, read
by the writers (the header), the observer (histograms, access log) and tracing.

Stages (Server-Timing names), each starting where the previous one ended:
  admit     request read, admission passed
  cache     the cache lookup (``desc``: hit, coalesced)
  route     the routing decision
  queue     waiting in the gateway's queue in front of the target (gateway.pipeline.queue)
  pool      waiting for an upstream connection (connect included when a new one opened);
            its desc names the protocol that carried the request (http1 | http2 | http3)
  upstream  from sending the request to the upstream's response headers (its queue + prefill
            for a streaming server that sends headers with the first token)
  engine    the edge engine: chat template and tokenisation (its time to the first token
            shows in the TTFT histogram; non-streaming answers in ``total``)
  total     everything up to the moment the header is sent (non-streaming: the whole answer)
"""

from __future__ import annotations

import time

__all__ = ["Timing"]


class Timing:
    """Stage durations of one request, rendered as a ``Server-Timing`` header."""

    __slots__ = ("start", "stages", "_mark")

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self._mark = self.start
        self.stages: list[tuple[str, float, str | None]] = []

    def mark(self, name: str, desc: str | None = None) -> float:
        """Close the stage ``name`` at now (it began where the previous one ended)."""
        now = time.perf_counter()
        self.stages.append((name, now - self._mark, desc))
        self._mark = now
        return now

    def upstream(self, queued: float, pool_wait: float, attempts: int, protocol: str = "") -> None:
        """Close the upstream stages: the gateway's queue, the pool (connect included; its
        desc names the protocol), then the time to the upstream's first byte."""
        now = time.perf_counter()
        self.stages.append(("queue", queued, None))
        self.stages.append(("pool", pool_wait, protocol or None))
        desc = "first byte" if attempts == 1 else f"first byte, attempt {attempts}"
        self.stages.append(("upstream", max(0.0, now - self._mark - pool_wait - queued), desc))
        self._mark = now

    def engine(self, queued: float) -> None:
        """Close the edge engine's stages: the gateway's queue, then the prompt rendered and
        tokenised (its time to first token shows in the TTFT histogram)."""
        now = time.perf_counter()
        self.stages.append(("queue", queued, None))
        self.stages.append(("engine", max(0.0, now - self._mark - queued), "prompt rendered and tokenised"))
        self._mark = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def header(self) -> bytes:
        parts = [
            f'{name};dur={seconds * 1000:.3f};desc="{desc}"' if desc else f"{name};dur={seconds * 1000:.3f}"
            for name, seconds, desc in self.stages
        ]
        parts.append(f"total;dur={(time.perf_counter() - self.start) * 1000:.3f}")
        return ", ".join(parts).encode()
