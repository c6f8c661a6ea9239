"""Tokens and logits of the engine against transformers (CPU, float32) on the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edge_engine import SamplingParams
from edge_engine.kv_cache import KVCache
from edge_engine.loader import load_model
from edge_engine.model import Transformer
from edge_engine.sequence import Sequence
from tests.edge_engine.conftest import make_engine

# max |logit difference| allowed between the paged engine and transformers' full forward
LOGIT_ATOL = 1e-4

TEXTS = [
    "Hello",
    "The capital of France is",
    "def add(a, b):\n    return",
    "Numbers 0123456789 and more numbers 2024, 3.14159. What is the capital of Italy? It is",
    "Café, naïve, résumé and façade. " * 4,
]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


async def engine_greedy(engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    tokens: list[int] = []
    cached = 0
    async for delta in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        tokens.extend(delta.token_ids)
        cached = delta.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("path_fixture", [pytest.param("tiny_gguf", id="gguf"), pytest.param("tiny_hf", id="safetensors")])
async def test_greedy_tokens_alone_equal_reference(request, path_fixture, reference):
    engine = make_engine(request.getfixturevalue(path_fixture))
    try:
        for text in TEXTS:
            prompt = engine.tokenizer.encode(text)
            expected = reference_greedy(reference, prompt, 24)
            got, _ = await engine_greedy(engine, prompt, 24)
            assert got == expected, text
    finally:
        await engine.close()


async def test_greedy_tokens_in_a_mixed_batch_with_chunked_prefill_and_shared_prefix(tiny_gguf, reference):
    # a small budget forces chunked prefill next to decode rows; block_size 4 puts many
    # block boundaries inside the prompts
    engine = make_engine(tiny_gguf, max_num_batched_tokens=12, block_size=4, num_kv_blocks=128)
    try:
        tok = engine.tokenizer
        prefix = tok.encode("system user assistant You are a helpful assistant. " * 2)
        prompts = [prefix + tok.encode(t) for t in TEXTS] + [tok.encode(t) for t in TEXTS[:3]]
        expected = [reference_greedy(reference, p, 16) for p in prompts]
        await engine_greedy(engine, prefix + tok.encode("Hi"), 2)  # primes the prefix cache
        results = await asyncio.gather(*(engine_greedy(engine, p, 16) for p in prompts))
        for (got, _), want, p in zip(results, expected, prompts):
            assert got == want, tok.decode(p)
        cached = [c for _, c in results[: len(TEXTS)]]
        assert all(c >= len(prefix) // 4 * 4 - 4 for c in cached), cached
        assert engine.stats().prefix_cache_hit_rate > 0
        assert engine.scheduler.num_preemptions == 0
    finally:
        await engine.close()


def _engine_logits(engine, ids: list[int], prefill_chunk: int, num_prefill: int) -> torch.Tensor:
    """Logits at every position: the first ``num_prefill`` tokens in prefill chunks, the rest
    as decode rows (one token per step), all through the paged cache."""
    runner, bm = engine.runner, engine.block_manager
    seq = Sequence(ids, SamplingParams(temperature=0))
    rows = []
    with torch.inference_mode():
        while seq.num_computed_tokens < len(ids):
            remaining = len(ids) - seq.num_computed_tokens
            n = min(prefill_chunk, remaining) if seq.num_computed_tokens < num_prefill else 1
            bm.allocate(seq, n)
            inputs = runner.prepare([(seq, n)])
            logits = runner.model(
                inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta, torch.arange(n)
            )
            rows.append(logits)
            seq.num_computed_tokens += n
    bm.free(seq)
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [pytest.param(64, id="one-prefill"), pytest.param(5, id="chunked-prefill")])
def test_logits_match_reference_within_tolerance(tiny_gguf, reference, chunk):
    engine = make_engine(tiny_gguf)
    ids = engine.tokenizer.encode(TEXTS[3] + " " + TEXTS[4])
    got = _engine_logits(engine, ids, prefill_chunk=chunk, num_prefill=len(ids) // 2)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff < LOGIT_ATOL, diff
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bf16_cpu_mode_keeps_fp32_output_layer_and_mostly_agrees(tiny_gguf, reference):
    engine = make_engine(tiny_gguf, dtype="bf16")
    model = engine.runner.model
    assert model.output.weight.dtype == torch.float32
    assert model.layers[0].attention.wqkv.weight.dtype == torch.bfloat16
    assert engine.runner.kv_dtype == torch.float32
    ids = engine.tokenizer.encode(TEXTS[3])
    got = _engine_logits(engine, ids, prefill_chunk=8, num_prefill=len(ids) // 2)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    assert (got - want).abs().max().item() < 0.5


def test_the_all_bf16_path_used_on_cuda_runs_and_mostly_agrees(tiny_gguf, reference):
    """No GPU here: run the CUDA dtype plan (bf16 weights, activations and KV; fp32 output
    layer) on the CPU, through the same runner code."""
    engine = make_engine(tiny_gguf)
    runner = engine.runner
    loaded = load_model(tiny_gguf)
    runner.model = Transformer(
        loaded.config, loaded.weights, max_len=engine.max_model_len, device=torch.device("cpu"),
        weight_dtype=torch.bfloat16, act_dtype=torch.bfloat16,
    ).eval()
    runner.weight_dtype = runner.act_dtype = runner.kv_dtype = torch.bfloat16
    runner.kv_cache = KVCache(loaded.config, engine.num_kv_blocks, engine.block_size, torch.bfloat16, torch.device("cpu"))
    assert runner.model.output.weight.dtype == torch.float32
    ids = engine.tokenizer.encode(TEXTS[3])
    got = _engine_logits(engine, ids, prefill_chunk=8, num_prefill=len(ids) // 2)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.8, agreement
