"""The request's ``Deadline``: made once, from the header or the tenant; the policy's default
guides but never cancels; one rounding for everyone who forwards it."""

from __future__ import annotations

import pytest

from gateway.core.deadline import Deadline

START = 1000.0


@pytest.mark.parametrize(
    "headers, tenant, source, budget",
    [
        pytest.param({"x-latency-budget-ms": "250"}, 900.0, "header", 250.0, id="header-wins"),
        pytest.param({}, 900.0, "tenant", 900.0, id="tenant"),
        pytest.param({}, None, "none", None, id="none"),
        pytest.param({"x-latency-budget-ms": "1e308"}, None, "header", 600_000.0, id="clamped"),
        pytest.param({"x-latency-budget-ms": "0"}, None, "none", None, id="zero-ignored"),
    ],
)
def test_where_a_deadline_comes_from(headers, tenant, source, budget):
    deadline = Deadline.admit(headers, tenant, START, max_ms=600_000)
    assert (deadline.source, deadline.budget_ms) == (source, budget)
    assert deadline.at == (None if budget is None else START + budget / 1000)


def test_the_policy_default_guides_but_never_cancels():
    deadline = Deadline.admit({}, None, START).guide(2000.0)
    assert deadline.budget_ms == 2000.0 and deadline.source == "policy"
    assert deadline.at is None and deadline.left(START + 5) is None and deadline.header(START) is None
    assert deadline.planned_left(START + 0.5) == pytest.approx(1.5)  # admission by predicted wait plans with it
    own = Deadline.admit({"x-latency-budget-ms": "300"}, None, START)
    assert own.guide(2000.0) is own  # a budget the client set stays the deadline


def test_one_rounding_floors_whole_milliseconds_and_never_sends_zero():
    deadline = Deadline.admit({"x-latency-budget-ms": "300"}, None, START)
    assert deadline.header(START + 0.0994) == b"200"  # 200.6 ms left
    assert deadline.header(START + 0.2999) == b"1"  # 0.1 ms left: at least 1
    assert deadline.header(START + 5) == b"1"  # passed
    assert deadline.left(START + 5) == 0.001
