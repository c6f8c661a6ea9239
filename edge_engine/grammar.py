"""Constrained decoding through llguidance: grammars compiled once, a matcher per sequence.

Why llguidance (bench/grammar_libs.py, BENCHMARKS.md): on this CPU with SmolLM2's 49,152
token vocabulary its per-token cost (next-token bitmask + advance) is ~9 µs mean (xgrammar
~4, outlines-core ~12): all three are below 0.1 % of a decode step, so what decided was the
rest -- it compiles a schema ~15x faster than xgrammar (a new schema's compile is paid in
TTFT) and outlines-core takes up to 13 s on the larger schemas; it installs as one 3 MB
wheel with no dependencies (xgrammar pulls transformers, and triton: 1 GB, for a GPU
kernel) and imports in ~70 ms (xgrammar ~1.7 s through transformers).

Lifecycle::

    compiler = GrammarCompiler(tokenizer, vocab_size)      # once per engine (~0.4 s for 49k tokens)
    grammar = compiler.compile(lark_text)                  # per request; cached by text (LRU)
    matcher = grammar.matcher()                            # per sequence
    matcher.fill_mask(ptr, nbytes)                          # each step: the allowed next tokens
    matcher.advance(token)                                  # each accepted token

The matcher's state is a function of the output tokens it has accepted (``num_tokens``): a
preempted sequence keeps its tokens and its matcher, and the recomputed prefill only
rebuilds the KV cache, so the next mask is the right one without replay. The bitmask is
llguidance's (and xgrammar's) layout: int32 words, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` is allowed; ``sampling.apply_token_bitmask`` applies it to logits.

No torch here: pointers and sizes come from the runner.
"""

from __future__ import annotations

import collections
import importlib.util
import threading
from typing import Any

from .errors import InvalidRequestError

__all__ = ["Grammar", "GrammarCompiler", "Matcher", "available"]

try:  # the ``engine`` extra installs it; without it the engine serves plain text only
    import llguidance
except ImportError:  # pragma: no cover - exercised only where llguidance is missing
    llguidance = None

_CACHE_SIZE = 256


def available() -> bool:
    """Whether the grammar library is installed (without importing it twice)."""
    return llguidance is not None or importlib.util.find_spec("llguidance") is not None


class Matcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m", "num_tokens", "eos_token_ids")

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self.num_tokens = 0  # output tokens accepted so far
        self.eos_token_ids = eos_token_ids

    def fill_mask(self, ptr: int, nbytes: int) -> None:
        """Write the allowed-next-token bitmask at ``ptr`` (``nbytes`` = 4 * ceil(V / 32))."""
        self._m.unsafe_compute_mask_ptr(ptr, nbytes)

    def advance(self, token: int) -> bool:
        """Accept ``token``; returns True when the grammar is complete (the token was the
        end of sequence, or nothing may follow it but the end)."""
        self.num_tokens += 1
        if token in self.eos_token_ids:
            return True
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")
        return self._m.is_stopped()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows and no other, next (what may be appended unsampled)."""
        return self._m.compute_ff_tokens()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def __repr__(self) -> str:
        return f"<Matcher tokens={self.num_tokens} accepting={self._m.is_accepting()}>"


class Grammar:
    """A compiled grammar: a pristine matcher, copied for each sequence."""

    __slots__ = ("_m", "_eos", "text")

    def __init__(self, matcher: Any, eos: frozenset[int], text: str) -> None:
        self._m = matcher
        self._eos = eos
        self.text = text

    def matcher(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self._eos)

    def __repr__(self) -> str:
        return f"<Grammar {len(self.text)} chars>"


class GrammarCompiler:
    """Compiles Lark grammars (with ``%json`` schemas inside) against one tokenizer.

    ``tokenizer`` is ``edge_engine.tokenizer.Tokenizer``; ``vocab_size`` the model's (the
    width of its logits: ids the tokenizer lacks are never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if llguidance is None:
            raise RuntimeError("constrained decoding needs llguidance (the engine extra)")
        self.vocab_size = vocab_size
        self.mask_words = -(-vocab_size // 32)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids) or None
        )
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, text: str, param: str = "response_format") -> Grammar:
        """The grammar for Lark ``text``; ``InvalidRequestError`` (naming ``param``) when it
        does not compile (an invalid or unsupported schema)."""
        with self._lock:
            grammar = self._cache.get(text)
            if grammar is not None:
                self._cache.move_to_end(text)
                return grammar
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            raise InvalidRequestError(f"invalid schema: {_short(matcher.get_error())}", param, "invalid_value")
        grammar = Grammar(matcher, self._eos, text)
        with self._lock:
            self.num_compiled += 1
            self._cache[text] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _short(message: str) -> str:
    """llguidance's error, first line only (later lines dump parser state)."""
    first = message.strip().splitlines()[0] if message.strip() else "the grammar library refused it"
    return first[:300]
