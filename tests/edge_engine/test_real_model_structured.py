"""The real SmolLM2-135M-Instruct held to a schema and to tool calls: its answers are valid
and say what they should."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import orjson
import pytest

from edge_engine import OpenAIServing
from edge_engine.server import create_app

pytestmark = pytest.mark.slow

CAPITAL = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}


async def test_a_json_answer_and_a_weather_call_in_one_batch(smollm_engine):
    await smollm_engine.start()
    try:
        serving = OpenAIServing(smollm_engine, "smollm2")
        json_body = {
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON with the keys city and country."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}},
        }
        call_body = {
            "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
            "max_tokens": 60, "temperature": 0, "tools": [WEATHER, NOTE], "tool_choice": "required",
        }
        answers = await asyncio.gather(
            *(serving.complete(serving.prepare("chat", body), f"chatcmpl-{i}") for i, body in enumerate([json_body, call_body]))
        )
        capital, call = (orjson.loads(a)["choices"][0] for a in answers)
        assert capital["finish_reason"] == "stop"
        document = json.loads(capital["message"]["content"])
        jsonschema.validate(document, CAPITAL)
        assert document["city"] == "Paris", document
        assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
        (tool_call,) = call["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "get_weather", tool_call
        arguments = json.loads(tool_call["function"]["arguments"])
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        assert "Paris" in arguments["location"], arguments
    finally:
        await smollm_engine.close()


async def test_a_streamed_weather_call_through_the_engine_server(smollm_engine):
    app = create_app(smollm_engine, "smollm2")
    await smollm_engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
            client = openai.AsyncOpenAI(base_url="http://engine/v1", api_key="unused", http_client=http, max_retries=0)
            stream = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Tell me the weather in Tokyo in fahrenheit."}],
                max_tokens=60, temperature=0, tools=[WEATHER], stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            names, arguments, finish = [], "", None
            async for chunk in stream:
                for part in chunk.choices[0].delta.tool_calls or []:
                    names += [part.function.name] if part.function.name else []
                    arguments += part.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
    finally:
        await smollm_engine.close()
    assert names == ["get_weather"] and finish == "tool_calls"
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, WEATHER["function"]["parameters"])
    assert "Tokyo" in parsed["location"], parsed
