"""The queue in front of every target: who waits, in what order, and for how long.

Each target (an endpoint, the edge engine) has a ``TargetQueue``: at most ``limit``
requests are sent to it at once; the rest wait here, in the gateway, not in the inference
server's own first-come-first-served queue. A free slot goes to, in order:

1. the best *priority class* (interactive, standard, batch), where a request that has
   waited ``ageing_s`` counts one class better, and one that has waited twice as long two
   classes better (and then beats newer requests of its class): batch is slowed, never
   starved;
2. within a class, weighted fair queueing across tenants (start-time fair queueing: a
   request's tag is ``max(V, F[tenant])``, its tenant's next tag ``+ 1/weight``, the
   smallest tag goes first and becomes the virtual time ``V``), so two tenants of equal
   weight flooding one target get equal shares of it, whoever sent first.

A waiting request whose deadline passes is dropped before it is ever sent. A preemptive
target (the edge engine, whose scheduler preempts lower-priority sequences) also takes a
request beyond the limit when a lower class holds a slot: the engine makes room for it.

``predicted_wait`` is Little's law over the request's own place in the queue: with every
slot busy, slots come free at ``limit / service time`` per second (the service time is an
EWMA of how long slots are held), so a request with ``n`` requests ahead of it waits about
``(n + 1) * service time / limit``, where ahead means a better class, or its own class with
an earlier fair-queueing tag than the one it would get (``ahead_of``): a tenant flooding a
target waits behind its own backlog, and a quiet tenant of the same class does not. The dispatcher adds the target's TTFT estimate and sheds at once a
request no target can start within its budget.

With ``adaptive: true`` the limit follows measured TTFT (AIMD, as TCP and Envoy's adaptive
concurrency do): a TTFT beyond twice the best recently seen shrinks it by a tenth, a
saturated limit with good TTFTs grows by one per ``limit`` completions.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import time

from gateway.core.errors import DeadlineExceeded, Overloaded
from gateway.core.tenant import Tenant

__all__ = ["Slot", "TargetQueue", "QueueDeadline"]

_RANKS = 3
_SERVICE_ALPHA = 0.2


class QueueDeadline(DeadlineExceeded):
    """The request's deadline passed while it waited for the target (504)."""


class _Ticket:
    __slots__ = ("tenant", "rank", "tag", "enqueued", "future", "seq", "done")

    def __init__(self, tenant: Tenant, tag: float, enqueued: float, future: asyncio.Future, seq: int) -> None:
        self.tenant = tenant
        self.rank = tenant.rank
        self.tag = tag
        self.enqueued = enqueued
        self.future = future
        self.seq = seq
        self.done = False


class Slot:
    """A request's place at a target; ``release`` gives it back (exactly once)."""

    __slots__ = ("queue", "rank", "acquired_at", "waited", "_released")

    def __init__(self, queue: TargetQueue, rank: int, acquired_at: float, waited: float) -> None:
        self.queue = queue
        self.rank = rank
        self.acquired_at = acquired_at
        self.waited = waited  # seconds spent in the queue
        self._released = False

    def release(self, ttft: float | None = None) -> None:
        if not self._released:
            self._released = True
            self.queue._release(self, ttft)


class TargetQueue:
    def __init__(
        self,
        name: str,
        limit: int | None,
        *,
        adaptive: bool = False,
        max_limit: int | None = None,
        ageing_s: float = 10.0,
        max_queue: int = 1024,
        preemptive: bool = False,
    ) -> None:
        self.name = name
        self.adaptive = adaptive
        self.max_limit = max_limit or limit
        self.limit = min(16, self.max_limit) if adaptive and self.max_limit else limit
        self.ageing_s = ageing_s
        self.max_queue = max_queue
        self.preemptive = preemptive
        self.active = 0
        self.active_by_rank = [0] * _RANKS
        self.arrivals = 0  # requests that asked for a slot, ever (the diagnosis's arrival rate)
        self.completions = 0  # slots given back, ever (its service rate)
        self.service_s: float | None = None  # EWMA of how long a slot is held
        self.best_ttft: float | None = None  # adaptive: the best TTFT seen lately
        self._heaps: list[list] = [[] for _ in range(_RANKS)]  # (tag, seq, ticket) by class
        self._fifos: list[collections.deque] = [collections.deque() for _ in range(_RANKS)]
        self._waiting = 0
        self._waiting_by_rank = [0] * _RANKS
        self._waiting_by_tenant: dict[str, int] = collections.defaultdict(int)
        self._virtual = 0.0  # V: the tag of the last request started
        self._finish: dict[str, float] = {}  # F[tenant]
        self._seq = itertools.count()
        self._grow = 0.0
        self._last_cut = 0.0

    def reconfigure(self, limit: int | None, *, adaptive: bool, max_limit: int | None, ageing_s: float, max_queue: int) -> None:
        """New settings (a reload); requests in flight and waiting keep their places, and a
        higher limit starts waiting ones at once."""
        was_adaptive, self.adaptive = self.adaptive, adaptive
        self.max_limit = max_limit or limit
        if adaptive and self.max_limit:  # an adaptive limit keeps what it learnt, under the new cap
            self.limit = min(self.limit or 16, self.max_limit) if was_adaptive else min(16, self.max_limit)
        else:
            self.limit = limit
        self.ageing_s = ageing_s
        self.max_queue = max_queue
        self._hand_on(time.monotonic())

    # -- what is known ---------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    def waiting_of(self, tenant: Tenant) -> int:
        return self._waiting_by_tenant.get(tenant.name, 0)

    def _can_start(self, rank: int) -> bool:
        if self.limit is None or self.active < self.limit:
            return True
        # the engine preempts lower classes for a better one: let it in, up to twice the limit
        return self.preemptive and self.active < 2 * self.limit and any(self.active_by_rank[rank + 1 :])

    def ahead_of(self, tenant: Tenant) -> int:
        """How many waiting requests a new request of ``tenant`` would wait behind: every
        one of a better class, and those of its own class whose fair-queueing tag is not
        after the tag it would get (``max(V, F[tenant])``). One tenant's flood thus raises
        that tenant's own tags, not another tenant's place."""
        rank = tenant.rank
        ahead = sum(self._waiting_by_rank[:rank])
        if self._waiting_by_rank[rank]:
            tag = max(self._virtual, self._finish.get(tenant.name, 0.0))
            ahead += sum(1 for entry in self._heaps[rank] if not entry[2].done and entry[0] <= tag)
        return ahead

    def predicted_wait(self, tenant: Tenant) -> float:
        """Seconds a new request of ``tenant`` would wait here before it is sent: its place
        in the fair queue (``ahead_of``) over the slots' measured turnover."""
        rank = tenant.rank
        if not any(self._waiting_by_rank[: rank + 1]) and self._can_start(rank):
            return 0.0
        if self.service_s is None or not self.limit:
            return 0.0  # nothing measured yet: no grounds to turn anyone away
        return (self.ahead_of(tenant) + 1) * self.service_s / self.limit

    # -- taking and giving back slots ------------------------------------------------

    async def acquire(self, tenant: Tenant, deadline: float | None) -> Slot:
        """A slot for a request of ``tenant``, waiting in order if none is free; raises
        ``QueueDeadline`` when ``deadline`` (``time.monotonic()``) passes first, and
        ``Overloaded`` when ``max_queue`` requests are waiting already."""
        now = time.monotonic()
        rank = tenant.rank
        self.arrivals += 1
        if self._can_start(rank) and not any(self._waiting_by_rank[: rank + 1]):
            return self._start(rank, now, 0.0)  # nobody of its class or better is waiting
        if self._waiting >= self.max_queue:
            raise Overloaded(f"{self._waiting} requests are waiting for {self.name}", retry_after=self.retry_after(tenant))
        loop = asyncio.get_running_loop()
        tag = max(self._virtual, self._finish.get(tenant.name, 0.0))
        self._finish[tenant.name] = tag + 1.0 / tenant.weight
        ticket = _Ticket(tenant, tag, now, loop.create_future(), next(self._seq))
        heapq.heappush(self._heaps[ticket.rank], (tag, ticket.seq, ticket))
        self._fifos[ticket.rank].append(ticket)
        self._waiting += 1
        self._waiting_by_rank[ticket.rank] += 1
        self._waiting_by_tenant[tenant.name] += 1
        try:
            async with asyncio.timeout(None if deadline is None else max(0.0, deadline - now)):
                return await ticket.future
        except BaseException as exc:
            granted = ticket.future.done() and not ticket.future.cancelled()
            if isinstance(exc, TimeoutError):
                if granted:
                    return ticket.future.result()  # granted just as the deadline passed
                raise QueueDeadline(
                    f"the request's deadline passed after {time.monotonic() - now:.3f} s waiting for {self.name}",
                    retry_after=self.retry_after(tenant),
                ) from None
            if granted:
                ticket.future.result().release()  # granted as the request gave up: hand it on
            raise
        finally:
            if not ticket.done:
                self._forget(ticket)

    def retry_after(self, tenant: Tenant) -> float:
        return max(1.0, self.predicted_wait(tenant))

    def _start(self, rank: int, now: float, waited: float) -> Slot:
        self.active += 1
        self.active_by_rank[rank] += 1
        return Slot(self, rank, now, waited)

    def _forget(self, ticket: _Ticket) -> None:
        ticket.done = True
        self._waiting -= 1
        self._waiting_by_rank[ticket.rank] -= 1
        self._waiting_by_tenant[ticket.tenant.name] -= 1

    def _release(self, slot: Slot, ttft: float | None) -> None:
        now = time.monotonic()
        self.active -= 1
        self.completions += 1
        self.active_by_rank[slot.rank] -= 1
        held = now - slot.acquired_at
        self.service_s = held if self.service_s is None else self.service_s + _SERVICE_ALPHA * (held - self.service_s)
        if self.adaptive and ttft is not None:
            self._adapt(ttft, now)
        self._hand_on(now)

    def _hand_on(self, now: float) -> None:
        while self._waiting:
            ticket = self._next(now)
            if ticket is None or not self._can_start(ticket.rank):
                return
            self._forget(ticket)
            if ticket.future.done():  # its request gave up (cancelled) and has not run its cleanup yet
                continue
            self._virtual = max(self._virtual, ticket.tag)
            ticket.future.set_result(self._start(ticket.rank, now, now - ticket.enqueued))

    def _next(self, now: float) -> _Ticket | None:
        """The ticket a free slot goes to (see the module docstring), or None."""
        best = None
        best_key = None
        for rank in range(_RANKS):
            heap, fifo = self._heaps[rank], self._fifos[rank]
            while heap and (heap[0][2].done or heap[0][2].future.done()):
                heapq.heappop(heap)
            while fifo and (fifo[0].done or fifo[0].future.done()):
                fifo.popleft()
            if not heap:
                continue
            oldest = fifo[0]
            promoted = max(0, rank - math.floor((now - oldest.enqueued) / self.ageing_s))
            candidate = oldest if promoted < rank else heap[0][2]
            key = (promoted, candidate.enqueued if promoted < rank else math.inf, rank)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
        return best

    def _adapt(self, ttft: float, now: float) -> None:
        best = self.best_ttft
        self.best_ttft = ttft if best is None else min(best * 1.01, ttft)  # drifts up: forget old bests
        if best is not None and ttft > 2 * best:
            if now - self._last_cut > best:
                self.limit = max(1, math.floor(self.limit * 0.9))
                self._last_cut = now
            return
        if self.active + 1 >= self.limit:
            self._grow += 1 / self.limit
            if self._grow >= 1:
                self._grow = 0.0
                self.limit = min(self.max_limit, self.limit + 1)
                self._hand_on(now)

    def __repr__(self) -> str:
        return f"<TargetQueue {self.name} active={self.active}/{self.limit} waiting={self._waiting}>"
