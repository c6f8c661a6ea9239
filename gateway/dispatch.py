"""Route a request and open its reply: the decision, admission by predicted wait, the queue,
fallbacks before the first byte, hedging.

``Dispatcher.route`` asks ``routing.decide`` where a request goes (with the client's
location, the fleet's health and the engine's load). ``Dispatcher.open`` first keeps the
targets that can start the request within its budget (``_admissible``: the queue's
predicted wait plus the target's TTFT estimate; none: the request is answered at once),
then takes a slot in the target's queue (``gateway.queueing``; a request whose deadline
passes while it waits is dropped, never sent) and opens a reply through the fleet, walking
the fallbacks on a connect error, a pool timeout, a refused engine or a 5xx before the
first byte (within the retry budget). It returns an ``Opened``.

Hedging (streams only: a JSON answer's first byte is the whole generation, and hedging it
would double every long request): the primary's reply is returned at once, wrapped in a
``HedgedReply``, so the client gets its headers and keep-alives exactly as without a hedge.
If no event has come ``hedge_after_ms`` after the request started, the same request starts
on the hedge target, and whichever sends a first event first is relayed; the other is
closed (its upstream request cancelled). A client that leaves meanwhile closes both.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from gateway.admission import Gate, RequestContext
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyUpstream,
    Overloaded,
    PoolTimeout,
    RateLimited,
    UpstreamConnectError,
)
from gateway.fleet import Fleet
from gateway.observability import Metrics
from gateway.openai import ParsedRequest
from gateway.queueing import QueueDeadline
from gateway.replies import Reply
from routing import NoRoute, RouteDecision, Target, UnknownModel, decide, locate_client, request_from_openai
from routing.config import AUTO, EDGE

__all__ = ["Dispatcher", "HedgedReply", "Opened"]

# failures before the first byte that another target may not share
_RETRYABLE = (PoolTimeout, UpstreamConnectError, NoHealthyUpstream, Overloaded)


@dataclass(slots=True)
class Opened:
    """The reply a dispatch opened, where, and how."""

    reply: Reply
    target: Target  # where the reply comes from (a hedge may still overtake it)
    attempt: int  # 1 for the first target tried, n for the (n-1)th fallback after it
    hedged: bool = False  # the reply is a ``HedgedReply`` (a hedge may start if the first event is late)
    queued: float = 0.0  # seconds it waited in the gateway's queue for its target
    note: str = ""  # for the route header: why the decision's target was passed over


class Dispatcher:
    def __init__(self, fleet: Fleet, gate: Gate, metrics: Metrics) -> None:
        self.fleet = fleet
        self.gate = gate
        self.metrics = metrics
        self.settings = fleet.settings
        self.rng = random.Random()  # the balancer's random source

    async def route(
        self,
        parsed: ParsedRequest,
        peer: str | None,
        headers: Mapping[str, str],
        *,
        budget_ms: float | None = None,
        cache_hit: bool = False,
    ) -> RouteDecision:
        fleet = self.fleet
        table = fleet.table
        ip, location = locate_client(table, fleet.geo, peer, headers)
        features = functools.partial(
            request_from_openai,
            parsed.data, headers, fleet.routing, client_ip=ip, location=location, tenant_budget_ms=budget_ms, cache_hit=cache_hit,
        )
        # the affinity key hashes the leading messages: on a thread when they are large
        request = await asyncio.to_thread(features) if parsed.large else features()
        try:
            now = time.monotonic()
            decision = decide(request, table, fleet.health, now, edge=fleet.edge_stats(), rng=self.rng)
            if decision.prefix_blocks and decision.target.endpoint is not None:
                fleet.health.record_routed(decision.target.endpoint, decision.prefix_blocks, now)
            return decision
        except UnknownModel:
            if fleet.undiscovered(parsed.model):
                raise NoHealthyUpstream(
                    f"the models of the upstream servers are not known yet; '{parsed.model}' may be one of them",
                    code="models_not_discovered",
                    retry_after=self.settings.limits.retry_after_s,
                ) from None
            raise ModelNotFound(f"the model '{parsed.model}' does not exist or is not served here", param="model") from None
        except NoRoute as exc:
            if fleet.edge is not None and self._only_the_edge_serves(parsed.model):
                # a request the engine can never serve (prompt or max_tokens past the context)
                # is the client's error, not a capacity problem to retry: the engine names
                # the parameter (400)
                await fleet.edge.check(parsed.kind, parsed.data)
            retry_after = exc.retry_after_s or self.settings.limits.retry_after_s
            raise NoHealthyUpstream(f"no healthy route for model '{parsed.model}': {exc}", retry_after=retry_after) from None

    def _only_the_edge_serves(self, model: str) -> bool:
        """Whether the edge engine is the only thing that could ever serve ``model``: the
        edge model itself, or ``auto`` with no central cluster."""
        table = self.fleet.table
        route = table.resolve_model(model)
        return route.kind == EDGE or route.model == self.fleet.edge.model_name or (route.kind == AUTO and table.central_model is None)

    async def open(self, decision: RouteDecision, parsed: ParsedRequest, ctx: RequestContext) -> Opened:
        """The first reply that starts well, from the first target that can start it within
        the request's budget; a stream is hedged if the decision says so."""
        deadline = ctx.arrival + decision.budget_ms / 1000
        targets, note = self._admissible(decision, ctx, deadline)
        opened = await self._open_with_fallbacks(targets, parsed, ctx, deadline)
        opened.note = note
        hedge_target = decision.hedge_target
        if (
            decision.hedge_after_ms is None
            or hedge_target is None
            or not parsed.stream
            or opened.reply.status >= 400
            or opened.target == hedge_target
        ):
            return opened

        async def start_hedge() -> Reply:
            return await self.open_one(hedge_target, parsed, ctx, None)

        opened.reply = HedgedReply(
            opened.reply,
            start_hedge,
            ctx.arrival + decision.hedge_after_ms / 1000,
            self.settings.limits.keepalive_interval_s,
            self._may_hedge,
            self._hedge_won,
        )
        opened.hedged = True
        return opened

    def _admissible(self, decision: RouteDecision, ctx: RequestContext, deadline: float) -> tuple[tuple[Target, ...], str]:
        """The decision's targets from the first one that is predicted to start the request
        within its budget (queue wait by Little's law + the target's TTFT estimate; a target
        with nothing to wait for always qualifies), and a note when that is not the first.
        When none is, the request is answered at once: 429 when the tenant's own backlog is
        what it would wait behind, else 503 (and ``/readyz`` says so for a moment)."""
        targets = (decision.target, *decision.fallbacks)
        if not self.settings.admission.predict:
            return targets, ""
        tenant = ctx.tenant
        left = deadline - time.monotonic()
        waits = []
        for i, target in enumerate(targets):
            wait = self.fleet.queue(target).predicted_wait(tenant)
            if wait == 0.0 or wait + (target.predicted_ttft_ms or 0.0) / 1000 <= left:
                if i == 0:
                    return targets, ""
                first = decision.target.label()
                return targets[i:], f"admitted-to={target.label()} ({first} predicted {waits[0] * 1000:.0f} ms of queue)"
            waits.append(wait)
        retry_after = max(1.0, min(waits))
        budget = f"its budget of {decision.budget_ms:.0f} ms"
        if self.fleet.queue(decision.target).waiting_of(tenant):
            self.metrics.shed.labels("tenant_backlog", tenant.priority).inc()
            raise RateLimited(
                f"this API key's own requests already wait for {decision.target.label()}: none could start within {budget}",
                code="tenant_backlog",
                retry_after=retry_after,
            )
        self.metrics.shed.labels("capacity", tenant.priority).inc()
        self.gate.shed_for_capacity()
        raise Overloaded(
            f"no target can start this request within {budget} (shortest predicted wait {min(waits) * 1000:.0f} ms)",
            code="capacity_exceeded",
            retry_after=retry_after,
        )

    def _may_hedge(self) -> bool:
        if not self.fleet.health.try_retry(time.monotonic()):
            return False
        self.metrics.hedges.inc()
        return True

    def _hedge_won(self) -> None:
        self.metrics.hedge_wins.inc()

    async def open_one(self, target: Target, parsed: ParsedRequest, ctx: RequestContext, deadline: float | None) -> Reply:
        """Take a slot at ``target`` (waiting in its queue, dropped if ``deadline`` passes
        first) and open the reply there; the reply gives the slot back when it ends."""
        queue = self.fleet.queue(target)
        try:
            slot = await queue.acquire(ctx.tenant, deadline)
        except QueueDeadline:
            self.metrics.shed.labels("deadline", ctx.tenant.priority).inc()
            raise
        self.metrics.queue_wait.labels(queue.name, ctx.tenant.priority).observe(slot.waited)
        try:
            reply = await self.fleet.open_target(target, parsed, ctx, deadline)
        except BaseException:
            slot.release()
            raise
        reply.slot = slot
        return reply

    async def _open_with_fallbacks(
        self, targets: tuple[Target, ...], parsed: ParsedRequest, ctx: RequestContext, deadline: float
    ) -> Opened:
        attempts = targets[: self.settings.limits.max_attempts]
        health = self.fleet.health
        last_error: GatewayError | None = None
        for attempt, target in enumerate(attempts, 1):
            if attempt > 1:
                if not health.try_retry(time.monotonic()):
                    break
                self.metrics.failovers.inc()
            try:
                reply = await self.open_one(target, parsed, ctx, deadline)
            except QueueDeadline:
                raise  # the budget is spent: another target cannot start it in time either
            except _RETRYABLE as exc:
                last_error = exc
                continue
            if reply.status >= 500 and attempt < len(attempts):
                await reply.aclose()
                continue
            return Opened(reply, target, attempt, queued=reply.slot.waited if reply.slot is not None else 0.0)
        message = f"no endpoint for model '{parsed.model}' could be reached"
        retry_after = self.settings.limits.retry_after_s
        if last_error is not None:
            message += f" (last error: {last_error.message})"
            retry_after = last_error.retry_after or retry_after
        raise NoHealthyUpstream(message, retry_after=retry_after)


class HedgedReply(Reply):
    """A stream whose first event may come from a second attempt.

    Until a first event arrives, ``next_events`` waits on the primary and, from
    ``hedge_at`` (``time.monotonic()``), also on the hedge (opened, then read to its first
    event); the first to produce events wins and the other is closed. Quiet spells return
    ``None`` every ``ping`` seconds, as every reply does. A primary beaten by its hedge is
    told its first token came at the hedge's win, a lower bound of its TTFT, so the balancer
    stops preferring it."""

    def __init__(
        self,
        primary: Reply,
        start_hedge: Callable[[], Awaitable[Reply]],
        hedge_at: float,
        ping: float,
        may_hedge: Callable[[], bool],
        on_hedge_win: Callable[[], None],
    ) -> None:
        self.status = primary.status
        self.headers = primary.headers
        self.label = primary.label
        self.pool_wait = primary.pool_wait
        self._primary: Reply | None = primary
        self._start_hedge = start_hedge
        self._hedge_at = hedge_at
        self._ping = ping
        self._may_hedge = may_hedge
        self._on_hedge_win = on_hedge_win
        self._winner: Reply | None = None
        self._pending: asyncio.Future | None = None  # the primary's next_events()
        self._hedge: asyncio.Future | None = None  # the hedge's (reply, first events)
        self._hedge_tried = False

    @property
    def in_event(self) -> bool:
        return self._winner.in_event if self._winner is not None else False

    async def read_body(self) -> bytes:
        return await self._primary.read_body()

    async def next_events(self) -> bytes | None:
        if self._winner is not None:
            return await self._winner.next_events()
        loop = asyncio.get_running_loop()
        quiet_at = loop.time() + self._ping
        while True:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._primary.next_events())
            waiting = (self._pending,) if self._hedge is None else (self._pending, self._hedge)
            timeout = quiet_at - loop.time()
            if not self._hedge_tried:
                timeout = min(timeout, self._hedge_at - time.monotonic())
            done, _ = await asyncio.wait(waiting, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
            if self._hedge in done:
                events = await self._hedge_finished()
                if events is not None:
                    return events
            if self._pending in done:
                pending, self._pending = self._pending, None
                events = pending.result()  # a GatewayError before any event is the stream's error
                if events is not None:
                    await self._discard_hedge()
                    self._winner = self._primary
                    return events
                continue  # a quiet spell of the primary's own: keep waiting
            if not self._hedge_tried and time.monotonic() >= self._hedge_at:
                self._hedge_tried = True
                if self._may_hedge():
                    self._hedge = asyncio.ensure_future(self._hedge_first_events())
                continue
            if loop.time() >= quiet_at:
                return None

    async def _hedge_finished(self) -> bytes | None:
        """The hedge ended: it wins with its first events, unless it failed."""
        hedge, self._hedge = self._hedge, None
        if hedge.cancelled() or hedge.exception() is not None:
            return None  # the primary alone goes on
        reply, events = hedge.result()
        primary, self._primary = self._primary, None
        self._winner = reply
        self._on_hedge_win()
        await _cancel(self._pending)
        self._pending = None
        primary.first_token(time.monotonic())  # beaten: a lower bound of its TTFT
        await primary.aclose()
        return events

    async def _hedge_first_events(self) -> tuple[Reply, bytes]:
        reply = await self._start_hedge()
        try:
            if reply.status >= 400:
                raise NoHealthyUpstream(f"the hedge answered {reply.status}")
            events = None
            while events is None:
                events = await reply.next_events()
            return reply, events
        except BaseException:
            await reply.aclose()
            raise

    def first_token(self, now: float) -> None:
        self._winner.first_token(now)

    def finish(self, ok: bool, chunks: int, now: float) -> None:
        (self._winner or self._primary).finish(ok, chunks, now)

    async def _discard_hedge(self) -> None:
        hedge, self._hedge = self._hedge, None
        result = await _cancel(hedge)
        if result is not None:
            await result[0].aclose()  # it had answered just now: close it all the same

    async def aclose(self) -> None:
        await self._discard_hedge()
        await _cancel(self._pending)
        self._pending = None
        for reply in (self._winner, self._primary):
            if reply is not None:
                await reply.aclose()


async def _cancel(future: asyncio.Future | None):
    """Cancel ``future`` and wait for it; its result if it had finished, else None."""
    if future is None:
        return None
    future.cancel()
    # gather, not await: our own cancellation must propagate, the future's must not
    (result,) = await asyncio.gather(future, return_exceptions=True)
    return None if isinstance(result, BaseException) else result
