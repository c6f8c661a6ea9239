"""Live per-endpoint state: latency EWMAs, in-flight counts, recent errors, circuit
breakers, active-probe scheduling and the retry budget.

Sans-I/O: the gateway feeds events in (``record_start``, ``record_first_token``,
``record_end``, ``record_probe``) with the time they happened, asks which endpoints to
probe (``endpoints_to_probe(now)``, ``next_probe_at()`` for its timer), does the I/O
itself, and reads ``snapshot(now)`` for metrics. Nothing here reads a clock.

Circuit breaker per endpoint (legal transitions in ``TRANSITIONS``, like h2's
``_transitions``)::

    CLOSED ──TRIP──► OPEN ──COOL_DOWN──► HALF_OPEN ──TRIAL_PASSED──► CLOSED
                      ▲                      │
                      └────TRIAL_FAILED──────┘

- TRIP (passive outlier ejection or failed probes): ``failure_threshold`` consecutive
  failed requests, or ``failure_threshold`` consecutive failed probes, or an error rate
  of at least ``error_rate_threshold`` over ``error_window_s`` with ``min_requests``.
- COOL_DOWN: applied lazily once ``now`` passes the open deadline. The open duration is
  ``open_duration_s`` doubled per consecutive re-open, capped at ``max_open_duration_s``.
- HALF_OPEN admits at most ``half_open_probes`` requests in flight; that many successes
  (requests or probes) close it, one failure re-opens it.

Retry budget: retries and hedges are allowed while they stay under
``retry_budget_ratio`` × requests started in the last ``retry_window_s`` (plus
``retry_budget_min`` always allowed), so a struggling fleet is not hit by a retry storm.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from typing import Any

from .config import BalancerConfig, HealthConfig, LoadConfig, RoutingConfig
from .errors import InvalidTransition
from .prefix import PrefixIndex
from .signals import ServerLoad

__all__ = [
    "BreakerEvent",
    "BreakerState",
    "CircuitBreaker",
    "EndpointHealth",
    "HealthState",
    "RetryBudget",
    "TRANSITIONS",
]


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(str, enum.Enum):
    TRIP = "trip"
    COOL_DOWN = "cool_down"
    TRIAL_PASSED = "trial_passed"
    TRIAL_FAILED = "trial_failed"


TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (BreakerState.CLOSED, BreakerEvent.TRIP): BreakerState.OPEN,
    (BreakerState.OPEN, BreakerEvent.COOL_DOWN): BreakerState.HALF_OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.TRIAL_PASSED): BreakerState.CLOSED,
    (BreakerState.HALF_OPEN, BreakerEvent.TRIAL_FAILED): BreakerState.OPEN,
}


class CircuitBreaker:
    """The state machine alone; ``EndpointHealth`` decides when to send events."""

    __slots__ = ("state", "open_until", "opens", "trial_successes", "transitions")

    def __init__(self) -> None:
        self.state = BreakerState.CLOSED
        self.open_until = 0.0  # when OPEN: the time COOL_DOWN applies
        self.opens = 0  # consecutive openings without a close in between
        self.trial_successes = 0
        self.transitions = 0  # count, for metrics

    def process(self, event: BreakerEvent, now: float, config: HealthConfig) -> BreakerState:
        try:
            new = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise InvalidTransition(self.state, event) from None
        if new is BreakerState.OPEN:
            self.opens += 1
            duration = config.open_duration_s * (2 ** (self.opens - 1))
            self.open_until = now + min(duration, config.max_open_duration_s)
        elif new is BreakerState.HALF_OPEN:
            self.trial_successes = 0
        elif new is BreakerState.CLOSED:
            self.opens = 0
        self.state = new
        self.transitions += 1
        return new

    def __repr__(self) -> str:
        return f"<CircuitBreaker [{self.state.value}, opens={self.opens}]>"


class EndpointHealth:
    """Everything known about one endpoint. Times in seconds."""

    __slots__ = (
        "endpoint",
        "ttft_s",
        "tpot_s",
        "rtt_s",
        "inflight",
        "consecutive_failures",
        "probe_failures",
        "outcomes",
        "window_failures",
        "breaker",
        "last_probe_at",
        "probe_started_at",
        "requests",
        "failures",
        "load",
        "prefix",
        "pending",
        "pending_tokens",
    )

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ttft_s: float | None = None  # EWMA of time to first token (from this gateway)
        self.tpot_s: float | None = None  # EWMA of time per output token
        self.rtt_s: float | None = None  # EWMA of probe round trips
        self.inflight = 0
        self.consecutive_failures = 0
        self.probe_failures = 0
        self.outcomes: deque[tuple[float, bool]] = deque()
        self.window_failures = 0
        self.breaker = CircuitBreaker()
        self.last_probe_at: float | None = None
        self.probe_started_at: float | None = None
        self.requests = 0
        self.failures = 0
        self.load: ServerLoad | None = None  # the server's own last reading of its load
        self.prefix: PrefixIndex | None = None  # prompt prefixes probably in its cache
        # prefill work sent and not yet answered (tokens its cache probably lacked), oldest
        # first: the server prefills roughly in order, so each first token retires the oldest
        self.pending: deque[float] = deque()
        self.pending_tokens = 0.0

    def __repr__(self) -> str:
        return (
            f"<EndpointHealth {self.endpoint} [{self.breaker.state.value}, "
            f"inflight={self.inflight}, ttft={self.ttft_s}]>"
        )


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


class RetryBudget:
    """Retries (and hedges) limited to a fraction of recent requests."""

    __slots__ = ("ratio", "minimum", "window_s", "_requests", "_retries")

    def __init__(self, ratio: float, minimum: int, window_s: float) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.window_s = window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] <= cutoff:
                q.popleft()

    def record_request(self, now: float) -> None:
        self._requests.append(now)

    def can_retry(self, now: float) -> bool:
        self._trim(now)
        return len(self._retries) < self.minimum + self.ratio * len(self._requests)

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows; ``False`` means do not retry."""
        if not self.can_retry(now):
            return False
        self._retries.append(now)
        return True

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, retries) in the current window."""
        self._trim(now)
        return len(self._requests), len(self._retries)


class HealthState:
    """Per-endpoint live state for a gateway process, fed by the gateway."""

    def __init__(
        self,
        config: HealthConfig | None = None,
        *,
        ewma_alpha: float = BalancerConfig().ewma_alpha,
        endpoints: Iterable[str] = (),
        load: LoadConfig | None = None,
        chars_per_token: float = 4.0,
    ) -> None:
        self.config = config if config is not None else HealthConfig()
        self.alpha = ewma_alpha
        self.load_config = load if load is not None else LoadConfig()
        # tokens per prefix block: sizes each endpoint's index from its KV capacity
        self.block_tokens = self.load_config.prefix_block_chars / chars_per_token
        self.retry_budget = RetryBudget(
            self.config.retry_budget_ratio,
            self.config.retry_budget_min,
            self.config.retry_window_s,
        )
        self._endpoints: dict[str, EndpointHealth] = {}
        for ep in endpoints:
            self.endpoint(ep)

    @classmethod
    def from_config(
        cls, config: RoutingConfig, endpoints: Iterable[str] = ()
    ) -> "HealthState":
        return cls(
            config.health,
            ewma_alpha=config.balancer.ewma_alpha,
            endpoints=endpoints,
            load=config.load,
            chars_per_token=config.policy.chars_per_token,
        )

    # -- access -------------------------------------------------------------------

    def endpoint(self, endpoint: str) -> EndpointHealth:
        """The record of ``endpoint``, created on first use."""
        h = self._endpoints.get(endpoint)
        if h is None:
            h = self._endpoints[endpoint] = EndpointHealth(endpoint)
        return h

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def forget(self, endpoint: str) -> None:
        """An endpoint taken out of the configuration (a reload): its record goes."""
        self._endpoints.pop(endpoint, None)

    def retune(self, config: RoutingConfig) -> None:
        """New health, balancer and load settings (a reload); what was measured stays."""
        self.config = config.health
        self.alpha = config.balancer.ewma_alpha
        self.load_config = config.load
        self.block_tokens = self.load_config.prefix_block_chars / config.policy.chars_per_token
        self.retry_budget = RetryBudget(self.config.retry_budget_ratio, self.config.retry_budget_min, self.config.retry_window_s)

    def _advance(self, h: EndpointHealth, now: float) -> BreakerState:
        b = h.breaker
        if b.state is BreakerState.OPEN and now >= b.open_until:
            b.process(BreakerEvent.COOL_DOWN, now, self.config)
        return b.state

    def state(self, endpoint: str, now: float) -> BreakerState:
        return self._advance(self.endpoint(endpoint), now)

    def is_available(self, endpoint: str, now: float) -> bool:
        """May a new request go to ``endpoint`` now? (closed, or half-open with room)."""
        h = self.endpoint(endpoint)
        state = self._advance(h, now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN:
            return h.inflight < self.config.half_open_probes
        return False

    def available_record(self, endpoint: str, now: float) -> EndpointHealth | None:
        """The record of ``endpoint`` if it may take a request now, else ``None``."""
        h = self._endpoints.get(endpoint)
        if h is None:
            h = self.endpoint(endpoint)
        b = h.breaker
        if b.state is BreakerState.CLOSED:
            return h
        state = self._advance(h, now)
        if state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and h.inflight < self.config.half_open_probes
        ):
            return h
        return None

    def available_records(self, endpoints: Iterable[str], now: float) -> list[EndpointHealth]:
        """``available_record`` over several endpoints, in order, the unavailable left out."""
        out = []
        records = self._endpoints
        closed = BreakerState.CLOSED
        for endpoint in endpoints:
            h = records.get(endpoint)
            if h is not None and h.breaker.state is closed:
                out.append(h)
            else:
                h = self.available_record(endpoint, now)
                if h is not None:
                    out.append(h)
        return out

    def error_rate(self, endpoint: str, now: float) -> float:
        h = self.endpoint(endpoint)
        self._trim(h, now)
        n = len(h.outcomes)
        return h.window_failures / n if n else 0.0

    def retry_after_s(self, endpoints: Iterable[str], now: float) -> float | None:
        """Seconds until the first of ``endpoints`` leaves OPEN (``None`` if none is open)."""
        waits = [
            h.breaker.open_until - now
            for h in (self.endpoint(e) for e in endpoints)
            if self._advance(h, now) is BreakerState.OPEN
        ]
        return max(0.0, min(waits)) if waits else None

    # -- events -------------------------------------------------------------------

    def record_start(self, endpoint: str, now: float) -> None:
        """A request (first try, retry or hedge) was sent to ``endpoint``."""
        h = self.endpoint(endpoint)
        self._advance(h, now)
        h.inflight += 1
        h.requests += 1
        self.retry_budget.record_request(now)

    def record_first_token(self, endpoint: str, ttft_s: float, now: float) -> None:
        h = self.endpoint(endpoint)
        h.ttft_s = _ewma(h.ttft_s, ttft_s, self.alpha)
        if h.pending:
            h.pending_tokens = max(0.0, h.pending_tokens - h.pending.popleft())

    def record_end(
        self,
        endpoint: str,
        ok: bool,
        tokens: int,
        duration_s: float,
        now: float,
        *,
        ttft_s: float | None = None,
    ) -> None:
        """A request finished. ``tokens``: output tokens; ``duration_s``: start to end.

        ``ttft_s`` (this request's own TTFT) makes the per-token estimate exact; without
        it the TTFT EWMA is subtracted instead. A cancelled request (client went away)
        should be recorded with ``ok=True`` if the endpoint was fine.
        """
        h = self.endpoint(endpoint)
        state = self._advance(h, now)
        if h.inflight > 0:
            h.inflight -= 1
        while len(h.pending) > h.inflight:  # ended without a first token: its prefill is gone too
            h.pending_tokens = max(0.0, h.pending_tokens - h.pending.popleft())
        self._trim(h, now)
        h.outcomes.append((now, ok))
        cfg = self.config
        if ok:
            h.consecutive_failures = 0
            first = ttft_s if ttft_s is not None else h.ttft_s
            if tokens > 1 and first is not None and duration_s > first:
                h.tpot_s = _ewma(h.tpot_s, (duration_s - first) / (tokens - 1), self.alpha)
            if state is BreakerState.HALF_OPEN:
                self._trial_success(h, now)
            return
        h.failures += 1
        h.window_failures += 1
        h.consecutive_failures += 1
        if state is BreakerState.HALF_OPEN:
            h.breaker.process(BreakerEvent.TRIAL_FAILED, now, cfg)
        elif state is BreakerState.CLOSED:
            n = len(h.outcomes)
            if h.consecutive_failures >= cfg.failure_threshold or (
                n >= cfg.min_requests and h.window_failures / n >= cfg.error_rate_threshold
            ):
                self._trip(h, now)

    def record_abandoned(self, endpoint: str, now: float) -> None:
        """A request sent to ``endpoint`` ended through no doing of the endpoint's (no
        connection came free on this side, the request's own deadline passed, its client
        left): it no longer counts in flight, and it says nothing of the endpoint's health."""
        h = self.endpoint(endpoint)
        self._advance(h, now)
        if h.inflight > 0:
            h.inflight -= 1

    def record_probe(self, endpoint: str, ok: bool, rtt_s: float | None, now: float) -> None:
        """An active probe (``probe_path``) finished; ``rtt_s`` is its round trip."""
        h = self.endpoint(endpoint)
        state = self._advance(h, now)
        h.last_probe_at = now
        h.probe_started_at = None
        if ok:
            h.probe_failures = 0
            if rtt_s is not None:
                h.rtt_s = _ewma(h.rtt_s, rtt_s, self.alpha)
            if state is BreakerState.HALF_OPEN:
                self._trial_success(h, now)
            return
        h.probe_failures += 1
        if state is BreakerState.HALF_OPEN:
            h.breaker.process(BreakerEvent.TRIAL_FAILED, now, self.config)
        elif state is BreakerState.CLOSED and h.probe_failures >= self.config.failure_threshold:
            self._trip(h, now)

    def record_load(self, endpoint: str, load: ServerLoad, now: float) -> None:
        """A reading of the server's own metrics (``routing.signals.read_load``). It sizes
        the endpoint's prefix index when it says how large the KV cache is, and a server
        whose counters went back to zero has restarted: its cache is gone."""
        h = self.endpoint(endpoint)
        previous = h.load
        h.load = load
        if h.prefix is not None:
            if (
                previous is not None
                and previous.hit_counters is not None
                and load.hit_counters is not None
                and load.hit_counters[0] < previous.hit_counters[0]
            ):
                h.prefix.clear()
            if load.kv_capacity_tokens:
                h.prefix.resize(self._capacity_blocks(load.kv_capacity_tokens))

    def fresh_load(self, h: EndpointHealth, now: float) -> ServerLoad | None:
        """``h``'s last server reading if it is within ``load.stale_after_s``, else None."""
        load = h.load
        if load is None or now - load.at > self.load_config.stale_after_s:
            return None
        return load

    def record_routed(self, endpoint: str, blocks: tuple[int, ...], now: float) -> None:
        """A prompt of these prefix blocks (``RouteRequest.prefix_blocks``) was sent to
        ``endpoint``: its server now caches them (and evicts the least recent)."""
        if not blocks:
            return
        h = self.endpoint(endpoint)
        if h.prefix is None:
            tokens = self.load_config.prefix_capacity_tokens
            if h.load is not None and h.load.kv_capacity_tokens:
                tokens = h.load.kv_capacity_tokens
            h.prefix = PrefixIndex(self._capacity_blocks(tokens))
        uncached = (len(blocks) - h.prefix.match(blocks)) * self.block_tokens
        if len(h.pending) < 4096:
            h.pending.append(uncached)
            h.pending_tokens += uncached
        h.prefix.insert(blocks)

    def prefix_match(self, endpoint: str, blocks: tuple[int, ...]) -> int:
        """Leading ``blocks`` that ``endpoint`` probably caches."""
        h = self._endpoints.get(endpoint)
        if h is None or h.prefix is None:
            return 0
        return h.prefix.match(blocks)

    def _capacity_blocks(self, tokens: int) -> int:
        # bounded memory whatever a server claims: 64k blocks is ~4 M tokens of prompts
        return max(1, min(65536, int(tokens / self.block_tokens)))

    def try_retry(self, now: float) -> bool:
        """Spend one unit of the retry budget (call before a retry or a hedge)."""
        return self.retry_budget.try_retry(now)

    def can_retry(self, now: float) -> bool:
        return self.retry_budget.can_retry(now)

    # -- probes -------------------------------------------------------------------

    def _probe_due_at(self, h: EndpointHealth) -> float:
        if h.probe_started_at is not None:
            return h.probe_started_at + self.config.probe_timeout_s
        if h.breaker.state is BreakerState.HALF_OPEN or h.last_probe_at is None:
            return float("-inf")
        return h.last_probe_at + self.config.probe_interval_s

    def endpoints_to_probe(self, now: float) -> list[str]:
        """Endpoints the gateway should probe now; they are marked as being probed.

        Due: never probed, ``probe_interval_s`` since the last probe, half-open (to
        readmit quickly), or a previous probe unanswered after ``probe_timeout_s``; and no
        request in flight there (its requests are its health evidence meanwhile, and some
        servers cut their running generation for any new request, a probe included).
        """
        due = []
        for h in self._endpoints.values():
            self._advance(h, now)
            if h.inflight == 0 and self._probe_due_at(h) <= now:
                h.probe_started_at = now
                due.append(h.endpoint)
        return due

    def next_probe_at(self) -> float | None:
        """The earliest time a probe falls due (for the gateway's timer), or ``None``."""
        times = [self._probe_due_at(h) for h in self._endpoints.values()]
        return min(times) if times else None

    # -- internals ----------------------------------------------------------------

    def _trim(self, h: EndpointHealth, now: float) -> None:
        cutoff = now - self.config.error_window_s
        q = h.outcomes
        while q and q[0][0] <= cutoff:
            _, ok = q.popleft()
            if not ok:
                h.window_failures -= 1

    def _trip(self, h: EndpointHealth, now: float) -> None:
        h.breaker.process(BreakerEvent.TRIP, now, self.config)
        # the window that tripped the breaker should not trip it again after readmission
        h.outcomes.clear()
        h.window_failures = 0
        h.consecutive_failures = 0
        h.probe_failures = 0

    def _trial_success(self, h: EndpointHealth, now: float) -> None:
        h.breaker.trial_successes += 1
        if h.breaker.trial_successes >= self.config.half_open_probes:
            h.breaker.process(BreakerEvent.TRIAL_PASSED, now, self.config)
            h.outcomes.clear()
            h.window_failures = 0
            h.consecutive_failures = 0

    # -- metrics ------------------------------------------------------------------

    def snapshot(self, now: float) -> dict[str, Any]:
        """A JSON-able view for metrics and ``/debug`` pages."""
        out: dict[str, Any] = {}
        for ep, h in self._endpoints.items():
            state = self._advance(h, now)
            out[ep] = {
                "state": state.value,
                "inflight": h.inflight,
                "ttft_ms": None if h.ttft_s is None else h.ttft_s * 1e3,
                "tpot_ms": None if h.tpot_s is None else h.tpot_s * 1e3,
                "rtt_ms": None if h.rtt_s is None else h.rtt_s * 1e3,
                "error_rate": self.error_rate(ep, now),
                "consecutive_failures": h.consecutive_failures,
                "open_until": h.breaker.open_until if state is BreakerState.OPEN else None,
                "requests": h.requests,
                "failures": h.failures,
                "server_load": None if h.load is None else h.load.to_dict(),
                "prefix_blocks": 0 if h.prefix is None else len(h.prefix),
                "pending_prefill_tokens": h.pending_tokens,
            }
        requests, retries = self.retry_budget.counts(now)
        return {"endpoints": out, "retry_budget": {"requests": requests, "retries": retries}}

    def __repr__(self) -> str:
        return f"<HealthState endpoints={len(self._endpoints)}>"
