"""Requests and tokens per minute per tenant: GCRA, in memory or shared through Redis.

GCRA (the generic cell rate algorithm, a leaky bucket kept as one number): a limit of L per
minute is one unit every T = 60/L seconds, and a key stores its *theoretical arrival time*
(TAT). A request costing c units is admitted when ``max(TAT, now) + c*T - now <= 60 s``
(a full minute's quota may be spent at once), and then moves the TAT by ``c*T``. One
number per key, no window edges to game, and ``remaining``, ``reset`` and ``Retry-After``
fall out of it: exactly the OpenAI headers. (A sliding window needs a sorted set per key
and still approximates; a fixed window lets a tenant spend two minutes' quota across an
edge.)

With ``rate_limits.backend: redis`` every check is one Lua script that reads the clock of
Redis itself (one clock for every replica), checks both the request and the token limit,
and updates both only if both allow: replicas never admit more than the limit plus what
one refill interval lets in. Redis slow or down: the call is bounded by ``timeout_s``, a
circuit then skips Redis for ``cooldown_s``, and requests are admitted (``fail_closed:
false``, the default) or refused with 503 (``fail_closed: true``) — never held.

Tokens are estimated at admission (the prompt's characters / 4, plus ``max_tokens`` or
``default_output_tokens``) and settled when the answer ends with its real ``usage``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from cache.circuit import Circuit
from cache.redis import REDIS_FAILURES, connect
from gateway.core.errors import Overloaded
from gateway.observe.metrics import Metrics
from gateway.core.settings import RateLimitSettings
from gateway.core.tenant import Tenant

__all__ = ["Quota", "RateLimiter"]

logger = logging.getLogger("edgegw.ratelimit")

PERIOD_S = 60.0
# A request is refused when its quota's theoretical arrival time would lie more than one
# period ahead, by more than this: ``tat + interval - now`` is computed in floating point,
# and when the sum crosses a power of two (the clock's seconds past 4,096, 8,192, ...) it is
# rounded up by one unit in the last place, which refused the last request of a full burst
# (the first of a 1-per-minute quota) for a minute before each such crossing.
SLACK_MS = 0.01

# KEYS: requests key, tokens key. ARGV: rpm, tpm (0: no limit), token cost, period ms, slack ms.
# Returns {allowed, requests remaining, requests reset ms, tokens remaining, tokens reset ms, retry after ms}.
_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = tonumber(ARGV[4])
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local tats, afters = {}, {}
local allowed, retry = 1, 0
for i = 1, 2 do
  if limits[i] > 0 then
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    tats[i] = tat
    afters[i] = tat + period / limits[i] * costs[i]
    if afters[i] - now > period + tonumber(ARGV[5]) then
      allowed = 0
      retry = math.max(retry, afters[i] - now - period)
    end
  end
end
local out = {allowed, -1, 0, -1, 0, math.floor(retry)}
for i = 1, 2 do
  if limits[i] > 0 then
    local basis = tats[i]
    if allowed == 1 then
      basis = afters[i]
      redis.call('SET', KEYS[i], tostring(basis), 'PX', math.ceil(basis - now) + 1000)
    end
    out[i * 2] = math.floor((period - (basis - now)) / (period / limits[i]))
    out[i * 2 + 1] = math.floor(basis - now)
  end
end
return out
"""

# KEYS: tokens key. ARGV: tpm, token delta (may be negative), period ms.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval = tonumber(ARGV[3]) / tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
tat = math.max(now, tat + interval * tonumber(ARGV[2]))
redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
return 1
"""


@dataclass(slots=True)
class Quota:
    """One check's outcome: admitted or not, and what the OpenAI rate-limit headers say."""

    allowed: bool
    headers: list[tuple[bytes, bytes]]
    retry_after: float = 0.0  # seconds, when not allowed
    limit: str = ""  # "requests" or "tokens": which one refused


class RateLimiter:
    def __init__(self, settings: RateLimitSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._memory: dict[str, float] = {}  # key -> TAT (time.monotonic(), seconds)
        self._redis = None
        self._circuit = Circuit(settings.cooldown_s)
        self._tasks: set[asyncio.Task] = set()
        if settings.backend == "redis":
            self._redis = connect(settings.redis_url, settings.timeout_s, settings.timeout_s)
            self._check = self._redis.register_script(_CHECK)
            self._settle = self._redis.register_script(_SETTLE)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    def _keys(self, tenant: Tenant) -> tuple[str, str]:
        prefix = f"{self.settings.namespace}:rl:{tenant.name}"
        return prefix + ":r", prefix + ":t"

    async def check(self, tenant: Tenant, tokens: int) -> Quota | None:
        """Spend one request and ``tokens`` of ``tenant``'s quotas, or say why not. None when
        the tenant has no rate limits (or Redis is down and ``fail_closed`` is off)."""
        policy = tenant.policy
        rpm, tpm = policy.requests_per_minute or 0, policy.tokens_per_minute or 0
        if not rpm and not tpm:
            return None
        keys = self._keys(tenant)
        if self._redis is None:
            result = self._check_memory(keys, rpm, tpm, tokens)
        else:
            result = await self._call(self._check, keys, [rpm, tpm, tokens, int(PERIOD_S * 1000), SLACK_MS])
            if result is None:
                if self.settings.fail_closed:
                    raise Overloaded("rate limits cannot be checked right now", code="rate_limits_unavailable", retry_after=1.0)
                return None
        allowed, r_left, r_reset, t_left, t_reset, retry_ms = (float(v) for v in result)
        quota = Quota(bool(allowed), _headers(rpm, r_left, r_reset, tpm, t_left, t_reset), retry_ms / 1000)
        if not quota.allowed:
            quota.limit = "tokens" if tpm and (not rpm or r_left >= 1) else "requests"
            self.metrics.rate_limited.labels(tenant.name, quota.limit).inc()
        return quota

    def settle(self, tenant: Tenant, delta: int) -> None:
        """Correct the token estimate by ``delta`` (real usage minus estimate), in the
        background: the answer is already on its way."""
        tpm = tenant.policy.tokens_per_minute
        if not tpm or not delta:
            return
        key = self._keys(tenant)[1]
        if self._redis is None:
            now = time.monotonic()
            tat = max(self._memory.get(key, now), now)
            self._memory[key] = max(now, tat + delta * PERIOD_S / tpm)
            return
        task = asyncio.get_running_loop().create_task(self._call(self._settle, [key], [tpm, delta, int(PERIOD_S * 1000)]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _check_memory(self, keys: tuple[str, str], rpm: int, tpm: int, tokens: int) -> list[float]:
        """The Redis script's arithmetic (see ``_CHECK``), on this process's own clock."""
        now = time.monotonic()
        checks = [(key, limit, cost) for key, limit, cost in ((keys[0], rpm, 1), (keys[1], tpm, tokens))]
        tats = [max(self._memory.get(key, now), now) for key, _, _ in checks]
        afters = [tat + PERIOD_S / limit * cost if limit else tat for tat, (_, limit, cost) in zip(tats, checks)]
        over = [after - now - PERIOD_S for after, (_, limit, _) in zip(afters, checks) if limit]
        allowed = all(o <= SLACK_MS / 1000 for o in over)
        out = [float(allowed), -1.0, 0.0, -1.0, 0.0, max([0.0, *over]) * 1000]
        for i, ((key, limit, _), tat, after) in enumerate(zip(checks, tats, afters)):
            if not limit:
                continue
            basis = after if allowed else tat
            if allowed:
                self._memory[key] = after
            out[2 * i + 1] = math.floor((PERIOD_S - (basis - now)) / (PERIOD_S / limit))
            out[2 * i + 2] = (basis - now) * 1000
        return out

    async def _call(self, script, keys: list[str], args: list) -> list | None:
        """One bounded Redis call under the circuit; None when Redis is skipped or failed."""
        if not self._circuit.allow():
            return None
        try:
            result = await asyncio.wait_for(script(keys=keys, args=args), self.settings.timeout_s)
        except REDIS_FAILURES as exc:
            self._circuit.failure()
            logger.warning("rate limits: Redis failed (%s); %s", type(exc).__name__, "refusing" if self.settings.fail_closed else "admitting")
            return None
        except BaseException:
            self._circuit.abandon()  # cancelled: no verdict on Redis
            raise
        self._circuit.success()
        return result


def _headers(rpm: int, r_left: float, r_reset: float, tpm: int, t_left: float, t_reset: float) -> list[tuple[bytes, bytes]]:
    headers = []
    if rpm:
        headers += [
            (b"x-ratelimit-limit-requests", str(rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, int(r_left))).encode()),
            (b"x-ratelimit-reset-requests", _duration(r_reset)),
        ]
    if tpm:
        headers += [
            (b"x-ratelimit-limit-tokens", str(tpm).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, int(t_left))).encode()),
            (b"x-ratelimit-reset-tokens", _duration(t_reset)),
        ]
    return headers


def _duration(ms: float) -> bytes:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(0, round(ms))}ms".encode()
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s".encode()
    return f"{int(seconds // 60)}m{int(seconds % 60)}s".encode()
