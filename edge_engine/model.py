"""A Llama-family forward pass over a paged KV cache, in one file (in the spirit of gpt-fast).

RMSNorm, RoPE (Hugging Face ``rotate_half`` layout; the GGUF loader un-permutes llama.cpp's
Q/K rows), grouped-query attention and SwiGLU.  One call runs a *flat* batch: the tokens of
every scheduled sequence concatenated, decode rows (one token each) first, then prefill
chunks.  The linear layers see all tokens at once; attention runs once per group of decode
rows of similar context length (their paged blocks gathered and padded to the longest in
the group, with a mask) and once per prefill chunk.  Where
attention reads and writes the cache is passed in ``AttentionMetadata``, never kept in a
global.

Dtypes: ``weight_dtype`` for the linear layers inside the blocks, ``act_dtype`` for the
residual stream; norms, embeddings and the output layer stay float32 (a bf16 output layer
changes the small model's answers, see FACTS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

__all__ = ["AttentionMetadata", "DecodeGroup", "PrefillChunk", "Transformer", "build_rope_cache"]


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first flat token index of the chunk
    end: int  # one past the last
    block_table: torch.Tensor  # [num_blocks] int64
    context_len: int  # tokens in the cache once this chunk is written
    mask: torch.Tensor | None  # [S, context_len] additive float (0 / -inf), None = plain causal (chunk starts at 0)


@dataclass(slots=True)
class DecodeGroup:
    start: int  # first flat token index (one token per row)
    end: int
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_len: int  # one row: its exact context length (then mask is None); else max_blocks * block_size
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] additive float, None for a single row


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    decodes: list[DecodeGroup] = field(default_factory=list)  # decode rows come first in the flat batch
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_rope_cache(config: ModelConfig, max_len: int, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """cos/sin table: [max_len, 2, head_dim] float32 (HF ``rotate_half`` layout); the sin half
    that multiplies the negated half of ``rotate_half`` carries the sign (see ``apply_rope``)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if rope_freqs is not None:  # llama.cpp stores Llama 3 frequency factors as a tensor
        inv_freq = inv_freq / rope_freqs.float()
    elif scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    t = torch.arange(max_len, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [max_len, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, dim]
    sin = emb.sin()
    sin[:, : dim // 2] = -sin[:, : dim // 2]
    return torch.stack((emb.cos(), sin), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, signed_sin: [T, 1, D]
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * signed_sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op (equal to the reference within float rounding)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """``y = x W^T`` with W stored in its own dtype; the result comes back in x's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.shape[0] == 1 and w.dtype == torch.bfloat16 and w.device.type == "cpu":
            # one row: the bf16 matrix-vector kernel is ~2x faster than bf16 GEMM on the CPU
            return torch.mv(w, x[0].to(w.dtype)).unsqueeze(0).to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, wqkv: torch.Tensor, wo: torch.Tensor) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.wqkv = Linear(wqkv)
        self.wo = Linear(wo)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(H + KH) * D, KH * D], dim=-1)
        qk = apply_rope(qk.view(T, H + KH, D), cos, sin)  # Q and K heads rotated in one go
        q, k = qk.split([H, KH], dim=1)
        v = v.view(T, KH, D)
        flat_k = k_cache.view(-1, KH, D)
        flat_v = v_cache.view(-1, KH, D)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))

        if len(meta.decodes) == 1 and not meta.prefills:  # the common pure-decode step: no scratch copy
            return self.wo(self._decode_attention(q, k_cache, v_cache, meta.decodes[0]).reshape(T, H * D))
        out = q.new_empty(T, H, D)
        for group in meta.decodes:
            out[group.start : group.end] = self._decode_attention(q, k_cache, v_cache, group)
        for chunk in meta.prefills:
            C = chunk.context_len
            kp = torch.index_select(k_cache, 0, chunk.block_table).view(-1, KH, D)[:C].transpose(0, 1).unsqueeze(0)
            vp = torch.index_select(v_cache, 0, chunk.block_table).view(-1, KH, D)[:C].transpose(0, 1).unsqueeze(0)
            # kp, vp: [1, KH, C, D]
            qp = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
            op = F.scaled_dot_product_attention(
                qp,
                kp.to(qp.dtype),
                vp.to(qp.dtype),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                enable_gqa=True,
            )
            out[chunk.start : chunk.end] = op.squeeze(0).transpose(0, 1)
        return self.wo(out.view(T, H * D))

    def _decode_attention(self, q, k_cache, v_cache, group: DecodeGroup) -> torch.Tensor:
        """Attention of one token per row over its paged context -> [B, H, D]."""
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
        B = group.end - group.start
        C = group.context_len
        blocks = group.block_tables.view(-1)  # index_select copies whole blocks (fast path)
        kd = torch.index_select(k_cache, 0, blocks).view(B, -1, KH, D)[:, :C].transpose(1, 2)  # [B, KH, C, D]
        vd = torch.index_select(v_cache, 0, blocks).view(B, -1, KH, D)[:, :C].transpose(1, 2)
        qd = q[group.start : group.end].view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(qd, kd.to(qd.dtype), vd.to(qd.dtype), attn_mask=group.mask, enable_gqa=True)
        return od.transpose(1, 2).reshape(B, H, D)


class FeedForward(nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13 = Linear(w13)  # gate and up, fused
        self.w2 = Linear(w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention, feed_forward: FeedForward) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        h = x + self.attention(self.attention_norm(x), cos, sin, k_cache, v_cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Built from Hugging Face-named float32 weights (see ``loader``)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_len: int,
        device: torch.device,
        weight_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.act_dtype = act_dtype

        def w(name: str, dtype: torch.dtype = weight_dtype) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        embed = w("model.embed_tokens.weight", torch.float32)
        self.tok_embeddings = nn.Parameter(embed, requires_grad=False)  # [V, hidden] float32
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            wqkv = torch.cat(
                [w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"), w(p + "self_attn.v_proj.weight")]
            )
            w13 = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            block = TransformerBlock(
                config,
                Attention(config, wqkv, w(p + "self_attn.o_proj.weight")),
                FeedForward(w13, w(p + "mlp.down_proj.weight")),
            )
            block.attention_norm.weight.data = w(p + "input_layernorm.weight", act_dtype)
            block.ffn_norm.weight.data = w(p + "post_attention_layernorm.weight", act_dtype)
            layers.append(block)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm.weight.data = w("model.norm.weight", torch.float32)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.output = Linear(w("lm_head.weight", torch.float32))
        else:
            self.output = Linear(embed)  # tied: shares the float32 embedding
        rope_freqs = weights.get("rope_freqs")
        self.register_buffer("rope", build_rope_cache(config, max_len, rope_freqs).to(device), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N]: the rows whose next-token logits are wanted
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.tok_embeddings).to(self.act_dtype)  # [T, hidden]
        rope = self.rope[positions]  # [T, 2, D]
        cos = rope[:, 0].unsqueeze(1).to(self.act_dtype)  # [T, 1, D]
        sin = rope[:, 1].unsqueeze(1).to(self.act_dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        x = self.norm(x[logits_indices].float())  # [N, hidden]
        return self.output(x)  # [N, V] float32
