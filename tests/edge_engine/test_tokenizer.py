"""Tokenizer from GGUF metadata vs tokenizer.json vs transformers, chat template, and
UTF-8-safe incremental detokenisation."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from edge_engine.loader import load_gguf, load_hf_dir
from edge_engine.tokenizer import IncrementalDetokenizer

TEXTS = [
    pytest.param("Hello, world! The capital of France is Paris.", id="english"),
    pytest.param("Café naïve résumé Ünïcödé", id="accents"),
    pytest.param("北京是中国的首都。東京は日本の首都です。서울", id="cjk"),
    pytest.param("family: 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇫🇷", id="emoji-zwj"),
    pytest.param("def add(a, b):\n    return a + b  # 12345\n\t\n", id="code-digits"),
    pytest.param("<|im_start|>user\nhi<|im_end|>\n", id="special-tokens"),
]


@pytest.fixture(scope="module")
def tokenizers(tiny_gguf, tiny_hf):
    return load_gguf(tiny_gguf).tokenizer, load_hf_dir(tiny_hf).tokenizer, AutoTokenizer.from_pretrained(tiny_hf)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_equals_tokenizer_json_and_transformers(tokenizers, text):
    from_gguf, from_json, reference = tokenizers
    ids = from_gguf.encode(text)
    assert ids == from_json.encode(text) == reference.encode(text, add_special_tokens=False)
    assert from_gguf.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_like_transformers(tokenizers):
    from_gguf, from_json, reference = tokenizers
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert from_gguf.apply_chat_template(messages) == want == from_json.apply_chat_template(messages)
    assert want.endswith("<|im_start|>assistant\n") and "You are a tiny test model." in want
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert from_gguf.apply_chat_template(with_system) == reference.apply_chat_template(
        with_system, tokenize=False, add_generation_prompt=True
    )
    ids = from_gguf.encode_chat(messages)
    assert ids[0] == from_gguf.bos_token_id == 1 and ids.count(2) == 2  # <|im_start|> ... <|im_end|>


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenisation_never_emits_half_a_character(tokenizers, text):
    tok = tokenizers[0]
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), skip_special_tokens=False)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_a_character_split_over_byte_tokens_comes_out_whole(tokenizers):
    tok = tokenizers[0]
    ids = tok.encode("世")
    assert len(ids) == 3  # not in the tiny vocabulary's merges: one token per UTF-8 byte
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["", "", "世"]


def test_token_bytes_are_the_raw_utf8_bytes(tokenizers):
    tok = tokenizers[0]
    ids = tok.encode("é世")
    assert b"".join(tok.token_bytes(i) for i in ids) == "é世".encode()
