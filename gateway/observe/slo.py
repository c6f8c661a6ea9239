"""Service-level objectives and their error-budget burn rates, computed live.

An objective promises a share (``target``) of good requests: TTFT, time per output token or
end-to-end time at or under ``threshold_ms``, or (``availability``) an answer that is not a
server error, optionally narrowed to one priority class, tenant, model or kind of target.
Requests that failed with a server error count as bad for the latency objectives too;
client errors (4xx) and clients that left (499) count for none.

Each finished request lands in a time bucket of good and total counts. The *burn rate* over a
window is the window's bad share divided by the budget ``1 - target``: 1 spends the budget
exactly over the window's length, 14.4 spends a 30-day budget's 2 % in one hour. An objective
*alerts* while both windows of a pair (the SRE workbook's multiwindow, multi-burn-rate
alerts: by default 1 h and 5 min at 14.4, 6 h and 30 min at 6) burn faster than the pair's
rate. The *error budget remaining* is ``1 - burn`` over the longest window (clamped at 0).

With ``slo.redis_url`` every replica adds its buckets to Redis (one pipelined write a
second, minute buckets) and reads the sums back (at most every few seconds), so every
replica reports the fleet's burn rates; a Redis outage falls back to the local counts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cache.circuit import Circuit
from cache.redis import REDIS_FAILURES, connect
from gateway.core.settings import ObjectiveSettings, SLOSettings

__all__ = ["Outcome", "SLOs", "window_name"]

logger = logging.getLogger("edgegw.slo")

LOCAL_BUCKET_S = 10.0
REDIS_BUCKET_S = 60.0
_REFRESH_S = 5.0


@dataclass(slots=True)
class Outcome:
    """What the objectives need to know about one finished request."""

    status: int
    ttft: float | None  # seconds from arrival to the first token (JSON: the whole answer)
    e2e: float  # seconds from arrival to the last byte
    tokens: int  # content events relayed (1 for a JSON answer)
    priority: str
    tenant: str
    model: str
    target_kind: str  # edge | endpoint | cache | none


def window_name(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


class Objective:
    def __init__(self, settings: ObjectiveSettings, retention_s: float) -> None:
        self.settings = settings
        self.name = settings.name
        self.threshold = None if settings.threshold_ms is None else settings.threshold_ms / 1000
        self._buckets: dict[int, list[int]] = {}  # bucket number -> [good, total]
        self._retention = int(retention_s // LOCAL_BUCKET_S) + 2
        self.pending: dict[int, list[int]] = {}  # minute buckets not yet added to Redis
        self.shared: dict[int, list[int]] | None = None  # minute buckets read back from Redis

    def matches(self, o: Outcome) -> bool:
        s = self.settings
        return (
            (s.priority is None or s.priority == o.priority)
            and (s.tenant is None or s.tenant == o.tenant)
            and (s.model is None or s.model == o.model)
            and (s.target_kind is None or s.target_kind == o.target_kind)
        )

    def verdict(self, o: Outcome) -> bool | None:
        """Good (True), bad (False), or not counted (None)."""
        if o.status == 499 or 400 <= o.status < 500:
            return None
        if o.status >= 500:
            return False
        metric = self.settings.metric
        if metric == "availability":
            return True
        if metric == "ttft":
            value = o.ttft if o.ttft is not None else o.e2e
        elif metric == "e2e":
            value = o.e2e
        else:  # tpot: a single token has no time per output token
            if o.tokens < 2 or o.ttft is None:
                return None
            value = (o.e2e - o.ttft) / (o.tokens - 1)
        return value <= self.threshold

    def add(self, good: bool, now: float, shared: bool) -> None:
        number = int(now // LOCAL_BUCKET_S)
        bucket = self._buckets.get(number)
        if bucket is None:
            bucket = self._buckets[number] = [0, 0]
            for old in [n for n in self._buckets if n < number - self._retention]:
                del self._buckets[old]
        bucket[0] += good
        bucket[1] += 1
        if shared:
            pending = self.pending.setdefault(int(now // REDIS_BUCKET_S), [0, 0])
            pending[0] += good
            pending[1] += 1

    def counts(self, window_s: float, now: float) -> tuple[int, int]:
        """(good, total) over the last ``window_s`` seconds."""
        if self.shared is not None:
            first = int((now - window_s) // REDIS_BUCKET_S) + 1
            buckets = self.shared
        else:
            first = int((now - window_s) // LOCAL_BUCKET_S) + 1
            buckets = self._buckets
        good = total = 0
        for number, (g, t) in buckets.items():
            if number >= first:
                good += g
                total += t
        return good, total

    def burn(self, window_s: float, now: float) -> float | None:
        good, total = self.counts(window_s, now)
        if not total:
            return None
        return (total - good) / total / (1 - self.settings.target)


class SLOs:
    def __init__(self, settings: SLOSettings) -> None:
        self.settings = settings
        windows = [w for pair in settings.windows for w in (pair.long, pair.short)]
        self.longest = max(windows, default=3600.0)
        self.objectives = [Objective(o, self.longest) for o in settings.objectives]
        self._redis = None
        self._circuit = Circuit(5.0)
        self._task: asyncio.Task | None = None
        self._alerting: set[str] = set()
        if settings.redis_url and self.objectives:
            self._redis = connect(settings.redis_url, 0.2, 0.2)

    async def start(self) -> None:
        if self._redis is not None:
            self._task = asyncio.get_running_loop().create_task(self._share())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    def record(self, outcome: Outcome, now: float) -> None:
        shared = self._redis is not None
        for objective in self.objectives:
            if objective.matches(outcome):
                good = objective.verdict(outcome)
                if good is not None:
                    objective.add(good, now, shared)

    def alert(self, objective: Objective, now: float) -> bool:
        for pair in self.settings.windows:
            long, short = objective.burn(pair.long, now), objective.burn(pair.short, now)
            if long is not None and short is not None and long >= pair.burn and short >= pair.burn:
                return True
        return False

    def budget_remaining(self, objective: Objective, now: float) -> float:
        burn = objective.burn(self.longest, now)
        return 1.0 if burn is None else max(0.0, 1.0 - burn)

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = time.time() if now is None else now
        out = []
        for objective in self.objectives:
            windows = sorted({w for pair in self.settings.windows for w in (pair.long, pair.short)})
            burn = {window_name(w): _round(objective.burn(w, now)) for w in windows}
            alert = self.alert(objective, now)
            self._log_change(objective.name, alert)
            s = objective.settings
            out.append(
                {
                    "name": objective.name,
                    "metric": s.metric,
                    "threshold_ms": s.threshold_ms,
                    "target": s.target,
                    "burn": burn,
                    "error_budget_remaining": round(self.budget_remaining(objective, now), 4),
                    "alert": alert,
                    "shared": objective.shared is not None,
                }
            )
        return out

    def gauges(self) -> Iterator[tuple[str, str, dict[str, str], float]]:
        for view in self.snapshot():
            name = view["name"]
            for window, burn in view["burn"].items():
                if burn is not None:
                    yield "edgegw_slo_burn_rate", "Error-budget burn rate of the objective over the window.", {"objective": name, "window": window}, burn
            yield "edgegw_slo_error_budget_remaining", "Share of the error budget left over the longest window.", {"objective": name}, view["error_budget_remaining"]
            yield "edgegw_slo_alert", "1 while both windows of a burn-rate pair burn too fast.", {"objective": name}, float(view["alert"])

    def _log_change(self, name: str, alert: bool) -> None:
        if alert and name not in self._alerting:
            self._alerting.add(name)
            logger.warning("SLO %s: burning its error budget too fast (alert)", name)
        elif not alert and name in self._alerting:
            self._alerting.discard(name)
            logger.info("SLO %s: burn rate back under the alert thresholds", name)

    async def _share(self) -> None:
        """Add this replica's minute buckets to Redis every second; read the fleet's sums
        back every few seconds. Redis unreachable: the local counts stand."""
        ttl = int(self.longest + 2 * REDIS_BUCKET_S)
        prefix = f"{self.settings.namespace}:slo:"
        last_read = 0.0
        while True:
            await asyncio.sleep(1.0)
            if not self._circuit.allow():
                for objective in self.objectives:
                    objective.shared = None
                continue
            now = time.time()
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for objective in self.objectives:
                        pending, objective.pending = objective.pending, {}
                        for number, (good, total) in pending.items():
                            key = f"{prefix}{objective.name}:{number}"
                            pipe.hincrby(key, "g", good)
                            pipe.hincrby(key, "t", total)
                            pipe.expire(key, ttl)
                    await asyncio.wait_for(pipe.execute(), 1.0)
                if now - last_read >= _REFRESH_S:
                    last_read = now
                    await self._read_back(prefix, now)
            except REDIS_FAILURES as exc:
                self._circuit.failure()
                logger.warning("SLO counts: Redis failed (%s); burn rates are this replica's own", type(exc).__name__)
                for objective in self.objectives:
                    objective.shared = None
                continue
            except BaseException:
                self._circuit.abandon()
                raise
            self._circuit.success()

    async def _read_back(self, prefix: str, now: float) -> None:
        last = int(now // REDIS_BUCKET_S)
        numbers = range(last - math.ceil(self.longest / REDIS_BUCKET_S), last + 1)
        async with self._redis.pipeline(transaction=False) as pipe:
            for objective in self.objectives:
                for number in numbers:
                    pipe.hmget(f"{prefix}{objective.name}:{number}", "g", "t")
            values = await asyncio.wait_for(pipe.execute(), 2.0)
        i = 0
        for objective in self.objectives:
            shared = {}
            for number in numbers:
                good, total = values[i]
                i += 1
                if total is not None:
                    shared[number] = [int(good or 0), int(total)]
            objective.shared = shared


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
