"""The request flow, the only place that sequences the packages:

    cache plan ─► hit: replay                      (a hit pays for no routing decision)
               ─► identical request in flight: follow it
               ─► route ─► open (fallbacks, hedge) ─► cascade ─► record for the cache

``Pipeline.answer`` fills an ``Answer`` (``gateway.replies``): the reply and what the
response headers say about how it was found. The caller relays it (``gateway.relay``) and
closes it, always.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from cache import Entry, FlightAborted, usage_fields
from cache.replay import usage_of
from gateway.core.context import RequestContext
from gateway.core.deadline import Deadline
from gateway.core.errors import UpstreamTimeout
from gateway.core.openai import COMPLETIONS, ParsedRequest
from gateway.pipeline.caching import BYPASS, HIT, MISS, CacheLayer, Lookup, Recorder
from gateway.pipeline.dispatch import Dispatcher
from gateway.replies import Answer, FollowerReply, Reply, ReplayReply
from routing import RouteDecision, TargetKind, cascade_verdict

__all__ = ["Pipeline"]


class Pipeline:
    def __init__(self, dispatcher: Dispatcher, cache: CacheLayer, ping: float) -> None:
        self.dispatcher = dispatcher
        self.cache = cache
        self.ping = ping

    async def answer(self, ctx: RequestContext, parsed: ParsedRequest, answer: Answer) -> Answer:
        """Fill ``answer`` (the caller's, so that it can close what was opened even when this
        is cancelled) with the reply for ``parsed``."""
        timing = ctx.timing
        lookup: Lookup | None = None
        layer = self.cache
        if layer.enabled:
            if parsed.large:  # hashing the key grows with the body: not on the event loop
                lookup = await asyncio.to_thread(layer.plan, parsed, ctx.tenant.name, ctx.headers)
            else:
                lookup = layer.plan(parsed, ctx.tenant.name, ctx.headers)
            answer.x_cache = BYPASS
            if lookup.plan.lookup:
                entry = await layer.get(lookup)
                if entry is not None:
                    timing.mark("cache", "hit")
                    answer.reply, answer.original_id = layer.replay(entry, parsed, ctx.request_id)
                    answer.x_cache = HIT
                    answer.target_kind = "cache"
                    answer.age = int(entry.age(time.time()))
                    _note_saved(ctx, entry)
                    answer.route = b"target=cache; model=" + parsed.model.encode("ascii", "replace") + b"; why=exact-response cache hit"
                    return answer
            if lookup.plan.only_if_cached:
                raise UpstreamTimeout("not in the cache and Cache-Control says only-if-cached", code="cache_miss")
            if lookup.plan.store:
                answer.x_cache = MISS
                flight = await layer.join(lookup.key)
                if flight is not None and not flight.is_leader:
                    followed = await self._follow(layer.follower(flight, parsed, self.ping))
                    if followed is not None:
                        timing.mark("cache", "coalesced")
                        answer.reply = followed
                        answer.target_kind = "cache"
                        answer.route = b"target=cache; model=" + parsed.model.encode("ascii", "replace") + b"; coalesced=1; why=an identical request is in flight"
                        return answer
                else:
                    answer.flight = flight
            timing.mark("cache")
        decision = await self.dispatcher.route(parsed, ctx.peer, ctx.headers, budget_ms=ctx.deadline.budget_ms)
        timing.mark("route")
        sent = parsed
        fields = dict(lookup.fields) if lookup is not None and lookup.fields else {}
        if ctx.wants_usage and not parsed.passthrough:  # another API's stream has no stream_options
            fields.update(usage_fields(parsed.data) or {})  # the tenant's tokens are settled with it
        if fields:
            answer.hide_usage = "stream_options" in fields
            sent = sent.with_fields(**fields)
        cascade = decision.cascade_threshold is not None and decision.target.kind is TargetKind.EDGE and not parsed.stream
        if cascade:
            sent = sent.with_fields(logprobs=0 if parsed.kind == COMPLETIONS else True)
        opened = await self.dispatcher.open(decision, sent, ctx)
        reply = answer.reply = opened.reply
        answer.target_kind = opened.target.kind.value
        ctx.served.model = opened.target.model
        if opened.target.kind is TargetKind.EDGE:
            timing.engine(opened.queued)
        else:
            timing.upstream(opened.queued, reply.pool_wait, opened.attempt, reply.protocol)
        route = _route_header(decision)
        if opened.target is not decision.target:
            route += b"; served-by=" + opened.target.label().encode()
        if opened.queued >= 0.0005:
            route += b"; queued=%dms" % round(opened.queued * 1000)
        if opened.note:
            route += b"; " + opened.note.encode("ascii", "replace")
        if cascade and reply.status == 200:
            answer.reply = None  # _cascade closes it
            answer.reply, note = await self._cascade(decision, parsed, reply, ctx)
            if answer.reply.label != "edge":
                answer.target_kind = "endpoint"  # escalated
            route += note
        answer.route = route
        # another model's answer (routing.fallbacks) is not the asked model's: never stored as it
        if lookup is not None and lookup.plan.store and not opened.model_fallback:
            answer.recorder = Recorder(layer, lookup, answer.flight, parsed.kind)
        return answer

    @staticmethod
    async def _follow(follower: FollowerReply) -> Reply | None:
        """The followed answer, or None when its leader failed before a byte (go upstream)."""
        try:
            await follower.start()
        except FlightAborted:
            await follower.aclose()
            return None
        except BaseException:
            await follower.aclose()
            raise
        return follower

    async def _cascade(self, decision: RouteDecision, parsed: ParsedRequest, reply: Reply, ctx: RequestContext) -> tuple[Reply, bytes]:
        """Confidence-gated cascade: keep the edge's answer unless routing's verdict on its
        mean token logprob says to escalate to the first central fallback."""
        try:
            body = await reply.read_body()
        finally:
            await reply.aclose()
        data = orjson.loads(body)
        central = next((t for t in decision.fallbacks if t.kind is TargetKind.ENDPOINT), None)
        escalate, mean = cascade_verdict(data, decision.cascade_threshold)
        if escalate and central is not None:
            escalated = await self.dispatcher.open_one(central, parsed, ctx, Deadline.unbounded(ctx.arrival))
            note = f"; cascaded=1 (edge mean logprob {mean:.2f} < {decision.cascade_threshold:g}) served-by={central.label()}"
            return escalated, note.encode()
        if parsed.data.get("logprobs") in (None, False):  # asked for on the client's behalf
            for choice in data.get("choices", []):
                choice["logprobs"] = None
            body = orjson.dumps(data)
        note = "" if mean is None else f"; cascade-kept (edge mean logprob {mean:.2f})"
        return ReplayReply(body, None, label="edge"), note.encode()


def _note_saved(ctx: RequestContext, entry: Entry) -> None:
    """A cache hit's stored usage: the tokens it saved (the tenant's usage counts them as cached)."""
    usage = usage_of(entry)
    if isinstance(usage, dict):
        for field, name in (("prompt_used", "prompt_tokens"), ("completion_used", "completion_tokens")):
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(ctx.charge, field, value)


def _route_header(decision: RouteDecision) -> bytes:
    return decision.header_value().encode("ascii", "replace")
