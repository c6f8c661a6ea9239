"""Where a target's time goes, and in one word why: the live bottleneck diagnosis.

Every finished request leaves an ``Observation`` with the target that served it: its stages
(queue, pool, upstream first byte, engine), its time to first token, time per output token,
inter-token gaps and prompt size. ``Diagnosis.view`` turns the last minute of samples
(and the target's queue: arrivals, completions, waiting) into percentiles and a verdict,
with the evidence, by the first of these rules that holds:

``queue_saturated``
    requests wait in the gateway's queue for the target and they arrive faster than it
    serves them (arrivals > 1.1 x completions per second), or the queue wait is a quarter or
    more of the TTFT (p50).
``network_bound``
    connecting (the ``pool`` stage) plus the network round trip (the health probe's RTT) is
    half or more of the TTFT (p50): the wire, not the model, is the cost.
``prefill_bound``
    queues are short (queue wait under a tenth of the TTFT) while TTFT rises with the prompt
    (correlation of prompt tokens and TTFT >= 0.7, over prompts that differ in size).
``decode_bound``
    generating is slow or uneven: time per output token over 100 ms (under 10 tokens/s),
    or inter-token gaps with a p99 more than five times their p50.
``healthy``
    none of the above; ``unknown`` with fewer than 8 samples in the window.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Diagnosis", "Observation", "VERDICTS"]

logger = logging.getLogger("edgegw.diagnosis")

VERDICTS = ("healthy", "queue_saturated", "network_bound", "prefill_bound", "decode_bound", "unknown")
WINDOW_S = 60.0
MIN_SAMPLES = 8
SLOW_TPOT_S = 0.1
JITTER_RATIO = 5.0


@dataclass(slots=True)
class Observation:
    at: float  # time.monotonic() at the end
    stages: list[tuple[str, float, str | None]]  # the request's Timing stages: (name, seconds, desc)
    ttft: float | None
    tpot: float | None
    prompt_tokens: int
    ok: bool
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Target:
    kind: str
    samples: deque = field(default_factory=lambda: deque(maxlen=1024))
    gaps: deque = field(default_factory=lambda: deque(maxlen=4096))
    counters: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, arrivals, completions)
    verdict: str = "unknown"


class Diagnosis:
    """Per-target samples and verdicts; ``queue_of(name)`` and ``rtt_of(name)`` read the
    live queue and the health probe's round trip (the fleet's)."""

    def __init__(self, queue_of=None, rtt_of=None) -> None:
        self._targets: dict[str, _Target] = {}
        self._queue_of = queue_of or (lambda name: None)
        self._rtt_of = rtt_of or (lambda name: None)

    def record(self, target: str, kind: str, sample: Observation) -> None:
        view = self._targets.get(target)
        if view is None:
            view = self._targets[target] = _Target(kind)
        view.samples.append(sample)
        if sample.gaps:
            view.gaps.extend(sample.gaps)

    def targets(self) -> Iterator[str]:
        return iter(self._targets)

    def view(self, target: str, now: float | None = None) -> dict:
        """Percentiles of the last minute, the queue, and the verdict with its evidence."""
        now = time.monotonic() if now is None else now
        state = self._targets.get(target)
        queue = self._queue_of(target)
        samples = [s for s in state.samples if now - s.at <= WINDOW_S] if state is not None else []
        gaps = list(state.gaps)[-2048:] if state is not None else []
        # an answer that failed says nothing of how long answers take (a server that refuses
        # a malformed request in 5 ms would otherwise make the target look network-bound)
        answered = [s for s in samples if s.ok]
        stages: dict[str, list[float]] = {}
        for s in answered:
            for name, seconds, _ in s.stages:
                stages.setdefault(name, []).append(seconds)
        ttfts = [s.ttft for s in answered if s.ttft is not None]
        tpots = [s.tpot for s in answered if s.tpot is not None]
        figures = {
            "requests": len(samples),
            "requests_per_s": round(len(samples) / WINDOW_S, 3),
            "stages_ms": {name: _percentiles(values) for name, values in stages.items()},
            "ttft_ms": _percentiles(ttfts),
            "tpot_ms": _percentiles(tpots),
            "itl_ms": _percentiles(gaps),
        }
        rates = self._rates(state, queue, now) if state is not None else (None, None)
        if queue is not None:
            figures["queue"] = {
                "waiting": queue.waiting,
                "active": queue.active,
                "limit": queue.limit,
                "arrival_rate_per_s": _round(rates[0]),
                "service_rate_per_s": _round(rates[1]),
            }
        verdict, evidence = self._verdict(samples, stages, ttfts, tpots, gaps, queue, rates, target)
        if state is not None and verdict != state.verdict and verdict != "unknown":
            logger.info("diagnosis of %s: %s -> %s (%s)", target, state.verdict, verdict, evidence)
            state.verdict = verdict
        figures["diagnosis"] = {"verdict": verdict, "evidence": evidence}
        return figures

    def _rates(self, state: _Target, queue, now: float) -> tuple[float | None, float | None]:
        """Arrivals and completions per second at the target over the window (from the
        queue's running counts, sampled whenever a view is taken)."""
        if queue is None:
            return None, None
        counters = state.counters
        counters.append((now, queue.arrivals, queue.completions))
        while len(counters) > 2 and now - counters[0][0] > WINDOW_S:
            counters.popleft()
        first = counters[0]
        span = now - first[0]
        if span < 1.0:
            return None, None
        return (queue.arrivals - first[1]) / span, (queue.completions - first[2]) / span

    def _verdict(self, samples, stages, ttfts, tpots, gaps, queue, rates, target) -> tuple[str, str]:
        if len(samples) < MIN_SAMPLES or not ttfts:
            return "unknown", f"{len(samples)} requests in the last {WINDOW_S:.0f} s"
        ttft = _quantile(ttfts, 0.5)
        wait = _quantile(stages.get("queue", [0.0]), 0.5)
        arrivals, service = rates
        if queue is not None and queue.waiting and (
            (arrivals is not None and service is not None and arrivals > 1.1 * service) or wait >= 0.25 * ttft
        ):
            rate = "" if arrivals is None or service is None else f"arrivals {arrivals:.2f}/s > service {service:.2f}/s; "
            return "queue_saturated", f"{rate}{queue.waiting} waiting; queue wait p50 {wait * 1000:.0f} ms of TTFT p50 {ttft * 1000:.0f} ms"
        pool = _quantile(stages.get("pool", [0.0]), 0.5)
        rtt = self._rtt_of(target) or 0.0
        if pool + rtt >= 0.5 * ttft:
            return "network_bound", f"connect p50 {pool * 1000:.0f} ms + round trip {rtt * 1000:.0f} ms of TTFT p50 {ttft * 1000:.0f} ms"
        prompts = [s.prompt_tokens for s in samples if s.ok and s.ttft is not None]
        if wait < 0.1 * ttft and len(set(prompts)) > 2:
            r = _correlation(prompts, ttfts)
            if r is not None and r >= 0.7:
                return "prefill_bound", f"TTFT rises with prompt length (r = {r:.2f}) while queue wait p50 is {wait * 1000:.0f} ms"
        if tpots:
            tpot = _quantile(tpots, 0.5)
            if tpot > SLOW_TPOT_S:
                return "decode_bound", f"time per output token p50 {tpot * 1000:.0f} ms (under {1 / SLOW_TPOT_S:.0f} tokens/s)"
        if len(gaps) >= MIN_SAMPLES:
            p50, p99 = _quantile(gaps, 0.5), _quantile(gaps, 0.99)
            if p50 > 0.001 and p99 > JITTER_RATIO * p50:
                return "decode_bound", f"inter-token gap p99 {p99 * 1000:.0f} ms is {p99 / p50:.0f}x its p50 {p50 * 1000:.0f} ms"
        return "healthy", f"TTFT p50 {ttft * 1000:.0f} ms, queue wait p50 {wait * 1000:.0f} ms, {len(samples)} requests"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {name: round(_quantile(values, q) * 1000, 3) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def _correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # one of them does not vary
        return None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
