"""Which constrained-decoding library: xgrammar, llguidance and outlines-core, measured on
this CPU with SmolLM2's tokenizer (vocabulary 49,152) on the 50 schemas of
``bench/grammar_schemas.py``.

    .venv/bin/python -m pip install --no-deps -r bench/requirements-grammar.txt   # the peers
    .venv/bin/python bench/grammar_libs.py [--schemas 50] [--json OUT]

For every library and schema: the grammar is compiled from the schema (cold: no cache), then
the schema's instance -- serialised with ", " and ": ", the separators each library is told
to use -- is tokenised with SmolLM2's own BPE and fed through the library's matcher token by
token. Each step times the two calls an engine makes per token: fill the next-token bitmask
(49,152 bits) and advance the matcher with the accepted token. A library that rejects the
instance's tokens (a token it never allows) is reported as a failure for that schema.

The peers are not dependencies of the project: ``bench/requirements-grammar.txt`` names them
(with --no-deps: xgrammar's metadata wants triton, a GPU compiler, which this CPU path never
imports). llguidance, the one chosen, comes with the ``engine`` extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grammar_schemas import SCHEMAS  # noqa: E402
from edge_engine.config import default_model_path  # noqa: E402
from edge_engine.loader import load_tokenizer  # noqa: E402

VOCAB = 49152
SEPARATORS = (", ", ": ")


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance

        self.lib = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.backend_json(), n_vocab=VOCAB, eos_token=tok.eos_token_ids)
        self.options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        self.mask = torch.zeros(VOCAB // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self.options)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, m) -> None:
        m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def allowed(self, token: int) -> bool:
        return bool((int(self.mask[token // 32]) >> (token % 32)) & 1)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar

        self.lib = xgrammar
        vocab = [tok.token_bytes(i) for i in range(VOCAB)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=tok.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, VOCAB)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )
        return self.lib.GrammarMatcher(compiled)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.mask)

    def allowed(self, token: int) -> bool:
        return bool((int(self.mask[0, token // 32]) >> (token % 32)) & 1)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok) -> None:
        import outlines_core

        self.lib = outlines_core
        special = set(range(17))  # SmolLM2's control tokens
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(VOCAB):
            if i not in special:
                by_bytes.setdefault(tok.token_bytes(i), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_ids[0], by_bytes)
        self.mask = torch.zeros(VOCAB // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        regex = self.lib.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r" ?")
        return self.lib.Guide(self.lib.Index(regex, self.vocabulary))

    def fill(self, m) -> None:
        m.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)

    def allowed(self, token: int) -> bool:
        return bool((int(self.mask[token // 32]) >> (token % 32)) & 1)

    def advance(self, m, token: int) -> bool:
        m.advance(token, return_tokens=False)
        return True


LIBS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(lib, cases, tok, repeats: int) -> dict:
    """Per-token times as the minimum over ``repeats`` passes of each (schema, token) step:
    on a shared machine a step's minimum is its cost, the rest is other processes' time."""
    runs = [_one_pass(lib, cases, tok) for _ in range(repeats)]
    compile_s = [min(c) for c in zip(*(r[0] for r in runs))]
    mask_s = [min(m) for m in zip(*(r[1] for r in runs))]
    advance_s = [min(a) for a in zip(*(r[2] for r in runs))]
    failures = runs[0][3]
    return _summary(lib, cases, compile_s, mask_s, advance_s, failures)


def _one_pass(lib, cases, tok) -> tuple[list[float], list[float], list[float], list[str]]:
    compile_s: list[float] = []
    mask_s: list[float] = []
    advance_s: list[float] = []
    failures: list[str] = []
    for case in cases:
        text = json.dumps(case.instance, separators=SEPARATORS, ensure_ascii=False)
        tokens = tok.encode(text, add_special_tokens=False) + tok.eos_token_ids[:1]
        t0 = time.perf_counter()
        try:
            matcher = lib.compile(case.schema)
        except Exception as exc:  # a schema the library cannot compile
            failures.append(f"{case.name}: compile: {str(exc)[:120]}")
            continue
        compile_s.append(time.perf_counter() - t0)
        for i, token in enumerate(tokens):
            t1 = time.perf_counter()
            lib.fill(matcher)
            t2 = time.perf_counter()
            if not lib.allowed(token):
                failures.append(f"{case.name}: token {i} ({tok.decode([token])!r}) masked out")
                break
            ok = lib.advance(matcher, token) if i < len(tokens) - 1 else True  # the last is EOS
            t3 = time.perf_counter()
            if not ok:
                failures.append(f"{case.name}: token {i} refused")
                break
            mask_s.append(t2 - t1)
            advance_s.append(t3 - t2)
    return compile_s, mask_s, advance_s, failures


def _summary(lib, cases, compile_s, mask_s, advance_s, failures) -> dict:
    per_token = [m + a for m, a in zip(mask_s, advance_s)]
    return {
        "library": lib.name,
        "schemas": len(cases),
        "failures": failures,
        "tokens": len(per_token),
        "compile_ms_p50": statistics.median(compile_s) * 1e3 if compile_s else None,
        "compile_ms_max": max(compile_s) * 1e3 if compile_s else None,
        "mask_us_mean": statistics.fmean(mask_s) * 1e6 if mask_s else None,
        "mask_us_p50": statistics.median(mask_s) * 1e6 if mask_s else None,
        "mask_us_p99": pct(mask_s, 0.99) * 1e6 if mask_s else None,
        "advance_us_mean": statistics.fmean(advance_s) * 1e6 if advance_s else None,
        "per_token_us_mean": statistics.fmean(per_token) * 1e6 if per_token else None,
        "per_token_us_p99": pct(per_token, 0.99) * 1e6 if per_token else None,
        "per_token_us_max": max(per_token) * 1e6 if per_token else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF whose tokenizer to use (default SmolLM2-135M-Instruct)")
    p.add_argument("--schemas", type=int, default=50)
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--repeats", type=int, default=3, help="passes; each step's minimum over them is reported")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model or default_model_path())
    cases = SCHEMAS[: args.schemas]
    results = []
    for name in args.libs.split(","):
        t0 = time.perf_counter()
        lib = LIBS[name](tok)
        setup = time.perf_counter() - t0
        result = {"tokenizer_setup_s": setup, **measure(lib, cases, tok, args.repeats)}
        results.append(result)
        print(json.dumps(result), flush=True)
    print()
    print("| library | tokenizer set-up s | compile ms p50 / max | mask µs mean / p50 / p99 | advance µs mean | per token µs mean / p99 / max | schemas failed |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        def f(key: str, digits: int = 0) -> str:
            v = r.get(key)
            return "–" if v is None else f"{v:.{digits}f}"

        print(
            f"| {r['library']} | {r['tokenizer_setup_s']:.2f} | {f('compile_ms_p50', 1)} / {f('compile_ms_max', 1)} | "
            f"{f('mask_us_mean')} / {f('mask_us_p50')} / {f('mask_us_p99')} | {f('advance_us_mean')} | "
            f"{f('per_token_us_mean')} / {f('per_token_us_p99')} / {f('per_token_us_max')} | {len(r['failures'])} |"
        )
    for r in results:
        for failure in r["failures"][:10]:
            print(f"{r['library']}: {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
