"""OpenTelemetry traces of the stage model, with the W3C trace context continued upstream.

Imported only when ``tracing.otlp_url`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) is set: the
SDK and its OTLP/HTTP exporter are the ``tracing`` extra. Without it the gateway's only
cost is forwarding the client's ``traceparent`` and ``tracestate`` as any end-to-end header.

Per request:

- ``begin``: the server span starts at the request's arrival, a child of the client's
  ``traceparent`` when it sent one (a new trace otherwise);
- ``client``: when the request is sent to a target, a client span (a child of the server
  span) starts, and *its* context is what the upstream gets as ``traceparent`` (not the
  client's header copied through), so an edge gateway and the vLLM or central gateway
  behind it show one trace;
- ``finish``: one span per stage (admit, cache, route, queue, pool, upstream, engine,
  first_token, decode) is recorded with the stage's own start and end, then the client and
  server spans end. The stages are measured anyway (``Timing``); only the spans are new.

Spans are exported in batches from the SDK's own thread, never from the event loop.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.core.settings import TracingSettings

__all__ = ["Tracing"]

logger = logging.getLogger("edgegw.tracing")

_GIVE_UP_S = 2.0  # an export (and the last one, at shutdown) waits no longer for the collector
_PROPAGATOR = TraceContextTextMapPropagator()
_CONTEXT_HEADERS = (b"traceparent", b"tracestate")


class _Exporter(OTLPSpanExporter):
    """OTLP/HTTP, noting whether an export failed: the last spans' fate is told at shutdown
    whether the exporter gave up (its own ``_GIVE_UP_S``) before the shutdown's wait ran out
    or after."""

    failed = False

    def export(self, spans) -> SpanExportResult:
        result = super().export(spans)
        if result is not SpanExportResult.SUCCESS:
            self.failed = True
        return result


class Tracing:
    def __init__(self, settings: TracingSettings) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        exporter = self._exporter = _Exporter(endpoint=settings.otlp_url, timeout=_GIVE_UP_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=_GIVE_UP_S * 1000))
        self.tracer = self.provider.get_tracer("edgegw")

    def shutdown(self) -> None:
        """Export what is still buffered (from the lifespan's end, on a thread), giving up
        after ``_GIVE_UP_S``: a dead or silent collector must not hold the gateway's exit."""
        self._exporter.failed = False
        exporting = threading.Thread(target=self.provider.shutdown, name="otlp-shutdown", daemon=True)
        exporting.start()
        exporting.join(_GIVE_UP_S)
        if exporting.is_alive():
            logger.warning("traces: the collector took nothing within %g s; the last spans are dropped", _GIVE_UP_S)
        elif self._exporter.failed:  # the exporter's own timeout came first, or the collector refused
            logger.warning("traces: the collector did not take the last export; the last spans are dropped")

    def begin(self, ctx) -> None:
        """Start ``ctx``'s server span at its arrival (``ctx``: a ``RequestContext``)."""
        parent = _PROPAGATOR.extract({k: v for k, v in ctx.headers.items() if k in ("traceparent", "tracestate")})
        span = self.tracer.start_span(
            f"{ctx.api} request", context=parent, kind=SpanKind.SERVER, start_time=ctx.wall_start
        )
        ctx.trace.span = span
        ctx.trace.trace_id = format(span.get_span_context().trace_id, "032x")

    def client(self, ctx, target: str, kind: str, forward: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Start a client span for sending ``ctx`` to ``target``; the headers to send, with
        the trace context of that span in place of the client's."""
        if ctx.trace.span is None:
            return forward
        span = self.tracer.start_span(
            f"send to {kind}",
            context=trace.set_span_in_context(ctx.trace.span),
            kind=SpanKind.CLIENT,
            attributes={"edgegw.target": target, "edgegw.target_kind": kind},
        )
        ctx.trace.client_spans.append(span)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        headers = [(k, v) for k, v in forward if k not in _CONTEXT_HEADERS]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        return headers

    def finish(self, ctx, total_s: float) -> None:
        """Record the stage spans and end the request's spans."""
        span = ctx.trace.span
        if span is None:
            return
        parent = trace.set_span_in_context(span)
        at = sent = ctx.wall_start
        for name, seconds, desc in ctx.timing.stages:
            end = at + int(seconds * 1e9)
            stage = self.tracer.start_span(f"edgegw.{name}", context=parent, start_time=at)
            if desc:
                stage.set_attribute("edgegw.stage.detail", desc)
            stage.end(end_time=end)
            at = end
            if name == "engine":  # the prompt is ready: the engine's own stages start here
                sent = end
        if ctx.served.target_stages:  # the target's own, back to back, overlapping the relay's stages
            inside = self.tracer.start_span("edgegw.inside_target", context=parent, start_time=sent)
            within = trace.set_span_in_context(inside)
            for name, seconds in ctx.served.target_stages:
                end = sent + int(seconds * 1e9)
                self.tracer.start_span(f"edgegw.{name}", context=within, start_time=sent).end(end_time=end)
                sent = end
            inside.end(end_time=sent)
        end = ctx.wall_start + int(total_s * 1e9)
        for client in ctx.trace.client_spans:
            client.end(end_time=end)
        span.set_attributes(
            {
                "http.response.status_code": ctx.delivery.status,
                "edgegw.api": ctx.api,
                "edgegw.model": ctx.model,
                "edgegw.target": ctx.served.via,
                "edgegw.target_kind": ctx.served.target_kind,
                "edgegw.tenant": ctx.tenant.name if ctx.tenant is not None else "-",
            }
        )
        if ctx.delivery.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end)
