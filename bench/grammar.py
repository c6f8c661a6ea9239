"""JSON answers at the edge: the 50 schemas of ``bench/grammar_schemas.py`` (increasing
complexity) through the engine on SmolLM2, constrained, against the same prompts without a
constraint, in one run.

    .venv/bin/python bench/grammar.py [--schemas 50] [--dtype auto] [--max-tokens 2048] [--step-every 5] [--json OUT]

For each schema, one request at a time (greedy):

- constrained: ``response_format: json_schema`` (strict) with the schema, the prompt asking
  for a JSON object that follows it (the schema is in the prompt, as users are told to
  do); the output is checked with ``jsonschema``: the goal is 100 % valid;
- the same, with jump-forward off (every forced token sampled in a step of its own), for
  every ``--step-every``-th schema: the cost of masking alone;
- unconstrained: the same prompt, no ``response_format``, ``ignore_eos`` and ``max_tokens``
  equal to the constrained answer's length: the same number of tokens decoded freely.

Decode tokens/s per mode = output tokens after the first / the engine's decode time (its
``StageTimes``: first token to last), summed over the schemas; the goal is constrained >=
80 % of unconstrained. The mask cost is timed inside the engine: per constrained row and
step, filling its bitmask (llguidance) and applying it to the logits (``ModelRunner``
``_constrain``), and advancing its matcher by the accepted token (``Matcher.advance``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grammar_schemas import SCHEMAS  # noqa: E402
from edge_engine import Engine, EngineConfig, OpenAIServing  # noqa: E402
from edge_engine import grammar as grammar_module  # noqa: E402
from edge_engine import runner as runner_module  # noqa: E402


class MaskTimer:
    """Times ``ModelRunner._constrain`` (per masked row) and ``Matcher.advance``."""

    def __init__(self) -> None:
        self.constrain_s = 0.0
        self.rows = 0
        self.advance_s = 0.0
        self.advances = 0
        constrain, advance = runner_module.ModelRunner._constrain, grammar_module.Matcher.advance
        timer = self

        def timed_constrain(runner, logits, seqs):
            rows = sum(1 for s in seqs if s.constraint is not None)
            t0 = time.perf_counter()
            constrain(runner, logits, seqs)
            timer.constrain_s += time.perf_counter() - t0
            timer.rows += rows

        def timed_advance(matcher, token):
            t0 = time.perf_counter()
            try:
                return advance(matcher, token)
            finally:
                timer.advance_s += time.perf_counter() - t0
                timer.advances += 1

        runner_module.ModelRunner._constrain = timed_constrain
        grammar_module.Matcher.advance = timed_advance

    def reset(self) -> None:
        self.constrain_s = self.advance_s = 0.0
        self.rows = self.advances = 0


def prompt(schema: dict) -> list[dict]:
    return [{
        "role": "user",
        "content": "Answer with one JSON object, with realistic values, that follows this JSON schema:\n"
        + json.dumps(schema),
    }]


async def one(serving: OpenAIServing, body: dict) -> dict:
    prepared = serving.prepare("chat", body)
    answer = json.loads(await serving.complete(prepared, "chatcmpl-bench"))
    times = prepared.times
    choice = answer["choices"][0]
    return {
        "text": choice["message"]["content"],
        "finish": choice["finish_reason"],
        "tokens": answer["usage"]["completion_tokens"],
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "decode_s": times.decode if times else 0.0,
        "prefill_s": times.prefill if times else 0.0,
    }


def rate(results: list[dict]) -> float:
    tokens = sum(max(0, r["tokens"] - 1) for r in results)
    seconds = sum(r["decode_s"] for r in results)
    return tokens / seconds if seconds else 0.0


async def main_async(args) -> dict:
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=8192, max_num_batched_tokens=512))
    await engine.start()
    serving = OpenAIServing(engine, "smollm2")
    timer = MaskTimer()
    cases = SCHEMAS[: args.schemas]
    rows = []
    mask = {"jump": [0.0, 0, 0.0, 0], "step": [0.0, 0, 0.0, 0]}
    try:
        for case in cases:
            base = {"messages": prompt(case.schema), "temperature": 0, "max_tokens": args.max_tokens}
            constrained_body = {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": case.schema, "strict": True}}}
            row: dict = {"schema": case.name}
            modes = [("jump", True)] + ([("step", False)] if case.index % args.step_every == 0 else [])
            for mode, jump in modes:
                engine.jump_forward = jump
                timer.reset()
                result = await one(serving, constrained_body)
                m = mask[mode]
                m[0] += timer.constrain_s
                m[1] += timer.rows
                m[2] += timer.advance_s
                m[3] += timer.advances
                try:
                    jsonschema.validate(json.loads(result["text"]), case.schema)
                    result["valid"] = True
                except (ValueError, jsonschema.ValidationError) as exc:
                    result["valid"] = False
                    result["error"] = str(exc)[:200]
                row[mode] = result
            engine.jump_forward = True
            row["free"] = await one(serving, {**base, "max_tokens": max(row["jump"]["tokens"], 2), "ignore_eos": True})
            rows.append(row)
            step = row.get("step", {})
            print(
                f"{case.name}: valid={row['jump']['valid']}/{step.get('valid', '-')} tokens={row['jump']['tokens']}/"
                f"{step.get('tokens', '-')}/{row['free']['tokens']} prompt={row['jump']['prompt_tokens']} "
                f"finish={row['jump']['finish']}/{step.get('finish', '-')} decode_s={row['jump']['decode_s']:.2f}/"
                f"{step.get('decode_s', 0):.2f}/{row['free']['decode_s']:.2f}",
                flush=True,
            )
    finally:
        await engine.close()
    stepped = [r for r in rows if "step" in r]
    summary = {
        "schemas": len(rows),
        "schemas_stepped": len(stepped),
        "dtype": engine.runner.dtype_name,
        "valid_jump": sum(r["jump"]["valid"] for r in rows),
        "valid_step": sum(r["step"]["valid"] for r in stepped),
        "tok_s_free": rate([r["free"] for r in rows]),
        "tok_s_constrained_jump": rate([r["jump"] for r in rows]),
        # the stepped runs against the free runs of the same schemas
        "tok_s_constrained_step": rate([r["step"] for r in stepped]),
        "tok_s_free_stepped_schemas": rate([r["free"] for r in stepped]),
        "tokens_jump": sum(r["jump"]["tokens"] for r in rows),
        "tokens_step": sum(r["step"]["tokens"] for r in stepped),
        "mask_us_per_row_jump": mask["jump"][0] / max(1, mask["jump"][1]) * 1e6,
        "mask_us_per_row_step": mask["step"][0] / max(1, mask["step"][1]) * 1e6,
        "advance_us_step": mask["step"][2] / max(1, mask["step"][3]) * 1e6,
        "decode_ms_per_token_free": 1e3 / max(1e-9, rate([r["free"] for r in rows])),
        "prefill_s_median": statistics.median(r["jump"]["prefill_s"] for r in rows),
    }
    summary["ratio_jump"] = summary["tok_s_constrained_jump"] / summary["tok_s_free"]
    summary["ratio_step"] = summary["tok_s_constrained_step"] / max(1e-9, summary["tok_s_free_stepped_schemas"])
    return {"summary": summary, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--schemas", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--step-every", type=int, default=5, help="also run every N-th schema with jump-forward off")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    s = out["summary"]
    print()
    print(json.dumps(s, indent=1))
    print()
    print("| mode | valid | output tokens | decode tok/s | vs unconstrained | mask µs per row-step | advance µs |")
    print("|---|---|---|---|---|---|---|")
    print(f"| unconstrained (same lengths) | – | {s['tokens_jump']} | {s['tok_s_free']:.1f} | 1.00 | – | – |")
    print(f"| constrained, jump-forward | {s['valid_jump']}/{s['schemas']} | {s['tokens_jump']} | {s['tok_s_constrained_jump']:.1f} | {s['ratio_jump']:.2f} | {s['mask_us_per_row_jump']:.0f} | – |")
    print(f"| constrained, every token sampled ({s['schemas_stepped']} schemas) | {s['valid_step']}/{s['schemas_stepped']} | {s['tokens_step']} | {s['tok_s_constrained_step']:.1f} | {s['ratio_step']:.2f} (vs {s['tok_s_free_stepped_schemas']:.1f}) | {s['mask_us_per_row_step']:.0f} | {s['advance_us_step']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
