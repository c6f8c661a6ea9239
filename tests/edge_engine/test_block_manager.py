"""Block allocator, reference counts and prefix sharing (plain Python, no model)."""

from __future__ import annotations

import random

from edge_engine.block_manager import BlockManager, compute_hash
from edge_engine.sampling import SamplingParams
from edge_engine.sequence import Sequence


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(temperature=0))


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """What a scheduled prefill does to the block manager: hits, allocation, registration."""
    bm.allocate_cached(seq, bm.find_cached_blocks(seq))
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(list(range(10)))
    assert bm.num_blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = seq_of(prompt + [1, 2])
    prefill(bm, a)
    b = seq_of(prompt + [3, 4, 5])
    hits = bm.find_cached_blocks(b)
    assert hits == a.block_table[:3]
    prefill(bm, b)
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:3]] == [1, 1, 1]
    bm.check_invariants([b])
    assert bm.prefix_cache_hit_rate == 12 / (15 + 16)


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(9)))
    prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    b = seq_of(list(range(9)) + [42])
    prefill(bm, b)
    assert b.num_cached_tokens == 8  # both full blocks came back from the cache
    bm.check_invariants([b])


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(8)))
    prefill(bm, a)
    bm.free(a)
    same = seq_of(list(range(8)))
    assert len(bm.find_cached_blocks(same)) == 1  # block 2 would leave nothing to compute


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    prefill(bm, a)
    b = seq_of([9, 9, 3, 4, 5])  # second block has the same tokens but another prefix
    assert bm.find_cached_blocks(b) == []
    assert compute_hash([3, 4], compute_hash([1, 2])) != compute_hash([3, 4], compute_hash([9, 9]))


def test_lru_eviction_takes_the_least_recently_freed_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq_of([1, 2, 3]), seq_of([7, 8, 9])
    prefill(bm, old)
    bm.free(old)
    prefill(bm, new)
    bm.free(new)
    # two fresh blocks are taken from the front of the free queue: old's blocks go first
    c = seq_of([50, 51, 52])
    bm.allocate(c, 3)
    assert bm.find_cached_blocks(seq_of([1, 2, 3])) == []
    assert len(bm.find_cached_blocks(seq_of([7, 8, 9]))) == 1
    bm.check_invariants([c])


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq_of([1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.find_cached_blocks(seq_of([1, 2, 3, 4, 5])) == []
    assert bm.num_cached_blocks == 0


def test_invariants_hold_under_random_traffic():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = seq_of(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))])
            hits = bm.find_cached_blocks(seq)
            need = bm.num_blocks_for(seq.num_tokens) - len(hits) + bm.num_new_blocks_with_hits(hits)
            if bm.can_allocate(need):
                prefill(bm, seq)
                live.append(seq)
        bm.check_invariants(live)
        for seq in live:  # shared blocks hold the tokens of every sequence using them
            for i, block_id in enumerate(seq.block_table):
                block = bm.blocks[block_id]
                if block.hash is not None:
                    assert block.token_ids == tuple(seq.token_ids[i * 4 : (i + 1) * 4])
    assert bm.num_prefix_hits > 0
