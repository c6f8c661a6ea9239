"""Routing micro-benchmark: the balancer against round-robin and random, simulated.

Three central clusters of different latency (a near one with one degraded replica, two
far ones), three replicas each, simulated in-process with a discrete-event clock (no
sockets, no sleeping). Each replica prefills one request at a time (prefill cost per
uncached prompt token) and keeps an LRU prefix cache of recent conversations; a
request whose conversation prefix is cached on its replica prefills only the new turn.
Workload: multi-turn conversations picked with a Zipf-skewed popularity, Poisson
arrivals. Strategies:

- ``edgegw``: ``routing.decide`` (region ranking from measured TTFT, p2c on
  latency × load, rendezvous affinity on the conversation with bounded load), fed with
  the simulated events through ``HealthState`` (and active probes).
- ``edgegw-signals``: the same with the servers' load read once a simulated second
  (``HealthState.record_load``) and each conversation's prompt blocks in the prefix index
  (``record_routed``): what ``decide()`` costs with both.
- ``round-robin`` and ``random`` over all nine endpoints.

Reported: p50/p99 TTFT, KV prefix hit rate (follow-up turns landing on a replica that
holds their prefix), and the wall-clock cost of ``decide()`` per request.

    .venv/bin/python bench/routing.py [--requests 20000] [--rate 20] [--cluster-ratio 1.25] [--seed 1]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from hashlib import blake2b

# Run as a script, this file's folder is sys.path[0] and this file would shadow the
# `routing` package it measures: import from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from routing import (  # noqa: E402
    ClusterSpec,
    HealthState,
    Location,
    RegionConfig,
    RouteRequest,
    RoutingConfig,
    RoutingTable,
    ServerLoad,
    decide,
)

# name, region, (lat, lon), network RTT from the gateway (s), prefill s/token per replica
CLUSTERS = [
    ("near", "us-west", (37.77, -122.42), 0.010, [0.00010, 0.00010, 0.00030]),  # one degraded
    ("mid", "us-east", (39.04, -77.49), 0.070, [0.00012, 0.00012, 0.00012]),
    ("far", "eu-central", (50.11, 8.68), 0.150, [0.00012, 0.00012, 0.00012]),
]
TPOT_S = 0.020  # per output token, + 2 % per request in flight on the replica
OUTPUT_TOKENS = 120
SYSTEM_TOKENS = 600
TURN_TOKENS = 250
TURNS = 8
CONVERSATIONS = 500
CACHE_CONVERSATIONS = 40  # prefix-cache capacity per replica, in conversations
CLUSTER_RATIO = 1.25  # balancer.affinity_cluster_ratio (the default); --cluster-ratio
CLIENT = Location("US", "San Francisco", 37.77, -122.42)


@dataclass
class Replica:
    url: str
    rtt_s: float
    prefill_s_per_token: float
    busy_until: float = 0.0
    inflight: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)  # conversation -> cached tokens


def build_fleet() -> tuple[list[Replica], list[ClusterSpec], RoutingConfig]:
    replicas, specs, regions = [], [], []
    for name, region, (lat, lon), rtt, rates in CLUSTERS:
        urls = []
        for i, rate in enumerate(rates):
            url = f"http://{name}-{i}:8000"
            replicas.append(Replica(url, rtt, rate))
            urls.append(url)
        specs.append(ClusterSpec(name, ("big",), tuple(urls)))
        regions.append(RegionConfig(name=region, lat=lat, lon=lon, clusters=[name]))
    config = RoutingConfig(
        regions=regions,
        default_region="us-west",
        hedging={"enabled": True},
        policy={"prior_ttft_ms": 200.0},
        balancer={"affinity_cluster_ratio": CLUSTER_RATIO},
    )
    return replicas, specs, config


def workload(n: int, rate: float, seed: int):
    """(arrival time, conversation id, turn) — Zipf-skewed conversations, Poisson arrivals."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 1.1 for i in range(CONVERSATIONS)]
    turn = [0] * CONVERSATIONS
    generation = [0] * CONVERSATIONS
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        c = rng.choices(range(CONVERSATIONS), weights)[0]
        if turn[c] == TURNS:
            turn[c] = 0
            generation[c] += 1
        turn[c] += 1
        yield t, (c, generation[c]), turn[c]


def simulate(strategy: str, n: int, rate: float, seed: int) -> dict:
    replicas, specs, config = build_fleet()
    by_url = {r.url: r for r in replicas}
    table = RoutingTable.build(config, specs, None)
    health = HealthState.from_config(config, table.endpoint_ids())
    rng = random.Random(seed + 1)
    balancer_rng = random.Random(seed + 2)
    rr = itertools.cycle(replicas)
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    ttfts: list[float] = []
    decide_ns: list[int] = []
    hits = follow_ups = 0
    next_poll = 0.0

    def drain(until: float) -> None:
        while events and events[0][0] <= until:
            now, _, kind, payload = heapq.heappop(events)
            rep, ttft, tokens, dur = payload
            if kind == "first":
                health.record_first_token(rep.url, ttft, now)
            else:
                rep.inflight -= 1
                health.record_end(rep.url, True, tokens, dur, now, ttft_s=ttft)

    for now, conv, turn in workload(n, rate, seed):
        drain(now)
        for url in health.endpoints_to_probe(now):  # probes answer in one RTT
            health.record_probe(url, True, by_url[url].rtt_s, now)
        prompt = SYSTEM_TOKENS + TURN_TOKENS * turn
        if strategy.startswith("edgegw"):
            key = blake2b(repr(conv).encode(), digest_size=16).digest()
            signals = strategy == "edgegw-signals"
            # the conversation's prompt blocks (64 tokens each), chained: turn n+1 repeats turn n's
            blocks = tuple(hash((conv, i)) for i in range(prompt // 64)) if signals else ()
            if signals and now >= next_poll:  # the servers' own counts, read once a second
                next_poll = now + 1.0
                for r in replicas:
                    health.record_load(r.url, ServerLoad("vllm", r.inflight, 0, None, at=now,
                                                         inflight_at=health.endpoint(r.url).inflight), now)
            req = RouteRequest(model="big", prompt_tokens=prompt, max_tokens=OUTPUT_TOKENS,
                               stream=True, affinity_key=key, affinity_source="session",
                               location=CLIENT, prefix_blocks=blocks)
            t0 = time.perf_counter_ns()
            d = decide(req, table, health, now, rng=balancer_rng)
            decide_ns.append(time.perf_counter_ns() - t0)
            rep = by_url[d.target.endpoint]
            if blocks:
                health.record_routed(rep.url, blocks, now)
        elif strategy == "round-robin":
            rep = next(rr)
        else:
            rep = rng.choice(replicas)
        cached = rep.cache.get(conv, 0)
        if turn > 1:
            follow_ups += 1
            hits += cached > 0
        new_tokens = prompt - cached
        start = max(now + rep.rtt_s / 2, rep.busy_until)
        rep.busy_until = start + new_tokens * rep.prefill_s_per_token
        ttft = rep.busy_until + rep.rtt_s / 2 - now
        rep.inflight += 1
        dur = ttft + OUTPUT_TOKENS * TPOT_S * (1 + 0.02 * rep.inflight)
        rep.cache[conv] = prompt + OUTPUT_TOKENS
        rep.cache.move_to_end(conv)
        if len(rep.cache) > CACHE_CONVERSATIONS:
            rep.cache.popitem(last=False)
        health.record_start(rep.url, now)
        heapq.heappush(events, (now + ttft, next(seq), "first", (rep, ttft, OUTPUT_TOKENS, dur)))
        heapq.heappush(events, (now + dur, next(seq), "end", (rep, ttft, OUTPUT_TOKENS, dur)))
        ttfts.append(ttft)
    ttfts.sort()
    out = {
        "strategy": strategy,
        "p50": ttfts[len(ttfts) // 2] * 1e3,
        "p99": ttfts[int(len(ttfts) * 0.99)] * 1e3,
        "hit": hits / follow_ups if follow_ups else 0.0,
    }
    if decide_ns:
        decide_ns.sort()
        out["decide_p50_us"] = decide_ns[len(decide_ns) // 2] / 1e3
        out["decide_p99_us"] = decide_ns[int(len(decide_ns) * 0.99)] / 1e3
        out["decide_mean_us"] = statistics.fmean(decide_ns) / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=20.0, help="arrivals per simulated second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cluster-ratio", type=float, default=1.25, help="balancer.affinity_cluster_ratio")
    args = ap.parse_args()
    global CLUSTER_RATIO
    CLUSTER_RATIO = args.cluster_ratio
    rows = [simulate(s, args.requests, args.rate, args.seed) for s in ("edgegw", "edgegw-signals", "round-robin", "random")]
    print(f"affinity_cluster_ratio={CLUSTER_RATIO:g}; {args.requests} requests, {args.rate:g}/s, {CONVERSATIONS} Zipf(1.1) conversations of "
          f"{TURNS} turns, 3 clusters x 3 replicas (RTT 10/70/150 ms, one slow replica)\n")
    print("| strategy | TTFT p50 (ms) | TTFT p99 (ms) | KV prefix hit rate | decide() p50 / p99 (µs) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        cost = f"{r['decide_p50_us']:.1f} / {r['decide_p99_us']:.1f}" if "decide_p50_us" in r else "–"
        print(f"| {r['strategy']} | {r['p50']:.0f} | {r['p99']:.0f} | {r['hit']:.1%} | {cost} |")


if __name__ == "__main__":
    main()
