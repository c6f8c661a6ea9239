"""Monthly token quotas: ``tenants[].quota.monthly_tokens`` (and ``auth.anonymous.quota``).

A tenant whose prompt + completion tokens this calendar month (UTC, as ``gateway.observe.usage``
counts them: cache hits are free) have reached its quota is refused at admission with
OpenAI's answer to an exhausted account: 429, ``type`` and ``code`` ``insufficient_quota``,
and ``x-should-retry: false`` (the OpenAI SDKs would otherwise retry a 429). The request
that crosses the line is answered in full: the quota is checked before a request, its
tokens are known after it (OpenAI's own quotas behave so).

With ``usage.redis_url`` every replica counts into the same monthly total, so the quota is
the fleet's; a replica sees the others' tokens within about ``usage.flush_interval_s``.
Redis unreachable: the last figure read stands (admitting, as rate limits fail open).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from gateway.core.errors import InsufficientQuota
from gateway.core.tenant import Tenant
from gateway.observe.usage import Usage

__all__ = ["check_quota", "month_ends"]


def month_ends(now: float) -> float:
    """The Unix time the calendar month (UTC) of ``now`` ends."""
    day = datetime.fromtimestamp(now, timezone.utc)
    year, month = (day.year + 1, 1) if day.month == 12 else (day.year, day.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp()


async def check_quota(tenant: Tenant, usage: Usage, now: float | None = None) -> None:
    """Raise ``InsufficientQuota`` when ``tenant`` has spent its monthly tokens."""
    limit = tenant.policy.quota.monthly_tokens
    if limit is None or not usage.settings.enabled:
        return
    now = time.time() if now is None else now
    used = await usage.month_tokens(tenant.name, now)
    if used >= limit:
        reset = datetime.fromtimestamp(month_ends(now), timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        raise InsufficientQuota(
            f"You exceeded your current quota: {used} of {limit} tokens this month (resets {reset}).",
        )
