"""Edge engine benchmark: each CPU mode of the engine against transformers ``generate()`` and
llama.cpp on the same model, in one run.

    .venv/bin/python bench/engine.py [--model PATH] [--repeats 3] [--new-tokens 128]
        [--modes float32,bf16,int8,int4,int4-a8] [--llama-cpp DIR|off] [--json OUT]

llama.cpp is measured when ``llama_cpp`` imports (``llama-cpp-python`` 0.3.36 built from
source: cmake, several minutes on 2 cores), from the environment or from a directory of its
own given with ``--llama-cpp``:

    .venv/bin/python -m pip install --no-deps --target /tmp/llama-cpp-py llama-cpp-python==0.3.36 diskcache
    .venv/bin/python bench/engine.py --llama-cpp /tmp/llama-cpp-py

It runs the same GGUF file with as many threads as torch uses.

One OpenMP pool at a time: torch and llama.cpp share one libgomp, which gives every thread
that runs a parallel region its own pool of workers for the thread's life, and stops letting
idle workers spin once the process holds more of them than CPUs -- which roughly halves
batch-1 decode speed for whoever runs.  So every contender runs on a thread that ends with
its measurement (``in_thread``), and each engine's step thread is started for its
measurement and closed after it (``running``).

Reports (medians over repeats, every contender measured in the same run, interleaved repeat
by repeat):

- the candidate kernels on SmolLM2's shapes (30 layers of distinct weights, so they come
  from memory as in a decode step), 1, 16 and 512 rows: float32 ``F.linear``, PyTorch's
  ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` (bf16 activations: their
  float32 paths are scalar), and ``edge_engine.kernels`` (float32 and 8-bit activations)
  (``--kernels-only`` runs just this);
- single-stream decode tok/s (128 new tokens after a ~50-token chat prompt) and TTFT, each
  mode against transformers fp32 and llama.cpp, with the memory-bandwidth bound of each mode;
- aggregate tok/s with 16 concurrent streams of mixed prompt lengths, against the mode's own
  single stream;
- prefill: TTFT of fresh ~1,000-token prompts per mode and llama.cpp's prompt processing;
- answers: greedy outputs of 50 fixed prompts against float32 (share identical, first
  divergence) and perplexity on a held-out text (``edge_engine/quality.py``), for each
  mode and llama.cpp;
- a decode step's breakdown per mode: the whole step, its linear layers alone, the rest;
- TTFT with a repeated ~1,000-token system prompt, prefix caching on vs off;
- resident memory; and the engine on CUDA when a GPU is present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from edge_engine.loader import load_model  # noqa: E402
from edge_engine.sequence import Sequence  # noqa: E402
from edge_engine.quality import HELDOUT_TEXT, PROMPTS, agreement, greedy_outputs, perplexity  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue, and what makes sunsets red and orange."
FRANCE = "What is the capital of France?"
QUALITY_TOKENS = 48


def in_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread that ends with it (its OpenMP pool goes with it)."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args, **kwargs)))
        except BaseException as exc:
            result.append((False, exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


@contextlib.asynccontextmanager
async def running(engine: Engine, warmup_prompt: list[int]):
    """The engine's step thread for one measurement (then closed: its pool goes too)."""
    await engine.start()
    try:
        await one_stream(engine, warmup_prompt, 8)
        yield engine
    finally:
        await engine.close()


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
    """Bytes of weights one decode step reads: the blocks, the final norm and the output
    layer (not the embedding table, of which it reads one row)."""
    model = engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not model.tok_embeddings)


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
    return model.float().eval()


def hf_run(model, prompt_ids: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=2,
        )
        elapsed = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == new_tokens
    return {"tokens": new_tokens, "elapsed": elapsed}


# -- llama.cpp ------------------------------------------------------------------------------
class LlamaCpp:
    """llama-cpp-python on the same GGUF, greedy, ``threads`` threads."""

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp

        self.module = llama_cpp
        self.path = path
        self.threads = threads
        self.llm = llama_cpp.Llama(
            model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=4096, n_batch=512, verbose=False
        )
        self.version = getattr(llama_cpp, "__version__", "?")

    def run(self, prompt_ids: list[int], new_tokens: int, stop_at_eos: bool = False) -> dict:
        t0 = time.perf_counter()
        first = None
        tokens: list[int] = []
        for token in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter()
            if len(tokens) == new_tokens or (stop_at_eos and token == self.llm.token_eos()):
                break
        end = time.perf_counter()
        return {
            "tokens": len(tokens),
            "elapsed": end - t0,
            "ttft": first - t0,
            "decode_tok_s": (len(tokens) - 1) / (end - first) if len(tokens) > 1 else float("nan"),
            "ids": tokens,
        }

    def perplexity(self, token_ids: list[int]) -> float:
        llm = self.module.Llama(
            model_path=self.path, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=len(token_ids) + 8,
            n_batch=512, logits_all=True, verbose=False,
        )
        llm.eval(token_ids)
        logits = torch.from_numpy(llm.scores[: len(token_ids) - 1].copy())  # [n - 1, V]
        targets = torch.tensor(token_ids[1:])
        nll = -torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).sum().item()
        del llm
        return math.exp(nll / (len(token_ids) - 1))


# -- engine runs ----------------------------------------------------------------------------
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


def mixed_prompts(tok, n: int) -> list[list[int]]:
    base = tok.encode(" ".join([QUESTION] * 40))
    lengths = [32 + (i * 97) % 257 for i in range(n)]  # 32 .. 288 tokens, spread (mean ~150)
    return [base[i : i + length] for i, length in enumerate(lengths)]


def long_prompts(tok, n: int, length: int = 1000) -> list[list[int]]:
    """``n`` different ``length``-token prompts (different first blocks: no cache hits)."""
    words = tok.encode(" ".join([HELDOUT_TEXT] * 3))
    assert len(words) >= 7 * n + length
    return [words[7 * i : 7 * i + length] for i in range(n)]


def make_engine(path: str | None, dtype: str, device: str = "cpu", **overrides) -> Engine:
    # no TPOT objectives: this measures what the engine can do, not what its admission lets in
    # (with them, 16 float32 streams are refused: a step of 16 rows is past 100 ms)
    options = dict(model=path, dtype=dtype, device=device, num_kv_blocks=1024, max_num_seqs=16, tpot_ms={})
    options.update(overrides)
    return Engine(EngineConfig(**options))


# -- kernels on the model's shapes ----------------------------------------------------------
def bench_kernels(config, repeats: int = 15) -> dict:
    """ms per decode token for the linear layers of all blocks and for the output layer, each
    candidate kernel on its own copy of the weights (random, SmolLM2's shapes), p50 of
    ``repeats`` sweeps, the candidates interleaved."""
    from edge_engine import kernels

    hidden, ffn, layers = config.hidden_size, config.intermediate_size, config.num_layers
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(qkv, hidden), (hidden, config.num_heads * config.head_dim), (2 * ffn, hidden), (hidden, ffn)]
    gen = torch.Generator().manual_seed(0)

    def weights(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=gen) * 0.05

    def int8pack(w: torch.Tensor):
        scale = w.abs().amax(dim=1) / 127
        return torch.round(w / scale[:, None]).to(torch.int8), scale.bfloat16()

    def int4pack(w: torch.Tensor):
        n, k = w.shape
        g = w.view(n, k // 32, 32)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = ((hi - lo) / 15).clamp(min=1e-6)
        q = torch.round((g - lo) / s).clamp(0, 15).to(torch.int32).view(n, k)
        sz = torch.cat([s, lo + 8 * s], dim=-1).transpose(0, 1).contiguous().bfloat16()  # [k/32, n, 2]
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz

    def q4(w: torch.Tensor):
        return kernels.q4_tiles(*kernels.pack_q4(w)), w.shape[0]

    def q8(w: torch.Tensor):
        return kernels.q8_tiles(*kernels.pack_q8(w)), w.shape[0]

    candidates = {
        "float32 F.linear": (lambda w: (w,), lambda x, t: F.linear(x, t[0])),
        "aten int8pack (bf16 x)": (int8pack, lambda x, t: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), *t)),
        "aten int4pack (bf16 x)": (int4pack, lambda x, t: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), t[0], 32, t[1])),
        "edge_engine Q4/Q8 (float32 x)": (q4, lambda x, t: kernels.q4_linear(x, t[0], t[1])),
        "edge_engine Q4/Q8 (8-bit x)": (q4, lambda x, t: kernels.q4_linear(x, t[0], t[1], True)),
    }
    out: dict[str, dict] = {}
    for rows in (1, 16, 512):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        built = {}
        for name, (pack, _) in candidates.items():
            blocks = [[pack(weights(n, k)) for n, k in shapes] for _ in range(layers)]
            head_pack = q8 if name.startswith("edge_engine") else pack
            built[name] = (blocks, head_pack(weights(config.vocab_size, hidden)))
        times = {name: ([], []) for name in candidates}
        for r in range(repeats + 2 if rows < 512 else 3):
            for name, (_, run) in candidates.items():
                blocks, head = built[name]
                t = time.perf_counter()
                for layer in blocks:
                    for (n, k), packed in zip(shapes, layer):
                        run(xs[k], packed)
                t1 = time.perf_counter()
                if name.startswith("edge_engine"):
                    kernels.q8_linear(xs[hidden], head[0], head[1], "8-bit" in name)
                else:
                    run(xs[hidden], head)
                if r >= (2 if rows < 512 else 1):
                    times[name][0].append(t1 - t)
                    times[name][1].append(time.perf_counter() - t1)
        for name, (b, h) in times.items():
            out.setdefault(name, {})[f"batch{rows}"] = {
                "blocks_ms": statistics.median(b) * 1000,
                "output_ms": statistics.median(h) * 1000,
            }
        del built
        gc.collect()
    return out


def print_kernels(table: dict) -> None:
    print(
        "\n| ms per step (p50) | blocks, batch 1 | output layer, batch 1 | blocks, batch 16 | output layer, batch 16 "
        "| blocks, 512 rows (prefill chunk) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in table.items():
        b1, b16, b512 = r["batch1"], r["batch16"], r["batch512"]
        cells = [b1["blocks_ms"], b1["output_ms"], b16["blocks_ms"], b16["output_ms"], b512["blocks_ms"]]
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


# -- a decode step's breakdown --------------------------------------------------------------
def step_breakdown(engine: Engine, prompt_ids: list[int], steps: int = 40) -> dict:
    """p50 ms of one batch-1 decode step (runner.run, ~60-token context), of its linear layers
    alone (each called once on a random row), and, for int4, of the same step through
    model.py's layers instead of the fused C++ decoder."""
    runner, bm, model = engine.runner, engine.block_manager, engine.runner.model

    def fresh() -> Sequence:
        seq = Sequence(prompt_ids, SamplingParams(temperature=0))
        bm.allocate(seq, len(prompt_ids))
        runner.run([(seq, len(prompt_ids))])
        seq.num_computed_tokens = len(prompt_ids)
        return seq

    def linears() -> None:
        hidden, ffn = model.config.hidden_size, model.config.intermediate_size
        x, x2 = torch.randn(1, hidden), torch.randn(1, ffn)
        with torch.inference_mode():
            for layer in model.layers:
                layer.attention.wqkv(x)
                layer.attention.wo(torch.randn(1, model.config.num_heads * model.config.head_dim))
                layer.feed_forward.w13(x)
                layer.feed_forward.w2(x2)
            model.output(x)

    variants = {"step": None}
    if getattr(model, "decoder", None) is not None:
        variants["step_layer_by_layer"] = "unfused"
    times: dict[str, list[float]] = {name: [] for name in [*variants, "linears"]}
    seq = fresh()
    for i in range(steps + 3):
        for name, how in variants.items():
            decoder = model.decoder if how == "unfused" else None
            if how == "unfused":
                model.decoder = None
            seq.token_ids.append(100)
            bm.allocate(seq, 1)
            t = time.perf_counter()
            runner.run([(seq, 1)])
            elapsed = time.perf_counter() - t
            seq.num_computed_tokens += 1
            if how == "unfused":
                model.decoder = decoder
            if i >= 3:
                times[name].append(elapsed)
            if seq.num_tokens > len(prompt_ids) + 40:
                bm.free(seq)
                seq = fresh()
        t = time.perf_counter()
        linears()
        if i >= 3:
            times["linears"].append(time.perf_counter() - t)
    bm.free(seq)
    out = {f"{name}_ms_p50": statistics.median(v) * 1000 for name, v in times.items()}
    out["rest_ms_p50"] = out["step_ms_p50"] - out["linears_ms_p50"]
    return out


# -- sections -------------------------------------------------------------------------------
async def bench_single(engines: dict[str, Engine], hf_model, llama: LlamaCpp | None, prompt: list[int], args) -> dict:
    """Single stream, every contender once per repeat, interleaved (same machine load)."""
    runs: dict[str, list[dict]] = {name: [] for name in ["transformers", *(["llama.cpp"] if llama else []), *engines]}
    in_thread(hf_run, hf_model, prompt, 8)  # warm-ups
    if llama:
        in_thread(llama.run, prompt, 8)
    for _ in range(args.repeats):
        runs["transformers"].append(in_thread(hf_run, hf_model, prompt, args.new_tokens))
        if llama:
            runs["llama.cpp"].append(in_thread(llama.run, prompt, args.new_tokens))
        for mode, engine in engines.items():
            async with running(engine, prompt):
                runs[mode].append(await one_stream(engine, prompt, args.new_tokens))
    out = {}
    for name, rs in runs.items():
        out[name] = {"tok_s": statistics.median(r["tokens"] / r["elapsed"] for r in rs)}
        if name != "transformers":
            out[name]["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in rs)
            out[name]["ttft_ms"] = statistics.median(r["ttft"] for r in rs) * 1000
        out[name]["runs_tok_s"] = [r["tokens"] / r["elapsed"] for r in rs]
    for name in runs:
        out[name]["vs_transformers"] = out[name]["tok_s"] / out["transformers"]["tok_s"]
        if llama:
            out[name]["vs_llama_cpp"] = out[name]["tok_s"] / out["llama.cpp"]["tok_s"]
    return out


async def bench_prefill(engines: dict[str, Engine], llama: LlamaCpp | None, args) -> dict:
    """TTFT of fresh ~1,000-token prompts (1 new token; a new prompt every time, so nothing
    comes from the prefix cache), modes and llama.cpp (its prompt processing, n_batch 512)
    interleaved."""
    tok = next(iter(engines.values())).tokenizer
    prompts = iter(long_prompts(tok, args.repeats * (len(engines) + 1)))
    ttfts: dict[str, list[float]] = {mode: [] for mode in engines}
    if llama:
        ttfts["llama.cpp"] = []
    for _ in range(args.repeats):
        if llama:
            ttfts["llama.cpp"].append(in_thread(llama.run, next(prompts), 1)["ttft"])
        for mode, engine in engines.items():
            async with running(engine, tok.encode(QUESTION)):
                ttfts[mode].append((await one_stream(engine, next(prompts), 1))["ttft"])
    n = len(long_prompts(tok, 1)[0])
    return {
        mode: {"prompt_tokens": n, "ttft_ms": statistics.median(v) * 1000, "prefill_tok_s": n / statistics.median(v)}
        for mode, v in ttfts.items()
    }


async def bench_quality(engines: dict[str, Engine], llama: LlamaCpp | None) -> dict:
    """Greedy outputs of the 50 prompts against float32's, and held-out perplexity."""
    tok = engines["float32"].tokenizer
    heldout = tok.encode(HELDOUT_TEXT)
    outputs: dict[str, list[list[int]]] = {}
    out: dict[str, dict] = {}
    for mode, engine in engines.items():
        out[mode] = {"perplexity": in_thread(perplexity, engine, heldout)}
        async with running(engine, tok.encode(QUESTION)):
            outputs[mode] = await greedy_outputs(engine, PROMPTS, QUALITY_TOKENS)
    if llama:
        ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        outputs["llama.cpp"] = in_thread(lambda: [llama.run(p, QUALITY_TOKENS, stop_at_eos=True)["ids"] for p in ids])
        out["llama.cpp"] = {"perplexity": in_thread(llama.perplexity, heldout)}
    reference_ppl = out["float32"]["perplexity"]
    for name, result in out.items():
        result.update(agreement(outputs[name], outputs["float32"]).as_dict())
        result["perplexity_vs_float32"] = result["perplexity"] / reference_ppl - 1
        result["france"] = tok.decode(outputs[name][PROMPTS.index(FRANCE)])
    out["heldout_tokens"] = len(heldout)
    return out


async def bench_prefix(path: str | None, dtype: str, args) -> dict:
    out = {"dtype": dtype}
    system = None
    for caching in (False, True):
        engine = make_engine(path, dtype, num_kv_blocks=512, enable_prefix_caching=caching)
        await engine.start()  # the only engine alive (see the module docstring)
        try:
            tok = engine.tokenizer
            if system is None:
                ids = tok.encode((QUESTION + " ") * 60)[:1000]
                system = tok.decode(ids)
                out["system_prompt_tokens"] = len(tok.encode(system))
            ttfts = []
            for i in range(args.repeats + 3):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
                r = await one_stream(engine, tok.encode_chat(messages), 1)
                if i > 0:  # the first request fills the cache (or, without caching, warms up)
                    ttfts.append(r["ttft"])
            key = "cached" if caching else "uncached"
            out[f"ttft_ms_{key}"] = statistics.median(ttfts) * 1000
            out[f"hit_rate_{key}"] = engine.stats().prefix_cache_hit_rate
        finally:
            await engine.close()
            del engine
            gc.collect()
    out["speedup"] = out["ttft_ms_uncached"] / out["ttft_ms_cached"]
    return out


async def main_async(args) -> dict:
    path = args.model or EngineConfig().model_path
    modes = args.modes.split(",")
    assert "float32" in modes, "the answers are compared against float32"
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "new_tokens": args.new_tokens}
    results["read_bandwidth_gbs"] = in_thread(read_bandwidth_gbs)
    config = load_model(path).config
    results["kernels"] = in_thread(bench_kernels, config)
    print(json.dumps({"kernels": results["kernels"]}), flush=True)
    if args.kernels_only:
        return results
    engines: dict[str, Engine] = {}
    results["rss_mib_after_load"] = {}
    for mode in modes:
        before = rss_mib()
        engines[mode] = make_engine(args.model, mode)  # built on a thread of its own
        results["rss_mib_after_load"][mode] = rss_mib() - before
    llama = None
    if args.llama_cpp != "off":
        if args.llama_cpp:
            sys.path.insert(0, args.llama_cpp)
        try:
            llama = in_thread(LlamaCpp, path, torch.get_num_threads())
            results["llama_cpp_version"] = llama.version
        except ImportError as exc:
            print(f"llama.cpp: not measured ({exc}); see the module docstring", flush=True)
    hf_model = in_thread(build_reference, path)
    tok = engines["float32"].tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    results["prompt_tokens"] = len(prompt)

    # a decode step's breakdown (the step threads are not running: the runner is ours alone)
    results["step_breakdown"] = {mode: in_thread(step_breakdown, engine, prompt) for mode, engine in engines.items()}
    print(json.dumps({"step_breakdown": results["step_breakdown"]}), flush=True)

    results["single"] = await bench_single(engines, hf_model, llama, prompt, args)
    for mode, engine in engines.items():
        r = results["single"][mode]
        r["weight_bytes_per_token"] = weight_bytes_per_token(engine)
        r["bandwidth_bound_tok_s"] = results["read_bandwidth_gbs"] * 1e9 / r["weight_bytes_per_token"]
    print(json.dumps({"single": results["single"]}), flush=True)
    del hf_model
    gc.collect()

    results["concurrent"] = {}
    for mode, engine in engines.items():
        async with running(engine, prompt):
            c = await engine_concurrent(engine, mixed_prompts(tok, 16), args.new_tokens)
        c["aggregate_over_single"] = c["aggregate_tok_s"] / results["single"][mode]["tok_s"]
        results["concurrent"][mode] = c
        print(json.dumps({mode: c}), flush=True)

    results["prefill"] = await bench_prefill(engines, llama, args)
    print(json.dumps({"prefill": results["prefill"]}), flush=True)

    if not args.skip_quality:
        results["quality"] = await bench_quality(engines, llama)
        print(json.dumps({"quality": results["quality"]}, ensure_ascii=False), flush=True)

    del engines, llama
    gc.collect()
    results["peak_rss_mib_engines"] = peak_rss_mib()

    results["prefix"] = (
        {} if args.skip_prefix else {dtype: await bench_prefix(args.model, dtype, args) for dtype in ("float32", "int4") if dtype in modes}
    )
    print(json.dumps({"prefix": results["prefix"]}), flush=True)
    results["peak_rss_mib"] = peak_rss_mib()

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        engine = make_engine(args.model, "bf16", "cuda")
        await engine.start()
        try:
            runs = [await one_stream(engine, prompt, args.new_tokens) for _ in range(args.repeats)]
            cuda = {"tok_s": statistics.median(r["tokens"] / r["elapsed"] for r in runs)}
            cuda.update(await engine_concurrent(engine, mixed_prompts(tok, 16), args.new_tokens))
        finally:
            await engine.close()
        cuda["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        cuda["gpu"] = torch.cuda.get_device_name()
        results["cuda"] = cuda
    return results


def print_tables(results: dict) -> None:
    print_kernels(results["kernels"])
    if "single" not in results:
        return
    single, conc = results["single"], results["concurrent"]
    has_llama = "llama.cpp" in single
    llama_column = " vs llama.cpp |" if has_llama else ""
    print("\n| single stream | tok/s | vs transformers |" + llama_column + " decode tok/s | TTFT ms | bandwidth bound |")
    print("|---|---|---|" + ("---|" if has_llama else "") + "---|---|---|")
    for name, r in single.items():
        cells = [f"{r['tok_s']:.1f}", f"{r['vs_transformers']:.2f}x"]
        if has_llama:
            cells.append(f"{r['vs_llama_cpp']:.2f}x")
        cells += [f"{r.get('decode_tok_s', float('nan')):.1f}", f"{r.get('ttft_ms', float('nan')):.0f}"]
        cells.append(f"{r['bandwidth_bound_tok_s']:.0f}" if "bandwidth_bound_tok_s" in r else "")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| 16 streams | aggregate tok/s | x own single | decode-phase tok/s | TTFT p50 ms |")
    print("|---|---|---|---|---|")
    for mode, c in conc.items():
        cells = [f"{c['aggregate_tok_s']:.1f}", f"{c['aggregate_over_single']:.1f}x", f"{c['decode_phase_tok_s']:.1f}"]
        print(f"| {mode} | " + " | ".join(cells) + f" | {c['ttft_ms_p50']:.0f} |")
    prefill = results["prefill"]
    llama_pp = prefill.get("llama.cpp", {}).get("prefill_tok_s")
    print("\n| prefill (fresh ~1,000-token prompt) | TTFT ms | prefill tok/s | vs llama.cpp |")
    print("|---|---|---|---|")
    for mode, p in prefill.items():
        ratio = f"{p['prefill_tok_s'] / llama_pp:.2f}x" if llama_pp else ""
        print(f"| {mode} | {p['ttft_ms']:.0f} | {p['prefill_tok_s']:.0f} | {ratio} |")
    print("\n| decode step, batch 1 (p50 ms) | step | linear layers alone | rest | step through model.py's layers |")
    print("|---|---|---|---|---|")
    for mode, b in results["step_breakdown"].items():
        print(
            f"| {mode} | {b['step_ms_p50']:.1f} | {b['linears_ms_p50']:.1f} | {b['rest_ms_p50']:.1f} | "
            f"{b.get('step_layer_by_layer_ms_p50', float('nan')):.1f} |"
        )
    if "quality" in results:
        q = results["quality"]
        title = f"answers vs float32 (50 prompts, {QUALITY_TOKENS} tokens; held-out text {q['heldout_tokens']} tokens)"
        print(f"\n| {title} | identical | median first divergence | perplexity | vs float32 | France |")
        print("|---|---|---|---|---|---|")
        for name, r in q.items():
            if name == "heldout_tokens":
                continue
            div = r["median_first_divergence"]
            print(
                f"| {name} | {r['identical']}/{r['prompts']} | {'-' if div is None else f'{div:.0f}'} | {r['perplexity']:.3f} | "
                f"{100 * r['perplexity_vs_float32']:+.2f} % | {r['france'][:60]!r} |"
            )
    for dtype, pf in results["prefix"].items():
        print(
            f"\nTTFT ({dtype}), {pf['system_prompt_tokens']}-token system prompt: {pf['ttft_ms_uncached']:.0f} ms without prefix "
            f"caching, {pf['ttft_ms_cached']:.0f} ms with ({pf['speedup']:.1f}x lower)"
        )
    print("RSS added by loading each engine (MiB):", {k: round(v) for k, v in results["rss_mib_after_load"].items()})
    print(f"peak RSS of the run {results['peak_rss_mib']:.0f} MiB")
    if "cuda" in results:
        c = results["cuda"]
        print(
            f"CUDA ({c['gpu']}, bf16): single stream {c['tok_s']:.1f} tok/s, 16 streams {c['aggregate_tok_s']:.1f} tok/s, "
            f"peak GPU memory {c['peak_gpu_mib']:.0f} MiB"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--modes", default="float32,bf16,int8,int4,int4-a8", help="engine CPU modes (float32 is the reference)")
    p.add_argument(
        "--llama-cpp", default=None, help="directory holding llama-cpp-python (see the docstring); 'off': without it"
    )
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-prefix", action="store_true", help="without the prefix-caching TTFT section")
    p.add_argument("--kernels-only", action="store_true", help="only the kernel comparison")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    text = json.dumps(results, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    print_tables(results)


if __name__ == "__main__":
    main()
