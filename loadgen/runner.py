"""One repetition of a benchmark: requests released on their arrival times, bounded by the
concurrency limit, measured as they end; progress on the side; a clean stop on request.

The dispatcher releases request ``i`` when it is due (``arrivals``) and, with
``--max-concurrency``, when it holds a slot; each request runs as its own task on a pooled
keep-alive connection. A request's *lag* is how late its task actually started after that
moment (due, or slot taken, whichever is later): the load generator's own delay, which
stays near zero unless it is overloaded.
When ``stop`` is set (Ctrl-C) the dispatcher and the requests in flight are cancelled and
the run ends with what has completed so far, marked interrupted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from loadgen.http import ConnectionPool
from loadgen.openai import RequestHead, Requester
from loadgen.progress import Progress, Tally
from loadgen.stats import RunFacts
from loadgen.types import RequestRecord, RequestSpec

__all__ = ["Run", "RunOutcome", "Schedule"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """How many requests, for how long, and how many at once (None: no limit)."""

    num_prompts: int | None
    duration: float | None
    max_concurrency: int | None


@dataclass(slots=True)
class RunOutcome:
    records: list[RequestRecord]
    facts: RunFacts


class Run:
    def __init__(
        self,
        pool: ConnectionPool,
        head: RequestHead,
        timeout: float,
        specs: Iterator[RequestSpec],
        arrivals: Iterator[float],
        schedule: Schedule,
        stop: asyncio.Event,
        progress: Progress | None = None,
    ) -> None:
        self.pool = pool
        self.head = head
        self.timeout = timeout
        self.specs = specs
        self.arrivals = arrivals
        self.schedule = schedule
        self.stop = stop
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.tally = Tally()
        self.inflight: set[asyncio.Task] = set()
        self.t0 = 0.0

    async def execute(self) -> RunOutcome:
        loop = asyncio.get_running_loop()
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        opened = self.pool.opened
        cpu0 = time.process_time()
        self.t0 = time.perf_counter()
        requester = Requester(self.pool, self.head, self.timeout, self.t0)
        dispatcher = loop.create_task(self._dispatch(requester))
        stopper = loop.create_task(self.stop.wait())
        ticker = loop.create_task(self._tick()) if self.progress is not None else None
        await asyncio.wait({dispatcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = not dispatcher.done()
        if interrupted:
            dispatcher.cancel()
            for task in list(self.inflight):
                task.cancel()
        helpers = [t for t in (stopper, ticker) if t is not None]
        for task in helpers:
            task.cancel()
        await asyncio.gather(dispatcher, *self.inflight, *helpers, return_exceptions=True)
        if not interrupted:
            dispatcher.result()  # a bug in the dispatcher surfaces here
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - cpu0
        if self.progress is not None:
            self.progress.close(self.tally, wall)
        facts = RunFacts(started_at, wall, cpu, self.pool.opened - opened, interrupted, requester.server or None)
        return RunOutcome(self.records, facts)

    async def _dispatch(self, requester: Requester) -> None:
        schedule = self.schedule
        t0 = self.t0
        slots = asyncio.Semaphore(schedule.max_concurrency) if schedule.max_concurrency else None
        indices = range(schedule.num_prompts) if schedule.num_prompts is not None else itertools.count()
        for index in indices:
            due = next(self.arrivals)
            if self._past_end(due):
                break
            now = time.perf_counter() - t0
            while due > now:
                await asyncio.sleep(due - now)
                now = time.perf_counter() - t0
            ready = due
            if slots is not None:
                await slots.acquire()
                ready = max(due, time.perf_counter() - t0)
                if self._past_end(ready):
                    slots.release()
                    break
            task = asyncio.get_running_loop().create_task(self._one(requester, index, next(self.specs), ready, slots))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
        while self.inflight:
            await asyncio.gather(*list(self.inflight))

    def _past_end(self, due: float) -> bool:
        duration = self.schedule.duration
        return duration is not None and max(due, time.perf_counter() - self.t0) >= duration

    async def _one(
        self, requester: Requester, index: int, spec: RequestSpec, ready: float, slots: asyncio.Semaphore | None
    ) -> None:
        try:
            record = await requester.send(index, spec, ready, time.perf_counter())
            self.records.append(record)
            self.tally.add(record, time.perf_counter() - self.t0)
        finally:
            if slots is not None:
                slots.release()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.progress.interval)
            self.progress.show(self.tally, time.perf_counter() - self.t0)
