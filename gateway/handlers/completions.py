"""``POST /v1/chat/completions`` and ``POST /v1/completions``: run the pipeline, relay the answer.

Admission (request id, limits, body, disconnects) has happened before this runs
(``gateway.admission``); framing happens in ``gateway.relay``. The handler is short on
purpose: what it adds is the order of things and the one rule that matters here: a reply
that was opened is closed, whatever happens.
"""

from __future__ import annotations

from gateway.core.context import WRITER, RequestContext
from gateway.core.errors import GatewayError, send_error
from gateway.observe import Metrics
from gateway.pipeline import Pipeline
from gateway.relay import KeepAlive, fail_sse, respond_json, respond_sse
from gateway.replies import Answer

__all__ = ["CompletionsApp"]


class CompletionsApp:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` (admission parsed the body)."""

    def __init__(self, pipeline: Pipeline, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        ctx: RequestContext = scope["edgegw"]
        answer = Answer()
        failure: BaseException | None = None
        started = False  # a stream's head went out before its answer (keep-alives while it waited)
        try:
            parsed = ctx.parsed
            keepalive = KeepAlive(send, ctx, self.pipeline.ping) if parsed.stream else None
            try:
                await self.pipeline.answer(ctx, parsed, answer)
            finally:
                if keepalive is not None:
                    started = await keepalive.stop()
            reply = answer.reply
            ctx.served.via = reply.label
            ctx.served.target_kind = answer.target_kind
            series = self.metrics.series(parsed.model, reply.label)
            if started or (parsed.stream and reply.status < 400):
                await respond_sse(send, ctx, answer, series, scope.get(WRITER), started=started)
                failure = answer.failed_mid_stream
            else:
                await respond_json(send, ctx, answer, series)
        except GatewayError as exc:
            failure = exc
            if started and not ctx.delivery.finished:
                await fail_sse(send, ctx, exc)  # the head went out: the error is the stream's
                return
            if ctx.delivery.status:
                raise  # the response had started: nothing more can be said to this client
            ctx.delivery.status = exc.status
            route = (b"x-edgegw-route", answer.route_of_failure(exc))
            headers = [(b"x-request-id", ctx.request_id), route, (b"server-timing", ctx.timing.header()), *ctx.charge.rate_headers]
            await send_error(send, exc, headers)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await answer.close(ctx, failure)
