"""The HTTP/1.1 listener against clients that send their heads slowly, endlessly or wrongly:
each is answered in OpenAI-shaped JSON and closed, and nobody else notices."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import select
import socket
import time

import httpx
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.ingress.http1 import _Cycle

from tests.conftest import cluster
from tests.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def fake(upstreams):
    return upstreams()


@pytest.fixture
def gw(fake, gateways):
    limits = {"header_timeout_s": 0.6, "max_header_bytes": 8192, "max_header_count": 20, "max_connections": 64}
    return gateways({"clusters": [cluster(fake)], "limits": limits})


def connect(gw) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def error_of(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_head_sent_a_byte_at_a_time_is_cut_off_with_408_while_others_are_served(gw):
    with connect(gw) as sock:
        sock.settimeout(30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        served = sent = 0
        slow = b"host: x\r\nx-slow: " + b"a" * 600  # slowloris: a byte every 50 ms (30 s), never the end
        try:
            for byte in slow:
                sock.sendall(bytes([byte]))
                sent += 1
                if served < 3:
                    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
                    served += 1
                if select.select([sock], [], [], 0.05)[0]:
                    break  # the gateway answered
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert error_of(answer, 408)["code"] == "request_timeout"
    assert sent < len(slow)  # cut at the header timeout (0.6 s + the sweep), not when the client stopped
    assert served == 3


def test_a_connection_that_sends_nothing_is_closed(gw):
    with connect(gw) as sock:
        sock.settimeout(30)  # a generous bound: the header timeout is 0.6 s
        answer = read_all(sock)
    assert error_of(answer, 408)["code"] == "request_timeout"


def test_a_kept_alive_connection_serves_request_after_request(gw):
    with httpx.Client() as client:
        for _ in range(5):
            assert client.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
            time.sleep(0.2)  # together longer than the header timeout: it counts per request head


def test_too_many_headers_is_431(gw):
    with connect(gw) as sock:
        headers = b"".join(b"x-h%d: v\r\n" % i for i in range(25))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + headers + b"content-length: 2\r\n\r\n{}")
        error = error_of(read_all(sock), 431)
    assert error["code"] == "request_header_fields_too_large" and "20 headers" in error["message"]
    many = {f"x-h{i}": "v" for i in range(12)}
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=many).status_code == 200


def test_an_endless_header_is_cut_off_with_431_long_before_its_end(gw):
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        try:
            for _ in range(16 * 1024):  # would be 64 MiB
                sock.sendall(b"a" * 4096)
                sent += 4096
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert sent < 4 * 1024 * 1024
    if answer:  # the 431 may be lost to the reset of a connection closed with unread data
        assert error_of(answer, 431)["code"] == "request_header_fields_too_large"
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_a_large_header_below_the_limit_passes_and_one_above_is_431(gw):
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-big": "a" * 6000}).status_code == 200
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 9000 + b"\r\ncontent-length: 2\r\n\r\n{}")
        assert error_of(read_all(sock), 431)["code"] == "request_header_fields_too_large"


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"FOO /v1/models HTTP/1.1\r\nhost: x\r\n\r\n", id="unknown-method"),
        pytest.param(b"GET /v1/models HTTP/9.9\r\nhost: x\r\n\r\n", id="bad-version"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", id="tls-to-plain-port"),
        pytest.param(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            id="smuggling-cl-te",
        ),
        pytest.param(b"GET /v1/models HTTP/1.1\r\nbad header\r\n\r\n", id="header-without-colon"),
    ],
)
def test_what_the_parser_refuses_is_an_openai_400(gw, request_bytes):
    with connect(gw) as sock:
        sock.sendall(request_bytes)
        error = error_of(read_all(sock), 400)
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"


CHUNKED = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = json.dumps(CHAT).encode()


@pytest.mark.parametrize(
    "request_bytes,status,code,message",
    [
        pytest.param(b"GET /healthz HTTP/1.1\r\n\r\n", 400, "invalid_http_request", "exactly one Host", id="no-host"),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", 400, "invalid_http_request", "exactly one Host",
            id="two-hosts",
        ),
        pytest.param(
            CHUNKED.replace(b"chunked", b"gzip, chunked") + b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY),
            501, "unsupported_transfer_coding", "'gzip'", id="gzip-before-chunked",
        ),
        pytest.param(
            CHUNKED.replace(b"transfer-encoding: chunked", b"transfer-encoding: x-custom\r\ntransfer-encoding: chunked")
            + b"0\r\n\r\n",
            501, "unsupported_transfer_coding", "'x-custom'", id="unknown-coding-in-two-fields",
        ),
        pytest.param(CHUNKED.replace(b"chunked", b"gzip") + b"{}", 400, "invalid_http_request", "end with chunked", id="gzip-alone"),
        pytest.param(
            CHUNKED.replace(b"chunked", b"chunked;q=1") + b"0\r\n\r\n", 400, "invalid_http_request", "malformed", id="coding-with-parameter",
        ),
        pytest.param(
            CHUNKED.replace(b"HTTP/1.1", b"HTTP/1.0") + b"0\r\n\r\n", 400, "invalid_http_request", "HTTP/1.0", id="chunked-in-http10",
        ),
        pytest.param(CHUNKED + b"fffffffffffffffffff\r\nab\r\n0\r\n\r\n", 400, "invalid_http_request", "", id="chunk-size-overflow"),
        pytest.param(CHUNKED + b"5\nhello\n0\n\n", 400, "invalid_http_request", "", id="lf-only-chunk-lines"),
        pytest.param(CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", 400, "invalid_http_request", "", id="chunk-size-not-hex"),
        pytest.param(
            CHUNKED + b"%x\r\n%b\r\n" % (len(BODY), BODY) + b"5\r\nhello!\r\n0\r\n\r\n", 400, "invalid_http_request", "",
            id="chunk-longer-than-its-size",
        ),
    ],
)
def test_framing_the_gateway_does_not_trust_is_refused_in_json_before_the_close(gw, fake, request_bytes, status, code, message):
    """RFC 9112's framing rules (one Host; chunked as the only, final transfer coding) and
    every refusal of the parser mid-body are answered in JSON before the connection
    closes; the upstream never sees such a request."""
    seen = len(fake.requests)
    with connect(gw) as sock:
        sock.sendall(request_bytes)
        error = error_of(read_all(sock), status)
    assert error["code"] == code and message in error["message"]
    assert len(fake.requests) == seen
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_an_http10_request_may_come_without_host(gw):
    with connect(gw) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body) == {"status": "ok"}


def test_past_max_connections_a_client_gets_a_json_503_with_retry_after(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "limits": {"max_connections": 2}})
    held = [httpx.Client() for _ in range(2)]
    try:
        for client in held:  # two kept-alive connections
            assert client.get(gw.url + "/healthz").status_code == 200
        refused = httpx.get(gw.url + "/healthz")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_connections"
    finally:
        for client in held:
            client.close()
    wait_until(lambda: not gw.server.server_state.connections, what="the closed connections to be gone")
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_requests_and_their_connection_leave_nothing_to_the_garbage_collector(gw):
    """Every request's objects are freed when it ends, and a connection's when it closes:
    none waits in a reference cycle for the collector (whose passes over many such
    objects cost the hot path more than the request itself)."""
    with httpx.Client() as client:  # warm: pools, caches, lazily built objects
        for stream in (False, True):
            client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with httpx.Client() as client:
            for stream in (False, True) * 10:
                assert client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}).status_code == 200
        # the gateway's side of the closed connection
        wait_until(lambda: not gw.server.server_state.connections, what="the closed connection to be gone")
        gc.collect()
        ours = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.split(".")[0] in ("gateway", "routing", "cache")
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours, ours


def test_a_json_answer_goes_out_in_one_write(gw):
    """Its status line, headers and body leave in one write (one syscall, one segment),
    not the head and then the body; a stream's head still goes out on its own, before
    its first event."""
    sock = connect(gw)
    try:
        protocol = wait_until(
            lambda: next(iter(gw.server.server_state.connections), None), what="the gateway's side of the connection"
        )
        writes: list[bytes] = []
        real = protocol.transport

        class Spy:
            def write(self, data: bytes) -> None:
                writes.append(bytes(data))
                real.write(data)

            def __getattr__(self, name):
                return getattr(real, name)

        protocol.transport = Spy()  # what the next request's response is written through
        body = json.dumps(CHAT).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body)
        )
        answer = read_all(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["object"] == "chat.completion"
    assert writes == [answer], [w[:60] for w in writes]


class _Recorder:
    """A transport that keeps what is written to it (the cycle's only use of its transport
    while it writes a head)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.written.append(b"<closed>")


def _cycle(cls, method: str, keep_alive: bool, default_headers):
    transport = _Recorder()
    scope = {"type": "http", "method": method, "http_version": "1.1", "path": "/", "query_string": b"", "headers": []}
    cycle = cls(scope, transport, FlowControl(transport), logging.getLogger("t"), logging.getLogger("t.a"), False,
                default_headers, asyncio.Event(), False, keep_alive, lambda: None)
    return cycle, transport


_DATE = [(b"date", b"Wed, 02 Dec 2026 07:00:00 GMT")]


@pytest.mark.parametrize(
    "method, keep_alive, defaults, messages",
    [
        pytest.param("POST", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"r1"), (b"content-length", b"2")]}, {"type": "http.response.body", "body": b"{}"}], id="json"),
        pytest.param("POST", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"Content-Type", b"text/event-stream"), (b"X-Accel-Buffering", b"no")]}, {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}, {"type": "http.response.body", "body": b""}], id="stream-chunked-upper-case-names"),
        pytest.param("POST", False, _DATE, [{"type": "http.response.start", "status": 429, "headers": [(b"retry-after", b"2"), (b"content-length", b"0")]}, {"type": "http.response.body", "body": b""}], id="not-kept-alive"),
        pytest.param("HEAD", True, [], [{"type": "http.response.start", "status": 200, "headers": [(b"x", b"y")]}, {"type": "http.response.body", "body": b""}], id="head-no-defaults"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 204, "headers": []}, {"type": "http.response.body", "body": b""}], id="204-defaults-only"),
        pytest.param("GET", True, [], [{"type": "http.response.start", "status": 304}, {"type": "http.response.body", "body": b""}], id="no-headers-at-all"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3"), (b"Content-Length", b"9")]}, {"type": "http.response.body", "body": b"abc"}], id="content-length-twice"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"Transfer-Encoding", b"chunked"), (b"content-length", b"3")]}, {"type": "http.response.body", "body": b"abc"}], id="transfer-encoding"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"connection", b"keep-alive, Close"), (b"content-length", b"1")]}, {"type": "http.response.body", "body": b"a"}], id="connection-close"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"ok", b"1"), (b"bad name", b"1")]}], id="invalid-name"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"ok", b"1\r\nx-injected: 1")]}], id="invalid-value"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"ten")]}], id="content-length-not-a-number"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 999, "headers": []}], id="unknown-status"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.body", "body": b"x"}], id="body-before-start"),
        pytest.param("GET", True, _DATE, [{"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1")]}, {"type": "http.response.body", "body": b"xy"}], id="body-longer-than-its-length"),
    ],
)
async def test_the_listeners_response_head_is_uvicorns_byte_for_byte(method, keep_alive, defaults, messages):
    """``_Cycle.send`` against uvicorn's own ``RequestResponseCycle.send``, the oracle: the
    same bytes written, the same error raised, the same state after, for every kind of head."""
    outcomes = []
    for cls in (RequestResponseCycle, _Cycle):
        cycle, transport = _cycle(cls, method, keep_alive, list(defaults))
        error = None
        try:
            for message in messages:
                await cycle.send(message)
        except Exception as exc:  # the same class and message from both
            error = (type(exc), str(exc))
        state = (cycle.response_started, cycle.response_complete, cycle.chunked_encoding, cycle.expected_content_length, cycle.keep_alive)
        outcomes.append((transport.written, error, state))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][0] or outcomes[0][1]  # each case writes or refuses something
