"""The weight-only modes: the compiled Q4/Q8 kernels, the int4 and int8 models, and whether
their answers hold against float32 (tiny model here; SmolLM2 in test_real_model)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from edge_engine import SamplingParams, kernels
from edge_engine.model import Int4Linear, Int8Linear, RescoredOutput
from edge_engine.runner import resolve_dtype
from tests.edge_engine.conftest import make_engine
from edge_engine.quality import PROMPTS, HELDOUT_TEXT, agreement, greedy_outputs, perplexity
from tests.edge_engine.test_model_parity import LOGIT_ATOL, TEXTS, _engine_logits, engine_greedy, reference_greedy


def q41(shape, seed=0) -> torch.Tensor:
    """Weights as a Q4_1 GGUF holds them (dequantised by the gguf package)."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
    return torch.from_numpy(quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1))


def q80(shape, seed=0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
    return torch.from_numpy(quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))


# -- kernels --------------------------------------------------------------------------------
def test_the_kernels_build_here():
    assert kernels.available()


def test_a_stale_build_lock_does_not_hang_the_next_start():
    """A build killed half-way leaves torch's lock file behind; a later start must not wait
    on it for ever (it did: torch's FileBaton polls until the file goes)."""
    assert kernels.available()
    lock = os.path.join(kernels.build_directory(), "lock")
    with open(lock, "w"):
        pass
    old = os.path.getmtime(lock) - 3600
    os.utime(lock, (old, old))
    code = "from edge_engine import kernels; import sys; sys.exit(0 if kernels.available() else 1)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(lock)


def test_q4_and_q8_grids_recover_a_gguf_files_weights_exactly():
    w4 = q41((96, 128))
    assert torch.equal(kernels.unpack_q4(*kernels.pack_q4(w4)), w4)
    assert torch.equal(kernels.q4_dequantize(*kernels.pack_q4(w4)), w4)
    w8 = q80((96, 128))
    assert torch.equal(kernels.unpack_q8(*kernels.pack_q8(w8)), w8)
    # other weights land within half a step of their group's grid
    w = torch.randn(64, 96)
    packed, scales, mins = kernels.pack_q4(w)
    step = scales.float().repeat_interleave(32, dim=1)
    assert ((kernels.unpack_q4(packed, scales, mins) - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [pytest.param(96, 128, id="96x128"), pytest.param(576, 1536, id="576x1536")]
)
def test_q4_and_q8_kernels_equal_a_float32_matmul_with_the_same_weights(rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    w4, w8 = q41((out_features, in_features)), q80((out_features, in_features))
    got4 = kernels.q4_linear(x, *kernels.pack_q4(w4))
    got8 = kernels.q8_linear(x, *kernels.pack_q8(w8))
    torch.testing.assert_close(got4, x @ w4.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got8, x @ w8.T, rtol=1e-5, atol=1e-5)


def test_the_kernels_refuse_what_they_cannot_compute():
    packed, scales, mins = kernels.pack_q4(q41((32, 64)))
    with pytest.raises(RuntimeError, match="16 rows"):
        kernels.q4_linear(torch.randn(17, 64), packed, scales, mins)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.q4_linear(torch.randn(1, 32), packed, scales, mins)


# -- layers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 16, 40, 100])
def test_int4_linear_computes_the_same_weights_on_every_path(rows):
    w = q41((192, 64))
    layer = Int4Linear(w)
    x = torch.randn(rows, 64)  # 1-16: one kernel call, 40: three, 100: dequantise + GEMM
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_int8_linear_is_within_its_quantisation_step():
    w = torch.randn(96, 64) * 0.1
    layer = Int8Linear(w)
    step = layer.scales.float()[:, None]
    assert ((layer.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(3, 64)
    # the kernel path rounds x and its output to bf16: ~3 significant digits
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.dequantize()), rtol=2e-2, atol=2e-2)
    long = layer(torch.randn(40, 64))  # prefill rows: dequantised weight, float32 GEMM
    assert long.shape == (40, 96) and long.dtype == torch.float32


def test_rescored_output_gives_exact_logits_for_its_top_tokens():
    torch.manual_seed(0)
    weight = torch.randn(400, 64)
    out = RescoredOutput(weight)
    x = torch.randn(5, 64)
    got, exact = out(x), x @ weight.T
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-5)  # float32, not bf16
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert (got - exact).abs().max() < 0.5  # the rest: the int8 estimate


# -- the int4 model on a Q4_1 GGUF computes the file's weights in float32 --------------------
@pytest.fixture(scope="module")
def q4_reference(tiny_q4_paths):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_q4_paths[1]), torch_dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("chunk", [pytest.param(64, id="one-prefill"), pytest.param(5, id="chunked-prefill")])
def test_int4_logits_match_the_reference_on_a_q4_1_gguf(tiny_q4_gguf, q4_reference, chunk):
    engine = make_engine(tiny_q4_gguf, dtype="int4")
    assert engine.runner.model.decoder is not None
    ids = engine.tokenizer.encode(TEXTS[3] + " " + TEXTS[4])
    got = _engine_logits(engine, ids, prefill_chunk=chunk, num_prefill=len(ids) // 2)  # then decode rows
    with torch.no_grad():
        want = q4_reference(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() < LOGIT_ATOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_fused_decoder_equals_the_layer_by_layer_path(tiny_q4_gguf):
    """Three decode rows of different lengths through kernels.Q4Decoder and through
    model.py's blocks (the decoder switched off) give the same logits."""
    fused, layered = make_engine(tiny_q4_gguf, dtype="int4"), make_engine(tiny_q4_gguf, dtype="int4")
    layered.runner.model.decoder = None
    prompts = [fused.tokenizer.encode(t) for t in TEXTS[2:5]]
    results = []
    for engine in (fused, layered):
        runner, bm = engine.runner, engine.block_manager
        from edge_engine.sequence import Sequence

        seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts]
        with torch.inference_mode():
            for seq in seqs:  # prefill each, then one decode step for all three
                bm.allocate(seq, seq.num_tokens)
                runner.run([(seq, seq.num_tokens)])
                seq.num_computed_tokens = seq.num_tokens
                seq.token_ids.append(7)
                bm.allocate(seq, 1)
            logits, _ = runner.compute_logits([(s, 1) for s in seqs])
        results.append(logits)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-4)


async def test_int4_greedy_equals_the_reference_in_a_mixed_batch(tiny_q4_gguf, q4_reference):
    engine = make_engine(tiny_q4_gguf, dtype="int4", max_num_batched_tokens=12, num_kv_blocks=128)
    try:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        expected = [reference_greedy(q4_reference, p, 16) for p in prompts]
        results = await asyncio.gather(*(engine_greedy(engine, p, 16) for p in prompts))
        assert [r for r, _ in results] == expected
    finally:
        await engine.close()


# -- bytes per token ------------------------------------------------------------------------
def _decode_bytes(model) -> int:
    """Bytes of parameters one decode step reads: everything but the embedding table (of
    which it reads one row) and the float32 rows RescoredOutput keeps for rescoring."""
    skip = {id(model.tok_embeddings)}
    total = 0
    for name, p in model.named_parameters():
        if id(p) not in skip:
            total += p.numel() * p.element_size()
    return total


def test_the_quantised_modes_read_a_fraction_of_float32s_bytes(tiny_q4_gguf):
    sizes = {dtype: _decode_bytes(make_engine(tiny_q4_gguf, dtype=dtype).runner.model) for dtype in ("float32", "int8", "int4")}
    assert sizes["int8"] < 0.3 * sizes["float32"]
    assert sizes["int4"] < 0.25 * sizes["float32"]


# -- config ---------------------------------------------------------------------------------
def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == "int4"  # the kernels build here
    assert resolve_dtype("auto", cuda) == "bf16"
    for dtype in ("int8", "int4"):
        assert resolve_dtype(dtype, cpu) == dtype
        with pytest.raises(ValueError, match="CPU mode"):
            resolve_dtype(dtype, cuda)


# -- answers hold (tiny model, Q4_1 layout) -------------------------------------------------
async def _answers(path: str, dtype: str) -> tuple[list[list[int]], float]:
    """Greedy outputs of the 50 prompts (16 tokens) and the held-out perplexity."""
    engine = make_engine(path, dtype=dtype, num_kv_blocks=512, max_num_seqs=16)
    try:
        outputs = await greedy_outputs(engine, PROMPTS, 16)
    finally:
        await engine.close()
    return outputs, perplexity(engine, engine.tokenizer.encode(HELDOUT_TEXT))


@pytest.fixture(scope="module")
def float32_answers(tiny_q4_gguf):
    return asyncio.run(_answers(tiny_q4_gguf, "float32"))


@pytest.mark.parametrize(
    ("dtype", "min_identical"),
    [
        # int4 reads the file's own Q4_1 weights in float32: only summation order differs
        pytest.param("int4", 0.96, id="int4"),
        # int8 re-quantises them per channel and rounds decode activations to bf16
        pytest.param("int8", 0.3, id="int8"),
    ],
)
async def test_answers_hold_against_float32(tiny_q4_gguf, float32_answers, dtype, min_identical):
    reference, reference_ppl = float32_answers
    outputs, ppl = await _answers(tiny_q4_gguf, dtype)
    result = agreement(outputs, reference)
    assert result.share_identical >= min_identical, result.as_dict()
    assert abs(ppl / reference_ppl - 1) < 0.02, (ppl, reference_ppl)
