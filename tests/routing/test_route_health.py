import pytest

from routing import BreakerState, HealthConfig, HealthState, InvalidTransition, RetryBudget
from routing.health import TRANSITIONS, BreakerEvent, CircuitBreaker

EP = "http://a"
CFG = HealthConfig(
    failure_threshold=3,
    open_duration_s=10.0,
    max_open_duration_s=25.0,
    half_open_probes=2,
    error_rate_threshold=0.5,
    min_requests=6,
    error_window_s=30.0,
    probe_interval_s=5.0,
    probe_timeout_s=2.0,
)


def fail(h: HealthState, now: float, ep: str = EP) -> None:
    h.record_start(ep, now)
    h.record_end(ep, False, 0, 0.1, now)


def succeed(h: HealthState, now: float, ep: str = EP) -> None:
    h.record_start(ep, now)
    h.record_end(ep, True, 10, 0.5, now)


def test_transition_table_is_exactly_the_four_edges():
    assert TRANSITIONS == {
        (BreakerState.CLOSED, BreakerEvent.TRIP): BreakerState.OPEN,
        (BreakerState.OPEN, BreakerEvent.COOL_DOWN): BreakerState.HALF_OPEN,
        (BreakerState.HALF_OPEN, BreakerEvent.TRIAL_PASSED): BreakerState.CLOSED,
        (BreakerState.HALF_OPEN, BreakerEvent.TRIAL_FAILED): BreakerState.OPEN,
    }


@pytest.mark.parametrize(
    "event",
    [BreakerEvent.COOL_DOWN, BreakerEvent.TRIAL_PASSED, BreakerEvent.TRIAL_FAILED],
)
def test_illegal_transition_from_closed(event):
    with pytest.raises(InvalidTransition):
        CircuitBreaker().process(event, 0.0, CFG)


def test_closed_open_half_open_closed():
    h = HealthState(CFG, endpoints=[EP])
    for t in range(2):
        fail(h, float(t))
    assert h.state(EP, 2.0) is BreakerState.CLOSED
    fail(h, 2.0)  # third consecutive failure: ejected
    assert h.state(EP, 2.0) is BreakerState.OPEN
    assert not h.is_available(EP, 11.9)
    assert h.retry_after_s([EP], 5.0) == pytest.approx(7.0)
    # cool-down elapsed: half-open, admits at most half_open_probes in flight
    assert h.state(EP, 12.0) is BreakerState.HALF_OPEN
    h.record_start(EP, 12.0)
    h.record_start(EP, 12.0)
    assert not h.is_available(EP, 12.0)
    h.record_end(EP, True, 5, 0.2, 12.5)
    assert h.state(EP, 12.5) is BreakerState.HALF_OPEN
    h.record_end(EP, True, 5, 0.2, 12.6)
    assert h.state(EP, 12.6) is BreakerState.CLOSED
    assert h.is_available(EP, 12.6)


def test_success_resets_consecutive_failures():
    h = HealthState(CFG)
    fail(h, 0.0)
    fail(h, 0.1)
    succeed(h, 0.2)
    fail(h, 0.3)
    fail(h, 0.4)
    assert h.state(EP, 0.5) is BreakerState.CLOSED


def test_half_open_failure_reopens_with_doubled_then_capped_duration():
    h = HealthState(CFG)
    for t in range(3):
        fail(h, 0.0)
    assert h.endpoint(EP).breaker.open_until == 10.0
    assert h.state(EP, 10.0) is BreakerState.HALF_OPEN
    fail(h, 10.0)
    assert h.state(EP, 10.0) is BreakerState.OPEN
    assert h.endpoint(EP).breaker.open_until == 30.0  # 2 x 10 s
    assert h.state(EP, 30.0) is BreakerState.HALF_OPEN
    fail(h, 30.0)
    assert h.endpoint(EP).breaker.open_until == 55.0  # 40 s capped at 25 s
    # readmitted: the doubling resets
    h.record_probe(EP, True, 0.01, 55.0)
    h.record_probe(EP, True, 0.01, 55.1)
    assert h.state(EP, 55.1) is BreakerState.CLOSED
    for t in range(3):
        fail(h, 60.0)
    assert h.endpoint(EP).breaker.open_until == 70.0


def test_error_rate_ejection_needs_min_requests():
    h = HealthState(CFG)
    # alternate fail/success: never 3 in a row, error rate 50 %
    for i in range(5):
        (fail if i % 2 == 0 else succeed)(h, float(i))
    assert h.state(EP, 5.0) is BreakerState.CLOSED  # 5 < min_requests
    fail(h, 5.0)  # 6 requests, 4 failures
    assert h.state(EP, 5.0) is BreakerState.OPEN


def test_error_window_forgets_old_failures():
    h = HealthState(CFG)
    for i in range(2):
        fail(h, float(i))
    succeed(h, 2.0)
    assert h.error_rate(EP, 2.0) == pytest.approx(2 / 3)
    assert h.error_rate(EP, 40.0) == 0.0


def test_probe_failures_trip_and_probes_readmit():
    h = HealthState(CFG, endpoints=[EP])
    for t in range(3):
        h.record_probe(EP, False, None, float(t))
    assert h.state(EP, 3.0) is BreakerState.OPEN
    assert h.state(EP, 13.0) is BreakerState.HALF_OPEN
    h.record_probe(EP, True, 0.02, 13.0)
    h.record_probe(EP, True, 0.04, 13.5)
    assert h.state(EP, 13.5) is BreakerState.CLOSED
    assert h.endpoint(EP).rtt_s == pytest.approx(0.02 + 0.3 * (0.04 - 0.02))


def test_endpoints_to_probe_schedule():
    h = HealthState(CFG, endpoints=["http://a", "http://b"])
    assert h.endpoints_to_probe(0.0) == ["http://a", "http://b"]  # never probed
    assert h.endpoints_to_probe(0.5) == []  # in flight
    assert h.next_probe_at() == 2.0  # probe timeout
    h.record_probe("http://a", True, 0.01, 1.0)
    assert h.endpoints_to_probe(2.0) == ["http://b"]  # b timed out: probe again
    assert h.next_probe_at() == 4.0  # b's new probe times out at 4.0; a is due at 6.0
    h.record_probe("http://b", True, 0.01, 2.5)
    assert h.next_probe_at() == 6.0
    assert h.endpoints_to_probe(5.9) == []
    assert h.endpoints_to_probe(6.0) == ["http://a"]


def test_half_open_endpoint_is_probed_at_once():
    h = HealthState(CFG, endpoints=[EP])
    h.record_probe(EP, True, 0.01, 0.0)
    for _ in range(3):
        fail(h, 1.0)
    assert h.endpoints_to_probe(4.0) == []  # open, interval not elapsed
    assert h.endpoints_to_probe(11.0) == [EP]  # half-open at 11.0


def test_ewma_ttft_and_tpot():
    h = HealthState(CFG, ewma_alpha=0.5)
    h.record_start(EP, 0.0)
    h.record_first_token(EP, 0.2, 0.2)
    h.record_end(EP, True, 11, 1.2, 1.2, ttft_s=0.2)
    e = h.endpoint(EP)
    assert e.ttft_s == pytest.approx(0.2)
    assert e.tpot_s == pytest.approx(0.1)
    h.record_start(EP, 2.0)
    h.record_first_token(EP, 0.4, 2.4)
    h.record_end(EP, True, 11, 2.4, 4.4)  # no own ttft: EWMA (0.3) subtracted
    assert e.ttft_s == pytest.approx(0.3)
    assert e.tpot_s == pytest.approx(0.5 * 0.1 + 0.5 * 0.21)
    assert e.inflight == 0


def test_inflight_never_negative():
    h = HealthState(CFG)
    h.record_end(EP, True, 1, 0.1, 0.0)
    assert h.endpoint(EP).inflight == 0


def test_retry_budget_ratio_and_window():
    b = RetryBudget(ratio=0.2, minimum=1, window_s=10.0)
    for i in range(10):
        b.record_request(float(i) * 0.1)
    allowed = sum(b.try_retry(1.0) for _ in range(10))
    assert allowed == 3  # 1 + 0.2 * 10
    assert not b.can_retry(1.0)
    assert b.counts(1.0) == (10, 3)
    assert b.can_retry(11.5)  # the window has moved on
    assert b.counts(11.5) == (0, 0)


def test_snapshot_shape():
    h = HealthState(CFG, endpoints=[EP, "http://b"])
    for _ in range(3):
        fail(h, 0.0)
    h.try_retry(0.0)
    snap = h.snapshot(1.0)
    assert snap["endpoints"][EP]["state"] == "open"
    assert snap["endpoints"][EP]["open_until"] == 10.0
    assert snap["endpoints"]["http://b"]["state"] == "closed"
    assert snap["retry_budget"] == {"requests": 3, "retries": 1}
