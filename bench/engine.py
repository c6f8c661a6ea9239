"""Edge engine benchmark: the engine vs transformers ``generate()`` on the same model, same run.

    .venv/bin/python bench/engine.py [--model PATH] [--repeats 3] [--new-tokens 128]

Reports (medians over repeats):
- single-stream decode tok/s: transformers fp32 vs the engine in float32 and in bf16 (bf16
  weights, fp32 activations, fp32 output layer), and the memory-bandwidth bound
  (bytes of weights read per token / measured 2-thread read bandwidth);
- aggregate tok/s with 16 concurrent streams of mixed prompt lengths, vs own single stream;
- TTFT with a repeated ~1,000-token system prompt, prefix caching on vs off;
- peak resident memory; and the same engine figures on CUDA when a GPU is present.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from edge_engine.loader import load_model  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue, and what makes sunsets red and orange."


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def read_bandwidth_gbs(num_bytes: int = 540 * 2**20) -> float:
    """Best-of-5 time to read ``num_bytes`` of float32 with torch's threads (a sum)."""
    big = torch.ones(num_bytes // 4)
    big.sum()
    best = min(_timed(big.sum) for _ in range(5))
    del big
    return num_bytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_token(engine: Engine) -> int:
    """Bytes of weights one decode step reads (all blocks + norm + output layer; not the embedding row)."""
    total = 0
    for name, p in engine.runner.model.named_parameters():
        if name == "tok_embeddings":
            continue
        total += p.numel() * p.element_size()
    return total


# -- transformers reference -----------------------------------------------------------------
def build_reference(path: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    loaded = load_model(path)
    c = loaded.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.float().eval(), loaded.tokenizer


def hf_tok_s(model, prompt_ids: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=2,
        )
        elapsed = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == new_tokens
    return new_tokens / elapsed


# -- engine runs -------------------------------------------------------------------------
async def one_stream(engine: Engine, prompt, new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    n = 0
    async for delta in engine.generate(prompt, params):
        n += len(delta.token_ids)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": n, "elapsed": end - t0, "ttft": first - t0, "decode_tok_s": (n - 1) / (end - first)}


async def engine_single(engine: Engine, prompt_ids, new_tokens: int, repeats: int) -> dict:
    await one_stream(engine, prompt_ids, 8)  # warm-up
    runs = [await one_stream(engine, prompt_ids, new_tokens) for _ in range(repeats)]
    return {
        "tok_s": statistics.median(r["tokens"] / r["elapsed"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
    }


async def engine_concurrent(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    t = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(engine, p, new_tokens) for p in prompts))
    elapsed = time.perf_counter() - t
    return {
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
        "aggregate_tok_s": sum(r["tokens"] for r in runs) / elapsed,
        "decode_phase_tok_s": sum(r["decode_tok_s"] for r in runs),  # all streams decoding at once
        "ttft_ms_p50": statistics.median(r["ttft"] for r in runs) * 1000,
        "per_stream_decode_tok_s_p50": statistics.median(r["decode_tok_s"] for r in runs),
    }


async def prefix_ttft(engine: Engine, system: str, repeats: int) -> float:
    tok = engine.tokenizer
    ttfts = []
    for i in range(repeats + 1):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        r = await one_stream(engine, tok.encode_chat(messages), 1)
        if i > 0:  # the first request fills the cache (or, without caching, warms up)
            ttfts.append(r["ttft"])
    return statistics.median(ttfts) * 1000


def mixed_prompts(tok, n: int) -> list[list[int]]:
    base = tok.encode(" ".join([QUESTION] * 40))
    lengths = [32 + (i * 97) % 257 for i in range(n)]  # 32 .. 288 tokens, spread (mean ~160)
    return [base[i : i + length] for i, length in enumerate(lengths)]


def make_engine(path: str | None, dtype: str, device: str) -> Engine:
    return Engine(EngineConfig(model=path, dtype=dtype, device=device, num_kv_blocks=1024, max_num_seqs=16))


async def bench_concurrent(engine: Engine, args) -> dict:
    concurrent = await engine_concurrent(engine, mixed_prompts(engine.tokenizer, 16), args.new_tokens)
    return {"dtype": engine.runner.dtype_name, "device": str(engine.device), **concurrent}


async def bench_prefix(path: str | None, args) -> dict:
    out = {}
    system = None
    for caching in (False, True):
        engine = Engine(EngineConfig(model=path, dtype="float32", num_kv_blocks=512, enable_prefix_caching=caching))
        await engine.start()
        try:
            tok = engine.tokenizer
            if system is None:
                words = (QUESTION + " ") * 60
                ids = tok.encode(words)[:1000]
                system = tok.decode(ids)
                out["system_prompt_tokens"] = len(tok.encode(system))
            out["ttft_ms_cached" if caching else "ttft_ms_uncached"] = await prefix_ttft(engine, system, args.repeats + 2)
            out["hit_rate_cached" if caching else "hit_rate_uncached"] = engine.stats().prefix_cache_hit_rate
        finally:
            await engine.close()
            del engine
            gc.collect()
    out["speedup"] = out["ttft_ms_uncached"] / out["ttft_ms_cached"]
    return out


async def main_async(args) -> dict:
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "new_tokens": args.new_tokens}
    results["read_bandwidth_gbs"] = read_bandwidth_gbs()
    rss0 = rss_mib()
    engines = {dtype: make_engine(args.model, dtype, "cpu") for dtype in ("float32", "bf16")}
    results["rss_mib_two_engines_loaded"] = rss_mib() - rss0
    model, tok = build_reference(args.model or EngineConfig().model_path)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    results["prompt_tokens"] = len(prompt)
    for engine in engines.values():
        await engine.start()
        await one_stream(engine, prompt, 8)  # warm-up
    hf_tok_s(model, prompt, 8)

    # single stream, interleaved so that the three see the same machine load
    hf_runs: list[float] = []
    runs: dict[str, list[dict]] = {d: [] for d in engines}
    for _ in range(args.repeats):
        hf_runs.append(hf_tok_s(model, prompt, args.new_tokens))
        for dtype, engine in engines.items():
            runs[dtype].append(await one_stream(engine, prompt, args.new_tokens))
    del model
    gc.collect()
    results["transformers_tok_s"] = statistics.median(hf_runs)
    results["engine"] = {}
    for dtype, engine in engines.items():
        r = {
            "dtype": engine.runner.dtype_name,
            "tok_s": statistics.median(x["tokens"] / x["elapsed"] for x in runs[dtype]),
            "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs[dtype]),
            "weight_bytes_per_token": weight_bytes_per_token(engine),
        }
        r["vs_transformers"] = r["tok_s"] / results["transformers_tok_s"]
        r["bandwidth_bound_tok_s"] = results["read_bandwidth_gbs"] * 1e9 / r["weight_bytes_per_token"]
        r["fraction_of_bound"] = r["decode_tok_s"] / r["bandwidth_bound_tok_s"]
        results["engine"][dtype] = r
        print(json.dumps({dtype: r}), flush=True)

    # 16 concurrent streams of mixed prompt lengths
    for dtype, engine in engines.items():
        c = await bench_concurrent(engine, args)
        r = results["engine"][dtype]
        r.update(c)
        r["aggregate_over_single"] = c["aggregate_tok_s"] / r["tok_s"]
        print(json.dumps({dtype: c}), flush=True)
        await engine.close()
    del engines, engine
    gc.collect()
    results["peak_rss_mib_engines"] = peak_rss_mib()

    results["prefix"] = await bench_prefix(args.model, args)
    print(json.dumps({"prefix": results["prefix"]}), flush=True)
    results["peak_rss_mib"] = peak_rss_mib()

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        engine = make_engine(args.model, "bf16", "cuda")
        await engine.start()
        try:
            cuda = await engine_single(engine, prompt, args.new_tokens, args.repeats)
            cuda.update(await bench_concurrent(engine, args))
        finally:
            await engine.close()
        cuda["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        cuda["gpu"] = torch.cuda.get_device_name()
        results["cuda"] = cuda
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    e32, e16 = results["engine"]["float32"], results["engine"]["bf16"]
    print("\n| | tok/s (median) | vs transformers | decode tok/s | % of bandwidth bound | 16 streams tok/s | x own single |")
    print("|---|---|---|---|---|---|---|")
    print(f"| transformers generate() fp32 | {results['transformers_tok_s']:.1f} | 1.00x | | | | |")
    for name, r in (("engine float32", e32), ("engine bf16 weights", e16)):
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['vs_transformers']:.2f}x | {r['decode_tok_s']:.1f} | "
            f"{100 * r['fraction_of_bound']:.0f}% of {r['bandwidth_bound_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} | "
            f"{r['aggregate_over_single']:.1f}x |"
        )
    pf = results["prefix"]
    print(
        f"\nTTFT, {pf['system_prompt_tokens']}-token system prompt: {pf['ttft_ms_uncached']:.0f} ms without prefix caching, "
        f"{pf['ttft_ms_cached']:.0f} ms with ({pf['speedup']:.1f}x lower)"
    )
    print(
        f"RSS of both CPU engines after loading (weights + 2 x {1024 * 16}-token KV pools): "
        f"{results['rss_mib_two_engines_loaded']:.0f} MiB; peak RSS of the run {results['peak_rss_mib']:.0f} MiB"
    )
    if "cuda" in results:
        c = results["cuda"]
        print(
            f"CUDA ({c['gpu']}, bf16): single stream {c['tok_s']:.1f} tok/s, 16 streams {c['aggregate_tok_s']:.1f} tok/s, "
            f"peak GPU memory {c['peak_gpu_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
