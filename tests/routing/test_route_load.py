"""The servers' load and the prefix index in ``decide``: tables of who gets the request."""

from __future__ import annotations

import random

import pytest
from routing_fixtures import CLUSTERS, EDGE_MODEL, make_config

from routing import HealthState, Location, RoutingTable, decide, request_from_openai
from routing.signals import ServerLoad

SF = Location("US", "San Francisco", 37.77, -122.42)
USW = ("http://usw-1", "http://usw-2", "http://usw-3")
NOW = 1000.0
SYSTEM = "You are a careful assistant for a large retailer. " * 40  # ~2 k characters
SYSTEM_B = "You answer questions about the tax code, citing sections. " * 40


def setup(**overrides):
    cfg = make_config(**overrides)
    table = RoutingTable.build(cfg, CLUSTERS, EDGE_MODEL)
    health = HealthState.from_config(cfg, table.endpoint_ids())
    for ep in table.endpoint_ids():  # every replica measured alike: load and cache decide
        health.record_first_token(ep, 0.2 if ep.startswith("http://usw") else 0.5, NOW)
    return cfg, table, health


def chat(system: str, user: str) -> dict:
    return {"model": "llama-70b", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def route(cfg, table, health, body, now=NOW, seed=0):
    req = request_from_openai(body, {}, cfg, location=SF)
    return decide(req, table, health, now, rng=random.Random(seed))


def server(health, ep, running, waiting=0, kv=None, at=NOW, inflight_at=0):
    health.record_load(ep, ServerLoad("vllm", running, waiting, kv, at=at, inflight_at=inflight_at), at)


def test_a_cached_system_prompt_goes_where_it_is_cached():
    cfg, table, health = setup()
    health.record_routed("http://usw-2", route(cfg, table, health, chat(SYSTEM, "first")).prefix_blocks, NOW)
    for i in range(5):
        d = route(cfg, table, health, chat(SYSTEM, f"another user {i}"), seed=i)
        assert d.target.endpoint == "http://usw-2"
        assert d.affinity == "prefix-cache"
        assert any("cached prefix" in r for r in d.reasons)


def test_the_prefix_holder_at_the_load_bound_overflows_to_the_next_best_holder():
    cfg, table, health = setup()
    blocks = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    health.record_routed("http://usw-1", blocks, NOW)
    health.record_routed("http://usw-3", blocks[:3], NOW)  # a shorter part of it
    server(health, "http://usw-1", running=12, waiting=6)  # the server says: full
    d = route(cfg, table, health, chat(SYSTEM, "y"))
    assert d.target.endpoint == "http://usw-3"
    assert d.affinity == "prefix-cache-partial"


@pytest.mark.parametrize(
    "reading_age_s, expected",
    [
        pytest.param(0.5, "http://usw-2", id="fresh-reading-steers-away"),
        pytest.param(10.0, "http://usw-1", id="stale-reading-ignored"),
    ],
)
def test_stale_server_readings_are_ignored(reading_age_s, expected):
    cfg, table, health = setup()
    blocks = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    health.record_routed("http://usw-1", blocks, NOW)
    health.record_routed("http://usw-2", blocks, NOW - 1)
    server(health, "http://usw-1", running=30, waiting=20, at=NOW - reading_age_s)
    assert cfg.load.stale_after_s == 3.0
    d = route(cfg, table, health, chat(SYSTEM, "y"))
    assert d.target.endpoint == expected


@pytest.mark.parametrize(
    "loads, best, worst",
    [
        # (running, waiting, kv) per usw endpoint, as the servers report them
        pytest.param([(8, 4, 0.5), (1, 0, 0.2), (5, 1, 0.5)], "http://usw-2", "http://usw-1", id="least-loaded-server"),
        pytest.param([(1, 0, 0.99), (0, 0, 0.3), (1, 0, 0.3)], "http://usw-2", "http://usw-1", id="kv-nearly-full-avoided"),
        pytest.param([(0, 0, 0.1), (6, 0, 0.1), (3, 0, 0.1)], "http://usw-1", "http://usw-2", id="idle-server"),
    ],
)
def test_no_prefix_goes_by_server_load(loads, best, worst):
    """Power of two choices on the merged load: the worst is never taken, the best
    whenever it is one of the two drawn."""
    cfg, table, health = setup()
    for ep, (r, w, kv) in zip(USW, loads):
        server(health, ep, r, w, kv)
    chosen = [route(cfg, table, health, {"model": "llama-70b", "prompt": f"q{i}"}, seed=i).target.endpoint for i in range(30)]
    assert worst not in chosen
    assert chosen.count(best) > len(chosen) / 2


def test_our_own_requests_are_not_counted_twice():
    cfg, table, health = setup()
    # usw-1's server reports 6 requests, all 6 of them ours (in flight when it was read)
    for _ in range(6):
        health.record_start("http://usw-1", NOW)
    server(health, "http://usw-1", running=6, inflight_at=6)
    server(health, "http://usw-2", running=4)
    server(health, "http://usw-3", running=4)
    h1 = health.endpoint("http://usw-1")
    assert h1.load.merged_load(h1.inflight) == 6  # not 12
    chosen = [route(cfg, table, health, {"model": "llama-70b", "prompt": f"q{i}"}, seed=i).target.endpoint for i in range(20)]
    assert "http://usw-1" not in chosen  # 6 on it against 4
    # our requests finish: the server's stale 6 were ours, gone now; usw-1 is the idlest
    for _ in range(6):
        health.record_end("http://usw-1", True, 10, 1.0, NOW)
    assert h1.load.merged_load(h1.inflight) == 0
    chosen = [route(cfg, table, health, {"model": "llama-70b", "prompt": f"q{i}"}, seed=i).target.endpoint for i in range(20)]
    assert chosen.count("http://usw-1") > len(chosen) / 2


def test_a_different_system_prompt_is_not_pulled_to_the_first_ones_replica():
    cfg, table, health = setup()
    health.record_routed("http://usw-1", route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks, NOW)
    d = route(cfg, table, health, chat(SYSTEM_B, "y"))
    assert d.affinity not in ("prefix-cache", "prefix-cache-partial")


def test_cross_region_the_cache_and_load_trade_against_rtt():
    cfg, table, health = setup()
    blocks = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    # the near region is swamped (its servers say so); the far region is idle
    for ep in USW:
        server(health, ep, running=40, waiting=40)
        health.record_first_token(ep, 3.0, NOW)
    d = route(cfg, table, health, chat(SYSTEM, "y"))
    assert d.target.cluster != "usw"
    # once the near region is back, it wins again
    for ep in USW:
        server(health, ep, running=1, waiting=0, at=NOW + 1)
        for _ in range(8):
            health.record_first_token(ep, 0.2, NOW + 1)
    health.record_routed("http://usw-2", blocks, NOW + 1)
    d = route(cfg, table, health, chat(SYSTEM, "z"), now=NOW + 1)
    assert d.target.endpoint == "http://usw-2"


def test_prefix_off_keeps_the_old_behaviour():
    cfg, table, health = setup(load={"prefix": False})
    assert request_from_openai(chat(SYSTEM, "x"), {}, cfg).prefix_blocks == ()
    d = route(cfg, table, health, chat(SYSTEM, "x"))
    assert d.prefix_blocks == ()


def test_record_load_sizes_the_index_and_a_restart_clears_it():
    cfg, table, health = setup()
    blocks = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    health.record_routed("http://usw-1", blocks, NOW)
    assert health.prefix_match("http://usw-1", blocks) == len(blocks)
    h = health.endpoint("http://usw-1")
    health.record_load("http://usw-1", ServerLoad("vllm", 0, 0, at=NOW, hit_counters=(1e6, 5e5), kv_capacity_tokens=640), NOW)
    assert h.prefix.capacity == 640 // 64  # 256-character blocks at 4 characters a token
    assert len(h.prefix) <= 10
    health.record_load("http://usw-1", ServerLoad("vllm", 0, 0, at=NOW + 1, hit_counters=(10.0, 0.0)), NOW + 1)
    assert health.prefix_match("http://usw-1", blocks) == 0  # its counters restarted: so did its cache
    snap = health.snapshot(NOW + 1)["endpoints"]["http://usw-1"]
    assert snap["server_load"]["running"] == 0 and snap["prefix_blocks"] == 0


def test_pending_prefill_is_retired_in_order_by_first_tokens_and_ends():
    cfg, table, health = setup()
    a = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    b = route(cfg, table, health, chat(SYSTEM_B, "y")).prefix_blocks
    h = health.endpoint("http://usw-1")
    for blocks in (a, b):
        health.record_routed("http://usw-1", blocks, NOW)
        health.record_start("http://usw-1", NOW)
    assert h.pending_tokens == (len(a) + len(b)) * 64  # nothing was cached: all of both
    health.record_routed("http://usw-1", a, NOW)  # the same prompt again: cached now
    health.record_start("http://usw-1", NOW)
    assert h.pending_tokens == (len(a) + len(b)) * 64 and len(h.pending) == 3
    health.record_first_token("http://usw-1", 0.3, NOW + 1)  # the oldest is answered
    assert h.pending_tokens == len(b) * 64
    health.record_end("http://usw-1", False, 0, 1.0, NOW + 2)  # one failed before its first token
    health.record_end("http://usw-1", True, 16, 1.0, NOW + 2)
    assert len(h.pending) <= h.inflight == 1


def test_a_new_prompt_goes_where_less_prefill_is_queued():
    cfg, table, health = setup()
    blocks = route(cfg, table, health, chat(SYSTEM, "x")).prefix_blocks
    for ep in USW:  # all three cache the system prompt
        health.record_routed(ep, blocks, NOW)
        health.record_first_token(ep, 0.2, NOW)
    for i in range(3):  # usw-1 and usw-2 were just sent long uncached prompts
        for ep in ("http://usw-1", "http://usw-2"):
            other = route(cfg, table, health, chat(SYSTEM_B + str(i), "q")).prefix_blocks
            health.record_routed(ep, other, NOW)
            health.record_start(ep, NOW)
    health.record_start("http://usw-3", NOW)  # usw-3 is busier by count, not by prefill
    health.record_start("http://usw-3", NOW)
    health.record_start("http://usw-3", NOW)
    health.record_start("http://usw-3", NOW)
    d = route(cfg, table, health, chat(SYSTEM, "z"))
    assert d.target.endpoint == "http://usw-3"
    cfg2, table2, health2 = setup(load={"prefix_pending_weight": 0})
    for ep in USW:
        health2.record_routed(ep, blocks, NOW)
    for _ in range(4):
        health2.record_start("http://usw-3", NOW)
    assert route(cfg2, table2, health2, chat(SYSTEM, "z")).target.endpoint != "http://usw-3"
