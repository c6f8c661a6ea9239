"""EngineConfig is checked when built, naming the bad field."""

from __future__ import annotations

import pytest

from edge_engine import EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"dtype": "fp16"}, "dtype", id="dtype"),
        pytest.param({"device": "tpu"}, "device", id="device"),
        pytest.param({"block_size": 0}, "block_size", id="block-size"),
        pytest.param({"num_kv_blocks": 0}, "num_kv_blocks", id="num-kv-blocks"),
        pytest.param({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction", id="fraction"),
        pytest.param({"model": "/nonexistent/model.gguf"}, "model", id="missing-model"),
        pytest.param({"max_num_batched_tokens": 0}, "max_num_batched_tokens", id="budget"),
        pytest.param({"max_pending_outputs": 0}, "max_pending_outputs", id="pending-outputs"),
    ],
)
def test_bad_values_fail_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_dtype_aliases_are_normalised():
    assert EngineConfig(dtype="fp32").dtype == "float32"
    assert EngineConfig(dtype="bfloat16").dtype == "bf16"
    assert EngineConfig(dtype="int8").dtype == "int8" and EngineConfig(dtype="int4").dtype == "int4"
