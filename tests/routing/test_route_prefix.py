"""routing.prefix: chained prompt blocks and the bounded, prefix-closed index."""

from __future__ import annotations

import pytest

from routing.prefix import PrefixIndex, prompt_blocks, prompt_text


def blocks(text: str, size: int = 4, most: int = 100) -> tuple[int, ...]:
    return prompt_blocks(text, size, most)


def test_blocks_name_the_whole_prefix():
    a = blocks("aaaabbbbcccc")
    b = blocks("aaaabbbbdddd")
    c = blocks("zzzzbbbbcccc")
    assert len(a) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[1] != c[1]  # same block text after a different prefix: another name
    assert blocks("aaaabb") == a[:1]  # a partial last block is not a block
    assert len(blocks("x" * 400, most=10)) == 10


def test_prompt_text_of_chat_and_completions():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert prompt_text(chat) == "system\x1eS\x1fuser\x1eU\x1f"
    assert prompt_text({"prompt": "P"}) == "P"
    assert prompt_text({"prompt": ["P1", "P2"]}) == "P1"
    assert prompt_text({"prompt": [1, 2]}) == ""
    # the role is part of the prefix: the same words as system and as user differ
    assert prompt_text({"messages": [{"role": "user", "content": "S"}]}) != prompt_text(
        {"messages": [{"role": "system", "content": "S"}]}
    )


def test_match_is_the_longest_cached_prefix():
    idx = PrefixIndex(100)
    idx.insert(blocks("aaaabbbbcccc"))
    assert idx.match(blocks("aaaabbbbcccc")) == 3
    assert idx.match(blocks("aaaabbbbdddd")) == 2
    assert idx.match(blocks("aaaabbbbccccdddd")) == 3
    assert idx.match(blocks("bbbb")) == 0
    assert idx.match(()) == 0


def test_capacity_bounds_memory_and_evicts_least_recent_leaves_first():
    idx = PrefixIndex(6)
    system = "SSSSssss"  # two shared blocks
    idx.insert(blocks(system + "aaaa"))
    idx.insert(blocks(system + "bbbb"))
    idx.insert(blocks(system + "cccc"))
    assert len(idx) == 5
    idx.insert(blocks(system + "dddd" + "eeee"))
    assert len(idx) == 6  # never more than the capacity
    # the oldest conversation's leaf went; the shared system prompt, touched by every
    # insert, stays cached: the index is prefix-closed, as a server's LRU cache is
    assert idx.match(blocks(system + "aaaa")) == 2
    assert idx.match(blocks(system + "bbbb")) == 3
    assert idx.match(blocks(system + "dddd" + "eeee")) == 4
    idx.insert(blocks(system + "ffff"))
    assert idx.match(blocks(system + "bbbb")) == 2  # the next least recent leaf
    assert idx.match(blocks(system + "cccc")) == 3


def test_a_child_never_outlives_its_parent():
    idx = PrefixIndex(3)
    idx.insert(blocks("aaaabbbbcccc"))  # a, ab, abc
    idx.insert(blocks("xxxx"))  # evicts the least recent: the leaf abc
    assert idx.match(blocks("aaaabbbbcccc")) == 2
    idx.insert(blocks("yyyyzzzz"))
    assert idx.match(blocks("aaaabbbbcccc")) == 0  # the whole chain went, leaf first
    for held in (blocks("xxxx"), blocks("yyyyzzzz")):
        assert idx.match(held) == len(held)


def test_a_prompt_longer_than_the_cache_keeps_its_head():
    idx = PrefixIndex(4)
    long = blocks("abcdefghijklmnopqrstuvwxyz012345", size=4)  # 8 blocks
    idx.insert(long)
    assert len(idx) == 4
    assert idx.match(long) == 4


def test_resize_and_clear():
    idx = PrefixIndex(10)
    idx.insert(blocks("aaaabbbbccccdddd"))
    idx.resize(2)
    assert len(idx) == 2 and idx.match(blocks("aaaabbbbccccdddd")) == 2
    idx.clear()
    assert len(idx) == 0
    with pytest.raises(ValueError):
        PrefixIndex(0)
