"""The raw HTTP/1.1 client against real sockets on 127.0.0.1: keep-alive, a stale
connection, bodies delimited by the close, and each kind of failure."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from loadgen.http import BaseURL, ConnectionPool, HttpError, ssl_context
from loadgen.openai import ErrorReader, JsonReader, RequestHead, StreamReader, make_reader
from loadgen.types import ErrorKind
from tests.waiting import eventually

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def request(base: BaseURL, stream: bool = False, **fake) -> bytes:
    body = {**CHAT, "stream": stream}
    if fake:
        body["fake"] = fake
    return RequestHead(base, "/chat/completions", {}, stream).encode(orjson.dumps(body))


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_keep_alive_reuses_one_connection(upstreams):
    fake = upstreams()
    pool = ConnectionPool(BaseURL.parse(fake.url + "/v1"))
    try:
        for _ in range(5):
            response = await pool.request(request(pool.base), make_reader, 5)
            assert response.status == 200 and isinstance(response.reader, JsonReader)
            assert orjson.loads(response.reader.body())["usage"]["completion_tokens"] == 8
        assert pool.opened == 1
        assert repr(pool) == f"<ConnectionPool 127.0.0.1:{fake.port} open=1 idle=1 opened=1>"
    finally:
        pool.close()


async def test_a_stream_is_read_as_it_arrives(upstreams):
    fake = upstreams(ttft=0.05, delay=0.03, tokens=4)
    pool = ConnectionPool(BaseURL.parse(fake.url + "/v1"))
    try:
        response = await pool.request(request(pool.base, stream=True), make_reader, 5)
        reader = response.reader
        assert isinstance(reader, StreamReader) and reader.done
        gaps = [b - a for a, b in zip(reader.times, reader.times[1:])]
        assert len(reader.times) == 4 and min(gaps) >= 0.025  # stamped on arrival, not at the end
        assert reader.times[0] - response.sent >= 0.045
    finally:
        pool.close()


class _Server:
    """A scripted asyncio server whose connections are all closed when it is."""

    def __init__(self, server: asyncio.Server, writers: list[asyncio.StreamWriter]) -> None:
        self.server = server
        self.writers = writers

    def close(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()


async def _serve(handler) -> tuple[_Server, int]:
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader, writer):
        writers.append(writer)
        await handler(reader, writer)

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    return _Server(server, writers), server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head + await reader.readexactly(length)


OK_JSON = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}}]}'


async def test_a_keep_alive_connection_closed_by_the_server_is_retried_fresh():
    async def answer_once_then_drop(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(OK_JSON), OK_JSON))
        await writer.drain()
        await reader.read(1)  # the next request arrives: drop it unanswered (an idle timeout racing it)
        writer.close()

    server, port = await _serve(answer_once_then_drop)
    pool = ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{port}/v1"))
    try:
        for _ in range(3):
            assert (await pool.request(request(pool.base), make_reader, 5)).status == 200
        assert pool.opened == 3
    finally:
        pool.close()
        server.close()
        await asyncio.sleep(0)  # let the transports report themselves closed


async def test_a_body_delimited_by_the_close_is_complete():
    async def old_style(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + OK_JSON)
        await writer.drain()
        writer.close()

    server, port = await _serve(old_style)
    pool = ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{port}/v1"))
    try:
        response = await pool.request(request(pool.base), make_reader, 5)
        assert response.status == 200 and response.reader.body() == OK_JSON
        assert not pool.idle  # not reusable
    finally:
        pool.close()
        server.close()
        await asyncio.sleep(0)  # let the transports report themselves closed


async def test_garbage_is_a_protocol_error():
    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()

    server, port = await _serve(garbage)
    pool = ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{port}/v1"))
    try:
        with pytest.raises(HttpError) as caught:
            await pool.request(request(pool.base), make_reader, 5)
        assert caught.value.kind == ErrorKind.PROTOCOL
    finally:
        pool.close()
        server.close()
        await asyncio.sleep(0)  # let the transports report themselves closed


async def test_failures_by_kind(upstreams):
    fake = upstreams()
    pool = ConnectionPool(BaseURL.parse(fake.url + "/v1"))
    try:
        with pytest.raises(HttpError) as caught:
            await pool.request(request(pool.base, hang=True), make_reader, 0.3)
        assert caught.value.kind == ErrorKind.TIMEOUT and "0.3 s" in caught.value.detail

        with pytest.raises(HttpError) as caught:
            await pool.request(request(pool.base, stream=True, fail_after=2), make_reader, 5)
        assert caught.value.kind == ErrorKind.CONNECTION and "middle of the answer" in caught.value.detail

        response = await pool.request(request(pool.base, status=503), make_reader, 5)
        assert response.status == 503 and isinstance(response.reader, ErrorReader)
        assert b"scripted 503" in response.reader.data
    finally:
        pool.close()

    refused = ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{closed_port()}/v1"))
    with pytest.raises(HttpError) as caught:
        await refused.request(request(refused.base), make_reader, 5)
    assert caught.value.kind == ErrorKind.CONNECTION and "refused" in caught.value.detail.lower()


async def test_cancelling_a_request_closes_its_connection(upstreams):
    fake = upstreams(ttft=5)
    pool = ConnectionPool(BaseURL.parse(fake.url + "/v1"))
    try:
        task = asyncio.ensure_future(pool.request(request(pool.base, stream=True), make_reader, 30))
        await eventually(lambda: fake.requests, what="the request to reach the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pool.all and not pool.idle
        await eventually(fake.requests[-1].disconnected.is_set, what="the server to see the client go")
    finally:
        pool.close()


async def test_https_verified_against_a_ca_file_or_not_at_all(upstreams, certificate):
    fake = upstreams(tls=certificate)
    base = BaseURL.parse(fake.url + "/v1")
    assert base.tls
    for context in (ssl_context(verify=False), ssl_context(ca_file=certificate[0])):
        pool = ConnectionPool(base, context)
        try:
            assert (await pool.request(request(base), make_reader, 5)).status == 200
        finally:
            pool.close()
    pool = ConnectionPool(base)  # the system's CAs do not know this certificate
    with pytest.raises(HttpError) as caught:
        await pool.request(request(base), make_reader, 5)
    assert caught.value.kind == ErrorKind.TLS and "CERTIFICATE_VERIFY_FAILED" in caught.value.detail
