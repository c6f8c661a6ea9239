"""Micro-benchmark of the cache's per-request CPU: key, plan, memory lookup, replay.

    .venv/bin/python bench/cache_keys.py

Prints microseconds per call (best of 5 repeats). Numbers are machine-dependent; compare
side by side only.
"""

from __future__ import annotations

import asyncio
import timeit

import orjson

from cache.base import Entry
from cache.keys import make_key
from cache.memory import MemoryCache
from cache.policy import parse_cache_control, plan
from cache.replay import as_chunks, as_json

BODY = {
    "model": "smollm2-135m",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 10},
        {"role": "user", "content": "What is the capital of France? " * 20},
    ],
    "temperature": 0,
    "max_tokens": 128,
    "stream": True,
    "stream_options": {"include_usage": True},
}
BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHUNKS = [orjson.dumps({**BASE, "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                             "finish_reason": None}]}) for i in range(128)]
CHUNKS.append(orjson.dumps({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    cache = MemoryCache(1 << 26, 1 << 20)
    key = make_key("tenant", "chat", BODY)
    entry = Entry(kind="chat", chunks=CHUNKS)
    cache.set_nowait(key, entry, ttl=300)
    directives = parse_cache_control("max-age=60")
    rows = [
        ("make_key (2 messages, ~1 KB)", lambda: make_key("tenant", "chat", BODY), 20000),
        ("parse_cache_control + plan", lambda: plan(BODY, parse_cache_control("max-age=60"), 300), 50000),
        ("MemoryCache.get (hit)", lambda: cache.get_nowait(key, directives.max_age), 50000),
        ("as_chunks (129 chunks, no usage)", lambda: as_chunks(entry, False), 5000),
        ("as_json (129 chunks → JSON)", lambda: as_json(entry), 2000),
        ("Entry.to_bytes + from_bytes", lambda: Entry.from_bytes(entry.to_bytes()), 5000),
    ]
    for name, fn, number in rows:
        print(f"{name:40s} {per_call_us(fn, number):9.2f} µs")
    asyncio.run(cache.close())


if __name__ == "__main__":
    main()
