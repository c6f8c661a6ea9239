"""Load a Llama-family model: a GGUF file (the ``gguf`` package, dequantised) or a Hugging
Face directory (config.json + *.safetensors + tokenizer.json).

Both give Hugging Face-named float32 tensors.  GGUF differences handled here:

- llama.cpp's converter permutes the rows of Q and K per head for its interleaved RoPE; we
  undo it (``num_heads`` for Q, ``num_kv_heads`` for K) so the model uses HF ``rotate_half``.
- the dequantised arrays are already [out, in] (``nn.Linear`` layout); F32 tensors come back
  as read-only memmaps and are copied.
- embeddings may be tied: no ``output.weight``, the output layer is ``token_embd``.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from .config import ModelConfig
from .tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "load_model",
    "load_gguf",
    "load_hf_dir",
    "load_tokenizer",
    "permute_for_gguf",
    "unpermute_from_gguf",
]


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, float32, on the CPU
    tokenizer: Tokenizer
    name: str
    path: str


def load_model(path: str) -> LoadedModel:
    if os.path.isdir(path):
        return load_hf_dir(path)
    if path.endswith(".gguf") or _is_gguf(path):
        return load_gguf(path)
    raise ValueError(f"model: {path!r} is neither a GGUF file nor a directory with config.json")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a model alone (GGUF metadata or the directory's tokenizer files),
    without reading its weights: for tools that need the vocabulary, not the model."""
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    reader = gguf.GGUFReader(path)
    return Tokenizer.from_gguf_metadata(
        {name: _field_value(field) for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    )


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# -- llama.cpp's Q/K permutation --------------------------------------------------------
def permute_for_gguf(w: np.ndarray | torch.Tensor, num_heads: int):
    """What llama.cpp's ``convert_hf_to_gguf.py`` does to Q/K rows (HF -> GGUF)."""
    shape = w.shape
    w = w.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
    return w.swapaxes(1, 2).reshape(shape)


def unpermute_from_gguf(w: np.ndarray | torch.Tensor, num_heads: int):
    """The inverse of ``permute_for_gguf`` (GGUF -> HF ``rotate_half`` layout)."""
    shape = w.shape
    w = w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
    return w.swapaxes(1, 2).reshape(shape)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # very old gguf packages: decode by hand
        parts = [field.parts[i] for i in field.data]
        values = [bytes(p).decode("utf-8") if p.dtype == np.uint8 else p.tolist()[0] for p in parts]
        return values if len(values) != 1 else values[0]


def load_gguf(path: str) -> LoadedModel:
    reader = gguf.GGUFReader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"model: only Llama-architecture GGUF files are supported, not {arch!r}")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"llama.{name}", default)

    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    hidden = int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue
            hf_name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        elif name in _GGUF_GLOBAL_NAMES:
            hf_name = _GGUF_GLOBAL_NAMES[name]
        else:
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32, copy=True)  # memmap views are read-only
        if rest_is(name, "attn_q.weight"):
            array = unpermute_from_gguf(array, num_heads)
        elif rest_is(name, "attn_k.weight"):
            array = unpermute_from_gguf(array, num_kv_heads)
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
    embed = weights["model.embed_tokens.weight"]
    config = ModelConfig(
        vocab_size=int(key("vocab_size", embed.shape[0] if embed.ndim == 2 else len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(key("attention.key_length", key("rope.dimension_count", hidden // num_heads))),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in weights,
    )
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    name = os.path.basename(path)
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return LoadedModel(config, weights, tokenizer, name, path)


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)


def load_hf_dir(path: str) -> LoadedModel:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model: {path!r} has no config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in (None, "llama", "mistral") and not any("Llama" in a for a in archs):
        raise ValueError(f"model: only Llama-family models are supported, not {cfg.get('model_type')!r}")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: {path!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            weights[name] = tensor.float()
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    config = ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in weights,
        rope_scaling=cfg.get("rope_scaling"),
    )
    tokenizer = Tokenizer.from_dir(path)
    return LoadedModel(config, weights, tokenizer, os.path.basename(os.path.normpath(path)), path)
