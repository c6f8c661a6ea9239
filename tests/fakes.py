"""A fake OpenAI-compatible inference server with scripted timing and failures.

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
    hang         never answer
    health_delay seconds before GET /health answers (how fast a probe finds it)

Runs on HTTP/1.1 (uvicorn) or HTTP/2 cleartext with prior knowledge (hypercorn), each on
its own event loop in a thread, on 127.0.0.1 and an ephemeral port. Every request is
recorded (``FakeUpstream.requests``): its body, headers, how many chunks and bytes were
written, and whether the server saw the client go away.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from hypercorn.asyncio import serve
from hypercorn.config import Config
from hypercorn.protocol import h2 as hypercorn_h2

# Hypercorn's HTTP/2 send buffer releases the ASGI writer whenever its sender pops with a
# closed flow-control window (a pop of zero bytes counts as "drained"), so an app's writes
# never block and the buffer grows without bound. A real inference server must honour the
# window; patch the fake so that an empty pop releases nobody and flow control reaches the
# writer, as it does on HTTP/1.1.
_hypercorn_pop = hypercorn_h2.StreamBuffer.pop


async def _pop_honouring_window(self, max_length: int) -> bytes:
    if max_length <= 0:
        return b""
    return await _hypercorn_pop(self, max_length)


hypercorn_h2.StreamBuffer.pop = _pop_honouring_window

DEFAULTS = {
    "ttft": 0.0,
    "delay": 0.0,
    "tokens": 8,
    "pad": 0,
    "status": 200,
    "fail_after": None,
    "hang": False,
    "headers_first": True,
    "health_delay": 0.0,
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
            if path == "/v1/models":
                data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models]
                return await _json(send, 200, {"object": "list", "data": data})
            if path == "/health":
                await asyncio.sleep(self.defaults["health_delay"])
                return await _json(send, 200, {"status": "ok"})
            return await _json(send, 404, {"error": {"message": "not found"}})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = orjson.loads(body)
        seen = Seen(path, data, {k.decode(): v.decode() for k, v in scope["headers"]})
        self.requests.append(seen)
        script = {**self.defaults, **data.get("fake", {})}
        watcher = asyncio.create_task(_watch(receive, seen))
        try:
            await self._answer(send, seen, data, script, path)
        finally:
            watcher.cancel()

    async def _answer(self, send, seen: Seen, data: dict, script: dict, path: str) -> None:
        if script["hang"]:
            await _sleep(seen, 3600)
        status = script["status"]
        if status != 200:
            await _sleep(seen, script["ttft"])
            error = {"error": {"message": f"scripted {status}", "type": "fake_error", "param": None, "code": None}}
            return await _json(send, status, error)
        kind = "chat" if path.endswith("chat/completions") else "completion"
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
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")],
            }
        )
        if script["headers_first"]:
            await _sleep(seen, script["ttft"])
        fail_after = script["fail_after"]
        for i in range(tokens):
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeUpstream:
    """A fake server running in a thread; ``stop()`` ends it."""

    def __init__(
        self,
        protocol: str = "http1",
        models: list[str] | None = None,
        tls: tuple[str, str] | None = None,
        max_requests: int | None = None,
        **defaults: Any,
    ) -> None:
        self.protocol = protocol
        self.app = FakeApp(models or ["fake-model"], defaults)
        self.port = free_port()
        self.tls = tls  # (certfile, keyfile): serve https (ALPN h2 / http/1.1)
        self.max_requests = max_requests  # HTTP/2: GOAWAY after this many requests on a connection
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._server: uvicorn.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"fake-{protocol}-{self.port}")

    @property
    def requests(self) -> list[Seen]:
        return self.app.requests

    @property
    def defaults(self) -> dict[str, Any]:
        return self.app.defaults

    def start(self) -> FakeUpstream:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not (self._ready.is_set() or (self._server is not None and self._server.started)):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        if self.protocol == "http1":
            tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls else {}
            config = uvicorn.Config(
                self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off", **tls
            )
            self._server = uvicorn.Server(config)
            self._server.run()
        else:
            asyncio.run(self._serve_hypercorn())

    async def _serve_hypercorn(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.loglevel = "ERROR"
        config.accesslog = None
        config.errorlog = None
        # hypercorn leaves a stream whose app raised open until the connection idles out:
        # keep that short so a scripted mid-stream failure reaches the gateway quickly
        config.keep_alive_timeout = 1
        if self.tls:
            config.certfile, config.keyfile = self.tls
        if self.max_requests:
            config.keep_alive_max_requests = self.max_requests
        task = asyncio.create_task(serve(self.app, config, shutdown_trigger=self._stop.wait, mode="asgi"))
        for _ in range(500):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    break
            except OSError:
                await asyncio.sleep(0.01)
        self._ready.set()
        await task

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        elif self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
