"""A fake OpenAI-compatible inference server with scripted timing and failures, for the
benchmarks and the tests (``tests/fakes.py`` runs it on a thread).

The script comes from the server's defaults, overridden per request by a ``"fake"`` object
in the request body (the gateway forwards bodies unchanged, so a test scripts the upstream
through the gateway):

    ttft         seconds before the first token (before the response headers when
                 ``headers_first`` is false, the way some servers queue)
    delay        seconds between tokens
    tokens       number of content chunks
    pad          bytes of filler added to each token's content (for volume tests)
    status       answer with this HTTP status and an OpenAI error instead
    fail_after   drop the connection after this many content chunks
    done_after   after this many content chunks, ``data: [DONE]`` with no finish_reason (what
                 llama.cpp's server sends when another request interrupts a generation; 0:
                 an empty stream, as it answers a streamed prompt over its context)
    error_body   with ``status``: this raw body instead of an OpenAI error (llama.cpp's server
                 answers a non-UUID x-request-id with 400 and an empty body, some client
                 mistakes with 500 and a Python traceback)
    hang         never answer
    health_delay seconds before GET /health answers (how fast a probe finds it)
    slots        (server-wide, from the defaults) answer at most this many requests at once
                 and queue the rest first come, first served, as an inference server does

``FakeApp`` is a plain ASGI app: serve it with uvicorn (HTTP/1.1) or hypercorn (HTTP/2
cleartext; call ``honour_h2_flow_control()`` first). Every request is recorded
(``FakeApp.requests``): its body, headers, how many chunks and bytes were written, and
whether the server saw the client go away.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from hypercorn.protocol import h2 as hypercorn_h2

__all__ = ["DEFAULTS", "FakeApp", "Seen", "chunk", "honour_h2_flow_control", "token_text"]

_hypercorn_pop = hypercorn_h2.StreamBuffer.pop


async def _pop_honouring_window(self, max_length: int) -> bytes:
    if max_length <= 0:
        return b""
    return await _hypercorn_pop(self, max_length)


def honour_h2_flow_control(on: bool = True) -> None:
    """Make hypercorn's HTTP/2 writes wait for the client's flow-control window (``on``), or
    restore hypercorn as it is.

    Hypercorn's HTTP/2 send buffer releases the ASGI writer whenever its sender pops with a
    closed flow-control window (a pop of zero bytes counts as "drained"), so an app's writes
    never block and the buffer grows without bound. A real inference server honours the
    window; with this, an empty pop releases nobody and flow control reaches the writer, as
    it does on HTTP/1.1.
    """
    hypercorn_h2.StreamBuffer.pop = _pop_honouring_window if on else _hypercorn_pop

DEFAULTS = {
    "ttft": 0.0,
    "delay": 0.0,
    "tokens": 8,
    "pad": 0,
    "status": 200,
    "fail_after": None,
    "done_after": None,
    "error_body": None,
    "hang": False,
    "headers_first": True,
    "health_delay": 0.0,
    "slots": None,
}


@dataclass
class Seen:
    path: str
    body: dict
    headers: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    chunks_sent: int = 0
    bytes_sent: int = 0
    last_write: float = 0.0
    finished: bool = False
    gets_open: int = 0  # GET requests (probes, discovery) being answered when this one arrived
    disconnected: threading.Event = field(default_factory=threading.Event)


def chunk(i: int, text: str, *, model: str, kind: str, finish: str | None = None) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        if finish:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": "" if finish else text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": model, "choices": [choice]}


def token_text(i: int, pad: int) -> str:
    return f"tok{i} " + ("x" * pad if pad else "")


class FakeApp:
    def __init__(self, models: list[str], defaults: dict[str, Any]) -> None:
        self.models = models
        self.defaults = {**DEFAULTS, **defaults}
        self.requests: list[Seen] = []
        self.gets: list[str] = []  # paths of the GET requests
        self.gets_open = 0  # GET requests being answered now
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            self.gets.append(path)
            self.gets_open += 1
            try:
                return await self._get(send, path)
            finally:
                self.gets_open -= 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = orjson.loads(body)
        seen = Seen(path, data, {k.decode(): v.decode() for k, v in scope["headers"]}, gets_open=self.gets_open)
        self.requests.append(seen)
        script = {**self.defaults, **data.get("fake", {})}
        watcher = asyncio.create_task(_watch(receive, seen))
        try:
            if self.defaults["slots"]:
                if self._slots is None:
                    self._slots = asyncio.Semaphore(self.defaults["slots"])
                async with self._slots:
                    seen.started = time.monotonic()  # its turn came: the server's queue is behind it
                    await self._answer(send, seen, data, script, path)
            else:
                await self._answer(send, seen, data, script, path)
        finally:
            watcher.cancel()

    async def _get(self, send, path: str) -> None:
        if path.endswith("/v1/models"):  # under any base: /v1/models, /openai/v1/models...
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models]
            return await _json(send, 200, {"object": "list", "data": data})
        if path == "/health":
            await asyncio.sleep(self.defaults["health_delay"])
            return await _json(send, 200, {"status": "ok"})
        return await _json(send, 404, {"error": {"message": "not found"}})

    async def _answer(self, send, seen: Seen, data: dict, script: dict, path: str) -> None:
        if script["hang"]:
            await _sleep(seen, 3600)
        status = script["status"]
        if status != 200:
            await _sleep(seen, script["ttft"])
            if script["error_body"] is not None:
                raw = script["error_body"].encode()
                await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", str(len(raw)).encode())]})
                return await send({"type": "http.response.body", "body": raw})
            error = {"error": {"message": f"scripted {status}", "type": "fake_error", "param": None, "code": None}}
            return await _json(send, status, error)
        kind = "chat" if path.endswith("chat/completions") else "completions"
        model = data.get("model", "?")
        tokens, pad, delay = script["tokens"], script["pad"], script["delay"]
        if not data.get("stream"):
            await _sleep(seen, script["ttft"] + delay * max(0, tokens - 1))
            text = "".join(token_text(i, pad) for i in range(tokens))
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "stop"}
                answer = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1700000000, "model": model, "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
                answer = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": model, "choices": [choice], "usage": usage}
            return await _json(send, 200, answer)
        if not script["headers_first"]:
            await _sleep(seen, script["ttft"])
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                # as sse-starlette (llama.cpp's server, vLLM) sends them, X-Accel-Buffering included
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
            }
        )
        if script["headers_first"]:
            await _sleep(seen, script["ttft"])
        fail_after, done_after = script["fail_after"], script["done_after"]
        for i in range(tokens):
            if done_after is not None and i == done_after:
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            if seen.disconnected.is_set():
                return
            if fail_after is not None and i == fail_after:
                raise ConnectionAbortedError("scripted mid-stream failure")
            if i and delay:
                await asyncio.sleep(delay)
            elif i:
                # a send to a client that is gone returns at once: yield, or the watcher that
                # notices the disconnect never runs and a zero-delay stream "sends" to its end
                await asyncio.sleep(0)
            await self._event(send, seen, chunk(i, token_text(i, pad), model=model, kind=kind))
        await self._event(send, seen, chunk(tokens, "", model=model, kind=kind, finish="stop"))
        options = data.get("stream_options") or {}
        if options.get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            last = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": model, "choices": [], "usage": usage}
            await self._event(send, seen, last)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        seen.finished = True

    async def _event(self, send, seen: Seen, payload: dict) -> None:
        data = b"data: " + orjson.dumps(payload) + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})
        seen.chunks_sent += 1
        seen.bytes_sent += len(data)
        seen.last_write = time.monotonic()


async def _sleep(seen: Seen, seconds: float) -> None:
    """Sleep, but wake up early when the client has gone (as a server would stop work)."""
    deadline = time.monotonic() + seconds
    while not seen.disconnected.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        await asyncio.sleep(min(remaining, 0.05))


async def _watch(receive, seen: Seen) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            seen.disconnected.set()
            return


async def _json(send, status: int, payload: Any) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
