"""Reading edgegw's Server-Timing and x-edgegw-route as the gateway writes them."""

from __future__ import annotations

import pytest

from loadgen.gateway_headers import own_ms, parse_route, parse_server_timing


def test_server_timing_with_a_comma_inside_a_quoted_description():
    value = 'admit;dur=0.105, cache;dur=0.020, route;dur=0.031, pool;dur=0.002, upstream;dur=1.500;desc="first byte, attempt 2", total;dur=1.700'
    stages = parse_server_timing(value)
    assert stages == {
        "admit": pytest.approx(0.105),
        "cache": pytest.approx(0.02),
        "route": pytest.approx(0.031),
        "pool": pytest.approx(0.002),
        "upstream": pytest.approx(1.5),
        "total": pytest.approx(1.7),
    }
    assert own_ms(stages) == pytest.approx(0.158)


def test_server_timing_tolerates_spacing_other_params_and_entries_without_duration():
    stages = parse_server_timing('miss, db ; desc="x;y" ; dur = 2.5,cpu;dur="1.25", engine;dur=3, engine;dur=1, bad;dur=abc')
    assert stages == {"db": 2.5, "cpu": 1.25, "engine": 4.0}
    assert own_ms(stages) == pytest.approx(3.75)  # engine is the backend's time
    assert own_ms({"upstream": 1.0, "total": 2.0}) is None


@pytest.mark.parametrize(
    "header,label",
    [
        pytest.param("target=endpoint; cluster=central; endpoint=http://10.0.0.1:8000; model=m; budget=800ms", "cluster:central", id="endpoint"),
        pytest.param("target=edge; model=smollm2; target-region=local; why=small model | within budget", "edge", id="edge"),
        pytest.param("target=cache; model=m", "cache", id="cache"),
        pytest.param("target=none; why=no_route", "none", id="none"),
    ],
)
def test_route_labels(header, label):
    assert parse_route(header) == label
