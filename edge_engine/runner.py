"""Tensors in, token ids out: turns one scheduled step into a flat batch, runs the model and
samples.

CPU modes: ``float32`` (exact against the reference), ``bf16`` (bf16 weights inside the
blocks, float32 activations, float32 output layer and KV cache), and the weight-only
quantised ``int8``, ``int4`` and ``int4-a8`` (see ``model``: float32 residual stream, norms,
attention and KV cache; int8 rounds decode activations to bf16, int4-a8 to 8 bits per 32).  CUDA: bf16 weights,
activations and KV cache (float32 output layer), attention through
``scaled_dot_product_attention``.  CUDA graphs are not captured yet: decode steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .config import ModelConfig
from .kv_cache import KVCache
from .model import AttentionMetadata, DecodeGroup, PrefillChunk, Transformer
from .sampling import SampleResult, apply_token_bitmask, sample
from .sequence import Sequence

__all__ = ["ModelRunner", "StepInputs", "describe_dtype", "resolve_dtype", "resolve_dtypes"]

QUANTIZED = ("int8", "int4", "int4-a8")
KERNEL_MODES = ("int4", "int4-a8")  # need edge_engine.kernels built


def describe_dtype(dtype: str, device: torch.device) -> tuple[str, str]:
    """(the concrete mode a config dtype means on a device, why: one line for logs, /readyz,
    ``edgegw check-config`` and /v1/models).

    "auto" on the CPU is the fastest mode whose answers hold against float32 (perplexity
    within 2 % and identical greedy outputs on at least 90 % of the 50 fixed prompts; see
    BENCHMARKS.md): int4, whose kernels ``edgegw build-kernels`` compiles -- or float32 where
    they are not built (int4-a8, int8 and bf16 are faster than float32 but change most
    greedy answers).  Raises ValueError for a mode this device cannot run.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return "bf16", "auto: bf16 on CUDA"
        state = kernels.status()
        if state.available:
            return "int4", f"auto: int4 on the CPU (kernels: {state.describe()})"
        return "float32", f"auto: float32, not int4: {state.reason}"
    if dtype in QUANTIZED and device.type != "cpu":
        raise ValueError(f"dtype: {dtype} is a CPU mode (weight-only kernels); use bf16 on {device.type}")
    if dtype in KERNEL_MODES:
        state = kernels.status()
        if not state.available:
            raise ValueError(f"dtype: {dtype} needs the edge engine's kernels: {state.reason}")
        return dtype, f"{dtype} as configured (kernels: {state.describe()})"
    return dtype, f"{dtype} as configured"


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """The concrete mode a config dtype means on a device (``describe_dtype``'s first half)."""
    return describe_dtype(dtype, device)[0]


def resolve_dtypes(dtype: str, device: torch.device) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(weight dtype, activation dtype, KV cache dtype) for a config dtype on a device; the
    quantised modes report float32 weights (the dtype they dequantise to)."""
    dtype = resolve_dtype(dtype, device)
    if dtype in ("float32", *QUANTIZED):
        return torch.float32, torch.float32, torch.float32
    if device.type == "cuda":
        return torch.bfloat16, torch.bfloat16, torch.bfloat16
    return torch.bfloat16, torch.float32, torch.float32


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N]
    order: list[int]  # flat row r comes from scheduled[order[r]]
    sample_rows: list[int]  # indices into scheduled of the rows that sample a token, in logits order


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: str,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.device = device
        self.block_size = block_size
        self.dtype, self.dtype_reason = describe_dtype(dtype, device)
        self.dtype_requested = dtype
        self.weight_dtype, self.act_dtype, self.kv_dtype = resolve_dtypes(dtype, device)
        self.model = Transformer(
            config,
            weights,
            max_len=max_model_len,
            device=device,
            weight_dtype=self.weight_dtype,
            act_dtype=self.act_dtype,
            quantization=self.dtype if self.dtype in QUANTIZED else None,
        ).eval()
        self.kv_cache = KVCache(config, num_blocks, block_size, self.kv_dtype, device)
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32: grammar masks of a step

    @property
    def dtype_name(self) -> str:
        if self.dtype in QUANTIZED:
            return self.dtype
        if self.weight_dtype == torch.float32:
            return "float32"
        return "bf16" if self.act_dtype == torch.bfloat16 else "bf16-weights/fp32-activations"

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepInputs:
        bs = self.block_size
        # decode rows, longest context first, so that rows of similar length sit together
        decode = sorted(
            (i for i, (_, n) in enumerate(scheduled) if n == 1), key=lambda i: -scheduled[i][0].num_computed_tokens
        )
        prefill = [i for i, (_, n) in enumerate(scheduled) if n > 1]
        order = decode + prefill
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for i in order:
            seq, n = scheduled[i]
            start = seq.num_computed_tokens
            end = start + n
            assert end <= seq.num_tokens and len(seq.block_table) * bs >= end, seq
            flat_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            for p in range(start, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if n == 1:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                mask = None
                if start > 0:
                    q_pos = torch.arange(start, end).unsqueeze(1)  # [S, 1]
                    mask = self._additive(torch.arange(end).unsqueeze(0) <= q_pos)  # [S, C]
                prefills.append(
                    PrefillChunk(
                        start=flat_start,
                        end=flat_start + n,
                        block_table=torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=self.device),
                        context_len=end,
                        mask=mask,
                    )
                )
            if end == seq.num_tokens:  # the last known token: its logits give the next one
                logits_indices.append(flat_start + n - 1)
                sample_rows.append(i)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(self.device), prefills=prefills
        )
        meta.decodes = self._decode_groups(decode_tables, decode_lens)
        if decode_tables and not prefills and self.model.decoder is not None:  # a pure decode step, for the fused decoder
            width = len(decode_tables[0])  # rows are sorted longest first
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_tables = torch.tensor(padded, dtype=torch.long).to(self.device)
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long).to(self.device)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(self.device),
            positions=torch.tensor(positions, dtype=torch.long).to(self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(self.device),
            order=order,
            sample_rows=sample_rows,
        )

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean "may attend" mask as the additive float mask SDPA uses internally
        (0 or -inf, in the activation dtype), built once per step instead of once per layer."""
        mask = torch.zeros(allowed.shape, dtype=self.act_dtype)
        return mask.masked_fill_(~allowed, float("-inf")).to(self.device)

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decode rows (sorted longest first) into groups whose padding wastes at most
        ~1/3 of the KV a group reads: one gather + one attention call per group."""
        bs = self.block_size
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(tables):
            width = len(tables[start])
            end = start + 1
            while end < len(tables) and len(tables[end]) * 3 >= width * 2:
                end += 1
            rows = tables[start:end]
            padded = [t + [0] * (width - len(t)) for t in rows]
            block_tables = torch.tensor(padded, dtype=torch.long).to(self.device)
            if end - start == 1:
                groups.append(DecodeGroup(start, end, block_tables, lens[start], None))
            else:
                row_lens = torch.tensor(lens[start:end], dtype=torch.long)
                mask = self._additive(torch.arange(width * bs).unsqueeze(0) < row_lens.unsqueeze(1))  # [B, L]
                mask = mask.view(end - start, 1, 1, width * bs)
                groups.append(DecodeGroup(start, end, block_tables, width * bs, mask))
            start = end
        return groups

    @torch.inference_mode()
    def compute_logits(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """Run one step; returns (logits [N, V] float32, the scheduled indices they belong to)."""
        inputs = self.prepare(scheduled)
        logits = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta, inputs.logits_indices
        )
        return logits, inputs.sample_rows

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask each constrained row's logits with its grammar's allowed next tokens
        (sequences with and without a grammar share the step; each row has its own)."""
        rows = [r for r, seq in enumerate(seqs) if seq.constraint is not None]
        if not rows:
            return
        words = -(-logits.shape[-1] // 32)
        bitmask = self._bitmask
        if bitmask is None or bitmask.shape[0] < len(rows) or bitmask.shape[1] != words:
            bitmask = self._bitmask = torch.zeros((max(len(rows), 8), words), dtype=torch.int32)
        ptr, row_bytes = bitmask.data_ptr(), words * 4
        for j, r in enumerate(rows):
            matcher = seqs[r].constraint
            # its state is the output tokens it has accepted: a preempted sequence keeps both
            assert matcher.num_tokens == seqs[r].num_output_tokens, (matcher, seqs[r])
            matcher.fill_mask(ptr + j * row_bytes, row_bytes)
        apply_token_bitmask(logits, rows, bitmask[: len(rows)])

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[SampleResult | None]:
        """Run one step and sample; one result per scheduled entry (None: prefill chunk that
        does not reach the end of its sequence)."""
        logits, rows = self.compute_logits(scheduled)
        results: list[SampleResult | None] = [None] * len(scheduled)
        if rows:
            seqs = [scheduled[i][0] for i in rows]
            self._constrain(logits, seqs)
            sampled = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for i, result in zip(rows, sampled):
                results[i] = result
        return results
