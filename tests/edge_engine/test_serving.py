"""The OpenAI seam (OpenAIServing) and the standalone server over it."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import orjson
import pytest

from edge_engine import EngineOverloadedError, InvalidRequestError, OpenAIServing, SamplingParams
from edge_engine.server import create_app
from tests.edge_engine.conftest import make_engine
from tests.edge_engine.costs import freeze
from tests.waiting import eventually

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture
def serving(tiny_engine):
    return OpenAIServing(tiny_engine, "tiny")


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        pytest.param("chat", {"messages": []}, "messages", id="no-messages"),
        pytest.param("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.[0].role", id="bad-role"),
        pytest.param("chat", {**CHAT, "temperature": -1}, "temperature", id="negative-temperature"),
        pytest.param("chat", {**CHAT, "temperature": "0"}, "temperature", id="temperature-type"),
        pytest.param("chat", {**CHAT, "top_p": 0}, "top_p", id="top-p-zero"),
        pytest.param("chat", {**CHAT, "top_p": 1.01}, "top_p", id="top-p-above-one"),
        pytest.param("chat", {**CHAT, "max_tokens": "8"}, "max_tokens", id="max-tokens-type"),
        pytest.param("chat", {**CHAT, "max_tokens": 10_000}, "max_tokens", id="max-tokens-beyond-context"),
        pytest.param("chat", {**CHAT, "max_completion_tokens": 10_000}, "max_completion_tokens", id="max-completion-tokens"),
        pytest.param("chat", {**CHAT, "n": 2}, "n", id="n"),
        pytest.param("chat", {**CHAT, "stream": "yes"}, "stream", id="stream-type"),
        pytest.param("chat", {**CHAT, "seed": "1"}, "seed", id="seed-type"),
        pytest.param("completions", {"prompt": "Hello " * 400}, "prompt", id="prompt-beyond-context"),
        pytest.param("completions", {"prompt": {"x": 1}}, "prompt", id="prompt-type"),
        pytest.param("completions", {"prompt": [1, 2, 10**6]}, "prompt", id="token-out-of-vocab"),
        pytest.param("completions", {"prompt": "Hi", "logprobs": 9}, "logprobs", id="completion-logprobs"),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(serving, kind, body, param):
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare(kind, body)
    error = info.value.to_dict()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert info.value.status_code == 400


async def test_stream_yields_openai_chat_chunks_then_usage(serving):
    prepared = serving.prepare("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert prepared.stream and prepared.include_usage and prepared.num_prompt_tokens > 10
    chunks = [orjson.loads(c) async for c in serving.stream(prepared, "chatcmpl-1")]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" and c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == prepared.num_prompt_tokens
    assert 1 <= usage["usage"]["completion_tokens"] <= 8
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_complete_equals_the_joined_stream(serving):
    body = {**CHAT, "max_tokens": 12}
    streamed = [orjson.loads(c) async for c in serving.stream(serving.prepare("chat", {**body, "stream": True}), "a")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed)
    full = orjson.loads(await serving.complete(serving.prepare("chat", body), "b"))
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + full["usage"]["completion_tokens"]


async def test_completion_with_logprobs(serving):
    prepared = serving.prepare("completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True})
    body = orjson.loads(await serving.complete(prepared, "cmpl-1"))
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == choice["text"]
    chat = serving.prepare("chat", {**CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 3})
    chunks = [orjson.loads(c) async for c in serving.stream(chat, "x")]
    entries = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert entries and all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2 for e in entries)


async def test_closing_the_stream_frees_the_sequence(serving, tiny_engine):
    prepared = serving.prepare("completions", {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True})
    stream = serving.stream(prepared, "cmpl-2")
    await stream.__anext__()
    await stream.__anext__()
    await stream.aclose()
    for _ in range(500):
        stats = tiny_engine.stats()
        if stats.num_running == 0 and stats.num_kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0


def test_overload_raises_before_queueing(serving, tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine.config, "max_queue_len", 0)  # the queue is "full" already
    with pytest.raises(EngineOverloadedError) as info:
        serving.prepare("chat", CHAT)
    assert info.value.retry_after >= 1 and info.value.status_code == 503


async def test_server_speaks_openai_sse(tiny_engine, monkeypatch):
    app = create_app(tiny_engine, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert all(e.startswith("data: {") for e in events[:-1])
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
        assert r.json()["id"].startswith("cmpl-")
        for given, expected in (("req-7", "chatcmpl-req-7"), ("chatcmpl-req-8", "chatcmpl-req-8")):  # a gateway's id, OpenAI's form
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": given})
            assert r.json()["id"] == expected
        stats = await client.get("/stats")  # what a node's workers poll for routing
        assert stats.headers["content-type"] == "application/json"
        assert stats.json() == dataclasses.asdict(tiny_engine.stats())
        assert stats.json()["num_requests_finished"] >= 2
        assert (await client.post("/stats")).status_code in (404, 405)
        r = await client.post("/v1/chat/completions", json={**CHAT, "top_p": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        r = await client.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        monkeypatch.setattr(tiny_engine.config, "max_queue_len", 0)
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1


@pytest.fixture
def tokenizer_calls(serving, monkeypatch):
    """Names of the tokenizer methods called (the calls still go through)."""
    calls: list[str] = []
    tok = serving.tokenizer
    for name in ("encode", "encode_chat", "apply_chat_template"):
        real = getattr(tok, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, counted)
    return calls


HUGE = "x" * 3_900_000


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        pytest.param("completions", {"prompt": HUGE}, "prompt", id="completion"),
        pytest.param("completions", {"prompt": [HUGE]}, "prompt", id="completion-batch-of-one"),
        pytest.param("chat", {"messages": [{"role": "user", "content": HUGE}]}, "messages", id="chat"),
        pytest.param(
            "chat",
            {
                "messages": [
                    {"role": "system", "content": HUGE[:2_000_000]},
                    {"role": "user", "content": [{"type": "text", "text": HUGE[:1_900_000]}]},
                ]
            },
            "messages",
            id="chat-split-over-messages",
        ),
    ],
)
def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(serving, tokenizer_calls, kind, body, param):
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare(kind, body)
    assert info.value.code == "context_length_exceeded" and info.value.param == param
    assert tokenizer_calls == []


def test_the_early_refusal_bound_is_sound_and_not_over_eager(serving, tiny_engine, tokenizer_calls):
    tok = serving.tokenizer
    longest = tok.max_token_chars
    # no token stands for more characters than the bound
    assert longest >= max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))
    # a prompt that might still fit (just under the bound) is tokenised, then judged by its tokens
    limit = min(tiny_engine.max_model_len, tiny_engine.num_kv_tokens)
    text = "x" * ((limit - 1) * longest)
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare("completions", {"prompt": text})
    assert info.value.code == "context_length_exceeded" and tokenizer_calls == ["encode"]


async def test_a_request_that_cannot_start_in_its_budget_is_refused_at_once_with_503(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_pending_outputs=1)
    freeze(engine, fixed=0.01)  # every step is believed to take 10 ms
    app = create_app(engine, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await engine.start()
        try:
            # the only batch slot, held by a stream nobody reads, with 199 tokens (~2 s) to go
            blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            await blocker.__anext__()
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers={"x-latency-budget-ms": "1000"})
                assert r.status_code == 503 and r.headers["retry-after"] in ("2", "3"), r.text  # ~2 s to wait
                assert r.json()["error"]["code"] == "deadline_unattainable"
            assert engine.stats().num_refused == 2 and engine.stats().num_deadline_drops == 0
            # a budget the slot's wait fits in is admitted (and waits its turn)
            admitted = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers={"x-latency-budget-ms": "60000"}))
            await blocker.aclose()
            r = await asyncio.wait_for(admitted, 30)
            assert r.status_code == 200, r.text
        finally:
            await engine.close()


async def test_a_deadline_that_passes_in_the_queue_is_504(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_pending_outputs=1)
    freeze(engine)  # admission believes steps are free: it admits, and the node is slower than that
    app = create_app(engine, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await engine.start()
        try:
            # the only batch slot, held by a stream nobody reads (paused by flow control)
            blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            await blocker.__anext__()
            # paused: no step of it in flight, whose lateness on a busy machine admission would
            # add to the prediction (and refuse at once, 503, instead of admitting)
            await eventually(lambda: engine.stats().num_paused == 1, what="the unread stream to be paused")
            for stream in (False, True):
                budget = {"x-latency-budget-ms": "30"}
                r = await asyncio.wait_for(client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=budget), 10)
                assert r.status_code == 504, r.text
                assert r.json()["error"]["code"] == "deadline_exceeded"
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-latency-budget-ms": "soon"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-latency-budget-ms"
            assert engine.stats().num_deadline_drops == 2
            await blocker.aclose()
            # with the slot free, the same budget is plenty
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-latency-budget-ms": "5000"})
            assert r.status_code == 200
        finally:
            await engine.close()


async def test_a_client_that_leaves_while_its_request_waits_has_it_dropped_unrun(tiny_gguf):
    """Behind a stream holding the only batch slot, a request waits in the engine; its client
    disconnecting drops it from the queue (streaming or not), it never runs."""
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_pending_outputs=1)
    app = create_app(engine, "tiny")
    await engine.start()
    try:
        blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await blocker.__anext__()
        for stream in (False, True):
            left = asyncio.Event()
            messages = [{"type": "http.request", "body": orjson.dumps({**CHAT, "stream": stream}), "more_body": False}]
            sent: list[dict] = []

            async def receive() -> dict:
                if messages:
                    return messages.pop()
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {
                "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            }
            call = asyncio.create_task(app(scope, receive, send))
            for _ in range(500):
                if engine.stats().num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().num_waiting == 1
            left.set()
            await asyncio.wait_for(call, 5)
            for _ in range(100):
                if engine.stats().num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            stats = engine.stats()
            assert (stats.num_waiting, stats.num_running) == (0, 1)  # only the blocker
            assert sent[0]["status"] == 499
        await blocker.aclose()
        assert engine.stats().num_requests_finished == 0
    finally:
        await engine.close()


async def test_validate_only_checks_a_request_without_running_it(tiny_engine):
    app = create_app(tiny_engine, "tiny")
    only = {"x-validate-only": "1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json=CHAT, headers=only)
        assert r.status_code == 204
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000}, headers=only)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert tiny_engine.stats().num_requests_finished == 0


async def test_the_engines_stages_come_with_the_answer(tiny_engine):
    app = create_app(tiny_engine, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        asked = {"x-engine-stages": "1"}
        whole = await client.post("/v1/chat/completions", json=CHAT, headers=asked)
        stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=asked)
        plain = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert "x-engine-stages" not in plain.text  # only when asked: other clients see plain OpenAI SSE
    names = [part.split("=")[0] for part in whole.headers["x-engine-stages"].split(";")]
    assert names == ["queue", "prefill", "decode"]
    events = [event for event in stream.text.split("\n\n") if event]
    assert events[-2].startswith(": x-engine-stages queue=") and events[-1] == "data: [DONE]"
