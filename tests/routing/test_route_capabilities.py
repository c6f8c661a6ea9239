"""What a target must honour (structured output, the API) and fallbacks across models.

A request asking for tools, tool_choice or a JSON response_format goes only where it is
honoured: the edge engine only when it reports ``structured_output``; an API other than
chat and completions never goes to the edge. ``routing.fallbacks`` lists other models'
targets after the model's own.
"""

from __future__ import annotations

import pytest
from routing_fixtures import CLUSTERS, EDGE_MODEL, make_config

from routing import (
    ClusterSpec,
    EdgeStats,
    HealthState,
    RouteRequest,
    RoutingTable,
    TargetKind,
    Unservable,
    decide,
    request_from_openai,
    structured_field,
)

NOW = 1000.0
PLAIN = EdgeStats(kv_blocks_free=1000, kv_blocks_total=1000, recent_ttft_ms=80.0)
STRUCTURED = EdgeStats(kv_blocks_free=1000, kv_blocks_total=1000, recent_ttft_ms=80.0, structured_output=True)


def eject_all(health: HealthState, clusters=CLUSTERS) -> None:
    for cluster in clusters:
        for ep in cluster.endpoints:
            for _ in range(health.config.failure_threshold):
                health.record_start(ep, NOW - 1)
                health.record_end(ep, False, 0, 0.1, NOW - 1)


@pytest.mark.parametrize(
    "body, field",
    [
        pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", id="tools"),
        pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None, id="tools-choice-none"),
        pytest.param({"tool_choice": "required"}, "tool_choice", id="tool-choice-required"),
        pytest.param({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", id="tool-choice-named"),
        pytest.param({"response_format": {"type": "json_object"}}, "response_format", id="json-object"),
        pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format", id="json-schema"),
        pytest.param({"response_format": {"type": "text"}}, None, id="text-format"),
        pytest.param({"functions": [{"name": "f"}]}, "functions", id="legacy-functions"),
        pytest.param({}, None, id="plain"),
    ],
)
def test_which_fields_ask_for_structured_output(body, field):
    assert structured_field(body) == field
    assert request_from_openai({"model": "auto", "messages": [], **body}, {}, make_config()).structured == field


def test_auto_with_tools_escalates_even_when_the_policy_lets_the_edge_take_tools(health):
    table = RoutingTable.build(make_config(policy={"edge_handles_tools": True}), CLUSTERS, EDGE_MODEL)
    req = RouteRequest(prompt_tokens=10, has_tools=True, structured="tools")
    d = decide(req, table, health, NOW, edge=PLAIN)
    assert d.target.kind is TargetKind.ENDPOINT
    assert all(t.kind is TargetKind.ENDPOINT for t in d.fallbacks), "the edge must not be a fallback"
    assert "structured output" in d.header_value()
    # an engine that honours it may take it
    d = decide(req, table, health, NOW, edge=STRUCTURED)
    assert d.target.kind is TargetKind.EDGE


def test_auto_needing_structure_never_degrades_to_an_edge_without_it(table, health):
    eject_all(health)
    req = RouteRequest(prompt_tokens=10, structured="response_format")
    cfg = make_config(health={"panic": False})
    table = RoutingTable.build(cfg, CLUSTERS, EDGE_MODEL)
    health = HealthState.from_config(cfg, table.endpoint_ids())
    eject_all(health)
    with pytest.raises(Unservable) as caught:
        decide(req, table, health, NOW, edge=PLAIN)
    assert caught.value.explicit is False and caught.value.param == "response_format"
    assert "structured output" in str(caught.value)
    # the same request without structure degrades to the edge as before
    assert decide(RouteRequest(prompt_tokens=10), table, health, NOW, edge=PLAIN).target.kind is TargetKind.EDGE


def test_auto_without_any_cluster_and_an_edge_without_structure_is_unservable():
    table = RoutingTable.build(make_config(regions=[], default_region=None, local_region=None, aliases={"auto": "auto"}), (), EDGE_MODEL)
    health = HealthState.from_config(table.config, [])
    with pytest.raises(Unservable) as caught:
        decide(RouteRequest(structured="tools"), table, health, NOW, edge=PLAIN)
    assert caught.value.explicit is False and "no central cluster" in str(caught.value)


def test_the_edge_model_named_with_tools_is_the_clients_error(table, health):
    with pytest.raises(Unservable) as caught:
        decide(RouteRequest(model=EDGE_MODEL, structured="tools"), table, health, NOW, edge=PLAIN)
    assert caught.value.explicit is True and caught.value.param == "tools"
    assert decide(RouteRequest(model=EDGE_MODEL, structured="tools"), table, health, NOW, edge=STRUCTURED).target.kind is TargetKind.EDGE


def test_the_edge_model_also_served_centrally_goes_there_for_structure(health):
    clusters = (*CLUSTERS[:2], ClusterSpec("aps", ("llama-70b", EDGE_MODEL), ("http://aps-1",)))
    table = RoutingTable.build(make_config(), clusters, EDGE_MODEL)
    health = HealthState.from_config(table.config, table.endpoint_ids())
    d = decide(RouteRequest(model=EDGE_MODEL, structured="tools"), table, health, NOW, edge=PLAIN)
    assert d.target.cluster == "aps"


@pytest.mark.parametrize("api", ["embeddings", "responses", "audio"])
def test_other_apis_never_go_to_the_edge(table, health, api):
    d = decide(RouteRequest(model="auto", api=api), table, health, NOW, edge=STRUCTURED)
    assert d.target.kind is TargetKind.ENDPOINT and all(t.kind is TargetKind.ENDPOINT for t in d.fallbacks)
    with pytest.raises(Unservable) as caught:
        decide(RouteRequest(model=EDGE_MODEL, api=api), table, health, NOW, edge=STRUCTURED)
    assert caught.value.explicit and api in str(caught.value)


def test_model_fallbacks_follow_the_models_own_targets(health):
    clusters = (
        ClusterSpec("usw", ("big",), ("http://usw-1", "http://usw-2")),
        ClusterSpec("euc", ("medium",), ("http://euc-1",)),
        ClusterSpec("aps", ("other",), ("http://aps-1",)),
    )
    cfg = make_config(aliases={"auto": "auto"}, fallbacks={"big": ["medium", "missing", EDGE_MODEL]})
    table = RoutingTable.build(cfg, clusters, EDGE_MODEL)
    health = HealthState.from_config(cfg, table.endpoint_ids())
    d = decide(RouteRequest(model="big"), table, health, NOW, edge=PLAIN)
    assert [t.endpoint for t in (d.target, *d.fallbacks)] in (["http://usw-1", "http://usw-2"], ["http://usw-2", "http://usw-1"])
    assert [(t.kind, t.model) for t in d.model_fallbacks] == [(TargetKind.ENDPOINT, "medium"), (TargetKind.EDGE, EDGE_MODEL)]
    header = d.header_value()
    assert "model-fallbacks=medium@euc@http://euc-1,smollm2-135m@edge" in header
    assert "missing (served nowhere)" in header
    assert d.hedge_target is None or d.hedge_target.model == "big"  # a hedge races the same model
    # structure the edge cannot honour: it is no fallback either
    d = decide(RouteRequest(model="big", structured="tools"), table, health, NOW, edge=PLAIN)
    assert [t.model for t in d.model_fallbacks] == ["medium"]
    # a model nobody lists has none
    assert decide(RouteRequest(model="other"), table, health, NOW, edge=PLAIN).model_fallbacks == ()
