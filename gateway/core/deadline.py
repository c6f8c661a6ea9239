"""A request's latency budget, as one value made once at admission and read everywhere.

Where it comes from, first that applies (``Deadline.admit``): the request's
``x-latency-budget-ms`` header (a positive number, clamped to ``limits.max_budget_ms``),
the tenant's ``budget_ms``, else none. With none, routing's policy default guides routing,
hedging and admission by predicted wait (``Deadline.guide``), but cancels nothing.

Who reads it: the fair queue (a request whose deadline passes while it waits is dropped),
the dispatcher (which targets can start the request in time), the edge engine (a
sequence still waiting when it passes is dropped unrun) and the upstream header writer
(``x-latency-budget-ms`` with what is left, so an edgegw behind keeps the same deadline).
One rounding for all of them: ``header`` floors what is left to whole milliseconds, at
least 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from routing import budget_of

__all__ = ["Deadline"]


class Deadline:
    """``budget_ms``: what routing plans with (``None``: the policy's default); ``at``:
    ``time.monotonic()`` when the request is past saving (``None``: never cancelled);
    ``source``: where the budget came from (``header``, ``tenant``, ``policy``, ``none``)."""

    __slots__ = ("budget_ms", "source", "start", "at")

    def __init__(self, budget_ms: float | None, source: str, start: float, enforced: bool = True) -> None:
        self.budget_ms = budget_ms
        self.source = source
        self.start = start
        self.at = start + budget_ms / 1000 if budget_ms is not None and enforced else None

    @classmethod
    def admit(cls, headers: Mapping[str, str], tenant_budget_ms: float | None, start: float, max_ms: float | None = None) -> Deadline:
        """The deadline a request arriving at ``start`` gets from its header or its tenant."""
        header = budget_of(headers, None, max_ms)
        if header is not None:
            return cls(header, "header", start)
        if tenant_budget_ms is not None:
            return cls(tenant_budget_ms, "tenant", start)
        return cls(None, "none", start)

    @classmethod
    def unbounded(cls, start: float) -> Deadline:
        """No budget at all (a hedge or a cascade's second attempt: the first one keeps the
        request's deadline)."""
        return cls(None, "none", start)

    def guide(self, policy_budget_ms: float) -> Deadline:
        """This deadline once routing has planned with ``policy_budget_ms``: itself when the
        client or its tenant set a budget, else the policy's budget, which guides but never
        cancels."""
        if self.budget_ms is not None:
            return self
        return Deadline(policy_budget_ms, "policy", self.start, enforced=False)

    def left(self, now: float) -> float | None:
        """Seconds left (at least a millisecond), or None when nothing is enforced."""
        if self.at is None:
            return None
        return max(0.001, self.at - now)

    def planned_left(self, now: float) -> float | None:
        """Seconds left of the budget routing plans with, enforced or not (None: no budget)."""
        if self.budget_ms is None:
            return None
        return self.start + self.budget_ms / 1000 - now

    def header(self, now: float) -> bytes | None:
        """``x-latency-budget-ms`` for a request sent at ``now``: what is left, floored to
        whole milliseconds, at least 1; None when nothing is enforced."""
        left = self.left(now)
        return None if left is None else b"%d" % max(1, math.floor(left * 1000))

    def __repr__(self) -> str:
        return f"<Deadline {self.budget_ms}ms from {self.source}{'' if self.at is not None else ', not enforced'}>"
