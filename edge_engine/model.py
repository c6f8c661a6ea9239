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

Weight-only quantisation (``quantization="int8" | "int4" | "int4-a8"``, CPU): decode reads
every weight once per step, so fewer bytes per weight is what makes it faster.

- ``int4``: ``Int4Linear`` on llama.cpp's Q4_1 grid and the output layer on its Q8_0 grid
  (``Q8Output``), multiplied by float32 activations in ``kernels`` -- a Q4_1 GGUF (SmolLM2's
  format) runs its own weights with float32 arithmetic at 0.625 bytes per weight.
- ``int4-a8``: the same weights times activations rounded to 8 bits per 32 inputs
  (llama.cpp's Q8 activations), through the CPU's integer dot products: faster under batch
  and in prefill; answers within perplexity of float32's, not token for token.
- ``int8``: ``Int8Linear``, int8 weights with one scale per output channel, through
  PyTorch's ``_weight_int8pack_mm`` (nothing to compile).  That kernel vectorises only bf16
  activations, so decode rows are rounded to bf16 on the way in and its output is bf16.
  The output layer is int8 too, with the ``num_rescored`` most likely tokens of each row
  rescored exactly from the float32 embedding (``RescoredOutput``).  Up to
  ``max_kernel_rows`` rows run its kernel; more rows (prefill) dequantise each weight to
  float32 once per call and run a float32 GEMM.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "Int4Linear",
    "Int8Linear",
    "PrefillChunk",
    "Q8Output",
    "RescoredOutput",
    "Transformer",
    "build_rope_cache",
]


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
    # a pure decode step also carries every row's blocks and length (for the fused int4 decoder)
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded with block 0
    decode_lens: torch.Tensor | None = None  # [B] int64: context length including this token


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


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded up to the nearest bfloat16 (so a scale stored in bf16
    is exactly the scale the weights were quantised with, and ``|q|`` stays in range)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -65536).view(torch.float32)


class Int8Linear(nn.Module):
    """Weight-only int8: ``W ~= q * scale[:, None]``, one bf16 scale per output channel."""

    # rows up to which the int8 kernel runs; beyond, dequantise + float32 GEMM (faster there)
    max_kernel_rows = 16

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.float()  # [out, in]
        scale = _round_up_to_bf16((w.abs().amax(dim=1) / 127).clamp(min=1e-30))  # [out]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] int8
        self.scales = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)  # [out]

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]: bf16 from the kernel (T <= max_kernel_rows), else float32
        if x.shape[0] <= self.max_kernel_rows:
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
        return F.linear(x.float(), self.dequantize())


class Int4Linear(nn.Module):
    """Weight-only 4-bit on llama.cpp's Q4_1 grid (``w = q * scale + min``, q in [0, 15], fp16
    scale and min per 32 inputs), in ``kernels``' tiles of 16 output rows: a Q4_1 file's
    weights are recovered exactly.  ``kernels.q4_linear`` multiplies them by float32
    activations (``a8=False``: float32 arithmetic on the file's weights) or by activations
    rounded to 8 bits per 32 inputs (``a8=True``: integer dot products, llama.cpp's
    arithmetic).  Every row count runs the kernel: each unpacked weight block serves all the
    rows of the call, so a prefill chunk reads the weights once.
    """

    def __init__(self, weight: torch.Tensor, a8: bool = False) -> None:
        super().__init__()
        tiles, scales, mins = kernels.q4_tiles(*kernels.pack_q4(weight))
        self.out_features = weight.shape[0]
        self.a8 = a8
        self.weight = nn.Parameter(tiles, requires_grad=False)  # [out/16, in/32, 256] uint8
        self.scales = nn.Parameter(scales, requires_grad=False)  # [out/16, in/32, 16] fp16
        self.mins = nn.Parameter(mins, requires_grad=False)  # [out/16, in/32, 16] fp16

    def dequantize(self) -> torch.Tensor:
        return kernels.unpack_q4_tiles(self.weight, self.scales, self.mins, self.out_features)  # [out, in] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out] float32
        return kernels.q4_linear(x.float(), (self.weight, self.scales, self.mins), self.out_features, self.a8)


class Q8Output(nn.Module):
    """The output layer on llama.cpp's Q8_0 grid (int8, fp16 scale per 32 inputs; a Q8_0
    embedding is recovered exactly) through ``kernels.q8_linear``: float32 activations
    (exact logits from a quarter of float32's bytes) or, with ``a8``, 8-bit ones as
    llama.cpp.  Only the sampled rows reach it (at most one per sequence)."""

    def __init__(self, weight: torch.Tensor, a8: bool = False) -> None:
        super().__init__()
        tiles, scales = kernels.q8_tiles(*kernels.pack_q8(weight))
        self.out_features = weight.shape[0]
        self.a8 = a8
        self.weight = nn.Parameter(tiles, requires_grad=False)  # [V/16, hidden/32, 512] uint8 (q + 128)
        self.scales = nn.Parameter(scales, requires_grad=False)  # [V/16, hidden/32, 16] fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, hidden] -> [N, V] float32
        return kernels.q8_linear(x.float(), (self.weight, self.scales), self.out_features, self.a8)


class RescoredOutput(nn.Module):
    """The output layer from int8 weights, with the ``num_rescored`` most likely tokens of
    each row rescored exactly against the float32 weight (the tied embedding: no extra copy).

    The int8 logits (bf16, ~0.1 apart from the exact ones) only choose the candidates; the
    argmax and the probabilities that matter come from exact float32 logits.  The float32
    weight is kept for these few rows (and for the embedding), never read whole per token.
    """

    num_rescored = 64

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.approx = Int8Linear(weight)
        self.exact = weight  # [V, hidden] float32 (shared with the embedding when tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, hidden] float32 -> [N, V] float32
        logits = self.approx(x).float()  # [N, V]
        top = logits.topk(self.num_rescored, dim=-1).indices  # [N, k]
        rows = self.exact[top]  # [N, k, hidden]
        exact = torch.bmm(rows, x.unsqueeze(-1)).squeeze(-1)  # [N, k]
        return logits.scatter_(1, top, exact)


_QUANTIZED_LINEAR = {
    "int8": Int8Linear,
    "int4": Int4Linear,
    "int4-a8": functools.partial(Int4Linear, a8=True),
}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, wqkv: nn.Module, wo: nn.Module) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.wqkv = wqkv
        self.wo = wo

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
    def __init__(self, w13: nn.Module, w2: nn.Module) -> None:
        super().__init__()
        self.w13 = w13  # gate and up, fused
        self.w2 = w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # bf16 from a quantised kernel: w2 takes it as is
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
    """Built from Hugging Face-named float32 weights (see ``loader``).

    ``quantization`` ("int8" | "int4" | "int4-a8" | None) replaces the linear layers inside the blocks
    by weight-only quantised ones (``weight_dtype`` is then unused); ``quantize_output``
    also serves the output layer from int8 weights with exact rescoring (``RescoredOutput``).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_len: int,
        device: torch.device,
        weight_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
        quantization: str | None = None,
        quantize_output: bool = True,
    ) -> None:
        super().__init__()
        assert quantization in (None, *_QUANTIZED_LINEAR), quantization
        self.config = config
        self.act_dtype = act_dtype
        self.quantization = quantization

        def w(name: str, dtype: torch.dtype = weight_dtype) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def linear(*names: str) -> nn.Module:
            if quantization is None:
                return Linear(torch.cat([w(n) for n in names]))
            return _QUANTIZED_LINEAR[quantization](torch.cat([w(n, torch.float32) for n in names]))

        embed = w("model.embed_tokens.weight", torch.float32)
        self.tok_embeddings = nn.Parameter(embed, requires_grad=False)  # [V, hidden] float32
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            block = TransformerBlock(
                config,
                Attention(
                    config,
                    linear(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                    linear(p + "self_attn.o_proj.weight"),
                ),
                FeedForward(
                    linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), linear(p + "mlp.down_proj.weight")
                ),
            )
            block.attention_norm.weight.data = w(p + "input_layernorm.weight", act_dtype)
            block.ffn_norm.weight.data = w(p + "post_attention_layernorm.weight", act_dtype)
            layers.append(block)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm.weight.data = w("model.norm.weight", torch.float32)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            head = w("lm_head.weight", torch.float32)
        else:
            head = embed  # tied: shares the float32 embedding
        if quantization is None or not quantize_output:
            self.output = Linear(head)
        elif quantization in ("int4", "int4-a8"):
            self.output = Q8Output(head, a8=quantization == "int4-a8")
        else:
            self.output = RescoredOutput(head)
        rope_freqs = weights.get("rope_freqs")
        self.register_buffer("rope", build_rope_cache(config, max_len, rope_freqs).to(device), persistent=False)
        # int4 decode steps run all layers in one C++ call (kernels.Q4Decoder): batch-1 decode
        # is otherwise bound by ~100 small Python-dispatched ops per layer, not by the weights
        self.decoder = None
        if quantization in ("int4", "int4-a8"):
            params: list[torch.Tensor] = []
            for block in self.layers:
                a, f = block.attention, block.feed_forward
                params += [block.attention_norm.weight, a.wqkv.weight, a.wqkv.scales, a.wqkv.mins]
                params += [a.wo.weight, a.wo.scales, a.wo.mins, block.ffn_norm.weight]
                params += [f.w13.weight, f.w13.scales, f.w13.mins, f.w2.weight, f.w2.scales, f.w2.mins]
            self.decoder = kernels.q4_decoder(
                [p.data for p in params],
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.rms_norm_eps,
                a8=quantization == "int4-a8",
            )

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
        if self.decoder is not None and meta.decode_lens is not None and x.shape[0] <= kernels.MAX_ROWS:
            x = self.decoder.forward(
                x,
                rope,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                meta.slot_mapping,
                meta.decode_tables,
                meta.decode_lens,
            )
        else:
            cos = rope[:, 0].unsqueeze(1).to(self.act_dtype)  # [T, 1, D]
            sin = rope[:, 1].unsqueeze(1).to(self.act_dtype)
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer(x, cos, sin, k_cache, v_cache, meta)
        x = self.norm(x[logits_indices].float())  # [N, hidden]
        return self.output(x)  # [N, V] float32
