"""Where a finished request goes: the stage histogram, the SLOs, the diagnosis, the trace and
the access log, in one call at its end (``Gate.done``)."""

from __future__ import annotations

import logging
import time

from gateway.observe.diagnosis import Diagnosis, Observation
from gateway.observe.metrics import Metrics
from gateway.observe.slo import SLOs, Outcome

__all__ = ["Observer"]

access_log = logging.getLogger("edgegw.access")


class Observer:
    """Where a finished request's stage model goes: the stage histogram, the access log, the
    SLOs and the per-target diagnosis (``slo.py``, ``diagnosis.py``). One call per
    request, at its end (``Gate.done``)."""

    def __init__(self, metrics: Metrics, slos: SLOs, diagnosis: Diagnosis, access_log: bool, tracing=None) -> None:
        self.metrics = metrics
        self.slos = slos
        self.diagnosis = diagnosis
        self.access_log = access_log
        self.tracing = tracing  # gateway.observe.tracing.Tracing when traces are on
        self._verdicts: dict[str, str] = {}
        self.usage = None  # gateway.observe.usage.Usage: the tenants' tokens

    def finished(self, ctx) -> None:
        """``ctx``: the request's ``gateway.core.context.RequestContext``."""
        timing = ctx.timing
        total = timing.elapsed()
        served, delivery = ctx.served, ctx.delivery
        kind = served.target_kind
        stages = timing.stages  # (name, seconds, desc), as the stages ended
        children = self.metrics.stage_children(kind)
        for name, seconds, _ in stages:
            children[name].observe(seconds)
        for name, seconds in served.target_stages:
            children[name].observe(seconds)
        children["total"].observe(total)
        tenant = ctx.tenant
        priority = tenant.priority if tenant is not None else "-"
        status, ttft = delivery.status, delivery.ttft
        if status:
            outcome = Outcome(status, ttft, total, delivery.tokens, priority, tenant.name if tenant else "-", ctx.model, kind)
            self.slos.record(outcome, time.time())
        if kind in ("edge", "endpoint") and status:
            tpot = (total - ttft) / (delivery.tokens - 1) if ttft is not None and delivery.tokens > 1 else None
            first = ttft if ttft is not None else total  # a JSON answer's first token comes with its last
            self.diagnosis.record(
                served.via,
                kind,
                Observation(time.monotonic(), stages, first, tpot, ctx.charge.prompt_tokens, status < 400, delivery.gaps),
            )
        if self.usage is not None and tenant is not None and kind != "none" and status:
            self.usage.record(tenant.name, served.model or ctx.model, served.via, *_tokens(ctx))
        if self.tracing is not None:
            self.tracing.finish(ctx, total)
        if self.access_log:
            stage_text = ",".join(f"{name}:{seconds * 1000:.1f}" for name, seconds, *_ in (*stages, *served.target_stages))
            access_log.info(
                "%s %s %s tenant=%s model=%s via=%s upstream_id=%s ttft=%s total=%.1fms tokens=%s trace=%s stages=%s",
                ctx.request_id.decode(),
                ctx.api,
                status,
                tenant.name if tenant is not None else "-",
                ctx.model,
                served.via,
                served.upstream_request_id.decode() if served.upstream_request_id else "-",
                "-" if ttft is None else f"{ttft * 1000:.1f}ms",
                total * 1000,
                _token_text(kind, *_tokens(ctx)),
                ctx.trace.trace_id or "-",
                stage_text,
            )


def _tokens(ctx) -> tuple[int, int]:
    """(prompt, completion) tokens of a finished request: its answer's usage, else the
    prompt's estimate and, for a stream, the token events relayed; none for an error answer
    that did not say."""
    charge, delivery = ctx.charge, ctx.delivery
    if charge.prompt_used is not None or charge.completion_used is not None:
        return charge.prompt_used or 0, charge.completion_used or 0
    if not delivery.status or delivery.status >= 400:
        return 0, 0
    parsed = ctx.parsed
    return charge.prompt_tokens, delivery.tokens if parsed is not None and parsed.stream else 0


def _token_text(kind: str, prompt: int, completion: int) -> str:
    if kind == "none":
        return "-"
    return f"cached:{prompt + completion}" if kind == "cache" else f"prompt:{prompt},completion:{completion}"
