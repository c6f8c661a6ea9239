"""response_format and tools answered at the edge through the gateway, with the OpenAI SDK
as the client: the engine in-process (``gateway/engine/local.py``) and in its own process
behind the workers (``gateway/engine/process.py`` over the engine's server), on the tiny
random model -- whatever it prefers, the grammar holds its output to the schema."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import openai
import pytest
import uvicorn

from edge_engine import Engine, EngineConfig
from edge_engine.server import create_app as engine_app
from gateway.core.settings import Settings
from gateway.engine import EdgeClient
from tests.edge_engine.tiny import build_tiny_model

EDGE = {"enabled": True, "name": "tiny", "num_kv_blocks": 1024, "block_size": 4, "max_num_batched_tokens": 256,
        "max_num_seqs": 4, "dtype": "float32"}
ROUTING = {"policy": {"edge_handles_tools": True}}  # tools may stay at the edge
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"},
                   "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["city", "rain", "days"],
}


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> str:
    """The tiny model with room for a system prompt listing tools (its vocabulary is small:
    that prompt is ~1,000 of its tokens)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-long"), context=4096)[0])


def ask_for_a_call_and_json(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
    )
    assert raw.headers["x-edgegw-route"].startswith("target=edge")
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert re.match(r"^call_[0-9a-f]{24}$", call.id) and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, stream=True,
    )
    parts = [(c.choices[0].delta, c.choices[0].finish_reason) for c in stream if c.choices]
    arguments = "".join(tc.function.arguments or "" for delta, _ in parts for tc in delta.tool_calls or [])
    assert arguments == call.function.arguments and parts[-1][1] == "tool_calls"
    assert [tc.id for delta, _ in parts for tc in delta.tool_calls or [] if tc.id] != []

    answer = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert info.value.body["param"] == "tool_choice.function.name"


def test_the_in_process_engine_answers_tool_calls_and_json(gateways, long_tiny):
    gw = gateways({"edge": {**EDGE, "model": long_tiny}, "routing": ROUTING})
    assert gw.state.fleet.edge.structured_output is True
    ask_for_a_call_and_json(gw.url)


def test_the_engine_process_answers_tool_calls_and_json(gateway_processes, long_tiny):
    gw = gateway_processes({"listen": {"workers": 2}, "edge": {**EDGE, "model": long_tiny}, "routing": ROUTING})
    deadline = time.monotonic() + 60
    while "edge engine ready" not in gw.log.read_text():  # the workers serve before the engine has loaded
        assert time.monotonic() < deadline, "the engine did not start"
        time.sleep(0.05)
    ask_for_a_call_and_json(gw.url)


async def test_the_engine_process_client_reads_structured_output_from_the_engines_stats(tmp_path, long_tiny):
    engine = Engine(EngineConfig(model=long_tiny, dtype="float32", num_kv_blocks=64, block_size=4))
    path = str(tmp_path / "engine.sock")
    server = uvicorn.Server(uvicorn.Config(engine_app(engine, "tiny"), uds=path, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            await asyncio.sleep(0.01)
        client = await EdgeClient.start(Settings.model_validate({"edge": {"enabled": True, "process": True}}), path)
        try:
            assert client.structured_output is True
            engine.grammar = None  # as an engine without llguidance reports itself
            await client._poll_once()
            assert client.structured_output is False
        finally:
            await client.aclose()
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 10)
