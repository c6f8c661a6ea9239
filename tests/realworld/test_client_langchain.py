"""LangChain's OpenAI chat model (``langchain-openai``, pinned in the ``dev`` extra) with tools,
through the gateway to a central cluster. The central model is scripted
(tests/realworld/tool_upstream.py: OpenAI's tool-call answers, whole and streamed, as the API
sends them); LangChain's parsing of them, its requests and the gateway's relay are real."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.fakes import FakeUpstream
from tests.realworld.tool_upstream import ToolApp


@tool
def get_weather(city: str) -> str:
    """The weather now in a city."""
    return f"18 degrees and sunny in {city}"


@pytest.fixture
def central(gateways):
    upstream = FakeUpstream()
    upstream.app = ToolApp({"city": "Paris"}, reply="The tool says: {}.")
    upstream.start()
    gw = gateways({"clusters": [{"name": "central", "models": ["gpt-4o-mini"], "endpoints": [{"url": upstream.url}]}]})
    yield upstream.app, gw
    upstream.stop()


def model(gw) -> ChatOpenAI:
    return ChatOpenAI(model="gpt-4o-mini", base_url=gw.url + "/v1", api_key="unused", max_retries=0, temperature=0)


QUESTION = "What is the weather in Paris?"


@pytest.mark.parametrize("stream", [pytest.param(False, id="whole"), pytest.param(True, id="streamed")])
def test_a_tool_call_and_its_result_through_the_gateway(central, stream):
    app, gw = central
    llm = model(gw).bind_tools([get_weather])
    if stream:
        chunks = list(llm.stream([HumanMessage(QUESTION)]))
        asked = chunks[0]
        for chunk in chunks[1:]:
            asked = asked + chunk
        assert len(chunks) > 3  # the arguments came in pieces, LangChain put them together
    else:
        asked = llm.invoke([HumanMessage(QUESTION)])
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"].startswith("call_")
    result = get_weather.invoke(call)  # a ToolMessage answering that call
    answer = llm.invoke([HumanMessage(QUESTION), asked, result])
    assert answer.content == "The tool says: 18 degrees and sunny in Paris."
    first, second = app.requests
    assert first["tools"][0]["function"]["name"] == "get_weather"
    assert first["tools"][0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    assert first.get("stream", False) is stream
    tool_message = second["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["tool_call_id"] == call["id"]
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_async_and_batched(central):
    app, gw = central
    llm = model(gw).bind_tools([get_weather])

    async def main():
        return await llm.abatch([QUESTION, QUESTION, QUESTION])

    answers = asyncio.run(main())
    assert [a.tool_calls[0]["args"] for a in answers] == [{"city": "Paris"}] * 3
    assert len(app.requests) == 3
