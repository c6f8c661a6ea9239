"""Paged KV blocks: allocation, reference counts and the prefix cache (plain Python).

A block is ``block_size`` token slots.  Every sequence owns a block table (its blocks in
order).  When a block is full and its K/V computed it is *registered* under a hash chain of
its tokens -- ``hash(previous block's hash, this block's tokens)`` -- so a later sequence
whose prompt starts with the same tokens takes the block (reference count + 1) instead of
recomputing it.  A block whose count falls to zero goes to the back of the free queue but
keeps its hash: it stays a cache hit until it is handed out again, which takes blocks from
the front, i.e. least recently freed first (LRU eviction).

Invariants (checked by ``check_invariants``): a block is in the free queue iff its count is
zero; a registered hash maps to a block that carries that hash; the reference count of a
block equals the number of block tables that hold it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from .sequence import Sequence

__all__ = ["Block", "BlockManager", "compute_hash"]


def compute_hash(token_ids: Iterable[int], prefix_hash: bytes = b"") -> bytes:
    h = hashlib.blake2b(prefix_hash, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"<Block {self.block_id} ref={self.ref_count} cached={self.hash is not None}>"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        # prefix cache statistics, in prompt tokens
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block_id)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------
    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Registered blocks matching the start of ``seq``'s tokens (not yet taken).

        At most ``num_tokens - 1`` tokens can hit: the last token must run through the model
        to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prefix_hash = b""
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            prefix_hash = compute_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def num_new_blocks_with_hits(self, hits: list[int]) -> int:
        """Free-queue blocks that taking ``hits`` would consume (cached blocks nobody holds)."""
        return sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def allocate_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Give a fresh sequence the cached blocks ``hits`` (from ``find_cached_blocks``)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        prefix_hash = b""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            assert block.hash is not None
            prefix_hash = block.hash
            seq.block_hashes.append(prefix_hash)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.num_prefix_queries += seq.num_prompt_tokens
            self.num_prefix_hits += seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed in the last step."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            prefix_hash = compute_hash(tokens, seq.block_hashes[-1] if seq.block_hashes else b"")
            seq.block_hashes.append(prefix_hash)
            if not self.enable_prefix_caching:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:  # already registered (a shared block)
                continue
            if prefix_hash in self.hash_to_block_id:  # the same tokens computed twice: keep the first
                continue
            block.hash = prefix_hash
            block.token_ids = tokens
            self.hash_to_block_id[prefix_hash] = block.block_id

    # -- allocation ----------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict it from the prefix cache
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room in ``seq``'s block table for ``num_new_tokens`` more computed tokens."""
        need = self.num_blocks_needed(seq, num_new_tokens)
        assert self.can_allocate(need), "caller must check can_allocate first"
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references.  Tail blocks go to the free queue first, so the shared
        head of a prompt is evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self, live: Iterable[Sequence] = ()) -> None:
        counts = [0] * len(self.blocks)
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids), block
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == h

    def __repr__(self) -> str:
        return (
            f"<BlockManager blocks={self.num_blocks} free={self.num_free_blocks} "
            f"cached={self.num_cached_blocks} block_size={self.block_size}>"
        )
