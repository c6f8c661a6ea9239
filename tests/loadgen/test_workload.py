"""Synthetic prompts and datasets, rendered as request bodies."""

from __future__ import annotations

import random

import orjson
import pytest

from loadgen.workload import BodyBuilder, DatasetError, Prompt, SyntheticPrompts, dataset_prompts, load_dataset


def take(source, n):
    return [next(source) for _ in range(n)]


def test_synthetic_prompts_have_the_asked_length_in_words():
    prompts = take(SyntheticPrompts(random.Random(0), 300, 64), 50)
    assert {p.words for p in prompts} == {300}
    assert {p.max_tokens for p in prompts} == {64}


def test_range_ratio_spreads_both_lengths_within_bounds():
    prompts = take(SyntheticPrompts(random.Random(0), 100, 40, range_ratio=0.5), 400)
    words = [p.words for p in prompts]
    tokens = [p.max_tokens for p in prompts]
    assert 50 <= min(words) < 60 and 140 < max(words) <= 150
    assert 20 <= min(tokens) < 25 and 55 < max(tokens) <= 60


def test_prompts_are_reproducible_from_the_seed_and_start_differently():
    a = take(SyntheticPrompts(random.Random("1:0:prompts"), 64, 8), 200)
    b = take(SyntheticPrompts(random.Random("1:0:prompts"), 64, 8), 200)
    c = take(SyntheticPrompts(random.Random("1:1:prompts"), 64, 8), 200)
    assert a == b and a != c
    beginnings = {" ".join(p.text.split()[:8]) for p in a}
    assert len(beginnings) == len(a)  # no shared prefix for a prefix cache to hit


def test_dataset_lines_prompt_messages_and_extra_body(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "one two three", "max_tokens": 7}\n\n'
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}], "extra_body": {"temperature": 0}}\n'
    )
    prompts = load_dataset(str(path))
    assert prompts == [
        Prompt(text="one two three", max_tokens=7),
        Prompt(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}], extra_body={"temperature": 0}),
    ]
    assert prompts[1].words == 4
    assert take(dataset_prompts(prompts), 5) == prompts * 2 + prompts[:1]


@pytest.mark.parametrize(
    "line,message",
    [
        pytest.param("not json", "not JSON", id="json"),
        pytest.param('{"max_tokens": 3}', "exactly one of", id="neither"),
        pytest.param('{"prompt": "a", "messages": []}', "exactly one of", id="both"),
        pytest.param('{"prompt": "a", "max_tokens": 0}', "max_tokens", id="max-tokens"),
        pytest.param('{"prompt": "a", "extra_body": 3}', "extra_body", id="extra-body"),
        pytest.param("[1, 2]", "JSON object", id="not-an-object"),
    ],
)
def test_dataset_errors_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=rf"bad.jsonl:2: .*{message}"):
        load_dataset(str(path))


def test_an_empty_or_missing_dataset_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no prompts"):
        load_dataset(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(str(tmp_path / "missing.jsonl"))


def test_chat_body_streams_with_usage_and_merges_extra_fields():
    builder = BodyBuilder("chat", "m", stream=True, extra_body={"temperature": 0, "ignore_eos": True})
    spec = builder.build(Prompt(text="hello world", max_tokens=5, extra_body={"temperature": 0.5}))
    body = orjson.loads(spec.body)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,  # the line's own extra_body wins over --extra-body
        "ignore_eos": True,
    }
    assert (spec.input_len, spec.max_tokens) == (2, 5)


def test_completions_body_joins_messages_into_a_prompt_and_does_not_stream_when_asked():
    builder = BodyBuilder("completions", "m", stream=False)
    body = orjson.loads(builder.build(Prompt(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])).body)
    assert body == {"model": "m", "prompt": "a\nb", "stream": False}
