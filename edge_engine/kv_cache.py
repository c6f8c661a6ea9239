"""The paged KV tensors: one preallocated pool of fixed-size blocks per layer.

``k[layer]``/``v[layer]``: [num_blocks, block_size, num_kv_heads, head_dim].  Which block
belongs to which sequence is the block manager's business; this module only owns memory.
The pool is zero-filled: padded reads of unused slots are masked out of attention, and a
masked-out zero (unlike uninitialised memory, which may hold NaN) contributes nothing.
"""

from __future__ import annotations

import os

import torch

from .config import ModelConfig

__all__ = ["KVCache", "available_memory_bytes", "kv_bytes_per_block"]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available host memory (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __repr__(self) -> str:
        return f"<KVCache blocks={self.num_blocks} block_size={self.block_size} bytes={self.num_bytes}>"
