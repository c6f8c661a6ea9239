"""edge_engine: a small-model LLM engine in plain PyTorch (paged KV cache, prefix caching,
continuous batching), served in-process by the gateway or alone by ``python -m edge_engine.server``.

See ``edge_engine.engine`` for the lifecycle and ``edge_engine.serving.OpenAIServing`` for
the OpenAI-shaped seam the gateway calls.

The names below are imported on first use (PEP 562): ``edge_engine.config`` and
``edge_engine.errors`` need no torch, so a gateway that only reads the engine's
configuration (its defaults are the gateway's ``edge:`` defaults) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "describe_dtype",
]

_WHERE = {
    "DeadlineExceededError": "errors",
    "Delta": "sequence",
    "Engine": "engine",
    "EngineClosedError": "errors",
    "EngineConfig": "config",
    "EngineError": "errors",
    "EngineOverloadedError": "errors",
    "EngineStats": "engine",
    "InvalidRequestError": "errors",
    "ModelConfig": "config",
    "OpenAIServing": "serving",
    "PreparedRequest": "serving",
    "Priority": "sequence",
    "SamplingParams": "sampling",
    "default_model_path": "config",
    "describe_dtype": "engine",
}

if TYPE_CHECKING:
    from .config import EngineConfig, ModelConfig, default_model_path
    from .engine import Engine, EngineStats, describe_dtype
    from .errors import DeadlineExceededError, EngineClosedError, EngineError, EngineOverloadedError, InvalidRequestError
    from .sampling import SamplingParams
    from .sequence import Delta, Priority
    from .serving import OpenAIServing, PreparedRequest


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'edge_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
