"""Which prompt prefixes each endpoint probably holds in its prefix (KV) cache.

A prompt is cut into blocks of ``block_chars`` characters, and block *i* is named by a
hash chained over blocks 0..i (vLLM's and nano-vllm's block hashes do the same over
tokens): one name stands for the whole prefix up to and including that block, so a set of
names is a radix tree of prefixes without the tree's pointers. ``PrefixIndex`` keeps, per
endpoint, the names of the blocks routed there, most recently used last, bounded to the
server's KV capacity (in blocks of the same size): when a new prompt does not fit, the
least recently used blocks go first, which is what the server's own LRU evicts.

Blocks of one prompt are touched leaf first, root last, so a block is always more recent
than its descendants: a child never outlives its parent, the set stays prefix-closed, and
``match`` finds the longest cached prefix by binary search (a few dict lookups, whatever
the prompt's length).

Characters stand in for tokens (``chars_per_token`` of the policy converts): routing needs
to know which replica saves most of a prefill, not the exact count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PrefixIndex", "prompt_blocks", "prompt_text"]


def prompt_text(body: Mapping[str, Any]) -> str:
    """The part of a chat or completions body a server's prompt is made of, in order:
    each message's role and text (tool calls and attachments leave no text here), or the
    ``prompt``."""
    messages = body.get("messages")
    parts: list[str] = []
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            parts.append(role if isinstance(role, str) else "")
            parts.append("\x1e")
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for p in content:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        parts.append(p["text"])
                    elif isinstance(p, str):
                        parts.append(p)
            parts.append("\x1f")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]  # a batch of prompts: the first one's prefix
    return ""


def prompt_blocks(text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of ``text``'s full blocks of ``block_chars`` (a partial last block is
    not cached by a server either), at most ``max_blocks``. Python's string hash: stable
    within a process, which is where the index lives."""
    n = min(len(text) // block_chars, max_blocks)
    out = []
    h = 0
    for i in range(n):
        h = hash((h, text[i * block_chars : (i + 1) * block_chars]))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    """The prefix blocks one endpoint probably caches, LRU-bounded to ``capacity`` blocks."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a prefix index holds at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` are held (the longest cached prefix, in blocks)."""
        held = self._blocks
        if not blocks or blocks[0] not in held:
            return 0
        lo, hi = 1, len(blocks)  # blocks[:lo] held; find the first block not held
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in held:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, blocks: Sequence[int]) -> None:
        """``blocks`` were just sent to this endpoint: they are its most recent, the root
        most recent of all; the least recent blocks beyond ``capacity`` are dropped."""
        held = self._blocks
        if len(blocks) > self.capacity:
            blocks = blocks[: self.capacity]
        for h in reversed(blocks):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """A new bound (the server said how large its KV cache is); shrinking evicts."""
        self.capacity = max(1, capacity)
        held = self._blocks
        while len(held) > self.capacity:
            held.popitem(last=False)

    def clear(self) -> None:
        """The server lost its cache (it restarted)."""
        self._blocks.clear()

    def __repr__(self) -> str:
        return f"<PrefixIndex {len(self._blocks)}/{self.capacity} blocks>"
