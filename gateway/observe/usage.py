"""Usage per tenant: the tokens and requests each tenant spent, per model and target.

Three views of the same counts, fed once per finished request (``Usage.record``, from the
observer):

- Prometheus counters, ``edgegw_usage_requests_total{tenant, model, target}`` and
  ``edgegw_usage_tokens_total{tenant, model, target, type}`` with ``type`` ``prompt``,
  ``completion`` or ``cached`` (the tokens a cache hit, or a request that followed an
  identical one in flight, saved: its answer's prompt and completion tokens, counted as
  cached and not as prompt or completion). On a node of workers ``/metrics`` sums them
  across the workers, as every counter (``node_metrics``). ``target`` is an endpoint URL,
  ``edge``, ``cache`` or ``coalesced``; ``model`` the model that answered (an alias such as
  ``auto`` resolved).
- Hourly buckets for ``GET /admin/usage?from=&to=`` (``query``): in this process's memory,
  or, with ``usage.redis_url``, in Redis hashes that every replica adds to
  (``<namespace>:usage:<YYYYMMDDHH>``, a field per tenant, model and count), so that a
  fleet's usage is one sum. Counts go to Redis in one pipelined batch every
  ``flush_interval_s``; while Redis is down they wait for the next flush (never the
  request).
- A month's prompt + completion tokens per tenant (``month_tokens``), for the monthly
  quotas (``gateway.admission.quota``): ``<namespace>:quota:<YYYYMM>`` in Redis, else
  memory. A replica reads the fleet's figure at most once per ``flush_interval_s`` (it
  changes no faster), plus what it has not flushed yet.

Tokens come from the answer's ``usage`` (a stream is asked for its usage chunk on the
client's behalf, which the client does not see unless it asked); an answer without one
counts the prompt's estimate and, for a stream, its relayed token events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import datetime, timezone

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from cache.circuit import Circuit
from cache.redis import REDIS_FAILURES, connect
from gateway.core.settings import UsageSettings

__all__ = ["COUNTS", "Usage", "hour_of", "merge_rows", "month_of", "rows"]

logger = logging.getLogger("edgegw.usage")

COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
_HOUR_S = 3600
_MAX_HOURS = 24 * 400  # one query reads at most this many hourly buckets
_SAVED = ("cache", "coalesced")  # targets whose tokens were saved, not spent


def hour_of(ts: float) -> int:
    """The hourly bucket of a Unix time: hours since the epoch."""
    return int(ts // _HOUR_S)


def month_of(ts: float) -> str:
    """``YYYYMM`` of a Unix time, in UTC: the quota's calendar month."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y%m")


def _hour_key(hour: int) -> str:
    return datetime.fromtimestamp(hour * _HOUR_S, timezone.utc).strftime("%Y%m%d%H")


class Usage:
    """The tenants' usage: counters, hourly buckets and monthly totals (module docstring)."""

    def __init__(self, settings: UsageSettings, registry: CollectorRegistry) -> None:
        self._totals: dict[tuple[str, str, str], list[int]] = {}  # (tenant, model, target) -> COUNTS, since start
        registry.register(_Counters(self._totals))
        self._hours: dict[tuple[int, str, str], list[int]] = {}  # memory store: (hour, tenant, model) -> COUNTS
        self._months: dict[tuple[str, str], int] = {}  # memory store: (YYYYMM, tenant) -> prompt + completion
        self._pending: dict[tuple[int, str, str], list[int]] = {}  # not yet in Redis
        self._pending_months: dict[tuple[str, str], int] = {}
        self._flushing_months: dict[tuple[str, str], int] = {}  # taken by the flush in flight, not yet confirmed
        self._redis_turn = asyncio.Lock()  # a flush and a month read never overlap (see month_tokens)
        self._read: dict[tuple[str, str], tuple[float, int]] = {}  # Redis month totals read: (monotonic, value)
        self._redis = None
        self._task: asyncio.Task | None = None
        self._hour: tuple[int, str] = (-1, "")  # the hour last recorded, and its month
        self.configure(settings)

    def configure(self, settings: UsageSettings) -> None:
        """The settings, at start or on a reload (a changed ``redis_url`` takes a new client;
        the old one is closed by ``aclose_retired``)."""
        old = getattr(self, "settings", None)
        self.settings = settings
        if old is None or old.redis_url != settings.redis_url:
            self._retired = self._redis
            self._redis = connect(settings.redis_url, settings.timeout_s, settings.timeout_s) if settings.redis_url else None
            self._circuit = Circuit(5.0)
            self._read.clear()

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._flusher())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()
        await self.aclose_retired()
        if self._redis is not None:
            await self._redis.aclose()

    async def aclose_retired(self) -> None:
        retired, self._retired = getattr(self, "_retired", None), None
        if retired is not None:
            await retired.aclose()

    # -- recording -----------------------------------------------------------------

    def record(self, tenant: str, model: str, target: str, prompt: int, completion: int, now: float | None = None) -> None:
        """One finished request of ``tenant``; a cache hit's (``target`` cache or coalesced)
        tokens are counted as cached."""
        if not self.settings.enabled:
            return
        totals = self._totals
        key = (tenant, model, target)
        total = totals.get(key)
        if total is None:
            total = totals[key] = [0, 0, 0, 0]
        hour = int((time.time() if now is None else now) // _HOUR_S)
        if hour != self._hour[0]:
            self._hour = (hour, month_of(hour * _HOUR_S))  # formatting a date costs more than the rest together
        shared = self._redis is not None
        store = self._pending if shared else self._hours
        bucket = (hour, tenant, model)
        counts = store.get(bucket)
        if counts is None:
            counts = store[bucket] = [0, 0, 0, 0]
        total[0] += 1
        counts[0] += 1
        if target in _SAVED:  # saved, not spent: no month's tokens either
            total[3] += prompt + completion
            counts[3] += prompt + completion
            return
        total[1] += prompt
        total[2] += completion
        counts[1] += prompt
        counts[2] += completion
        if prompt or completion:
            months = self._pending_months if shared else self._months
            month = (self._hour[1], tenant)
            months[month] = months.get(month, 0) + prompt + completion

    # -- reading ---------------------------------------------------------------------

    async def month_tokens(self, tenant: str, now: float | None = None) -> int:
        """``tenant``'s prompt + completion tokens this calendar month (UTC): the fleet's, as
        last read from Redis (at most ``flush_interval_s`` ago), plus this process's unflushed
        (and what a flush in flight has taken but Redis has not confirmed).

        A read of Redis waits for a flush in flight: read while its increments were landing,
        the figure would hold them or not, and adding the flushed counts on top would count
        them twice or not at all."""
        now = time.time() if now is None else now
        month = (month_of(now), tenant)
        if self._redis is None:
            return self._months.get(month, 0)
        read = self._read.get(month)
        clock = time.monotonic()
        if read is None or clock - read[0] >= self.settings.flush_interval_s:
            async with self._redis_turn:
                value = await self._call(self._redis.hget(self._month_key(month[0]), tenant))
                if value is not None or read is None:
                    read = self._read[month] = (clock, int(value or 0))
        return read[1] + self._pending_months.get(month, 0) + self._flushing_months.get(month, 0)

    async def query(self, start: float, end: float, tenant: str | None = None) -> list[dict]:
        """Per tenant and model, the counts of the hourly buckets from ``start``'s hour up to
        ``end``'s (inclusive); from Redis when shared (``RuntimeError`` when it cannot be read)."""
        first, last = hour_of(start), hour_of(end)
        if last - first >= _MAX_HOURS:
            raise ValueError(f"the range spans more than {_MAX_HOURS // 24} days")
        totals: dict[tuple[str, str], list[int]] = {}
        if self._redis is None:
            for (hour, who, model), counts in self._hours.items():
                if first <= hour <= last and (tenant is None or who == tenant):
                    _add(totals, (who, model), counts)
        else:
            await self.flush()
            hashes = await self._read_hours(range(first, last + 1))
            for fields in hashes:
                for field, value in fields.items():
                    who, model, count = orjson.loads(field)
                    if (tenant is None or who == tenant) and count in COUNTS:
                        _add(totals, (who, model), {COUNTS.index(count): int(value)})
        return rows(totals)

    async def _read_hours(self, hours: Iterable[int]) -> list[dict]:
        hours = list(hours)
        out: list[dict] = []
        for i in range(0, len(hours), 500):
            async with self._redis.pipeline(transaction=False) as pipe:
                for hour in hours[i : i + 500]:
                    pipe.hgetall(self._hour_key(hour))
                try:
                    out += await asyncio.wait_for(pipe.execute(), max(2.0, self.settings.timeout_s))
                except (*REDIS_FAILURES, asyncio.TimeoutError) as exc:
                    raise RuntimeError(f"usage: Redis could not be read ({type(exc).__name__})") from None
        return out

    # -- Redis -------------------------------------------------------------------------

    def _hour_key(self, hour: int) -> str:
        return f"{self.settings.namespace}:usage:{_hour_key(hour)}"

    def _month_key(self, month: str) -> str:
        return f"{self.settings.namespace}:quota:{month}"

    async def flush(self) -> bool:
        """Add the unflushed counts to Redis in one pipeline; on failure they are kept for the
        next flush. True when nothing is left unflushed."""
        if self._redis is None or not (self._pending or self._pending_months):
            return True
        async with self._redis_turn:
            return await self._flush()

    async def _flush(self) -> bool:
        if not (self._pending or self._pending_months):
            return True
        if not self._circuit.allow():
            return False
        pending, self._pending = self._pending, {}
        months, self._pending_months = self._pending_months, {}
        self._flushing_months = months
        ttl = self.settings.retention_days * 86400
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for (hour, tenant, model), counts in pending.items():
                    key = self._hour_key(hour)
                    for name, value in zip(COUNTS, counts):
                        if value:
                            pipe.hincrby(key, orjson.dumps([tenant, model, name]).decode(), value)
                    pipe.expire(key, ttl)
                for (month, tenant), value in months.items():
                    key = self._month_key(month)
                    pipe.hincrby(key, tenant, value)
                    pipe.expire(key, 40 * 86400)
                await asyncio.wait_for(pipe.execute(), max(1.0, self.settings.timeout_s))
        except (*REDIS_FAILURES, asyncio.TimeoutError) as exc:
            self._circuit.failure()
            logger.warning("usage: Redis failed (%s); the counts wait for the next flush", type(exc).__name__)
            self._merge_back(pending, months)
            return False
        except BaseException:
            self._circuit.abandon()
            self._merge_back(pending, months)
            raise
        finally:
            self._flushing_months = {}
        self._circuit.success()
        for month, value in months.items():  # what this replica read is behind by its own flush
            read = self._read.get(month)
            if read is not None:
                self._read[month] = (read[0], read[1] + value)
        return True

    def _merge_back(self, pending: dict, months: dict) -> None:
        for bucket, counts in pending.items():
            _add(self._pending, bucket, dict(enumerate(counts)))
        for month, value in months.items():
            self._pending_months[month] = self._pending_months.get(month, 0) + value

    async def _call(self, awaitable):
        """One bounded Redis read under the circuit; None when skipped or failed."""
        if not self._circuit.allow():
            awaitable.close()
            return None
        try:
            value = await asyncio.wait_for(awaitable, self.settings.timeout_s)
        except (*REDIS_FAILURES, asyncio.TimeoutError) as exc:
            self._circuit.failure()
            logger.warning("usage: Redis failed (%s); quotas use the last figure read", type(exc).__name__)
            return None
        except BaseException:
            self._circuit.abandon()
            raise
        self._circuit.success()
        return value

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval_s)
            if self._redis is not None:
                await self.flush()
            else:
                self._trim(time.time())

    def _trim(self, now: float) -> None:
        """The memory store keeps ``retention_days`` of hours and this month and the last."""
        oldest = hour_of(now) - self.settings.retention_days * 24
        for bucket in [b for b in self._hours if b[0] < oldest]:
            del self._hours[bucket]
        keep = {month_of(now), month_of(now - 32 * 86400)}
        for month in [m for m in self._months if m[0] not in keep]:
            del self._months[month]


class _Counters:
    """``edgegw_usage_requests_total`` and ``edgegw_usage_tokens_total`` read from the plain
    counts at scrape time: the hot path adds to a list (as ``LoopHistogram`` does; one event
    loop thread writes), never through ``prometheus_client``'s locked counters."""

    def __init__(self, totals: dict[tuple[str, str, str], list[int]]) -> None:
        self._totals = totals

    def collect(self):
        requests = CounterMetricFamily(
            "edgegw_usage_requests",
            "Requests served per tenant, model (as answered) and target (an endpoint, edge, cache, coalesced).",
            labels=["tenant", "model", "target"],
        )
        tokens = CounterMetricFamily(
            "edgegw_usage_tokens",
            "Tokens per tenant, model and target: prompt, completion, and cached (saved by the response cache or by coalescing).",
            labels=["tenant", "model", "target", "type"],
        )
        for key, counts in list(self._totals.items()):
            requests.add_metric(list(key), counts[0])
            for kind, value in zip(("prompt", "completion", "cached"), counts[1:]):
                tokens.add_metric([*key, kind], value)
        return [requests, tokens]

    def describe(self):
        return []


def _add(totals: dict, key, counts) -> None:
    row = totals.get(key)
    if row is None:
        row = totals[key] = [0, 0, 0, 0]
    items = counts.items() if isinstance(counts, dict) else enumerate(counts)
    for i, value in items:
        row[i] += value


def rows(totals: dict[tuple[str, str], list[int]]) -> list[dict]:
    """``/admin/usage``'s rows, by tenant then model."""
    out = []
    for (tenant, model), counts in sorted(totals.items()):
        row = {"tenant": tenant, "model": model, **dict(zip(COUNTS, counts))}
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        out.append(row)
    return out


def merge_rows(*answers: Iterable[dict]) -> list[dict]:
    """Several processes' rows (a node's workers, each with its own memory) as one answer."""
    totals: dict[tuple[str, str], list[int]] = {}
    for answer in answers:
        for row in answer:
            _add(totals, (row["tenant"], row["model"]), [row[c] for c in COUNTS])
    return rows(totals)
