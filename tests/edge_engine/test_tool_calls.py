"""The tool-call block back into OpenAI's tool_calls, however the text is cut into deltas."""

from __future__ import annotations

import random

import pytest

from edge_engine.structured import plan
from edge_engine.tool_calls import ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "f2"}}]
TWO_CALLS = (
    '<tool_call>[\n{"name": "get_weather", "arguments": {"location": "P}a\\"ris", "days": [1, {"x": "]"}]}},\n'
    '{"name": "f2", "arguments": {}}\n]</tool_call>'
)


def feed_in_pieces(parser: ToolCallParser, text: str, rng: random.Random) -> tuple[str, dict[int, dict]]:
    cuts = sorted(rng.sample(range(1, len(text)), min(10, len(text) - 1)))
    content, calls = "", {}
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        delta = parser.feed(text[a:b])
        content += delta.content
        for part in delta.tool_calls:
            call = calls.setdefault(part["index"], {"arguments": ""})
            call.update({k: part[k] for k in ("id", "type") if k in part})
            call.setdefault("name", part["function"].get("name"))
            call["arguments"] += part["function"]["arguments"]
    content += parser.finish().content
    return content, calls


@pytest.mark.parametrize(
    ("choice", "text", "content", "arguments"),
    [
        pytest.param("required", TWO_CALLS, "", ['{"location": "P}a\\"ris", "days": [1, {"x": "]"}]}', "{}"], id="required-two-calls"),
        pytest.param("auto", "Let me see. " + TWO_CALLS, "Let me see. ", ['{"location": "P}a\\"ris", "days": [1, {"x": "]"}]}', "{}"], id="text-then-calls"),
        pytest.param("auto", "Paris is <b>big</b> <tool", "Paris is <b>big</b> <tool", [], id="text-with-a-held-prefix"),
        pytest.param("required", '<tool_call>[\n{"name": "f2", "arguments": {"a": "b', "", ['{"a": "b'], id="cut-short"),
    ],
)
def test_pieces_give_the_same_calls_as_the_whole(choice, text, content, arguments):
    rng = random.Random(5)
    for _ in range(25):
        parser = ToolCallParser(plan({"tools": TOOLS, "tool_choice": choice}))
        streamed_content, streamed = feed_in_pieces(parser, text, rng)
        assert streamed_content == parser.content == content
        assert [c["function"]["arguments"] for c in parser.calls] == arguments
        assert [streamed[i]["arguments"] for i in range(len(parser.calls))] == arguments
        assert [streamed[i]["id"] for i in range(len(parser.calls))] == [c["id"] for c in parser.calls]
        assert all(streamed[i]["type"] == "function" for i in streamed)


def test_a_json_answer_with_tools_holds_a_block_only_at_its_start():
    schema_plan = plan({"tools": TOOLS, "response_format": {"type": "json_object"}})
    parser = ToolCallParser(schema_plan)
    parser.feed('{"note": "<tool_call>[\\n"}')
    parser.finish()
    assert parser.content == '{"note": "<tool_call>[\\n"}' and parser.calls == []
