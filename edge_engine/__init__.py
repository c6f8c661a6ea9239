"""edge_engine: a small-model LLM engine in plain PyTorch (paged KV cache, prefix caching,
continuous batching), served in-process by the gateway or alone by ``python -m edge_engine.server``.

See ``edge_engine.engine`` for the lifecycle and ``edge_engine.serving.OpenAIServing`` for
the OpenAI-shaped seam the gateway calls.
"""

from .config import EngineConfig, ModelConfig, default_model_path
from .engine import Engine, EngineStats
from .errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from .sampling import SamplingParams
from .sequence import Delta, Priority
from .serving import OpenAIServing, PreparedRequest

__all__ = [
    "DeadlineExceededError",
    "Delta",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineOverloadedError",
    "EngineStats",
    "InvalidRequestError",
    "ModelConfig",
    "OpenAIServing",
    "PreparedRequest",
    "Priority",
    "SamplingParams",
    "default_model_path",
]
