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

from edge_engine import EngineConfig, SamplingParams, kernels
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
# Every test here needs the compiled kernels: the ``built_kernels`` fixture builds them (or
# fails, saying what to install, where the compiler is missing).
pytestmark = pytest.mark.usefixtures("built_kernels")


def test_the_kernels_build_here_and_run_the_best_isa_this_cpu_has():
    state = kernels.status()
    assert state.available and state.path == kernels.build_directory(), state
    best = next(isa for isa in ("avx512_vnni", "avxvnni", "avx2", "generic") if _cpu_has(isa))
    assert state.isa == best, (state, best)


def _cpu_has(isa: str) -> bool:
    with open("/proc/cpuinfo") as f:
        flags = f.read().split("\nflags", 1)[1].split("\n", 1)[0].split()
    need = {
        "avx512_vnni": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"},
        "avxvnni": {"avx_vnni", "avx2", "fma", "f16c"},
        "avx2": {"avx2", "fma", "f16c"},
        "generic": set(),
    }[isa]
    return need <= set(flags)


def test_a_stale_build_lock_does_not_hang_the_next_build():
    """A build killed half-way leaves torch's lock file behind; a later build must not wait
    on it for ever (it did: torch's FileBaton polls until the file goes)."""
    lock = os.path.join(kernels.build_directory(), "lock")
    with open(lock, "w"):
        pass
    old = os.path.getmtime(lock) - 3600
    os.utime(lock, (old, old))
    code = "from edge_engine import kernels; kernels.build(); assert kernels.available()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(lock)


def test_q4_and_q8_grids_and_tiles_recover_a_gguf_files_weights_exactly():
    for shape in [(96, 128), (40, 64)]:  # 40 rows: a last tile of 8
        w4 = q41(shape)
        q, scales, mins = kernels.pack_q4(w4)
        assert torch.equal(kernels.unpack_q4(q, scales, mins), w4)
        assert torch.equal(kernels.unpack_q4_tiles(*kernels.q4_tiles(q, scales, mins), shape[0]), w4)
        assert torch.equal(Int4Linear(w4).dequantize(), w4)
        w8 = q80(shape)
        q8, s8 = kernels.pack_q8(w8)
        assert torch.equal(kernels.unpack_q8(q8, s8), w8)
        assert torch.equal(kernels.unpack_q8_tiles(*kernels.q8_tiles(q8, s8), shape[0]), w8)
    # other weights land within half a step of their group's grid
    w = torch.randn(64, 96)
    q, scales, mins = kernels.pack_q4(w)
    step = scales.float().repeat_interleave(32, dim=1)
    assert ((kernels.unpack_q4(q, scales, mins) - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all()


# Each instruction set's kernels against plain torch, in a process of its own (the table is
# chosen once per process): float32 activations equal a float32 matmul on the same weights;
# 8-bit activations equal the same matmul on the activations rounded as llama.cpp's Q8
# (q = round(x / d), d = max|x| / 127 per 32 inputs; Q4_1's min term from the exact sums).
_ISA_CHECK = """
import sys, torch
from edge_engine import kernels
assert kernels.status().isa == sys.argv[1], kernels.status()

def a8(x):
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    d = amax / 127
    return (torch.round(g * torch.where(amax > 0, 127 / amax, 0)) * d).view_as(x), g.sum(-1)

torch.manual_seed(0)
for n, k in [(96, 128), (576, 1536), (40, 64), (400, 64)]:
    w = torch.randn(n, k) * 0.1
    q, s, m = kernels.pack_q4(w)
    w4, t4 = kernels.unpack_q4(q, s, m), kernels.q4_tiles(q, s, m)
    q8, s8 = kernels.pack_q8(w)
    w8, t8 = kernels.unpack_q8(q8, s8), kernels.q8_tiles(q8, s8)
    qs = kernels.unpack_q4(q, s, torch.zeros_like(m))  # q * scale
    for rows in [1, 3, 16, 17, 100]:
        x = torch.randn(rows, k)
        torch.testing.assert_close(kernels.q4_linear(x, t4, n), x @ w4.T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kernels.q8_linear(x, t8, n), x @ w8.T, rtol=1e-5, atol=1e-4)
        xq, sums = a8(x)
        torch.testing.assert_close(kernels.q4_linear(x, t4, n, True), xq @ qs.T + sums @ m.float().T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kernels.q8_linear(x, t8, n, True), xq @ w8.T, rtol=1e-5, atol=1e-4)
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx512_vnni", "avxvnni", "avx2", "generic"])
def test_every_instruction_sets_kernels_compute_their_arithmetic(isa):
    if not _cpu_has(isa):
        # a lower machine runs what it has; the request for a missing ISA falls back
        result = subprocess.run(
            [sys.executable, "-c", "from edge_engine import kernels; print(kernels.status().reason)"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "EDGE_ENGINE_ISA": isa},
        )
        assert "not available on this CPU" in result.stdout, result
        return
    result = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK, isa], capture_output=True, text=True, timeout=300,
        env={**os.environ, "EDGE_ENGINE_ISA": isa},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_kernels_refuse_what_they_cannot_compute():
    tiles = kernels.q4_tiles(*kernels.pack_q4(q41((32, 64))))
    with pytest.raises(RuntimeError, match="columns"):
        kernels.q4_linear(torch.randn(1, 32), tiles, 32)
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.q4_linear(torch.randn(1, 64), tiles, 48)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_linear(torch.randn(1, 64).double(), tiles, 32)


# -- layers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 16, 40, 100])
def test_int4_linear_computes_the_files_weights_at_every_row_count(rows):
    w = q41((192, 64))
    layer = Int4Linear(w)
    x = torch.randn(rows, 64)  # decode rows, a step of 16, prefill chunks
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
    assert EngineConfig(dtype="int4-a8").dtype == "int4-a8"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == "int4"  # the kernels build here
    assert resolve_dtype("auto", cuda) == "bf16"
    for dtype in ("int8", "int4", "int4-a8"):
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
        # int4-a8 rounds every linear layer's activations to 8 bits per 32 (llama.cpp's trade)
        pytest.param("int4-a8", 0.0, id="int4-a8"),
    ],
)
async def test_answers_hold_against_float32(tiny_q4_gguf, float32_answers, dtype, min_identical):
    reference, reference_ppl = float32_answers
    outputs, ppl = await _answers(tiny_q4_gguf, dtype)
    result = agreement(outputs, reference)
    assert result.share_identical >= min_identical, result.as_dict()
    assert abs(ppl / reference_ppl - 1) < 0.02, (ppl, reference_ppl)


# -- the mode auto picks, in the start-up log ------------------------------------------------
_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from edge_engine import Engine, EngineConfig
engine = Engine(EngineConfig(model=sys.argv[1], dtype="auto", num_kv_blocks=16, block_size=4))
print("runs", engine.runner.dtype_name)
"""


def test_the_start_up_log_says_which_mode_auto_picked_and_why(tiny_q4_gguf, tmp_path):
    built = subprocess.run([sys.executable, "-c", _START, tiny_q4_gguf], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "runs int4" in built.stdout
    assert "INFO edge engine " in built.stderr and "dtype int4 (auto: int4 on the CPU (kernels: " in built.stderr
    # never built here: float32, with a warning that says why and what to run (nothing compiles)
    bare = subprocess.run(
        [sys.executable, "-c", _START, tiny_q4_gguf], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
    )
    assert bare.returncode == 0, bare.stderr
    assert "runs float32" in bare.stdout
    assert "WARNING edge engine" in bare.stderr and "run `edgegw build-kernels`" in bare.stderr, bare.stderr
    assert list(tmp_path.iterdir()) == []
