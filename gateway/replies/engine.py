"""What the edge engine answers, in-process or from its own process, as ``Reply`` kinds; and
its errors in the gateway's terms, one table for both backends.

- ``EngineReply``: the in-process engine's answer (``gateway.engine.local``). Streams pull
  one chunk at a time from the engine's iterator; closing removes the sequence.
- ``EngineStreamReply``: the engine process's HTTP response (``gateway.engine.process``),
  relayed as it arrives; closing closes the connection, which drops the sequence. The
  engine's stage times come in a header of a whole answer, or in a comment just before a
  stream's end, which is taken out of the stream.
- ``engine_error``: an ``edge_engine`` error as a ``GatewayError`` (``ENGINE_ERRORS``; a
  test checks that every class of ``edge_engine.errors`` is there), and
  ``engine_error_of``: the engine server's error response as the ``edge_engine`` error it
  came from, so the same table maps both.

Needs no torch: ``edge_engine.errors`` is plain Python, and the in-process reply only holds
what the engine's serving layer gave it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from edge_engine.errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from gateway.core.errors import DeadlineExceeded, GatewayError, InvalidRequest, NoHealthyUpstream, Overloaded, UpstreamError
from gateway.core.sse import DONE, EventReader, sse_event
from gateway.replies.base import JSON, SSE, Paced, Reply
from gateway.upstream import UpstreamResponse

if TYPE_CHECKING:  # the serving layer imports torch: annotations only
    from edge_engine.serving import OpenAIServing, PreparedRequest

__all__ = ["ENGINE_ERRORS", "STAGES_HEADER", "EngineReply", "EngineStreamReply", "engine_error", "engine_error_of"]

STAGES_HEADER = b"x-engine-stages"
_STAGES_COMMENT = b": x-engine-stages "
_STAGES_EVENT = re.compile(rb"(?m)^: x-engine-stages ([^\r\n]*)\r?\n\r?\n")

# The one map from the engine's errors to the gateway's (the most specific class wins).
ENGINE_ERRORS: dict[type[EngineError], Callable[[EngineError], GatewayError]] = {
    InvalidRequestError: lambda e: InvalidRequest(e.message, param=e.param, code=e.code),
    EngineOverloadedError: lambda e: Overloaded(e.message, code=e.code, retry_after=e.retry_after),
    DeadlineExceededError: lambda e: DeadlineExceeded(e.message),  # dropped in its queue, never run
    EngineClosedError: lambda e: NoHealthyUpstream(e.message, code=e.code, retry_after=1.0),
    EngineError: lambda e: UpstreamError(e.message, code=e.code or "engine_error"),
}


def engine_error(exc: EngineError) -> GatewayError:
    for cls in type(exc).__mro__:
        translate = ENGINE_ERRORS.get(cls)
        if translate is not None:
            return translate(exc)
    raise TypeError(f"not an engine error: {exc!r}")


def engine_error_of(status: int, body: bytes, retry_after: bytes | None) -> EngineError:
    """The ``edge_engine`` error behind the engine server's error response (its
    ``EngineError.to_dict()`` with the error's status)."""
    try:
        error = orjson.loads(body)["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, param, code = f"the edge engine answered {status}", None, None
    if status == 400:
        return InvalidRequestError(message, param=param, code=code)
    if status == 503 and retry_after is not None:  # its queue is full
        try:
            return EngineOverloadedError(message, retry_after=float(retry_after), code=code or "engine_overloaded")
        except ValueError:
            pass
    if status == 503:
        return EngineClosedError(message)
    if status == 504:
        return DeadlineExceededError(message)
    return EngineError(message, code=code)


class EngineReply(Reply):
    """The edge engine's answer. Streams pull one chunk at a time from the engine's
    iterator; cancelling (``aclose``) removes the sequence and frees its KV blocks."""

    label = "edge"

    def __init__(self, serving: OpenAIServing, prepared: PreparedRequest, request_id: str, ping: float) -> None:
        self._serving = serving
        self._prepared = prepared
        self._request_id = request_id
        self._ping = ping
        self.headers = [SSE if prepared.stream else JSON]
        self._chunks: Paced | None = None
        self._done = False

    async def read_body(self) -> bytes:
        try:
            return await self._serving.complete(self._prepared, self._request_id)
        except EngineError as exc:
            raise engine_error(exc) from None

    async def next_events(self) -> bytes | None:
        if self._done:
            return b""
        if self._chunks is None:
            self._chunks = Paced(self._serving.stream(self._prepared, self._request_id), self._ping)
        try:
            chunk = await self._chunks.next()
        except StopAsyncIteration:
            self._done = True
            return DONE
        except EngineError as exc:
            self._done = True
            raise engine_error(exc) from None
        if chunk is Paced.QUIET:
            return None
        return sse_event(chunk)

    @property
    def stages(self) -> tuple[tuple[str, float], ...]:
        times = self._prepared.times
        if times is None:  # not ended (or ended in an error)
            return ()
        return (("engine_queue", times.queue), ("engine_prefill", times.prefill), ("engine_decode", times.decode))

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()
        if self.slot is not None:
            self.slot.release()


def _stages(value: bytes | None) -> tuple[tuple[str, float], ...]:
    """``queue=S;prefill=S;decode=S`` (the engine server's ``x-engine-stages``) as ``Reply.stages``."""
    if not value:
        return ()
    try:
        return tuple((f"engine_{name.decode().strip()}", float(seconds)) for name, _, seconds in (p.partition(b"=") for p in value.split(b";")))
    except ValueError:
        return ()


class EngineStreamReply(Reply):
    """The engine process's answer, relayed from its HTTP response as it arrives. Closing it
    early (``aclose``) closes the connection, which drops the engine's sequence. The engine's
    stage times (``stages``) come in a header of a whole answer, or in a comment just before
    a stream's end, which is taken out of the stream."""

    label = "edge"

    def __init__(self, response: UpstreamResponse, stream: bool, ping: float, read_timeout: float, max_event: int, limit: int) -> None:
        self.response = response
        self.headers = [SSE if stream else JSON]
        self.stages = ()
        self._reader = EventReader(response.body, ping, read_timeout, max_event)
        self._timeout = read_timeout
        self._limit = limit

    async def read_body(self) -> bytes:
        body = await self.response.body.read_all(self._timeout, self._limit)
        self.stages = _stages(self.response.header(STAGES_HEADER))
        return body

    async def next_events(self) -> bytes | None:
        while True:
            events = await self._reader.next()
            if not events:
                return events
            events = self._take_stages(events)
            if events:
                return events

    def hand_over(self, on_events: Callable[[bytes], None] | None) -> bool:
        if on_events is None:
            return self._reader.hand_over(None)

        def arrived(events: bytes) -> None:
            events = self._take_stages(events)
            if events:
                on_events(events)

        return self._reader.hand_over(arrived)

    def _take_stages(self, events: bytes) -> bytes:
        """``events`` without the engine's stage comment, whose times are kept in ``stages``."""
        if _STAGES_COMMENT not in events:
            return events
        match = _STAGES_EVENT.search(events)
        if match is None:
            return events
        self.stages = _stages(match.group(1))
        return events[: match.start()] + events[match.end() :]

    @property
    def in_event(self) -> bool:
        return self._reader.in_event

    async def aclose(self) -> None:
        self.response.close()
        if self.slot is not None:
            self.slot.release()
