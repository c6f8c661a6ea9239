"""Route a request and open its reply: the decision, admission by predicted wait, the queue,
fallbacks before the first byte, hedging (the race itself: ``gateway.replies.HedgedReply``).

``Dispatcher.route`` asks ``routing.decide`` where a request goes (with the client's
location, the fleet's health and the engine's load). ``Dispatcher.open`` first keeps the
targets that can start the request within its budget (``_admissible``: the queue's
predicted wait plus the target's TTFT estimate; none: the request is answered at once),
then takes a slot in the target's queue (``gateway.pipeline.queue``; a request whose deadline
passes while it waits is dropped, never sent) and opens a reply through the fleet, walking
the fallbacks on a connect error, a pool timeout, a refused engine (its queue full, or its
own admission predicting the budget or the class's TPOT objective missed) or a 5xx before
the first byte (within the retry budget). It returns an ``Opened``; when every target
refused for capacity, the last refusal is the answer (503 with its code and Retry-After).

Hedging is for streams only: a JSON answer's first byte is the whole generation, and
hedging it would double every long request.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.core.context import RequestContext
from gateway.core.deadline import Deadline
from gateway.core.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyUpstream,
    Overloaded,
    PoolTimeout,
    RateLimited,
    UpstreamConnectError,
)
from gateway.core.openai import ParsedRequest
from gateway.observe import Metrics
from gateway.pipeline.fleet import Fleet
from gateway.pipeline.queue import QueueDeadline
from gateway.replies import HedgedReply, Reply
from routing import NoRoute, RouteDecision, Target, UnknownModel, decide, locate_client, request_from_openai
from routing.config import AUTO, EDGE

__all__ = ["Dispatcher", "Opened"]

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
    def __init__(self, fleet: Fleet, metrics: Metrics, on_shed: Callable[[], None] = lambda: None) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.on_shed = on_shed  # a request was turned away for lack of capacity (readyz steers away)
        self.settings = fleet.settings
        self.rng = random.Random()  # the balancer's random source

    async def route(
        self,
        parsed: ParsedRequest,
        peer: str | None,
        headers: Mapping[str, str],
        *,
        budget_ms: float | None = None,
    ) -> RouteDecision:
        fleet = self.fleet
        table = fleet.table
        ip, location = locate_client(table, fleet.geo, peer, headers)
        features = functools.partial(
            request_from_openai,
            parsed.data, headers, fleet.routing, client_ip=ip, location=location, budget_ms=budget_ms,
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
            fleet.discover_soon()  # a server may have gained it since the last look
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
        deadline = ctx.deadline = ctx.deadline.guide(decision.budget_ms)
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
            return await self.open_one(hedge_target, parsed, ctx, Deadline.unbounded(ctx.arrival))

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

    def _admissible(self, decision: RouteDecision, ctx: RequestContext, deadline: Deadline) -> tuple[tuple[Target, ...], str]:
        """The decision's targets from the first one that is predicted to start the request
        within its budget (queue wait by Little's law + the target's TTFT estimate; a target
        with nothing to wait for always qualifies), and a note when that is not the first.
        When none is, the request is answered at once: 429 when the tenant's own backlog is
        what it would wait behind, else 503 (and ``/readyz`` says so for a moment)."""
        targets = (decision.target, *decision.fallbacks)
        if not self.settings.admission.predict:
            return targets, ""
        tenant = ctx.tenant
        left = deadline.planned_left(time.monotonic())
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
        self.on_shed()
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

    async def open_one(self, target: Target, parsed: ParsedRequest, ctx: RequestContext, deadline: Deadline) -> Reply:
        """Take a slot at ``target`` (waiting in its queue, dropped if ``deadline`` passes
        first) and open the reply there; the reply gives the slot back when it ends."""
        queue = self.fleet.queue(target)
        try:
            slot = await queue.acquire(ctx.tenant, deadline.at)
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
        self, targets: tuple[Target, ...], parsed: ParsedRequest, ctx: RequestContext, deadline: Deadline
    ) -> Opened:
        attempts = targets[: self.settings.limits.max_attempts]
        health = self.fleet.health
        last_error: GatewayError | None = None
        kinds: set[type] = set()  # how the attempts failed
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
                kinds.add(type(exc))
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
            if kinds == {PoolTimeout}:  # no connection came free anywhere: this side's limit, say so
                raise PoolTimeout(message, retry_after=retry_after)
            if kinds == {Overloaded}:  # every target refused it for capacity (the engine: its budget or TPOT can't be met)
                raise last_error
        raise NoHealthyUpstream(message, retry_after=retry_after)
