"""``python -m edge_engine.server``: the edge engine alone, as an OpenAI-compatible server.

    python -m edge_engine.server --model PATH --host 127.0.0.1 --port 8001 --dtype float32

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health
(and GET /stats, the engine's ``stats()``).  Streaming is SSE, ``data: {...}`` per chunk and
``data: [DONE]`` at the end; the response starts with the first chunk, so a request refused
or dropped before its first token still gets its own status code.  The request header
``x-latency-budget-ms`` sets the request's deadline (a request not started within it gets
504 ``deadline_exceeded``).  A client that leaves while its request waits for its first token
(or, non-streaming, for its whole answer) has its sequence dropped at once, as one that leaves
mid-stream does.  ``x-request-id`` (a gateway's) becomes the response's ``id``, after ``chatcmpl-`` or ``cmpl-`` unless it starts so.  Asked with
``x-engine-stages: 1``, where the answer's time went inside the engine comes with it: the
header ``x-engine-stages: queue=S;prefill=S;decode=S`` (seconds) on a whole answer, the
comment ``: x-engine-stages queue=S;...`` just before a stream's ``data: [DONE]``.  With ``x-validate-only: 1`` a completion request is only checked: 204 if the
engine would take it, else the error it would get.  A thin Starlette app over ``OpenAIServing``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .config import EngineConfig
from .engine import Engine
from .errors import EngineError, EngineOverloadedError, InvalidRequestError
from .sequence import StageTimes
from .serving import OpenAIServing

__all__ = ["create_app", "main"]

logger = logging.getLogger("edge_engine.server")


def _error_response(exc: EngineError) -> Response:
    headers = {}
    if isinstance(exc, EngineOverloadedError):
        headers["Retry-After"] = str(exc.retry_after)
    return Response(orjson.dumps(exc.to_dict()), status_code=exc.status_code, headers=headers, media_type="application/json")


LATENCY_BUDGET_HEADER = "x-latency-budget-ms"
VALIDATE_HEADER = "x-validate-only"
STAGES_HEADER = "x-engine-stages"


def _stages(times: StageTimes) -> str:
    return f"queue={times.queue:.6f};prefill={times.prefill:.6f};decode={times.decode:.6f}"


def _stage_header(times: StageTimes | None) -> dict[str, str]:
    return {} if times is None else {STAGES_HEADER: _stages(times)}
_GONE = object()


async def _unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or ``_GONE`` (``work`` cancelled, its sequence dropped) if the
    client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        return _GONE
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _deadline(request: Request) -> float | None:
    """``x-latency-budget-ms`` (a positive number) as a ``time.monotonic()`` deadline."""
    value = request.headers.get(LATENCY_BUDGET_HEADER)
    if value is None:
        return None
    try:
        budget_ms = float(value)
    except ValueError:
        budget_ms = float("nan")
    if not budget_ms > 0 or budget_ms == float("inf"):
        raise InvalidRequestError(
            f"{LATENCY_BUDGET_HEADER} must be a positive number of milliseconds", LATENCY_BUDGET_HEADER, "invalid_value"
        )
    return time.monotonic() + budget_ms / 1000


def create_app(engine: Engine, model_name: str | None = None) -> _StatsFirst:
    serving = OpenAIServing(engine, model_name or engine.model_name)
    counter = itertools.count()

    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequestError("the request body is not valid JSON", "body", "invalid_json") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object", "body", "invalid_type")
        return body

    def _handler(kind: str):
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

        async def handle(request: Request) -> Response:
            try:
                body, deadline = await _body(request), _deadline(request)
                if kind == "chat" and (body.get("response_format") or body.get("tools")):
                    # compiling a grammar takes up to tens of ms: off the event loop
                    prepared = await asyncio.to_thread(serving.prepare, kind, body, deadline=deadline)
                else:
                    prepared = serving.prepare(kind, body, deadline=deadline)
            except EngineError as exc:
                return _error_response(exc)
            if request.headers.get(VALIDATE_HEADER) == "1":
                return Response(status_code=204)
            given = request.headers.get("x-request-id")  # a gateway's: the answer's id keeps OpenAI's prefix
            request_id = (given if given.startswith(prefix) else prefix + given) if given else f"{prefix}{uuid.uuid4().hex[:24]}{next(counter)}"
            wants_stages = request.headers.get(STAGES_HEADER) == "1"
            if not prepared.stream:
                try:
                    body = await _unless_gone(request, serving.complete(prepared, request_id))
                except EngineError as exc:
                    return _error_response(exc)
                if body is _GONE:
                    return Response(status_code=499)
                headers = _stage_header(prepared.times) if wants_stages else {}
                return Response(body, headers=headers, media_type="application/json")

            chunks = serving.stream(prepared, request_id)
            try:  # wait for the first chunk before the headers: a refusal keeps its status code
                first = await _unless_gone(request, anext(chunks))
            except EngineError as exc:
                return _error_response(exc)
            except BaseException:
                await chunks.aclose()
                raise
            if first is _GONE:
                await chunks.aclose()
                return Response(status_code=499)  # nobody reads it

            async def sse() -> AsyncIterator[bytes]:
                async with contextlib.aclosing(chunks):
                    yield b"data: " + first + b"\n\n"
                    try:
                        async for chunk in chunks:
                            yield b"data: " + chunk + b"\n\n"
                    except EngineError as exc:  # headers are gone: report in-band
                        yield b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n"
                if wants_stages and prepared.times is not None:
                    yield b": " + STAGES_HEADER.encode() + b" " + _stages(prepared.times).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        return handle

    async def models(request: Request) -> Response:
        return Response(serving.models(), media_type="application/json")

    async def health(request: Request) -> Response:
        ok = engine.is_running
        return Response(orjson.dumps({"status": "ok" if ok else "stopped"}), status_code=200 if ok else 503, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _handler("chat"), methods=["POST"]),
            Route("/v1/completions", _handler("completions"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    return _StatsFirst(app, engine)


class _StatsFirst:
    """``GET /stats`` answered before Starlette's middleware and routing: on a node of
    workers each worker polls it every 50 ms for routing, so it is the engine server's most
    frequent request. Everything else is ``app``'s."""

    def __init__(self, app: Starlette, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/stats" and scope["method"] == "GET":
            body = orjson.dumps(self.engine.stats().as_dict())
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m edge_engine.server", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=None, help="name served on /v1/models")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bf16", "int8", "int4"])
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-queue-len", type=int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--no-tpot-objectives", action="store_true",
        help="no time-per-output-token objective for any class (admission then refuses only by deadline)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"))
    config = EngineConfig(
        model=args.model,
        model_name=args.model_name,
        dtype=args.dtype,
        device=args.device,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_len=args.max_queue_len,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        **({"tpot_ms": {}} if args.no_tpot_objectives else {}),  # else the default objectives
    )
    engine = Engine(config)
    logger.info("loaded %r", engine)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
