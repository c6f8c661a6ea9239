"""A fast fake OpenAI-compatible upstream for the relay benchmark: raw asyncio + httptools.

Zero delays, HTTP/1.1 keep-alive, no framework: so that the upstream is not what a gateway
benchmark measures. Answers

    POST /v1/chat/completions, /v1/completions   JSON, or SSE when "stream": true
    GET  /v1/models, /health
    POST /v1/traces                               200, empty (an OTLP/HTTP sink for traced gateways)

The answers have the shape of ``loadgen/fake_upstream.py`` (same ids, fields and token texts): a stream
is ``--tokens`` content chunks, one chunk with ``finish_reason: "stop"``, then
``data: [DONE]`` (tokens + 2 events), sent chunked, one event per event-loop turn (a
zero-delay token stream: each event is its own ``write``, streams on different
connections interleave), or ``"fake": {"delay": SECONDS}`` apart when the request body asks
(as ``loadgen/fake_upstream.py`` does). Responses are built once per (model, kind, stream) and cached.

    .venv/bin/python bench/fast_upstream.py --port 9001 [--tokens 64]
    .venv/bin/python bench/fast_upstream.py --port 9002 --hypercorn   # h2c + h1: loadgen/fake_upstream.py under hypercorn

``--hypercorn`` serves the ``loadgen/fake_upstream.py`` app instead (HTTP/1.1 and HTTP/2 cleartext with
prior knowledge on one port; much slower, but it speaks h2c).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import httptools
import orjson

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CREATED = 1700000000


def _token(i: int) -> str:
    return f"tok{i} "


def _chunk(i: int, text: str, model: str, kind: str, finish: str | None = None) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        if finish:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": _CREATED, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": "" if finish else text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-fake", "object": "text_completion", "created": _CREATED, "model": model, "choices": [choice]}


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "OK")
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_response(status: int, payload: object) -> bytes:
    body = orjson.dumps(payload)
    return _head(status, [("content-type", "application/json"), ("content-length", str(len(body)))]) + body


class Answers:
    """Pre-built responses, per (model, kind)."""

    def __init__(self, tokens: int, models: list[str]) -> None:
        self.tokens = tokens
        self.models = models
        self._json: dict[tuple[str, str], bytes] = {}
        self._sse: dict[tuple[str, str], list[bytes]] = {}
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in models]
        self.model_list = _json_response(200, {"object": "list", "data": data})
        self.health = _json_response(200, {"status": "ok"})
        self.accepted = _head(200, [("content-type", "application/x-protobuf"), ("content-length", "0")])
        self.not_found = _json_response(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        self.sse_head = _head(
            200,
            [
                ("content-type", "text/event-stream; charset=utf-8"),
                ("cache-control", "no-cache"),
                ("transfer-encoding", "chunked"),
            ],
        )

    def json(self, model: str, kind: str) -> bytes:
        key = (model, kind)
        answer = self._json.get(key)
        if answer is None:
            tokens = self.tokens
            text = "".join(_token(i) for i in range(tokens))
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "stop"}
                payload = {"id": "chatcmpl-fake", "object": "chat.completion", "created": _CREATED, "model": model, "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
                payload = {"id": "cmpl-fake", "object": "text_completion", "created": _CREATED, "model": model, "choices": [choice], "usage": usage}
            answer = self._json[key] = _json_response(200, payload)
        return answer

    def sse(self, model: str, kind: str) -> list[bytes]:
        """The chunked-encoded frames: one per event, then the terminating chunk."""
        key = (model, kind)
        frames = self._sse.get(key)
        if frames is None:
            events = [b"data: " + orjson.dumps(_chunk(i, _token(i), model, kind)) + b"\n\n" for i in range(self.tokens)]
            events.append(b"data: " + orjson.dumps(_chunk(self.tokens, "", model, kind, "stop")) + b"\n\n")
            events.append(b"data: [DONE]\n\n")
            frames = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
            frames.append(b"0\r\n\r\n")
            self._sse[key] = frames
        return frames


class Connection(asyncio.Protocol):
    __slots__ = ("answers", "loop", "transport", "parser", "url", "body", "frames", "index", "writable", "closed", "delay")

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.frames: list[bytes] | None = None
        self.index = 0
        self.writable = True
        self.closed = False
        self.delay = 0.0

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.frames = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        if self.frames is not None:
            self.loop.call_soon(self._step)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        answers = self.answers
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"GET":
            if path == b"/v1/models":
                self.transport.write(answers.model_list)
            elif path == b"/health":
                self.transport.write(answers.health)
            else:
                self.transport.write(answers.not_found)
            return
        if path == b"/v1/traces":  # an OTLP/HTTP sink: spans accepted and dropped
            self.transport.write(answers.accepted)
            return
        if path not in (b"/v1/chat/completions", b"/v1/completions"):
            self.transport.write(answers.not_found)
            return
        kind = "chat" if path == b"/v1/chat/completions" else "completions"
        try:
            data = orjson.loads(b"".join(self.body))
            model = str(data.get("model", "?"))
            stream = data.get("stream") is True
            delay = float((data.get("fake") or {}).get("delay", 0.0))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            self.transport.write(_json_response(400, {"error": {"message": "bad json", "type": "invalid_request_error"}}))
            return
        if not stream:
            self.transport.write(answers.json(model, kind))
            return
        self.transport.write(answers.sse_head)
        self.frames = answers.sse(model, kind)
        self.index = 0
        self.delay = delay
        self.loop.call_soon(self._step)

    def _step(self) -> None:
        frames = self.frames
        if frames is None or self.closed or not self.writable:
            return
        self.transport.write(frames[self.index])
        self.index += 1
        if self.index < len(frames):
            # the next token: on the next loop turn, or after the scripted delay (the finish
            # chunk, [DONE] and the terminating chunk follow the last token at once)
            if self.delay and self.index < len(frames) - 3:
                self.loop.call_later(self.delay, self._step)
            else:
                self.loop.call_soon(self._step)
        else:
            self.frames = None


async def serve_fast(host: str, port: int, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(answers), host, port, backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fast upstream on http://{host}:{port}", flush=True)
    async with server:
        await stop.wait()


async def serve_hypercorn(host: str, port: int, tokens: int, models: list[str]) -> None:
    sys.path.insert(0, _ROOT)
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from loadgen.fake_upstream import FakeApp, honour_h2_flow_control

    honour_h2_flow_control()
    app = FakeApp(models, {"tokens": tokens})
    app.requests = _Discard()  # don't keep a record of every request for the whole benchmark
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.loglevel = "ERROR"
    config.accesslog = None
    config.errorlog = None
    # hypercorn sends GOAWAY after 1000 requests on a connection and then drops the streams
    # still running on it: a benchmark must not measure that quirk as gateway failures
    config.keep_alive_max_requests = 10**9
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"hypercorn loadgen/fake_upstream.py upstream on http://{host}:{port} (h1 + h2c)", flush=True)
    await serve(app, config, shutdown_trigger=stop.wait, mode="asgi")


class _Discard(list):
    def append(self, item) -> None:  # noqa: D102
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=64, help="content chunks per answer (default 64)")
    parser.add_argument("--model", action="append", default=[], help="model listed by /v1/models (repeatable)")
    parser.add_argument("--hypercorn", action="store_true", help="serve loadgen/fake_upstream.py under hypercorn (h1 + h2c)")
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    models = args.model or ["bench-model"]
    if args.hypercorn:
        coro = serve_hypercorn(args.host, args.port, args.tokens, models)
    else:
        coro = serve_fast(args.host, args.port, Answers(args.tokens, models))
    try:
        if args.no_uvloop:
            raise ImportError
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


if __name__ == "__main__":
    main()
