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

import orjson
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.core.context import RequestContext
from gateway.core.deadline import Deadline
from gateway.core.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyUpstream,
    Overloaded,
    PoolTimeout,
    RateLimited,
    UpstreamConnectError,
    UpstreamTimeout,
)
from gateway.core.openai import ParsedRequest
from gateway.observe import Metrics
from gateway.pipeline.fleet import Fleet
from gateway.pipeline.queue import QueueDeadline
from gateway.replies import HedgedReply, ReplayReply, Reply
from routing import NoRoute, RouteDecision, Target, UnknownModel, Unservable, decide, locate_client, request_from_openai
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
    model_fallback: bool = False  # another model serves it (routing.fallbacks): its answer is not the asked model's


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
            parsed.data, headers, fleet.routing, client_ip=ip, location=location, budget_ms=budget_ms, api=parsed.kind,
            prompt_estimate=parsed.prompt_estimate(fleet.routing.policy.chars_per_token), prefix=table.endpoint_choice,
        )
        # the affinity key hashes the leading messages: on a thread when they are large
        request = await asyncio.to_thread(features) if parsed.large else features()
        try:
            now = time.monotonic()
            decision = decide(request, table, fleet.health, now, edge=fleet.edge_stats(), rng=self.rng)
            if decision.prefix_blocks and decision.target.endpoint is not None:
                fleet.health.record_routed(decision.target.endpoint, decision.prefix_blocks, now)
            return decision
        except Unservable as exc:
            if exc.explicit:
                raise InvalidRequest(str(exc), param=exc.param or "model", code="unsupported_by_model") from None
            raise NoHealthyUpstream(str(exc), code="no_capable_target", retry_after=self.settings.limits.retry_after_s) from None
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
            if fleet.edge is not None and not parsed.passthrough and self._only_the_edge_serves(parsed.model):
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
        the request's budget; a stream is hedged if the decision says so, at its time even
        while the primary holds its response headers (servers that queue do)."""
        deadline = ctx.deadline = ctx.deadline.guide(decision.budget_ms)
        targets, note = self._admissible(decision, ctx, deadline)
        hedge_target = decision.hedge_target
        if decision.hedge_after_ms is None or hedge_target is None or not parsed.stream or targets[0] == hedge_target:
            opened = await self._open_with_fallbacks(targets, decision.model_fallbacks, parsed, ctx, deadline)
            opened.note = "; ".join(n for n in (note, opened.note) if n)
            return opened
        hedge_at = ctx.arrival + decision.hedge_after_ms / 1000
        primary = asyncio.ensure_future(self._open_with_fallbacks(targets, decision.model_fallbacks, parsed, ctx, deadline))
        hedge: asyncio.Future | None = None
        try:
            done, _ = await asyncio.wait((primary,), timeout=max(hedge_at - time.monotonic(), 0))
            if not done and self._may_hedge():
                hedge = asyncio.ensure_future(self.open_one(hedge_target, parsed, ctx, Deadline.unbounded(ctx.arrival)))
                if await self._opened_first(primary, hedge):
                    reply = hedge.result()
                    self._hedge_won()
                    await _discard(primary)
                    return Opened(reply, hedge_target, 1, queued=reply.slot.waited if reply.slot is not None else 0.0, note=note)
            opened = await primary  # (a hedge still opening races it for the first event below)
        except BaseException:
            await _discard(primary)
            await _discard(hedge)
            raise
        opened.note = "; ".join(n for n in (note, opened.note) if n)
        if opened.reply.status >= 400 or opened.target == hedge_target or opened.model_fallback:  # a hedge would race another model's answer
            await _discard(hedge)
            return opened
        if hedge is None:
            start_hedge = functools.partial(self.open_one, hedge_target, parsed, ctx, Deadline.unbounded(ctx.arrival))
            may_hedge = self._may_hedge
        else:  # already under way: the first event of either wins
            start_hedge, may_hedge, hedge_at = (lambda: hedge), (lambda: True), time.monotonic()
        opened.reply = HedgedReply(
            opened.reply, start_hedge, hedge_at, self.settings.limits.keepalive_interval_s, may_hedge, self._hedge_won
        )
        opened.hedged = True
        return opened

    @staticmethod
    async def _opened_first(primary: asyncio.Future, hedge: asyncio.Future) -> bool:
        """Wait until the primary or the hedge has opened; True when the hedge opened first
        with a status below 400, or the primary failed and the hedge then did."""
        done, _ = await asyncio.wait((primary, hedge), return_when=asyncio.FIRST_COMPLETED)
        if primary in done and primary.exception() is not None:
            await asyncio.wait((hedge,))  # the primary failed: the hedge may still open
        elif hedge not in done:
            return False  # the primary opened: the two race for the first event
        return hedge.exception() is None and hedge.result().status < 400

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
        self,
        targets: tuple[Target, ...],
        model_fallbacks: tuple[Target, ...],
        parsed: ParsedRequest,
        ctx: RequestContext,
        deadline: Deadline,
    ) -> Opened:
        """The first of ``targets`` (at most ``limits.max_attempts``) that opens well, then
        the other models' (``model_fallbacks``): a connect error, a pool timeout, a refused
        engine, a timeout or a 5xx before the first byte moves on (within the retry budget);
        a prompt too long for a model's context (``context_length_exceeded``) moves on to
        the next model, passing over the same model's other targets."""
        attempts = targets[: self.settings.limits.max_attempts] + model_fallbacks
        health = self.fleet.health
        last_error: GatewayError | None = None
        kinds: set[type] = set()  # how the attempts failed
        too_long: set[str] = set()  # models whose context the prompt does not fit
        failed: list[str] = []  # "model (why)" of the attempts that did not open, for the route header
        for attempt, target in enumerate(attempts, 1):
            if target.model in too_long:
                continue
            later = attempts[attempt:]
            if attempt > 1:
                if not health.try_retry(time.monotonic()):
                    break
                self.metrics.failovers.inc()
            try:
                reply = await self.open_one(target, parsed, ctx, deadline)
            except QueueDeadline:
                raise  # the budget is spent: another target cannot start it in time either
            except _RETRYABLE + (UpstreamTimeout,) as exc:  # not DeadlineExceeded: the request's own budget is spent
                last_error = exc
                kinds.add(type(exc))
                failed.append(f"{target.label()} ({exc.code})")
                continue
            except InvalidRequest as exc:  # the edge engine refused it
                if exc.code != CONTEXT_LENGTH or not any(t.model != target.model for t in later):
                    raise
                too_long.add(target.model)
                failed.append(f"{target.label()} ({CONTEXT_LENGTH})")
                continue
            if reply.status >= 500 and later:
                failed.append(f"{target.label()} (HTTP {reply.status})")
                await reply.aclose()
                continue
            if reply.status == 400 and any(t.model != target.model for t in later):
                reply, exceeded = await _context_exceeded(reply, self.settings.limits.max_response_bytes)
                if exceeded:
                    too_long.add(target.model)
                    failed.append(f"{target.label()} ({CONTEXT_LENGTH})")
                    await reply.aclose()
                    continue
            opened = Opened(reply, target, attempt, queued=reply.slot.waited if reply.slot is not None else 0.0)
            if target in model_fallbacks and target not in targets:
                opened.model_fallback = True
                opened.note = f"model-fallback={target.model} after " + ", ".join(failed)
            return opened
        message = f"no endpoint for model '{parsed.model}' could be reached"
        retry_after = self.settings.limits.retry_after_s
        if last_error is not None:
            message += f" (last error: {last_error.message})"
            retry_after = last_error.retry_after or retry_after
            if kinds == {PoolTimeout}:  # no connection came free anywhere: this side's limit, say so
                raise PoolTimeout(message, retry_after=retry_after)
            if kinds and all(issubclass(k, UpstreamTimeout) for k in kinds):
                raise type(last_error)(message)  # 504: every target was silent
            if kinds == {Overloaded}:  # every target refused it for capacity (the engine: its budget or TPOT can't be met)
                raise last_error
        raise NoHealthyUpstream(message, retry_after=retry_after)


CONTEXT_LENGTH = "context_length_exceeded"


async def _context_exceeded(reply: Reply, limit: int) -> tuple[Reply, bool]:
    """Whether an upstream's 400 says the prompt does not fit the model's context (OpenAI's
    and vLLM's ``code``, llama.cpp's and others' message), and the reply to answer with if
    not (its body already read: a ``ReplayReply`` of the same status and headers)."""
    body = await reply.read_body()
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    text = body.decode("utf-8", "replace").lower()
    exceeded = (isinstance(error, dict) and error.get("code") == CONTEXT_LENGTH) or any(
        words in text for words in (CONTEXT_LENGTH, "maximum context length", "exceeds the context", "context window", "context size")
    )
    if exceeded:
        return reply, True
    kept = ReplayReply(body, None, label=reply.label)
    kept.status, kept.headers, kept.protocol, kept.pool_wait = reply.status, reply.headers, reply.protocol, reply.pool_wait
    await reply.aclose()
    return kept, False


async def _discard(opening: asyncio.Future | None) -> None:
    """Cancel an opening that lost (or close its reply if it had opened)."""
    if opening is None:
        return
    opening.cancel()
    (result,) = await asyncio.gather(opening, return_exceptions=True)
    if isinstance(result, Opened):
        result = result.reply
    if isinstance(result, Reply):
        await result.aclose()
