"""response_format and tools on the tiny random model: whatever its random weights prefer,
every finished output is valid against its schema (checked by ``jsonschema``, an
independent validator), in the OpenAI shapes, alone, batched with unconstrained requests
and through preemption."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import orjson
import pytest
import torch

from edge_engine import InvalidRequestError, OpenAIServing
from edge_engine.sampling import apply_token_bitmask
from edge_engine.server import create_app
from tests.edge_engine.conftest import make_engine
from tests.edge_engine.tiny import build_tiny_model

ASK = [{"role": "user", "content": "What is the capital of France?"}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

# every string and array bounded: random weights rarely close a string of their own accord
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "maxLength": 8},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 6}, "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["query", "limit"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = [
    pytest.param({"type": "object", "properties": {"name": SHORT}, "required": ["name"]}, id="one-string"),
    pytest.param(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500}, "ok": {"type": "boolean"}},
         "required": ["n", "ok"]},
        id="integer-and-boolean",
    ),
    pytest.param({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "v": {"const": "v1"}},
                  "required": ["color", "v"]}, id="enum-and-const"),
    pytest.param(
        {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
         "required": ["tags"]},
        id="array-of-strings",
    ),
    pytest.param(
        {"type": "object",
         "properties": {"points": {"type": "array", "maxItems": 2, "items": {
             "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "label": SHORT},
             "required": ["x", "label"]}}},
         "required": ["points"]},
        id="array-of-objects",
    ),
    pytest.param(
        {"type": "object",
         "properties": {"owner": {"type": "object", "properties": {
             "name": SHORT, "address": {"type": "object", "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                        "required": ["city", "zip"]}}, "required": ["name", "address"]}},
         "required": ["owner"]},
        id="nested-objects-and-pattern",
    ),
    pytest.param(
        {"type": "object", "properties": {"title": SHORT, "note": SHORT, "rank": {"type": "integer", "minimum": 1, "maximum": 3}},
         "required": ["title"]},
        id="optional-fields",
    ),
    pytest.param(
        {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}, SHORT]}},
         "required": ["value"]},
        id="any-of",
    ),
    pytest.param(
        {"type": "object", "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
                                              "required": ["sku"]}},
         "properties": {"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}}, "required": ["first", "second"]},
        id="defs-and-refs",
    ),
    pytest.param(
        {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
        id="bounded-number",
    ),
]


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """The tiny model with a context long enough for a system prompt listing tools."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-long"), context=4096)[0])


@pytest.fixture
async def engine(long_tiny):
    engine = make_engine(long_tiny, num_kv_blocks=1024, max_num_batched_tokens=256)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def serving(engine):
    return OpenAIServing(engine, "tiny")


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


async def complete(serving: OpenAIServing, body: dict) -> dict:
    return orjson.loads(await serving.complete(serving.prepare("chat", body), "chatcmpl-test"))


async def stream(serving: OpenAIServing, body: dict) -> list[dict]:
    prepared = serving.prepare("chat", {**body, "stream": True})
    return [orjson.loads(chunk) async for chunk in serving.stream(prepared, "chatcmpl-test")]


def check_tool_calls(calls: list[dict], tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert set(call) == {"id", "type", "function"} and CALL_ID.match(call["id"]) and call["type"] == "function"
        assert set(call["function"]) == {"name", "arguments"} and isinstance(call["function"]["arguments"], str)
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def assembled(chunks: list[dict]) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish_reason) put together from a stream's chunks as an OpenAI
    client does: tool-call fragments joined by their index."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content") is not None:
                content = (content or "") + delta["content"]
            for part in delta.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if key in part:
                        call[key] = part[key]
                if "name" in part.get("function", {}):
                    call["function"]["name"] = part["function"]["name"]
                call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


# -- response_format ---------------------------------------------------------------------
@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("sampling", [pytest.param({"temperature": 0}, id="greedy"), pytest.param({"temperature": 1.0, "seed": 11}, id="sampled")])
async def test_the_answer_is_valid_against_its_schema(serving, schema, sampling):
    body = {"messages": ASK, "max_tokens": 200, "response_format": json_schema_format(schema), **sampling}
    answer = await complete(serving, body)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(choice["message"]) == {"role", "content"}
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


async def test_json_object_gives_an_object_and_streams_the_same_text(serving):
    body = {"messages": ASK, "max_tokens": 300, "temperature": 0, "response_format": {"type": "json_object"}}
    whole = await complete(serving, body)
    text = whole["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict) and whole["choices"][0]["finish_reason"] == "stop"
    chunks = await stream(serving, body)
    content, calls, finish = assembled(chunks)
    assert content == text and calls == [] and finish == "stop"


async def test_strict_mode_allows_no_undeclared_keys_and_no_unknown_keywords(engine, serving):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(schema)}).structured)
    assert accepts(engine, compiled, '{"a": 3}') and not accepts(engine, compiled, '{"a": 3, "b": 1}')
    open_schema = {**schema, "additionalProperties": True}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(open_schema)}).structured)
    assert accepts(engine, compiled, '{"a": 3, "b": 1}')
    weird = {"type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(weird, strict=True)})
    assert info.value.param == "response_format.json_schema.schema"
    serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(weird, strict=False)})  # ignored, as JSON Schema says


def accepts(engine, grammar, text: str) -> bool:
    """Whether ``grammar`` lets ``text`` (as the tokenizer splits it) be the whole output:
    each token allowed by the mask in its turn, and the grammar complete at the end."""
    matcher = grammar.matcher()
    words = engine.grammar.mask_words
    mask = torch.zeros(words, dtype=torch.int32)
    tokens = [*engine.tokenizer.encode(text, add_special_tokens=False), engine.tokenizer.eos_token_id]
    for i, token in enumerate(tokens):
        matcher.fill_mask(mask.data_ptr(), words * 4)
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        if matcher.advance(token):  # complete: right only if nothing but the end follows
            return i >= len(tokens) - 2
    return False


# -- tools -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        pytest.param("required", {"get_weather", "search"}, id="required"),
        pytest.param({"type": "function", "function": {"name": "search"}}, {"search"}, id="named"),
    ],
)
async def test_a_tool_call_comes_back_as_openai_tool_calls(serving, tool_choice, names):
    body = {"messages": ASK, "max_tokens": 200, "temperature": 0, "tools": TOOLS, "tool_choice": tool_choice,
            "parallel_tool_calls": False}
    answer = await complete(serving, body)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    check_tool_calls(message["tool_calls"], TOOLS)
    assert len(message["tool_calls"]) == 1 and message["tool_calls"][0]["function"]["name"] in names

    chunks = await stream(serving, body)  # greedy: the same call, streamed
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    assert first["tool_calls"][0]["index"] == 0 and CALL_ID.match(first["tool_calls"][0]["id"])
    assert first["tool_calls"][0]["type"] == "function" and first["tool_calls"][0]["function"]["arguments"] == ""
    assert all(set(c["choices"][0]["delta"]) <= {"tool_calls"} for c in chunks[1:])
    content, calls, finish = assembled(chunks)
    assert content is None and finish == "tool_calls"
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    check_tool_calls(calls, TOOLS)


async def test_parallel_calls_are_allowed_unless_parallel_tool_calls_is_false(engine, serving):
    def grammar(**fields):
        return serving._grammar(serving.prepare("chat", {"messages": ASK, "tools": TOOLS, **fields}).structured)

    one = '<tool_call>[\n{"name": "search", "arguments": {"query": "rain", "limit": 3}}\n]</tool_call>'
    two = ('<tool_call>[\n{"name": "search", "arguments": {"query": "rain", "limit": 3}},\n'
           '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n]</tool_call>')
    parallel, single = grammar(tool_choice="required"), grammar(tool_choice="required", parallel_tool_calls=False)
    assert accepts(engine, parallel, one) and accepts(engine, parallel, two)
    assert accepts(engine, single, one) and not accepts(engine, single, two)
    named = grammar(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not accepts(engine, named, one)
    bad_arguments = '<tool_call>[\n{"name": "search", "arguments": {"query": "rain", "limit": 30}}\n]</tool_call>'
    unknown_tool = '<tool_call>[\n{"name": "delete_all", "arguments": {}}\n]</tool_call>'
    assert not accepts(engine, parallel, bad_arguments) and not accepts(engine, parallel, unknown_tool)
    assert not accepts(engine, parallel, "The capital is Paris.")  # required: a call, nothing else
    auto = grammar()  # tool_choice defaults to auto with tools
    assert accepts(engine, auto, "The capital is Paris.") and accepts(engine, auto, two)
    assert accepts(engine, auto, "Let me look. " + one)
    assert not accepts(engine, auto, "Let me look. <tool_call>[\n{\"name\": \"search\", \"arguments\": {}}\n]</tool_call>")


async def test_auto_answers_text_or_calls_and_none_leaves_the_tools_out(serving):
    auto = {"messages": ASK, "max_tokens": 60, "temperature": 1.0, "tools": TOOLS, "parallel_tool_calls": False}
    for seed in range(2):  # the random model chooses: either shape must be right
        choice = (await complete(serving, {**auto, "seed": seed}))["choices"][0]
        message = choice["message"]
        if message.get("tool_calls") and choice["finish_reason"] != "length":  # cut short: arguments unfinished
            assert choice["finish_reason"] == "tool_calls"
            check_tool_calls(message["tool_calls"], TOOLS)
        elif not message.get("tool_calls"):
            assert set(message) == {"role", "content"} and "<tool_call>" not in message["content"]
            assert choice["finish_reason"] in ("stop", "length")
    with_tools = serving.prepare("chat", {**auto, "tool_choice": "auto"})
    without = serving.prepare("chat", {**auto, "tool_choice": "none"})
    plain = serving.prepare("chat", {"messages": ASK})
    assert without.prompt_token_ids == plain.prompt_token_ids and without.params.grammar is None
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids) + 100 and with_tools.params.grammar is not None
    answer = await complete(serving, {**auto, "tool_choice": "none", "seed": 1})
    assert "tool_calls" not in answer["choices"][0]["message"]


async def test_tool_results_and_earlier_calls_are_rendered_in_the_models_format(serving, engine):
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    prepared = serving.prepare("chat", {"messages": turns, "tools": TOOLS})
    text = engine.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert '<tools>[{"name": "get_weather", "description": "The weather now in a city", "parameters": ' in text
    assert '<|im_start|>assistant\n<tool_call>[\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n]</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


# -- bad requests --------------------------------------------------------------------------
def fn(name: str = "f", **fields) -> dict:
    return {"type": "function", "function": {"name": name, **fields}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"response_format": {"type": "yaml"}}, "response_format.type", id="format-type"),
        pytest.param({"response_format": "json"}, "response_format", id="format-not-an-object"),
        pytest.param({"response_format": {"type": "json_schema"}}, "response_format.json_schema", id="json-schema-missing"),
        pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", id="schema-missing"),
        pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "response_format.json_schema.name", id="schema-name"),
        pytest.param({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict", id="strict-type"),
        pytest.param({"response_format": json_schema_format({"type": "objekt"})}, "response_format.json_schema.schema", id="unknown-type"),
        pytest.param({"response_format": json_schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema", id="dangling-ref"),
        pytest.param({"response_format": json_schema_format({"type": "integer", "minimum": 5, "maximum": 1})}, "response_format.json_schema.schema", id="empty-range"),
        pytest.param({"tools": {"name": "f"}}, "tools", id="tools-not-an-array"),
        pytest.param({"tools": [{"type": "retrieval"}]}, "tools.[0].type", id="tool-type"),
        pytest.param({"tools": [{"type": "function"}]}, "tools.[0].function", id="tool-without-function"),
        pytest.param({"tools": [fn("bad name")]}, "tools.[0].function.name", id="tool-name"),
        pytest.param({"tools": [fn("f"), fn("f")]}, "tools.[1].function.name", id="tool-name-twice"),
        pytest.param({"tools": [fn("f", parameters={"type": "string"})]}, "tools.[0].function.parameters", id="parameters-not-object"),
        pytest.param({"tools": [fn("f"), fn("g", parameters={"type": "object", "properties": {"x": {"type": "nope"}}})]},
                     "tools.[1].function.parameters", id="parameters-invalid"),
        pytest.param({"tools": [fn("f")], "tool_choice": "sometimes"}, "tool_choice", id="tool-choice-word"),
        pytest.param({"tools": [fn("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name", id="tool-choice-unknown"),
        pytest.param({"tool_choice": "required"}, "tool_choice", id="required-without-tools"),
        pytest.param({"tools": [fn("f")], "parallel_tool_calls": "no"}, "parallel_tool_calls", id="parallel-type"),
        pytest.param({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
                     "messages.[0].tool_calls.[0].function.arguments", id="history-arguments"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_parameter(serving, fields, param):
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare("chat", {"messages": ASK, **fields})
    error = info.value.to_dict()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and info.value.status_code == 400


# -- in the batch ----------------------------------------------------------------------
async def collect_all(serving: OpenAIServing, bodies: list[dict]) -> list[dict]:
    return await asyncio.gather(*(complete(serving, body) for body in bodies))


def mixed_bodies() -> list[dict]:
    plain = {"messages": ASK, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    sampled = {"messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 30, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    schemas = [s.values[0] for s in SCHEMAS[:4]]
    constrained = [{"messages": ASK, "max_tokens": 200, "temperature": 0, "response_format": json_schema_format(s)} for s in schemas]
    call = {"messages": ASK, "max_tokens": 200, "temperature": 0, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    return [plain, constrained[0], sampled, constrained[1], call, constrained[2], constrained[3]]


def outputs(answers: list[dict]) -> list:
    return [(a["choices"][0]["message"].get("content"), [c["function"] for c in a["choices"][0]["message"].get("tool_calls", [])])
            for a in answers]


async def test_constrained_and_plain_sequences_share_a_batch_each_with_its_own_mask(long_tiny):
    bodies = mixed_bodies()
    alone_engine = make_engine(long_tiny, num_kv_blocks=1024, max_num_batched_tokens=256, max_num_seqs=1)
    await alone_engine.start()
    alone = outputs([await complete(OpenAIServing(alone_engine, "tiny"), body) for body in bodies])
    await alone_engine.close()
    engine = make_engine(long_tiny, num_kv_blocks=1024, max_num_batched_tokens=256, max_num_seqs=8)
    await engine.start()
    try:
        together = outputs(await collect_all(OpenAIServing(engine, "tiny"), bodies))
    finally:
        await engine.close()
    assert together == alone  # a row's mask never leaks into another's; plain rows untouched
    for body, (content, calls) in zip(bodies, together):
        if "response_format" in body:
            jsonschema.validate(json.loads(content), body["response_format"]["json_schema"]["schema"])
        elif "tools" in body:
            assert content is None and len(calls) == 1


async def test_preempted_constrained_sequences_resume_in_their_grammar(long_tiny):
    bodies = [
        {**b, "messages": [{"role": "user", "content": f"Question {i}: what is the capital of France?"}], "max_tokens": 60}
        for i, b in enumerate(mixed_bodies())
        if "response_format" in b
    ]
    alone_engine = make_engine(long_tiny, num_kv_blocks=1024, max_num_batched_tokens=256, max_num_seqs=1)
    await alone_engine.start()
    answers = [await complete(OpenAIServing(alone_engine, "tiny"), body) for body in bodies]
    await alone_engine.close()
    # a pool that holds the longest sequence but not all of them at once: some are preempted
    # (blocks freed, tokens kept) and recomputed later, their matchers untouched
    need = [-(-a["usage"]["total_tokens"] // 4) for a in answers]
    blocks = -(-(max(a["usage"]["prompt_tokens"] for a in answers) + 60) // 4) + 1  # what max_tokens asks for
    engine = make_engine(long_tiny, num_kv_blocks=blocks, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False)
    assert blocks < sum(need)
    await engine.start()
    try:
        together = outputs(await collect_all(OpenAIServing(engine, "tiny"), bodies))
        assert engine.stats().num_preemptions > 0
    finally:
        await engine.close()
    assert together == outputs(answers)
    for body, (content, _) in zip(bodies, together):
        jsonschema.validate(json.loads(content), body["response_format"]["json_schema"]["schema"])


# -- the engine's own server, with the OpenAI SDK as its client ----------------------------
async def test_the_server_answers_the_openai_sdk_with_tool_calls_and_json(engine):
    app = create_app(engine, "tiny")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
        client = openai.AsyncOpenAI(base_url="http://engine/v1", api_key="unused", http_client=http, max_retries=0)
        answer = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and CALL_ID.match(call.id)
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        arguments, names, finishes = "", [], []
        async for chunk in stream:
            for part in chunk.choices[0].delta.tool_calls or []:
                assert part.index == 0
                names += [part.function.name] if part.function.name else []
                arguments += part.function.arguments or ""
            finishes.append(chunk.choices[0].finish_reason)
        assert names == ["get_weather"] and arguments == call.function.arguments and finishes[-1] == "tool_calls"

        schema = SCHEMAS[5].values[0]
        answer = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=200, temperature=0, response_format=json_schema_format(schema)
        )
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)

        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=ASK, response_format=json_schema_format({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
            )
        assert info.value.status_code == 400
        assert info.value.body["param"] == "response_format.json_schema.schema" and info.value.body["type"] == "invalid_request_error"


# -- forced tokens -----------------------------------------------------------------------
async def test_tokens_the_grammar_forces_are_appended_without_a_step_each(engine, serving):
    schema = SCHEMAS[5].values[0]  # nested objects: keys and punctuation are forced
    body = {"messages": ASK, "max_tokens": 200, "temperature": 0, "response_format": json_schema_format(schema)}

    async def deltas(**extra):
        prepared = serving.prepare("chat", {**body, **extra})
        return [d async for d in engine.generate(prepared.prompt_token_ids, prepared.params)]

    jumped = await deltas()
    assert max(len(d.token_ids) for d in jumped) > 1 and len(jumped) < jumped[-1].num_output_tokens
    jsonschema.validate(json.loads("".join(d.text for d in jumped)), schema)
    with_logprobs = await deltas(logprobs=True)  # forced tokens have no logprob: one token a step
    assert all(len(d.token_ids) == 1 for d in with_logprobs) and all(len(d.logprobs) == 1 for d in with_logprobs)
    jsonschema.validate(json.loads("".join(d.text for d in with_logprobs)), schema)
    engine.jump_forward = False
    stepped = await deltas()
    assert all(len(d.token_ids) == 1 for d in stepped)
    assert [t for d in stepped for t in d.token_ids] == [t for d in with_logprobs for t in d.token_ids]


def test_the_bitmask_masks_exactly_the_forbidden_tokens_on_either_path():
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [0, 2]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, -(-vocab // 32)), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    wide = torch.randn(3, 2 * vocab, generator=generator)
    wide[:, ::2] = logits
    strided = wide[:, ::2]  # not contiguous: the torch path
    apply_token_bitmask(logits, rows, bitmask)
    apply_token_bitmask(strided, rows, bitmask)
    for j, r in enumerate(rows):
        allowed = [bool((int(bitmask[j, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
        assert torch.isfinite(logits[r]).tolist() == allowed == torch.isfinite(strided[r]).tolist()
    assert torch.isfinite(logits[1]).all() and torch.isfinite(strided[1]).all()  # an unconstrained row untouched


def test_unbounded_numbers_and_free_strings_stay_within_sane_bounds(engine, serving):
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(schema)}).structured)
    assert accepts(engine, compiled, '{"id": 9007199254740991}') and accepts(engine, compiled, '{"id": -9007199254740991}')
    assert not accepts(engine, compiled, '{"id": 90071992547409910}')  # SmolLM2 writes digits until max_tokens
    wide = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**20}}, "required": ["id"]}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(wide)}).structured)
    assert accepts(engine, compiled, '{"id": 90071992547409910}')  # the schema's own bounds stand
    free = {"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}}, "required": ["x", "s"]}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(free)}).structured)
    assert accepts(engine, compiled, '{"x": -2.000001, "s": "' + "a" * 512 + '"}')
    assert not accepts(engine, compiled, '{"x": 2.0000001, "s": "ok"}')  # "1.000000..." until max_tokens
    assert not accepts(engine, compiled, '{"x": 2, "s": "' + "a" * 513 + '"}')  # "1.1.1.1..." until max_tokens
    long = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 600}}, "required": ["s"]}
    compiled = serving._grammar(serving.prepare("chat", {"messages": ASK, "response_format": json_schema_format(long)}).structured)
    assert accepts(engine, compiled, '{"s": "' + "a" * 600 + '"}')
