"""The OpenAI HTTP API as the load generator speaks it: request bytes out, SSE or JSON in.

``RequestHead`` renders the constant part of every request once per run; ``Requester``
sends one ``RequestSpec`` through the connection pool and turns the answer into a
``RequestRecord``. The readers see the body as it arrives:

- ``StreamReader`` (``text/event-stream``): stamps each event that carries content
  (``delta.content`` — or a reasoning model's ``reasoning_content`` / ``reasoning`` —
  for chat, ``text`` for completions) with the time of the read that brought it. TTFT is
  the first such stamp, ITL the gaps between them; ``usage`` (asked for with
  ``stream_options.include_usage``) gives the output tokens, else the content chunks are
  counted. An ``{"error": ...}`` event makes the request a ``stream_error``.
- ``JsonReader``: a whole answer; its TTFT is its end-to-end time.
- ``ErrorReader``: the first few KB of a non-200 answer, for the error's message.

The server chooses SSE or JSON by its ``content-type``, whatever was asked.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

import orjson

from loadgen.http import BaseURL, BodyReader, ConnectionPool, HttpError, Response
from loadgen.types import ErrorKind, RequestRecord, RequestSpec, http_error

__all__ = ["ENDPOINTS", "RequestHead", "Requester", "check_headers", "client_version", "error_message", "list_models"]

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # an HTTP header name (RFC 9110 token)
_DETAIL_BYTES = 4096
_loads = orjson.loads


def client_version() -> str:
    try:
        return version("edgegw")
    except PackageNotFoundError:
        return "0+unknown"


def check_headers(headers: dict[str, str]) -> dict[str, str]:
    """The headers with lower-case names; ``ValueError`` for a name that is not an HTTP
    token or a value that would start another header line."""
    checked = {}
    for name, value in headers.items():
        if not _TOKEN.match(name):
            raise ValueError(f"header name {name!r} is not a valid HTTP token")
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r}: the value must be one line")
        checked[name.lower()] = value
    return checked


class RequestHead:
    """The request line and headers shared by every request of a run (Content-Length
    aside); the user's headers replace the defaults of the same name."""

    def __init__(self, base: BaseURL, path: str, headers: dict[str, str], stream: bool) -> None:
        merged = {
            "host": base.authority,
            "user-agent": f"edgegw-bench/{client_version()}",
            "content-type": "application/json",
            "accept": "text/event-stream" if stream else "application/json",
        }
        merged.update(check_headers(headers))
        merged.pop("content-length", None)
        lines = [f"POST {base.prefix}{path} HTTP/1.1"] + [f"{k}: {v}" for k, v in merged.items()]
        self.prefix = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("latin-1")

    def encode(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self.prefix, len(body), body)


class StreamReader:
    """An SSE body: content-chunk times, usage, and what went wrong."""

    __slots__ = ("buffer", "times", "output_tokens", "input_tokens", "done", "error", "bad")

    def __init__(self) -> None:
        self.buffer = b""
        self.times: list[float] = []
        self.output_tokens: int | None = None
        self.input_tokens: int | None = None
        self.done = False
        self.error: str | None = None  # the message of an error event
        self.bad: str | None = None  # why the stream could not be read

    def feed(self, data: bytes, now: float) -> None:
        if self.buffer:
            data = self.buffer + data
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        end = data.find(b"\n\n")
        if end >= 0 and end == len(data) - 2:  # exactly one whole event: the usual read
            self.buffer = b""
            self._event(data[:end], now)
            return
        start = 0
        while end >= 0:
            self._event(data[start:end], now)
            start = end + 2
            end = data.find(b"\n\n", start)
        self.buffer = data[start:]

    def _event(self, raw: bytes, now: float) -> None:
        if raw[:6] == b"data: " and b"\n" not in raw:
            payload = raw[6:]
        else:
            lines = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return  # a comment (": ping") or a field this client does not use
            payload = b"\n".join(lines)
        try:
            event = _loads(payload)
        except orjson.JSONDecodeError:
            if payload.strip() == b"[DONE]":
                self.done = True
            elif self.bad is None:
                self.bad = f"an SSE event is not JSON: {payload[:80]!r}"
            return
        if type(event) is not dict:
            self.bad = self.bad or f"an SSE event is not a JSON object: {payload[:80]!r}"
            return
        choices = event.get("choices")
        if choices:
            for choice in choices:
                delta = choice.get("delta")
                if delta is None:
                    text = choice.get("text")
                else:
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                if text:
                    self.times.append(now)
                    break
        elif event.get("error") or event.get("object") == "error":
            self.error = self.error or error_message(event)
        usage = event.get("usage")
        if usage and type(usage) is dict:
            self.output_tokens = usage.get("completion_tokens", self.output_tokens)
            self.input_tokens = usage.get("prompt_tokens", self.input_tokens)


class JsonReader:
    """A whole JSON answer, parsed when complete."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def feed(self, data: bytes, now: float) -> None:
        self.parts.append(data)

    def body(self) -> bytes:
        return b"".join(self.parts)


class ErrorReader:
    """The start of a non-200 answer (its message is all a report needs)."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def feed(self, data: bytes, now: float) -> None:
        if len(self.data) < _DETAIL_BYTES:
            self.data += data[: _DETAIL_BYTES - len(self.data)]


def make_reader(status: int, headers: dict[str, str]) -> BodyReader:
    if status != 200:
        return ErrorReader()
    if headers.get("content-type", "").startswith("text/event-stream"):
        return StreamReader()
    return JsonReader()


def error_message(payload: object) -> str:
    """The message of an OpenAI (``{"error": {"message"}}``), vLLM (``{"object": "error",
    "message"}``) or FastAPI (``{"detail"}``) error; else the text itself, shortened."""
    if isinstance(payload, (bytes, str)):
        text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
        try:
            payload = orjson.loads(text)
        except orjson.JSONDecodeError:
            return " ".join(text.split())[:200]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:200]
        for key in ("message", "detail", "error"):
            if payload.get(key):
                return str(payload[key])[:200]
    return str(payload)[:200]


class Requester:
    """Sends requests of one run; times are measured from just before the connection is
    taken from the pool, and recorded relative to the run's start ``t0``."""

    def __init__(self, pool: ConnectionPool, head: RequestHead, timeout: float, t0: float) -> None:
        self.pool = pool
        self.head = head
        self.timeout = timeout
        self.t0 = t0
        self.server: str | None = None  # the Server header of the first answer

    async def send(self, index: int, spec: RequestSpec, ready: float, begin: float) -> RequestRecord:
        """``begin``: ``perf_counter()`` as the caller started this request."""
        record = RequestRecord(index, ready, begin - self.t0)
        try:
            response = await self.pool.request(self.head.encode(spec.body), make_reader, self.timeout)
        except HttpError as exc:
            record.error, record.detail = exc.kind, exc.detail
            return record
        if self.server is None:
            self.server = response.headers.get("server", "")
        read_response(record, response, begin)
        return record


def read_response(record: RequestRecord, response: Response, begin: float) -> None:
    """Fill ``record`` from a complete answer."""
    headers = response.headers
    record.status = response.status
    record.server_timing = headers.get("server-timing")
    record.route = headers.get("x-edgegw-route")
    record.x_cache = headers.get("x-cache")
    record.e2e = response.done - begin
    reader = response.reader
    if isinstance(reader, ErrorReader) or reader is None:
        record.error = http_error(response.status)
        record.detail = error_message(reader.data) if reader is not None else ""
    elif isinstance(reader, StreamReader):
        _read_stream(record, reader, begin)
    else:
        _read_json(record, reader)


def _read_stream(record: RequestRecord, reader: StreamReader, begin: float) -> None:
    record.streamed = True
    if reader.error is not None:
        record.error, record.detail = ErrorKind.STREAM, reader.error
        return
    if reader.bad is not None:
        record.error, record.detail = ErrorKind.PROTOCOL, reader.bad
        return
    times = reader.times
    if times:
        record.ttft = times[0] - begin
        record.itl = [b - a for a, b in zip(times, times[1:])]
    record.output_tokens = reader.output_tokens if isinstance(reader.output_tokens, int) else len(times)
    record.input_tokens = reader.input_tokens if isinstance(reader.input_tokens, int) else None


def _read_json(record: RequestRecord, reader: JsonReader) -> None:
    body = reader.body()
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        record.error, record.detail = ErrorKind.PROTOCOL, f"the answer is not JSON: {body[:80]!r}"
        return
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        record.error, record.detail = ErrorKind.PROTOCOL, f"not an OpenAI completion: {body[:80]!r}"
        return
    record.ttft = record.e2e
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.input_tokens = usage["prompt_tokens"]
    else:  # no usage: approximate tokens by words, as the prompts are
        record.output_tokens = sum(len(_text(choice).split()) for choice in answer["choices"])


def _text(choice: dict) -> str:
    message = choice.get("message")
    if isinstance(message, dict):
        return message.get("content") or ""
    return choice.get("text") or ""


async def list_models(pool: ConnectionPool, headers: dict[str, str], timeout: float) -> list[str]:
    """The model ids of ``GET {base}/models``; raises ``HttpError`` or ``ValueError``."""
    base = pool.base
    merged = {"host": base.authority, "user-agent": f"edgegw-bench/{client_version()}", **headers, "accept": "application/json"}
    lines = [f"GET {base.prefix}/models HTTP/1.1"] + [f"{k}: {v}" for k, v in merged.items() if k != "content-type"]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    response = await pool.request(raw, make_reader, timeout)
    reader = response.reader
    if response.status != 200 or not isinstance(reader, JsonReader):
        detail = error_message(reader.data) if isinstance(reader, ErrorReader) else ""
        raise ValueError(f"GET {base.url('/models')}: HTTP {response.status} {detail}".rstrip())
    try:
        data = orjson.loads(reader.body()).get("data") or []
        return [str(m["id"]) for m in data]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        raise ValueError(f"GET {base.url('/models')}: not an OpenAI model list") from None
