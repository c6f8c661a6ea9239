import json

import orjson
import pytest
from routing_fixtures import CLUSTERS, EDGE_MODEL, make_config

from routing import (
    ClusterSpec,
    EdgeStats,
    HealthState,
    Location,
    NoRoute,
    RouteRequest,
    RoutingConfig,
    RoutingTable,
    TargetKind,
    UnknownModel,
    cascade_verdict,
    decide,
    explain,
    request_from_openai,
)

SF = Location("US", "San Francisco", 37.77, -122.42)
BERLIN = Location("DE", "Berlin", 52.52, 13.40)
SINGAPORE = Location("SG", "Singapore", 1.35, 103.82)
NOW = 1000.0


def eject(health: HealthState, cluster: str) -> None:
    for ep in next(c for c in CLUSTERS if c.name == cluster).endpoints:
        for _ in range(health.config.failure_threshold):
            health.record_start(ep, NOW - 1)
            health.record_end(ep, False, 0, 0.1, NOW - 1)


def measure(health: HealthState, cluster: str, ttft_s: float) -> None:
    for ep in next(c for c in CLUSTERS if c.name == cluster).endpoints:
        health.record_first_token(ep, ttft_s, NOW - 1)


def nothing(health):
    pass


EDGE_IDLE = EdgeStats(queue_depth=0, kv_blocks_free=1000, kv_blocks_total=1000, recent_ttft_ms=80.0)


@pytest.mark.parametrize(
    "req, edge, setup, kind, cluster, degraded, why",
    [
        pytest.param(dict(prompt_tokens=40, max_tokens=100), EDGE_IDLE, nothing, "edge", None, False, "stays at the edge", id="short-auto-edge"),
        pytest.param(dict(prompt_tokens=5000), EDGE_IDLE, nothing, "endpoint", "usw", False, "prompt ~5000 tokens", id="long-prompt-escalates"),
        pytest.param(dict(prompt_tokens=40, max_tokens=4000), EDGE_IDLE, nothing, "endpoint", "usw", False, "max_tokens 4000", id="large-max-tokens-escalates"),
        pytest.param(dict(prompt_tokens=40, has_tools=True), EDGE_IDLE, nothing, "endpoint", "usw", False, "tools", id="tools-escalate"),
        pytest.param(dict(prompt_tokens=40, has_attachments=True), EDGE_IDLE, nothing, "endpoint", "usw", False, "attachments", id="attachments-escalate"),
        pytest.param(dict(model="llama-70b", prompt_tokens=10), EDGE_IDLE, nothing, "endpoint", "usw", False, "central model", id="explicit-central"),
        pytest.param(dict(model="smart", prompt_tokens=10), EDGE_IDLE, nothing, "endpoint", "usw", False, "central model", id="alias-central"),
        pytest.param(dict(model="fast", prompt_tokens=3000), EDGE_IDLE, nothing, "edge", None, False, "edge model", id="alias-edge"),
        pytest.param(dict(model=EDGE_MODEL), EDGE_IDLE, nothing, "edge", None, False, "edge model", id="explicit-edge-model"),
        pytest.param(dict(model="mixtral"), EDGE_IDLE, nothing, "endpoint", "euc", False, "central model", id="model-only-in-eu"),
        pytest.param(dict(prompt_tokens=40), EdgeStats(queue_depth=50), nothing, "endpoint", "usw", False, "edge queue 50", id="edge-queue-deep"),
        pytest.param(dict(prompt_tokens=40), EdgeStats(healthy=False), nothing, "endpoint", "usw", False, "edge engine unhealthy", id="edge-unhealthy"),
        pytest.param(dict(prompt_tokens=40), EdgeStats(kv_blocks_free=2, kv_blocks_total=1000), nothing, "endpoint", "usw", False, "edge KV full", id="edge-kv-full"),
        pytest.param(dict(prompt_tokens=40, budget_ms=600), EdgeStats(recent_ttft_ms=700), nothing, "endpoint", "usw", False, "edge predicted 700ms > budget 600ms", id="edge-too-slow-for-budget"),
        pytest.param(dict(prompt_tokens=5000), EDGE_IDLE, lambda h: [eject(h, c) for c in ("usw", "euc", "aps")], "edge", None, True, "central path unhealthy", id="degrade-central-ejected"),
        pytest.param(dict(prompt_tokens=5000, budget_ms=300), EDGE_IDLE, nothing, "edge", None, True, "> budget 300ms", id="degrade-budget"),
        pytest.param(dict(prompt_tokens=5000, location=BERLIN), EDGE_IDLE, nothing, "endpoint", "euc", False, "region eu-central", id="berlin-nearest-eu"),
        pytest.param(dict(prompt_tokens=5000, location=SINGAPORE), EDGE_IDLE, nothing, "endpoint", "aps", False, "region ap-southeast", id="singapore-nearest-ap"),
        pytest.param(dict(prompt_tokens=5000, location=BERLIN), EDGE_IDLE, lambda h: measure(h, "euc", 3.0), "endpoint", "usw", False, "region us-west", id="measured-slow-eu-corrects-geo"),
        pytest.param(dict(prompt_tokens=5000, location=BERLIN), EDGE_IDLE, lambda h: eject(h, "euc"), "endpoint", "usw", False, "skipped euc", id="eu-ejected-next-region"),
        pytest.param(dict(prompt_tokens=5000, location=None), EDGE_IDLE, nothing, "endpoint", "usw", False, "default region us-west", id="unknown-location-default"),
    ],
)
def test_decide_table(table, health, req, edge, setup, kind, cluster, degraded, why):
    req = {"location": SF, **req}
    setup(health)
    d = decide(RouteRequest(**req), table, health, NOW, edge=edge)
    assert d.target.kind.value == kind
    assert d.target.cluster == cluster
    assert d.degraded is degraded
    assert any(why in r for r in d.reasons), d.reasons


def test_fallbacks_ordered_and_distinct(table, health):
    d = decide(RouteRequest(prompt_tokens=5000, location=SF), table, health, NOW, edge=EDGE_IDLE)
    labels = [d.target.label()] + [f.label() for f in d.fallbacks]
    assert len(set(labels)) == len(labels)
    assert d.fallbacks[0].cluster == "usw"  # another replica of the same cluster first
    assert d.fallbacks[1].cluster in ("euc", "aps")  # then the next region
    assert len(d.fallbacks) == table.config.policy.max_fallbacks


def test_short_auto_falls_back_to_central(table, health):
    d = decide(RouteRequest(prompt_tokens=10, location=SF), table, health, NOW, edge=EDGE_IDLE)
    assert d.target.kind is TargetKind.EDGE and d.model == EDGE_MODEL
    assert d.fallbacks[0].kind is TargetKind.ENDPOINT and d.fallbacks[0].model == "llama-70b"


def test_escalated_auto_keeps_edge_as_last_resort(table, health):
    cfg = make_config(policy={"max_fallbacks": 10})
    t = RoutingTable.build(cfg, CLUSTERS, EDGE_MODEL)
    d = decide(RouteRequest(prompt_tokens=5000, location=SF), t, health, NOW, edge=EDGE_IDLE)
    assert d.fallbacks[-1].kind is TargetKind.EDGE


@pytest.mark.parametrize(
    "stream, threshold, expected",
    [
        pytest.param(False, -1.5, -1.5, id="non-streaming-cascades"),
        pytest.param(True, -1.5, None, id="streaming-never-cascades"),
        pytest.param(False, None, None, id="cascade-off"),
    ],
)
def test_cascade_threshold(health, stream, threshold, expected):
    t = RoutingTable.build(make_config(policy={"cascade_min_logprob": threshold}), CLUSTERS, EDGE_MODEL)
    d = decide(RouteRequest(prompt_tokens=10, stream=stream, location=SF), t, health, NOW, edge=EDGE_IDLE)
    assert d.target.kind is TargetKind.EDGE
    assert d.cascade_threshold == expected


def test_hedge_after_fraction_of_budget(table, health):
    d = decide(RouteRequest(prompt_tokens=5000, budget_ms=1200, location=SF), table, health, NOW)
    assert d.hedge_after_ms == pytest.approx(600)
    assert d.hedge_target == d.fallbacks[0]
    assert d.hedge_target.endpoint != d.target.endpoint


def test_hedge_min_delay_and_disabled(health):
    t = RoutingTable.build(make_config(hedging={"budget_fraction": 0.01, "min_delay_ms": 75}), CLUSTERS, EDGE_MODEL)
    d = decide(RouteRequest(prompt_tokens=5000, budget_ms=1000, location=SF), t, health, NOW)
    assert d.hedge_after_ms == 75
    t = RoutingTable.build(make_config(hedging={"enabled": False}), CLUSTERS, EDGE_MODEL)
    d = decide(RouteRequest(prompt_tokens=5000, location=SF), t, health, NOW)
    assert d.hedge_after_ms is None and d.hedge_target is None


def test_no_hedge_when_retry_budget_spent(table):
    health = HealthState.from_config(make_config(health={"retry_budget_min": 0, "retry_budget_ratio": 0.5}))
    health.record_start("http://usw-1", NOW)
    health.record_start("http://usw-1", NOW)
    assert health.try_retry(NOW)
    assert not health.try_retry(NOW)
    d = decide(RouteRequest(prompt_tokens=5000, location=SF), table, health, NOW)
    assert d.hedge_after_ms is None
    assert "no hedge: retry budget spent" in d.reasons


def no_panic() -> tuple[RoutingTable, HealthState]:
    config = make_config(health={"panic": False})
    table = RoutingTable.build(config, CLUSTERS, EDGE_MODEL)
    return table, HealthState.from_config(config, table.endpoint_ids())


def test_no_route_when_central_model_ejected_without_panic():
    table, health = no_panic()
    for c in ("usw", "euc", "aps"):
        eject(health, c)
    with pytest.raises(NoRoute) as info:
        decide(RouteRequest(model="llama-70b", location=SF), table, health, NOW)
    assert info.value.retry_after_s == pytest.approx(9.0)  # opened at NOW-1 for 10 s


def test_panic_routes_to_ejected_endpoints_when_nothing_else_is_left(table, health):
    for c in ("usw", "euc", "aps"):
        eject(health, c)
    d = decide(RouteRequest(model="llama-70b", location=SF), table, health, NOW)
    assert d.target.kind is TargetKind.ENDPOINT
    assert any(r.startswith("panic:") for r in d.reasons)


def test_no_panic_while_an_auto_request_can_degrade_to_the_edge(table, health):
    for c in ("usw", "euc", "aps"):
        eject(health, c)
    long_prompt = RouteRequest(model="auto", location=SF, prompt_tokens=5000)
    d = decide(long_prompt, table, health, NOW)
    assert d.target.kind is TargetKind.EDGE and d.degraded
    assert not any(r.startswith("panic:") for r in d.reasons)


def test_breaker_readmission_restores_route(table, health):
    eject(health, "usw")
    d = decide(RouteRequest(model="llama-70b", location=SF), table, health, NOW)
    assert d.target.cluster != "usw"
    later = NOW + 20  # half-open: trial traffic allowed again
    d = decide(RouteRequest(model="llama-70b", location=SF), table, health, later)
    assert d.target.cluster == "usw"


def test_unknown_model(table, health):
    with pytest.raises(UnknownModel):
        decide(RouteRequest(model="gpt-9"), table, health, NOW)


def test_zero_config_single_region():
    cfg = RoutingConfig()
    t = RoutingTable.build(cfg, [ClusterSpec("main", ("big",), ("http://x:8000",))], "small")
    h = HealthState.from_config(cfg, t.endpoint_ids())
    assert list(t.regions) == ["local"]
    short = decide(RouteRequest(prompt_tokens=10), t, h, 0.0)
    long = decide(RouteRequest(prompt_tokens=10_000), t, h, 0.0)
    assert (short.target.kind, short.region) == (TargetKind.EDGE, "local")
    assert (long.target.kind, long.target.endpoint, long.model) == (TargetKind.ENDPOINT, "http://x:8000", "big")


def test_edge_only_gateway_degrades():
    cfg = RoutingConfig()
    t = RoutingTable.build(cfg, [], "small")
    d = decide(RouteRequest(prompt_tokens=10_000), t, HealthState(), 0.0)
    assert d.target.kind is TargetKind.EDGE and d.degraded
    assert "degraded to edge: no central cluster" in d.reasons


def test_central_only_gateway():
    cfg = RoutingConfig()
    t = RoutingTable.build(cfg, [ClusterSpec("main", ("big",), ("http://x:8000",))], None)
    d = decide(RouteRequest(prompt_tokens=10), t, HealthState(), 0.0)
    assert d.target.kind is TargetKind.ENDPOINT
    assert "no edge engine here" in d.reasons[0]


def test_affinity_follow_up_turns_same_endpoint(table, health):
    """Follow-up turns go where the conversation's prefix is cached: the gateway records
    each routed prompt (``record_routed``, as the dispatcher does) in the prefix index."""
    cfg = table.config
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 30_000}]
    endpoints = set()
    for turn in range(4):
        body = {"model": "llama-70b", "messages": convo + [{"role": "assistant", "content": "ok"}] * turn}
        req = request_from_openai(body, {}, cfg, location=SF)
        d = decide(req, table, health, NOW + turn)
        health.record_routed(d.target.endpoint, d.prefix_blocks, NOW + turn)
        endpoints.add(d.target.endpoint)
        assert d.affinity == (None if turn == 0 else "prefix-cache")
    assert len(endpoints) == 1


def test_affinity_by_rendezvous_without_the_prefix_index():
    cfg = make_config(load={"prefix": False})
    table = RoutingTable.build(cfg, CLUSTERS, EDGE_MODEL)
    health = HealthState.from_config(cfg, table.endpoint_ids())
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 30_000}]
    endpoints = set()
    for turn in range(4):
        body = {"model": "llama-70b", "messages": convo + [{"role": "assistant", "content": "ok"}] * turn}
        d = decide(request_from_openai(body, {}, cfg, location=SF), table, health, NOW + turn)
        endpoints.add(d.target.endpoint)
        assert d.affinity == "prefix"  # the hash of the leading messages
    assert len(endpoints) == 1


def test_header_value_is_one_ascii_line(table, health):
    loc = Location("DE", "Düsseldorf\r\nX-Evil: 1", 51.2, 6.8)
    d = decide(RouteRequest(prompt_tokens=5000, location=loc, budget_ms=1500), table, health, NOW)
    v = d.header_value()
    v.encode("ascii")
    assert "\n" not in v and "\r" not in v
    assert v.startswith("target=endpoint; cluster=euc; ")
    assert "budget=1500ms" in v
    assert len(d.header_value(max_len=40)) == 40


def test_to_dict_is_json_with_required_keys(table, health):
    d = decide(RouteRequest(prompt_tokens=5000, location=BERLIN, client_ip="198.51.100.1"), table, health, NOW)
    out = json.loads(orjson.dumps(d.to_dict()))
    for key in ("client_ip", "location", "region", "target", "fallbacks", "reasons"):
        assert key in out
    assert out["client_ip"] == "198.51.100.1"
    assert out["region"] == "eu-central"
    assert out["target"]["cluster"] == "euc"
    assert out["location"]["country"] == "DE"


@pytest.mark.parametrize(
    "peer, headers, body, kind, region",
    [
        pytest.param("10.0.0.9", {"X-Forwarded-For": "198.51.100.4"}, {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}, "edge", "eu-central", id="trusted-eu-short"),
        pytest.param("10.0.0.9", {"X-Forwarded-For": "198.51.100.4"}, {"model": "smart", "messages": [{"role": "user", "content": "hi"}]}, "endpoint", "eu-central", id="trusted-eu-central-model"),
        pytest.param("203.0.113.9", {"X-Forwarded-For": "198.51.100.4"}, {"model": "smart", "messages": []}, "endpoint", "ap-southeast", id="spoofed-header-ignored"),
        pytest.param("100.64.1.1", {}, {"model": "smart", "prompt": "hello"}, "endpoint", "us-west", id="unknown-address-default"),
        pytest.param("10.0.0.9", {"X-Forwarded-For": "198.51.100.4", "x-latency-budget-ms": "250"}, {"model": "auto", "messages": [{"role": "user", "content": "y" * 20000}]}, "edge", "eu-central", id="budget-header-degrades"),
    ],
)
def test_explain(city_db, peer, headers, body, kind, region):
    cfg = make_config(geoip_db=city_db)
    d = explain(cfg, CLUSTERS, peer, headers, body, NOW, edge_model=EDGE_MODEL)
    assert d.target.kind.value == kind
    assert d.region == region
    if kind == "endpoint":
        assert d.target.region == region
    if "x-latency-budget-ms" in headers:
        assert d.budget_ms == 250 and d.degraded


# -- the cascade's verdict on an edge answer ------------------------------------------------


def _chat_answer(*logprobs: float) -> dict:
    content = [{"token": "t", "logprob": lp, "top_logprobs": []} for lp in logprobs]
    return {"choices": [{"index": 0, "message": {"content": "x"}, "logprobs": {"content": content}}]}


def _completion_answer(*logprobs: float) -> dict:
    return {"choices": [{"index": 0, "text": "x", "logprobs": {"token_logprobs": list(logprobs), "tokens": ["t"] * len(logprobs)}}]}


@pytest.mark.parametrize(
    "answer,threshold,escalate,mean",
    [
        pytest.param(_chat_answer(-0.1, -0.3), -1.0, False, -0.2, id="chat-confident"),
        pytest.param(_chat_answer(-2.0, -4.0), -1.0, True, -3.0, id="chat-unsure"),
        pytest.param(_completion_answer(-0.5, -2.5), -1.0, True, -1.5, id="completion-unsure"),
        pytest.param(_completion_answer(-0.5, float("-inf"), -0.5), -1.0, False, -0.5, id="non-finite-ignored"),
        pytest.param({"choices": [{"index": 0, "logprobs": None}]}, -1.0, False, None, id="no-logprobs-kept"),
    ],
)
def test_cascade_verdict(answer, threshold, escalate, mean):
    verdict, measured = cascade_verdict(answer, threshold)
    assert verdict is escalate
    assert measured == (pytest.approx(mean) if mean is not None else None)


def test_a_replica_nobody_has_measured_is_tried_rather_than_starved():
    """Two replicas of one cluster: one measured fast, one never measured. Pessimism about the
    unmeasured one (the 400 ms prior) would send it nothing, ever; it gets the next request."""
    config = RoutingConfig(balancer={"affinity": False}, aliases={})
    specs = (ClusterSpec("usw", ("llama-70b",), ("http://usw-1", "http://usw-2")),)
    table = RoutingTable.build(config, specs, None)
    health = HealthState.from_config(config, table.endpoint_ids())
    health.record_first_token("http://usw-1", 0.05, NOW)
    chosen = {decide(RouteRequest(model="llama-70b", location=SF), table, health, NOW).target.endpoint for _ in range(5)}
    assert chosen == {"http://usw-2"}
    health.record_first_token("http://usw-2", 0.30, NOW)  # measured now, and slower: the fast one wins again
    chosen = {decide(RouteRequest(model="llama-70b", location=SF), table, health, NOW).target.endpoint for _ in range(5)}
    assert chosen == {"http://usw-1"}
