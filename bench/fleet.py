"""A simulated inference fleet, and the same trace through edgegw and the routers users
would otherwise put in front of it.

    .venv/bin/python bench/fleet.py --install-peers          # sglang-router, vllm-router (bench only)
    .venv/bin/python bench/fleet.py --quick                  # smoke: every router, short runs
    .venv/bin/python bench/fleet.py [--reps 3] [--seconds 40] [--scenarios chat-80,uniform-80,region-110]
    .venv/bin/python bench/fleet.py --calibrate              # the step model against edge_engine

The fleet (one process, ``--serve``, many ports on 127.0.0.1). Each replica is an
OpenAI-compatible server modelling what a vLLM/SGLang engine does with its time:

- continuous batching: every step takes ``base + prefill × (prompt tokens prefilled this
  step) + decode × (sequences decoding)`` (chunked prefill: at most
  ``max_num_batched_tokens`` tokens a step, decoding sequences first), times the time
  scale; a sequence whose prefill ends in a step emits its first token at its end, every
  decoding sequence one token per step; at most ``max_num_seqs`` run at once;
- a paged KV cache of ``kv_blocks`` blocks of 16 tokens with a prefix cache over them: a
  prompt's full blocks are named by a hash chain (as vLLM does), blocks of finished
  sequences stay cached until evicted, least recently used first; a cached prefix is not
  prefilled again; when a running sequence needs a block and none is free, the newest
  sequence is preempted (its blocks freed, recomputed later), as vLLM's scheduler does;
- ``GET /metrics`` in vLLM's format (``vllm:num_requests_running``/``waiting``,
  ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``/``hits``,
  ``vllm:cache_config_info``), ``owned_by: vllm`` on ``/v1/models``, and what the Rust
  routers probe: ``/health``, ``/health_generate``, ``/get_server_info``,
  ``/get_model_info``, ``/server_info``, ``/model_info``, and vllm-router's
  ``POST /v1/chat/completions/render``;
- regions: a replica listens on one port per place it is reached from; a port of a
  remote place delays the request by half the round trip and every byte of the answer by
  the other half (user space, as bench/wan.py does; this machine has no netem).

Tokens are characters / 4 (the routers see text; the fleet counts the same way for all).

Workloads (seeded, the same trace for every router): ``chat`` (multi-turn sessions sharing
system prompts: Zipf(1.1) over 100 prompts of 1-2 k tokens, 1-6 turns), ``docqa`` (8
documents of 4-6 k tokens, many questions), ``uniform`` (1-2 k token prompts, nothing
shared); Poisson or bursty (gamma, ``--burstiness``) arrivals; every answer 16 tokens.
Offered load is a fraction of the fleet's nominal capacity (see ``nominal_capacity``).

Routers: ``edgegw`` (a gateway subprocess from a generated config: the fleet's replicas
as endpoints, ``load_source: vllm``, the prefix index; hedging and the response cache
off, as the peers have none), ``round_robin`` and ``random`` (sglang-router's policies of
those names: the cheapest proxies here), ``sglang`` (sglang-router, default
``cache_aware``), ``vllm`` (vllm-router, its default ``cache_aware``) and ``vllm-rr``
(vllm-router ``--policy round_robin``). Each is started with its documented defaults.

Reported per scenario and router (medians over ``--reps``): TTFT p50/p99, TPOT p50/p99,
goodput (requests/s with TTFT <= 1 s and TPOT <= 100 ms), the fleet's prefix-cache hit
rate (tokens hit / tokens queried, from the replicas' counters), load imbalance (the
busiest replica's requests / the mean), and the router's CPU per request (user + system of
its process tree / requests).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path[:0] = [ROOT, HERE]

import httptools  # noqa: E402
import orjson  # noqa: E402

from bench.processes import Child, free_port  # noqa: E402

MODEL = "sim-8b"
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
OUTPUT_TOKENS = 16
CALIBRATION = os.path.join(HERE, "fleet_calibration.json")

# The step model, in engine seconds (before the time scale). Its shape (what a prefilled
# token costs against a decode step, and how a step grows with the batch) is fitted to
# edge_engine on this CPU by --calibrate (bench/fleet_calibration.json); without that file
# these defaults (from the run recorded in BENCHMARKS.md) apply.
DEFAULT_STEP = {"base_s": 0.040, "prefill_s_per_token": 0.00030, "decode_s_per_seq": 0.0020}


def load_step_model() -> dict:
    try:
        with open(CALIBRATION) as fh:
            fitted = json.load(fh)
        return {k: float(fitted["scaled"][k]) for k in DEFAULT_STEP}
    except (OSError, KeyError, ValueError):
        return dict(DEFAULT_STEP)


# -- the simulated replica ------------------------------------------------------------------


def render(body: dict) -> str:
    """The prompt a chat template would make: role markers and text, in order."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<|{m.get('role', '')}|>{m.get('content', '')}<|end|>" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def block_hashes(text: str) -> list[int]:
    out, h = [], 0
    for i in range(len(text) // BLOCK_CHARS):
        h = hash((h, text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS]))
        out.append(h)
    return out


def answer_text(n: int) -> str:
    """What every replica answers (the clients replay it in later turns)."""
    return " ".join(f"word{i}" for i in range(n))


class Seq:
    __slots__ = ("hashes", "prompt_tokens", "max_tokens", "out", "prefill_left", "pinned", "private", "emit", "done",
                 "arrived", "admitted")

    def __init__(self, hashes: list[int], prompt_tokens: int, max_tokens: int, emit, done) -> None:
        self.hashes = hashes
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.out = 0
        self.prefill_left = 0
        self.pinned: list[int] = []  # hashed blocks held
        self.private = 0  # blocks of generated tokens and the partial prompt block
        self.emit = emit  # emit(token_index) on each token
        self.done = done  # done() at the end
        self.arrived = time.monotonic()
        self.admitted = 0


class Replica:
    """One simulated engine: scheduler, paged KV with a prefix cache, the step clock."""

    def __init__(self, name: str, step: dict, scale: float, kv_blocks: int, max_num_seqs: int, max_batched: int) -> None:
        self.name = name
        self.base = step["base_s"] * scale
        self.per_prefill = step["prefill_s_per_token"] * scale
        self.per_seq = step["decode_s_per_seq"] * scale
        self.kv_blocks = kv_blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched = max_batched
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.refs: dict[int, int] = {}  # pinned hashed block -> sequences holding it
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unpinned, LRU first
        self.private = 0
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which cached
        self.requests = 0
        self.preemptions = 0
        self.busy_s = 0.0
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    # KV accounting
    def used(self) -> int:
        return len(self.refs) + self.private

    def _room(self, need: int) -> bool:
        """Make ``need`` blocks available, evicting cached free blocks LRU first."""
        while self.used() + len(self.free) + need > self.kv_blocks and self.free:
            self.free.popitem(last=False)
        return self.used() + len(self.free) + need <= self.kv_blocks

    def _admit(self, s: Seq) -> bool:
        hashes = s.hashes
        matched = 0
        for h in hashes:
            if h in self.refs or h in self.free:
                matched += 1
            else:
                break
        new = len(hashes) - matched + 1  # the uncached blocks and the partial last one
        # pin the cached part first (eviction must not take it), then make room
        for h in hashes[:matched]:
            if h in self.free:
                del self.free[h]
            self.refs[h] = self.refs.get(h, 0) + 1
        if not self._room(new):
            self._unpin(hashes[:matched])
            return False
        for h in hashes[matched:]:
            self.refs[h] = self.refs.get(h, 0) + 1
        self.private += 1
        s.pinned = list(hashes)
        s.private = 1
        cached_tokens = matched * BLOCK_TOKENS
        self.queries += s.prompt_tokens
        self.hits += min(cached_tokens, s.prompt_tokens)
        s.prefill_left = max(1, s.prompt_tokens - cached_tokens + s.out)  # a preempted one recomputes its output too
        s.admitted = time.monotonic()
        return True

    def _unpin(self, hashes: list[int]) -> None:
        for h in hashes:
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
            else:
                del self.refs[h]
                self.free[h] = None  # cached, reusable, evictable

    def _release(self, s: Seq) -> None:
        self._unpin(s.pinned)
        s.pinned = []
        self.private -= s.private
        s.private = 0

    def submit(self, s: Seq) -> None:
        self.requests += 1
        self.waiting.append(s)
        self.wake.set()

    def cancel(self, s: Seq) -> None:
        if s in self.running:
            self.running.remove(s)
            self._release(s)
        elif s in self.waiting:
            self.waiting.remove(s)

    async def loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            budget = self.max_batched
            decoding = [s for s in self.running if s.prefill_left == 0]
            budget -= len(decoding)
            prefilled = 0
            finishing_prefill = []
            for s in self.running:  # chunked prefills in progress first
                if s.prefill_left and budget > 0:
                    take = min(budget, s.prefill_left)
                    s.prefill_left -= take
                    budget -= take
                    prefilled += take
                    if s.prefill_left == 0:
                        finishing_prefill.append(s)
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                s = self.waiting[0]
                if not self._admit(s):
                    break
                self.waiting.popleft()
                self.running.append(s)
                take = min(budget, s.prefill_left)
                s.prefill_left -= take
                budget -= take
                prefilled += take
                if s.prefill_left == 0:
                    finishing_prefill.append(s)
            step = self.base + self.per_prefill * prefilled + self.per_seq * len(decoding)
            self.busy_s += step
            await asyncio.sleep(step)
            # a decoding sequence that fills a block needs a new one: preempt the newest if none
            for s in decoding + finishing_prefill:
                if s not in self.running:
                    continue  # preempted or cancelled during the step
                s.out += 1
                s.emit(s.out)
                if s.out >= s.max_tokens:
                    self.running.remove(s)
                    self._release(s)
                    s.done()
                    continue
                if (s.prompt_tokens + s.out) % BLOCK_TOKENS == 0:
                    while not self._room(1):
                        victim = max(self.running, key=lambda v: v.admitted)
                        self.running.remove(victim)
                        self._release(victim)
                        self.preemptions += 1
                        self.waiting.appendleft(victim)
                        if victim is s:
                            break
                    if s in self.running:
                        s.private += 1
                        self.private += 1

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{MODEL}"'
        kv = self.used() / self.kv_blocks
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(len(self.running))}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(len(self.waiting))}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(self.queries)}\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(self.hits)}\n"
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK_TOKENS}",enable_prefix_caching="True",engine="0",'
            f'num_gpu_blocks="{self.kv_blocks}"}} 1.0\n'
        )

    def stats(self) -> dict:
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "preemptions": self.preemptions, "busy_s": self.busy_s,
                "active": len(self.running) + len(self.waiting), "cached_blocks": len(self.free) + len(self.refs)}


# -- its HTTP/1.1 face ----------------------------------------------------------------------


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a replica through one listener (``delay``:
    half the round trip of the place this listener is reached from)."""

    def __init__(self, replica: Replica, delay: float) -> None:
        self.replica = replica
        self.delay = delay
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.url = b""
        self.body: list[bytes] = []
        self.out: collections.deque[tuple[float, bytes]] = collections.deque()
        self.timer = None
        self.seq: Seq | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.seq is not None:
            self.replica.cancel(self.seq)
            self.seq = None
        if self.timer is not None:
            self.timer.cancel()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.split(b"?")[0].decode()
        body = b"".join(self.body)
        self.url, self.body = b"", []
        if self.delay:
            asyncio.get_running_loop().call_later(self.delay, self.handle, method, path, body)
        else:
            self.handle(method, path, body)

    # writing, delayed by the listener's half round trip, in order
    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if not self.delay:
            self.transport.write(data)
            return
        self.out.append((time.monotonic() + self.delay, data))
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.delay, self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = time.monotonic()
        while self.out and self.out[0][0] <= now + 0.0005:
            data = self.out.popleft()[1]
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(data)
        if self.out:
            self.timer = asyncio.get_running_loop().call_later(self.out[0][0] - now, self._flush)

    def respond(self, status: int, payload, content_type: bytes = b"application/json") -> None:
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"OK")
        self.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, reason, content_type, len(data), data))

    def handle(self, method: bytes, path: str, body: bytes) -> None:
        r = self.replica
        if method == b"GET":
            if path in ("/health", "/health_generate", "/ping"):
                return self.respond(200, b"")
            if path == "/metrics":
                return self.respond(200, r.metrics().encode(), b"text/plain; version=0.0.4; charset=utf-8")
            if path == "/v1/models":
                return self.respond(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 32768}]})
            if path in ("/get_server_info", "/server_info"):
                return self.respond(200, {"model_path": MODEL, "served_model_name": MODEL, "max_total_num_tokens": r.kv_blocks * BLOCK_TOKENS,
                                          "max_running_requests": r.max_num_seqs, "version": "sim"})
            if path in ("/get_model_info", "/model_info"):
                return self.respond(200, {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})
            if path == "/bench/stats":
                return self.respond(200, r.stats())
            if path == "/bench/reset":  # between routers: an empty prefix cache (once idle)
                if not r.running and not r.waiting:
                    r.free.clear()
                return self.respond(200, r.stats())
            return self.respond(404, {"error": {"message": f"no {path}"}})
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self.respond(400, {"error": {"message": "body is not JSON"}})
        if path == "/v1/chat/completions/render":
            text = render(data)
            return self.respond(200, {"prompt": text, "prompt_token_ids": list(range(len(text) // CHARS_PER_TOKEN))})
        if path not in ("/v1/chat/completions", "/v1/completions", "/generate"):
            return self.respond(404, {"error": {"message": f"no {path}"}})
        chat = path == "/v1/chat/completions"
        text = render(data)
        max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or OUTPUT_TOKENS
        stream = bool(data.get("stream"))
        usage_wanted = bool((data.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        rid = f"cmpl-{id(self):x}{r.requests}"
        created = int(time.time())
        words = answer_text(max_tokens).split(" ")
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        if stream:
            self.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def emit(i: int) -> None:
            if not stream:
                return
            word = words[i - 1] if i == 1 else " " + words[i - 1]
            if chat:
                choice = {"index": 0, "delta": {"content": word} if i > 1 else {"role": "assistant", "content": word}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": word, "finish_reason": None}
            event = b"data: " + orjson.dumps({"id": rid, "object": kind.decode(), "created": created, "model": MODEL, "choices": [choice]}) + b"\n\n"
            self.write(b"%x\r\n%s\r\n" % (len(event), event))

        def done() -> None:
            self.seq = None
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}
            if stream:
                tail = {"id": rid, "object": kind.decode(), "created": created, "model": MODEL,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "", "finish_reason": "length"}]}
                events = b"data: " + orjson.dumps(tail) + b"\n\n"
                if usage_wanted:
                    events += b"data: " + orjson.dumps({"id": rid, "object": kind.decode(), "created": created, "model": MODEL, "choices": [], "usage": usage}) + b"\n\n"
                events += b"data: [DONE]\n\n"
                self.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
            else:
                message = {"role": "assistant", "content": answer_text(max_tokens)}
                choice = {"index": 0, "message": message, "finish_reason": "length"} if chat else {"index": 0, "text": answer_text(max_tokens), "finish_reason": "length"}
                self.respond(200, {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                                   "model": MODEL, "choices": [choice], "usage": usage})

        self.seq = Seq(block_hashes(text), prompt_tokens, int(max_tokens), emit, done)
        r.submit(self.seq)


async def serve(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    loop = asyncio.get_running_loop()
    replicas = []
    for rs in spec["replicas"]:
        r = Replica(rs["name"], spec["step"], spec["time_scale"], spec["kv_blocks"], spec["max_num_seqs"], spec["max_batched_tokens"])
        r.task = loop.create_task(r.loop())
        replicas.append(r)
        for listener in rs["listeners"]:
            await loop.create_server(lambda r=r, d=listener["delay"]: Conn(r, d), "127.0.0.1", listener["port"], backlog=1024)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()


# -- workloads ------------------------------------------------------------------------------

VOCAB = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro", "si", "tu", "va", "ze") for b in ("n", "r", "s", "t", "l", "m", "x", "d")]


def words(rng: random.Random, tokens: int) -> str:
    n = tokens * CHARS_PER_TOKEN // 4  # ~4 characters per word with its space
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def zipf_picker(n: int, s: float, rng: random.Random):
    weights = [1 / (k + 1) ** s for k in range(n)]
    cum = list(itertools.accumulate(weights))
    return lambda: bisect.bisect_left(cum, rng.random() * cum[-1])


@dataclass
class Trace:
    name: str
    due: list[float]
    bodies: list[bytes]
    prompt_tokens: list[int]
    mean_prompt_tokens: float = 0.0
    shared_fraction: float = 0.0  # the part of a prompt a cache-aware router finds cached


def make_trace(workload: str, rate: float, seconds: float, seed: int, burstiness: float = 1.0) -> Trace:
    rng = random.Random(seed)
    arr = random.Random(seed + 1)
    due, t = [], 0.0
    while t < seconds:
        due.append(t)
        t += arr.expovariate(rate) if burstiness == 1.0 else arr.gammavariate(burstiness, 1 / (rate * burstiness))
    bodies, tokens = [], []
    base = {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    if workload == "chat":
        systems = [words(rng, rng.randint(1000, 2000)) for _ in range(100)]
        pick = zipf_picker(100, 1.1, rng)
        active: list[list[dict]] = []
        for _ in due:
            if active and rng.random() < 0.6:
                i = rng.randrange(len(active))
                convo = active[i]
                convo.append({"role": "user", "content": words(rng, rng.randint(30, 120))})
                if len(convo) >= 12:  # six turns: the session ends
                    active.pop(i)
            else:
                convo = [{"role": "system", "content": systems[pick()]}, {"role": "user", "content": words(rng, rng.randint(30, 120))}]
                active.append(convo)
                if len(active) > 64:
                    active.pop(0)
            messages = list(convo)
            bodies.append(orjson.dumps({**base, "messages": messages}))
            tokens.append(sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN)
            convo.append({"role": "assistant", "content": answer_text(OUTPUT_TOKENS)})
        shared = 0.85
    elif workload == "docqa":
        docs = [words(rng, rng.randint(4000, 6000)) for _ in range(8)]
        pick = zipf_picker(8, 0.8, rng)
        for _ in due:
            messages = [{"role": "system", "content": "Answer from the document."},
                        {"role": "user", "content": docs[pick()] + "\n\nQuestion: " + words(rng, rng.randint(20, 50))}]
            bodies.append(orjson.dumps({**base, "messages": messages}))
            tokens.append(sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN)
        shared = 0.95
    elif workload == "uniform":
        for _ in due:
            messages = [{"role": "user", "content": words(rng, rng.randint(1000, 2000))}]
            bodies.append(orjson.dumps({**base, "messages": messages}))
            tokens.append(len(messages[0]["content"]) // CHARS_PER_TOKEN)
        shared = 0.0
    else:
        raise ValueError(workload)
    return Trace(workload, due, bodies, tokens, statistics.fmean(tokens) if tokens else 0.0, shared)


def nominal_capacity(step: dict, scale: float, mean_prompt: float, shared: float, batch: float = 4.0) -> float:
    """Requests/s one replica serves when busy all the time, with the shared part of each
    prompt cached (what a cache-aware router can reach): each request costs its uncached
    prefill, and its output tokens at one decode slot of a step of ``batch`` sequences."""
    prefill = step["prefill_s_per_token"] * (1 - shared) * mean_prompt
    decode = OUTPUT_TOKENS * (step["decode_s_per_seq"] + step["base_s"] / batch)
    return 1.0 / ((prefill + decode) * scale)


# -- processes ------------------------------------------------------------------------------


class Proc(Child):
    """A process this script started: its simulated servers and routers log little (RUST_LOG)
    and import the project (PYTHONPATH)."""

    def __init__(self, name: str, argv: list[str], tmp: str, cwd: str = ROOT) -> None:
        super().__init__(name, argv, tmp, cwd, env={"PYTHONPATH": ROOT, "RUST_LOG": "warn"})

    def wait_http(self, port: int, path: str, timeout: float = 60) -> None:
        super().wait_http(port, path, timeout)


def get_json(port: int, path: str):
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", path)
    data = c.getresponse().read()
    c.close()
    return json.loads(data)


@dataclass
class Fleet:
    """The replicas' ports: ``local[i]`` as reached in their own region, ``via[i]`` as
    reached from the routers (the same port when they are in the same place)."""

    regions: list[str]
    local: list[int]
    via: list[int]
    proc: Proc | None = None


def start_fleet(tmp: str, regions: list[tuple[str, int, float]], step: dict, scale: float, kv_blocks: int) -> Fleet:
    """``regions``: (name, replicas, round trip from the routers in seconds)."""
    spec = {"step": step, "time_scale": scale, "kv_blocks": kv_blocks, "max_num_seqs": 24, "max_batched_tokens": 256, "replicas": []}
    fleet = Fleet([], [], [])
    for name, n, rtt in regions:
        for i in range(n):
            local = free_port()
            listeners = [{"port": local, "delay": 0.0}]
            via = local
            if rtt > 0:
                via = free_port()
                listeners.append({"port": via, "delay": rtt / 2})
            spec["replicas"].append({"name": f"{name}-{i}", "listeners": listeners})
            fleet.regions.append(name)
            fleet.local.append(local)
            fleet.via.append(via)
    path = os.path.join(tmp, "fleet.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    fleet.proc = Proc("fleet", [PY, os.path.abspath(__file__), "--serve", path], tmp)
    for port in fleet.local:
        fleet.proc.wait_http(port, "/health")
    return fleet


def fleet_stats(fleet: Fleet) -> list[dict]:
    return [get_json(p, "/bench/stats") for p in fleet.local]


async def reset_fleet(fleet: Fleet) -> None:
    """Wait until every replica is idle, then empty their prefix caches: each router
    starts from the same cold fleet."""
    for _ in range(600):
        if all(s["active"] == 0 for s in fleet_stats(fleet)):
            break
        await asyncio.sleep(0.1)
    for p in fleet.local:
        get_json(p, "/bench/reset")


EDGEGW_LOAD: dict = {}  # --edgegw-load: routing.load keys for the edgegw under test
ROUTERS = ("edgegw", "edgegw-base", "round_robin", "random", "sglang", "vllm", "vllm-rr")
# region coordinates for edgegw's table: 66 km per ms of round trip (its km_per_rtt_ms)
COORDS = [(37.77, -122.42), (40.71, -74.01), (51.51, -0.13)]


def edgegw_config(port: int, fleet: Fleet, signals: bool = True) -> dict:
    """``signals``: the servers' load and the prefix index (False: edgegw as it routed
    before them, its own measurements only: the baseline in the same run)."""
    regions = list(dict.fromkeys(fleet.regions))
    clusters = []
    source = "vllm" if signals else "none"
    for region in regions:
        eps = [{"url": f"http://127.0.0.1:{p}/v1", "load_source": source, "pool_size": 256, "warm_connections": 4}
               for p, r in zip(fleet.via, fleet.regions) if r == region]
        clusters.append({"name": f"c-{region}", "models": [MODEL], "endpoints": eps})
    routing = {
        "hedging": {"enabled": False},
        "load": {"prefix": signals, **(EDGEGW_LOAD if signals else {})},
    }
    if len(regions) > 1:
        routing["regions"] = [
            {"name": r, "lat": COORDS[i][0], "lon": COORDS[i][1], "clusters": [f"c-{r}"]} for i, r in enumerate(regions)
        ]
        routing["default_region"] = regions[0]
        routing["local_region"] = regions[0]
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "clusters": clusters,
        "routing": routing,
        "cache": {"backend": "off"},
    }


def start_router(kind: str, fleet: Fleet, tmp: str, rtts: dict[str, float], workers: list[int]) -> tuple[Proc, int]:
    import yaml

    port = free_port()
    urls = [f"http://127.0.0.1:{p}" for p in workers]
    if kind.startswith("edgegw"):
        # edgegw+key=value+...: the edgegw under test with routing.load keys changed
        name, *changes = kind.split("+")
        config = edgegw_config(port, fleet, signals=name == "edgegw")
        for change in changes:
            key, _, value = change.partition("=")
            config["routing"]["load"][key] = json.loads(value)
        path = os.path.join(tmp, f"{name}-{len(changes)}.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(config, fh)
        proc = Proc(kind, [PY, "-m", "gateway", "serve", "--config", path], tmp)
        proc.wait_http(port, "/readyz")
        return proc, port
    if kind in ("round_robin", "random", "sglang"):
        policy = {"round_robin": "round_robin", "random": "random", "sglang": None}[kind]
        argv = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        if policy:
            argv += ["--policy", policy]
    elif kind in ("vllm", "vllm-rr"):
        exe = os.path.join(os.path.dirname(PY), "vllm-router")
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        if kind == "vllm-rr":
            argv += ["--policy", "round_robin"]
    else:
        raise ValueError(kind)
    proc = Proc(kind, argv, tmp)
    proc.wait_http(port, "/v1/models", timeout=120)
    return proc, port


# -- load ------------------------------------------------------------------------------------


async def drive(port: int, trace: Trace, background: list[tuple[int, Trace]] = (), timeout: float = 60.0):
    """Send ``trace`` open-loop to the router on ``port`` (and each background trace
    straight to its replica); the router's records."""
    from loadgen.http import BaseURL, ConnectionPool
    from loadgen.openai import RequestHead, Requester
    from loadgen.types import RequestSpec

    async def run(port: int, tr: Trace, t0: float, records: list | None):
        base = BaseURL.parse(f"http://127.0.0.1:{port}/v1")
        pool = ConnectionPool(base)
        requester = Requester(pool, RequestHead(base, "/chat/completions", {}, True), timeout, t0)
        tasks = []
        for i, (due, body) in enumerate(zip(tr.due, tr.bodies)):
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            spec = RequestSpec(body, tr.prompt_tokens[i], OUTPUT_TOKENS)
            tasks.append(asyncio.create_task(requester.send(i, spec, due, time.perf_counter())))
        done = await asyncio.gather(*tasks)
        pool.close()
        if records is not None:
            records.extend(done)

    t0 = time.perf_counter()
    records: list = []
    await asyncio.gather(run(port, trace, t0, records), *(run(p, tr, t0, None) for p, tr in background))
    return records


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarise(records, seconds: float, before: list[dict], after: list[dict], cpu_s: float, replicas: list[int]) -> dict:
    ok = [r for r in records if r.ok and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    good = sum(1 for r in ok if r.ttft <= 1.0 and (r.tpot is None or r.tpot <= 0.1))
    reqs = [after[i]["requests"] - before[i]["requests"] for i in replicas]
    q = sum(after[i]["queries"] - before[i]["queries"] for i in replicas)
    h = sum(after[i]["hits"] - before[i]["hits"] for i in replicas)
    pre = sum(after[i]["preemptions"] - before[i]["preemptions"] for i in replicas)
    mean = statistics.fmean(reqs) if reqs else 0
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "goodput": good / seconds, "hit_rate": h / q if q else math.nan,
        "imbalance": max(reqs) / mean if mean else math.nan, "cpu_ms_per_req": 1e3 * cpu_s / max(1, len(records)),
        "preemptions": pre,
        # why the others missed: TTFT over 1 s, TPOT over 100 ms (a request may miss both)
        "ttft_miss": sum(1 for r in ok if r.ttft > 1.0) / max(1, len(ok)),
        "tpot_miss": sum(1 for r in ok if r.tpot is not None and r.tpot > 0.1) / max(1, len(ok)),
    }


# -- scenarios -------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    workload: str
    load: float  # of the routed region's nominal capacity
    regions: list[tuple[str, int, float]] = field(default_factory=lambda: [("local", 4, 0.0)])
    background: float = 0.0  # load of the other regions' own clients (multi-region)
    burstiness: float = 1.0


SCENARIOS = {
    "chat-50": Scenario("chat-50", "chat", 0.5),
    "chat-80": Scenario("chat-80", "chat", 0.8),
    "chat-120": Scenario("chat-120", "chat", 1.2),
    "chat-80-bursty": Scenario("chat-80-bursty", "chat", 0.8, burstiness=0.25),
    "docqa-80": Scenario("docqa-80", "docqa", 0.8),
    "uniform-50": Scenario("uniform-50", "uniform", 0.5),
    "uniform-80": Scenario("uniform-80", "uniform", 0.8),
    "uniform-120": Scenario("uniform-120", "uniform", 1.2),
    # three regions 20 / 80 / 150 ms from the clients of the first, whose 2 replicas get
    # 110 % of their capacity; the other regions' own clients load theirs to 40 %
    "region-110": Scenario("region-110", "chat", 1.1, [("near", 2, 0.020), ("mid", 2, 0.080), ("far", 2, 0.150)], background=0.4),
}


async def run_scenario(sc: Scenario, routers: list[str], reps: int, seconds: float, scale: float, step: dict,
                       tmp: str, seed: int, kv_blocks: int) -> dict:
    fleet = start_fleet(tmp, sc.regions, step, scale, kv_blocks)
    results: dict[str, list[dict]] = {r: [] for r in routers}
    try:
        home = sc.regions[0][0]
        home_idx = [i for i, r in enumerate(fleet.regions) if r == home]
        probe = make_trace(sc.workload, 1.0, 30.0, seed)
        cap = nominal_capacity(step, scale, probe.mean_prompt_tokens, probe.shared_fraction)
        rate = sc.load * cap * len(home_idx)
        for rep in range(reps):
            trace = make_trace(sc.workload, rate, seconds, seed + rep, sc.burstiness)
            background = []
            if sc.background:
                for j, (name, n, _) in enumerate(sc.regions[1:], 1):
                    idx = [i for i, r in enumerate(fleet.regions) if r == name]
                    for k, i in enumerate(idx):
                        bg = make_trace(sc.workload, sc.background * cap, seconds, seed + 1000 * j + 10 * k + rep)
                        background.append((fleet.local[i], bg))
            order = routers[rep % len(routers):] + routers[: rep % len(routers)]  # rotate: no router always first
            for kind in order:
                # region-unaware peers are deployed per region: they know the home region's replicas
                workers = [fleet.via[i] for i in home_idx] if not kind.startswith("edgegw") else []
                await reset_fleet(fleet)
                proc, port = start_router(kind, fleet, tmp, {}, workers)
                try:
                    # a warm-up of the same workload (other sessions, the same shared
                    # prompts) through this router: its own placement fills the caches
                    warm = make_trace(sc.workload, rate, max(3.0, seconds / 3), seed + 777 + rep, 1.0)
                    await drive(port, warm)
                    await asyncio.sleep(0.5)
                    before = fleet_stats(fleet)
                    cpu0 = proc.cpu()
                    records = await drive(port, trace, background)
                    cpu = proc.cpu() - cpu0
                    after = fleet_stats(fleet)
                finally:
                    proc.stop()
                s = summarise(records, seconds, before, after, cpu, home_idx if not sc.background else list(range(len(fleet.local))))
                s["rate"] = rate
                results[kind].append(s)
                print(f"  {sc.name} rep {rep + 1} {kind:12s} ttft p50 {s['ttft_p50'] * 1e3:6.0f} p99 {s['ttft_p99'] * 1e3:6.0f} ms  "
                      f"tpot p99 {s['tpot_p99'] * 1e3:5.0f} ms  goodput {s['goodput']:5.2f}/s  hit {s['hit_rate']:.2f}  "
                      f"imb {s['imbalance']:.2f}  cpu {s['cpu_ms_per_req']:.2f} ms  err {s['errors']}", flush=True)
    finally:
        fleet.proc.stop()
    return {"scenario": sc.name, "rate": rate, "capacity_per_replica": cap, "results": results}


def median_of(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if not math.isnan(r[key])]
    return statistics.median(vals) if vals else math.nan


def report(all_results: list[dict], command: str, reps: int, seconds: float, scale: float, step: dict) -> str:
    lines = [
        f"`{command}` — {reps} rep(s) of {seconds:g} s per router and scenario, medians; step model "
        f"base {step['base_s'] * 1e3:.1f} ms + {step['prefill_s_per_token'] * 1e6:.0f} µs/prefill token + "
        f"{step['decode_s_per_seq'] * 1e3:.2f} ms/decoding sequence, time scale {scale:g}. The machine (2 cores) was shared "
        "with other engineers' work during the run.",
        "",
        "| scenario | router | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | goodput /s | prefix hit | imbalance | router CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in all_results:
        for kind, runs in res["results"].items():
            if not runs:
                continue
            m = {k: median_of(runs, k) for k in runs[0] if isinstance(runs[0][k], (int, float))}
            lines.append(
                f"| {res['scenario']} ({res['rate']:.1f} req/s) | {kind} | {m['ttft_p50'] * 1e3:.0f} | {m['ttft_p99'] * 1e3:.0f} | "
                f"{m['tpot_p50'] * 1e3:.0f} | {m['tpot_p99'] * 1e3:.0f} | {m['goodput']:.2f} | {m['hit_rate']:.2f} | "
                f"{m['imbalance']:.2f} | {m['cpu_ms_per_req']:.2f} | {m['errors']:.0f} |"
            )
    return "\n".join(lines)


# -- calibration -----------------------------------------------------------------------------


def calibrate(target_decode_ms: float) -> dict:
    """Time edge_engine on this CPU (SmolLM2-135M, its default dtype, 2 threads, chunked
    prefill of 256 tokens a step) through its own API: TPOT of 1, 4, 8 and 16 concurrent
    streams (a decode step of that batch) gives ``base + decode × batch`` by least squares;
    the TTFT of single prompts of 128-1024 uncached tokens, less one base per chunk, gives
    the prefill cost per token. Then everything is scaled so that a batch-1 decode step
    takes ``target_decode_ms``: the shape is the engine's, the size a GPU server's."""
    import numpy as np

    from edge_engine import EngineConfig
    from edge_engine.engine import Engine
    from edge_engine.sampling import SamplingParams

    async def stream(engine, prompt, new_tokens):
        t0 = time.perf_counter()
        first = None
        n = 0
        async for delta in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)):
            n += len(delta.token_ids)
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return first - t0, (end - first) / max(1, n - 1)

    async def measure():
        engine = Engine(EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_threads=2))
        await engine.start()
        rng = random.Random(0)
        fresh = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731 - no cache hits
        try:
            await stream(engine, fresh(16), 4)  # warm-up
            decode = []
            for b in (1, 4, 8, 16):
                runs = await asyncio.gather(*(stream(engine, fresh(8), 24) for _ in range(b)))
                decode.append((b, statistics.median(t for _, t in runs)))
            prefill = []
            for n in (128, 256, 512, 1024):
                ttft, _ = await stream(engine, fresh(n), 2)
                prefill.append((n, ttft))
            return engine.config.dtype, decode, prefill
        finally:
            await engine.close()

    dtype, decode, prefill = asyncio.run(measure())
    x = np.array([[1.0, b] for b, _ in decode])
    y = np.array([t for _, t in decode])
    (base, per_seq), *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_seq = max(float(base), 1e-4), max(float(per_seq), 0.0)
    per_tok = statistics.median(max(0.0, (t - math.ceil(n / 256) * base) / n) for n, t in prefill)
    k = target_decode_ms / 1e3 / (base + per_seq)
    return {
        "measured": {"base_s": base, "prefill_s_per_token": per_tok, "decode_s_per_seq": per_seq,
                     "decode_step_by_batch": decode, "ttft_by_prompt_tokens": prefill, "dtype": dtype},
        "scaled": {"base_s": base * k, "prefill_s_per_token": per_tok * k, "decode_s_per_seq": per_seq * k},
        "scale_factor": k,
        "how": f"edge_engine ({dtype}) on this CPU: TPOT at batch 1/4/8/16 fitted to base + per-sequence, "
               f"TTFT of 128-1024-token prompts less a base per 256-token chunk per token; "
               f"scaled so that a batch-1 decode step takes {target_decode_ms:g} ms",
    }


# -- main ------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--install-peers", action="store_true", help="pip install bench/requirements-fleet.txt and exit")
    ap.add_argument("--calibrate", action="store_true", help="fit the step model to edge_engine, write bench/fleet_calibration.json")
    ap.add_argument("--target-decode-ms", type=float, default=42.0, help="--calibrate: a batch-1 decode step, scaled")
    ap.add_argument("--quick", action="store_true", help="smoke test: one short run of two scenarios")
    ap.add_argument("--scenarios", default="chat-80,uniform-80,region-110", help=f"comma list of {','.join(SCENARIOS)}")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks of 16 tokens per replica")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--edgegw-load", default="{}", help="JSON: routing.load settings of the edgegw under test")
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.install_peers:
        return subprocess.call([PY, "-m", "pip", "install", "-r", os.path.join(HERE, "requirements-fleet.txt")])
    if args.calibrate:
        fitted = calibrate(args.target_decode_ms)
        with open(CALIBRATION, "w") as fh:
            json.dump(fitted, fh, indent=1)
        print(json.dumps(fitted, indent=1))
        return 0
    step = load_step_model()
    EDGEGW_LOAD.update(json.loads(args.edgegw_load))
    routers = args.routers.split(",")
    names = args.scenarios.split(",")
    reps, seconds = args.reps, args.seconds
    if args.quick:
        names, reps, seconds = ["chat-80", "region-110"], 1, 8.0
    command = "bench/fleet.py " + " ".join(sys.argv[1:])
    all_results = []
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        for name in names:
            sc = SCENARIOS[name]
            print(f"{name}: {sc.workload} at {sc.load:.0%}", flush=True)
            all_results.append(asyncio.run(run_scenario(sc, routers, reps, seconds, args.time_scale, step, tmp, args.seed, args.kv_blocks)))
    text = report(all_results, command, reps, seconds, args.time_scale, step)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(all_results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
