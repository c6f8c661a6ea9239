from pathlib import Path

import pydantic
import pytest
import yaml
from routing_fixtures import CLUSTERS, EDGE_MODEL, make_config

from routing import (
    budget_of,
    ClusterSpec,
    HealthState,
    RouteRequest,
    RoutingConfig,
    RoutingTable,
    TableError,
    TargetKind,
    decide,
    request_from_openai,
)
from routing.geo import parse_ip

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "multi-region.example.yaml"


def load_example():
    raw = yaml.safe_load(EXAMPLE.read_text())
    clusters = [
        ClusterSpec(c["name"], tuple(c["models"]), tuple(e["url"] for e in c["endpoints"]))
        for c in raw["clusters"]
    ]
    return RoutingConfig.model_validate(raw["routing"]), clusters


def test_example_config_builds_and_routes():
    cfg, clusters = load_example()
    table = RoutingTable.build(cfg, clusters, "smollm2-135m-instruct")
    assert set(table.regions) == {"us-west", "eu-central", "ap-southeast"}
    assert all(r.edge for r in table.regions.values())
    health = HealthState.from_config(cfg, table.endpoint_ids())
    d = decide(RouteRequest(model="large"), table, health, 0.0)
    assert (d.target.cluster, d.model) == ("eu-central-central", "mixtral-8x22b-instruct")
    d = decide(RouteRequest(model="fast", prompt_tokens=9000), table, health, 0.0)
    assert d.target.kind is TargetKind.EDGE


def test_every_config_field_has_a_default():
    cfg = RoutingConfig()
    assert cfg.geoip_db is None and cfg.regions == [] and cfg.aliases == {"auto": "auto"}
    for model in (RoutingConfig, *(type(getattr(cfg, n)) for n in ("policy", "balancer", "health", "hedging"))):
        for name, field in model.model_fields.items():
            assert not field.is_required(), f"{model.__name__}.{name}"


@pytest.mark.parametrize(
    "overrides, match",
    [
        pytest.param({"unknown_key": 1}, "unknown_key", id="extra-forbidden"),
        pytest.param({"policy": {"edge_max_tokens": 1}}, "edge_max_tokens", id="nested-extra-forbidden"),
        pytest.param({"trusted_proxies": ["10.0.0.0/33"]}, "not a CIDR", id="bad-cidr"),
        pytest.param({"default_region": "mars"}, "default_region", id="unknown-default-region"),
        pytest.param({"regions": [{"name": "a"}, {"name": "a"}]}, "duplicate", id="duplicate-region"),
        pytest.param({"regions": [{"name": "a", "lat": 1.0}], "default_region": "a", "local_region": "a"}, "both lat and lon", id="half-coordinates"),
        pytest.param({"hedging": {"budget_fraction": 1.5}}, "budget_fraction", id="fraction-range"),
    ],
)
def test_config_rejects(overrides, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        make_config(**overrides)


@pytest.mark.parametrize(
    "config, clusters, match",
    [
        pytest.param(make_config(), CLUSTERS[:2], "unknown cluster 'aps'", id="region-lists-unknown-cluster"),
        pytest.param(make_config(), CLUSTERS + (ClusterSpec("extra", ("m",), ("http://e",)),), "not listed in any region", id="orphan-cluster"),
        pytest.param(make_config(), CLUSTERS + (CLUSTERS[0],), "duplicate cluster", id="duplicate-cluster"),
        pytest.param(RoutingConfig(), [ClusterSpec("c", ("m",), ())], "no endpoints", id="no-endpoints"),
        pytest.param(make_config(aliases={"x": "nope"}), CLUSTERS, "no cluster serves", id="alias-to-unserved"),
        pytest.param(make_config(policy={"central_model": "nope"}), CLUSTERS, "central_model", id="central-model-unserved"),
    ],
)
def test_table_rejects(config, clusters, match):
    with pytest.raises(TableError, match=match):
        RoutingTable.build(config, clusters, EDGE_MODEL)


def test_edge_alias_without_engine_rejected():
    with pytest.raises(TableError, match="no edge engine"):
        RoutingTable.build(make_config(), CLUSTERS, None)


def test_table_queries(table):
    assert table.local_region == "us-west" and table.edge_model == EDGE_MODEL
    assert [c.name for c in table.clusters_for("llama-70b")] == ["usw", "euc", "aps"]
    assert table.resolve_model("smart").model == "llama-70b"
    assert "fast" in table.models() and EDGE_MODEL in table.models() and "mixtral" in table.models()
    assert len(table.endpoint_ids()) == 6
    assert "us-west" in repr(table)


@pytest.mark.parametrize(
    "body, headers, expect",
    [
        pytest.param({"messages": [{"role": "user", "content": "x" * 400}]}, {}, dict(model="auto", prompt_tokens=104, affinity_source="prefix"), id="chat-defaults"),
        pytest.param({"model": "smart", "prompt": "y" * 80, "max_tokens": 64, "stream": True}, {}, dict(model="smart", prompt_tokens=20, max_tokens=64, stream=True, affinity_source=None), id="completions"),
        pytest.param({"messages": [], "max_completion_tokens": 9, "max_tokens": 3}, {}, dict(max_tokens=9), id="max-completion-tokens-wins"),
        pytest.param({"messages": [], "tools": [{"type": "function"}]}, {}, dict(has_tools=True), id="tools"),
        pytest.param({"messages": [], "tools": []}, {}, dict(has_tools=False), id="empty-tools"),
        pytest.param({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "data:"}}]}]}, {}, dict(has_attachments=True, prompt_tokens=5), id="attachment"),
        pytest.param({"messages": [], "user": "u1"}, {"X-Session-Id": "abc"}, dict(affinity_source="session"), id="session-header-wins"),
        pytest.param({"messages": [], "user": "u1"}, {}, dict(affinity_source="user"), id="user-field"),
    ],
)
def test_request_from_openai(body, headers, expect):
    req = request_from_openai(body, headers, RoutingConfig())
    for key, value in expect.items():
        assert getattr(req, key) == value, key


def test_affinity_key_stable_across_turns_and_distinct_across_conversations():
    cfg = RoutingConfig()
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    k1 = request_from_openai({"messages": head}, {}, cfg).affinity_key
    k2 = request_from_openai({"messages": head + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}, {}, cfg).affinity_key
    k3 = request_from_openai({"messages": [head[0], {"role": "user", "content": "other"}]}, {}, cfg).affinity_key
    assert k1 == k2 != k3
    off = RoutingConfig(balancer={"affinity": False})
    assert request_from_openai({"messages": head}, {}, off).affinity_key is None


@pytest.mark.parametrize(
    "headers, tenant, max_ms, expect",
    [
        pytest.param({"X-Latency-Budget-Ms": "350"}, None, None, 350.0, id="header"),
        pytest.param({"x-latency-budget-ms": "350"}, 800, None, 350.0, id="header-over-tenant"),
        pytest.param({}, 800, None, 800, id="tenant-without-header"),
        pytest.param({"x-latency-budget-ms": "-5"}, None, None, None, id="negative-ignored"),
        pytest.param({"x-latency-budget-ms": "nan"}, 800, None, 800, id="nan-ignored"),
        pytest.param({"x-latency-budget-ms": "1e308"}, None, 600000, 600000, id="clamped"),
        pytest.param({"x-latency-budget-ms": "inf"}, None, 600000, None, id="infinite-ignored"),
    ],
)
def test_budget_of(headers, tenant, max_ms, expect):
    assert budget_of(headers, tenant, max_ms) == expect


def test_request_carries_the_budget_its_caller_decided():
    assert request_from_openai({"messages": []}, {"x-latency-budget-ms": "5"}, RoutingConfig(), budget_ms=800).budget_ms == 800
    assert request_from_openai({"messages": []}, {}, RoutingConfig()).budget_ms is None


@pytest.mark.parametrize("text, expected", [("::ffff:1.2.3.4", "1.2.3.4"), ("fe80::1%eth0", "fe80::1"), (" 10.0.0.1 ", "10.0.0.1"), ("1.2.3", None)])
def test_parse_ip(text, expected):
    addr = parse_ip(text)
    assert (None if addr is None else str(addr)) == expected
