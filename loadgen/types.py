"""What one request is (``RequestSpec``) and what it measured (``RequestRecord``).

Small slotted objects: thousands are made per run and they sit on the hot path of the
load generator, so they stay plain dataclasses (the result document, built once at the
end, is the validated pydantic model in ``result.py``). Times are ``time.perf_counter()``
seconds, the same clock the connection's read callback stamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ErrorKind", "RequestRecord", "RequestSpec", "http_error"]


class ErrorKind:
    """The kinds a failed request is counted under (``http_<status>`` besides these)."""

    TIMEOUT = "timeout"  # no complete answer within --timeout
    CONNECTION = "connection"  # refused, reset, or closed before the answer was complete
    TLS = "tls"  # the TLS handshake failed (certificate, protocol)
    PROTOCOL = "protocol"  # not parseable as HTTP/1.1, SSE or the OpenAI JSON
    STREAM = "stream_error"  # a 200 stream that carried an OpenAI error event


def http_error(status: int) -> str:
    return f"http_{status}"


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request of the workload: the JSON body as sent, and its intended sizes."""

    body: bytes
    input_len: int  # prompt length in words (the token count is approximated by words)
    max_tokens: int | None


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. ``start`` and ``ready`` are seconds after the run's start;
    the durations are seconds from ``start`` (connecting included when a new connection
    was needed, as a client pays it)."""

    index: int
    ready: float  # when it was due and a concurrency slot was free
    start: float  # when its bytes were written
    error: str | None = None  # an ``ErrorKind`` or ``http_<status>``; None when it succeeded
    detail: str = ""  # the server's error message or the exception, shortened
    status: int = 0
    streamed: bool = False  # an SSE answer (TTFT, TPOT and ITL are measured only on those)
    ttft: float | None = None  # to the first content token (non-streaming: the whole answer)
    e2e: float | None = None  # to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else counted
    input_tokens: int | None = None  # usage.prompt_tokens when reported
    # what an edgegw says about the request, raw (parsed once per run by gateway_headers)
    server_timing: str | None = None
    route: str | None = None  # x-edgegw-route
    x_cache: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e − ttft) / (output tokens − 1)."""
        if not self.streamed or self.error is not None or self.ttft is None or self.e2e is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def lag(self) -> float:
        """How late the load generator wrote the request after it was ready to go."""
        return self.start - self.ready
