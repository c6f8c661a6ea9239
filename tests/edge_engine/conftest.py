"""Fixtures: the tiny random Llama (GGUF + HF directory; float32, or laid out like SmolLM2's
Q4_1 file), engines over it, and the real SmolLM2 engine (loaded once per session, for the
few ``slow`` tests)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from edge_engine import Engine, EngineConfig
from tests.edge_engine.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_gguf(tiny_paths):
    return str(tiny_paths[0])


@pytest.fixture(scope="session")
def tiny_hf(tiny_paths):
    return str(tiny_paths[1])


@pytest.fixture(scope="session")
def tiny_q4_paths(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-q4"), quantized=True)


@pytest.fixture(scope="session")
def tiny_q4_gguf(tiny_q4_paths):
    return str(tiny_q4_paths[0])


@pytest.fixture(scope="session")
def reference(tiny_hf):
    """transformers' LlamaForCausalLM on the same weights (CPU, float32, eager attention)."""
    model = LlamaForCausalLM.from_pretrained(tiny_hf, torch_dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_engine(path: str, **overrides) -> Engine:
    # float32 unless a test asks: exactness against the reference belongs to float32
    options = dict(model=path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    options.update(overrides)
    return Engine(EngineConfig(**options))


@pytest.fixture
async def tiny_engine(tiny_gguf):
    engine = make_engine(tiny_gguf)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
def smollm_engine():
    """The real SmolLM2-135M-Instruct, float32 on the CPU (its step thread is started per test).
    Its tests are about answers: no TPOT objectives (a float32 step of many rows is past
    100 ms, and admission would refuse the 50 prompts sent at once)."""
    return Engine(EngineConfig(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=256, tpot_ms={}))
