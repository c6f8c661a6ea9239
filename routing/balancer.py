"""Pick an endpoint inside a cluster.

- Without affinity: power-of-two-choices. Two distinct available endpoints are drawn
  at random and the one with the lower cost wins, where
  ``cost = predicted TTFT × (in-flight + 1) × (1 + error_penalty × recent error rate)``.
  Two random choices avoid the herd behaviour of always taking the global minimum from
  slightly stale state, while still steering away from slow or busy replicas.
- With an affinity key (session id, or a digest of the conversation's leading
  messages): rendezvous (highest-random-weight) hashing orders the endpoints the same
  way for every request of that conversation, so follow-up turns land on the replica
  whose prefix cache holds them; adding or removing a replica only moves the keys that
  were on it. Load is the tiebreak, with bounded loads: the first endpoint in
  rendezvous order whose in-flight count (with this request) stays within
  ``ceil((1 + affinity_load_factor) × mean) + affinity_load_slack`` is taken, so one hot
  conversation (or an unlucky hash) never piles onto a single replica; the slack keeps
  affinity when the fleet is nearly idle. A replica predicted more than
  ``affinity_max_ttft_ratio`` × the fastest one's TTFT is passed over too (a degraded
  replica would otherwise keep its conversations and queue them).
- With a prompt's prefix blocks (``routing.prefix``), instead of the above: each replica
  scores the share of the prompt it would have to prefill (what its prefix index says it
  caches), plus the prefill work already sent to it and not answered (in prompts of this
  size: what the new prompt would queue behind), plus ``load_weight`` per request on it
  plus a KV-use term, replicas past a
  looser load bound left out; the lowest score wins (ties: the cheaper). A prompt nobody
  caches goes to the least loaded replica (join the shortest queue, with the servers'
  own counts); a hot system prompt stays on its replica until that one carries
  ``1 / load_weight`` requests more than another, then spreads.
- Load, where the policy passes it, is the servers' own running + waiting count merged
  with this gateway's in-flight count (``ServerLoad.merged_load``), else the in-flight count.

Pure functions of their arguments: the caller passes the ``HealthState``, ``now`` and
the random source.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from .config import BalancerConfig
from .health import EndpointHealth, HealthState

__all__ = [
    "Pick",
    "endpoint_cost",
    "pick",
    "pick_available",
    "predicted_ttft_s",
    "rendezvous_order",
    "rendezvous_weight",
]


@dataclass(frozen=True, slots=True)
class Pick:
    """The chosen endpoint, the other available ones best first, and how it was chosen.

    ``affinity``: ``None`` (no key), ``"hit"`` (the key's own replica) or
    ``"overflow"`` (its replica was too loaded; ``affinity_rank`` says which was used).
    """

    endpoint: str
    others: tuple[str, ...]
    affinity: str | None = None
    affinity_rank: int = 0


def predicted_ttft_s(h: EndpointHealth, prior_s: float) -> float:
    """TTFT EWMA if measured; else probe RTT + ``prior_s``; else ``prior_s``."""
    if h.ttft_s is not None:
        return h.ttft_s
    if h.rtt_s is not None:
        return h.rtt_s + prior_s
    return prior_s


def endpoint_cost(h: EndpointHealth, prior_s: float, error_penalty: float) -> float:
    n = len(h.outcomes)
    err = h.window_failures / n if n else 0.0
    return predicted_ttft_s(h, prior_s) * (h.inflight + 1) * (1.0 + error_penalty * err)


# the random source of the power of two choices when the caller brings none (the gateway
# and reproducible tests bring their own, seeded as they need)
SHARED_RNG = random.Random()

_M64 = (1 << 64) - 1
_node_ids: dict[str, int] = {}  # memo: name -> 64-bit id (names are few and long-lived)


def _node_id(name: str) -> int:
    v = _node_ids.get(name)
    if v is None:
        if len(_node_ids) >= 65536:
            _node_ids.clear()
        v = _node_ids[name] = int.from_bytes(blake2b(name.encode(), digest_size=8).digest(), "big")
    return v


def rendezvous_weight(key: bytes, name: str) -> int:
    """The rendezvous (highest-random-weight) score of ``name`` for ``key``.

    splitmix64 of (first 8 bytes of the key XOR a blake2b id of the name): stable across
    processes and restarts (unlike ``hash()``), and cheap per request.
    """
    z = (int.from_bytes(key[:8], "big") ^ _node_id(name)) + 0x9E3779B97F4A7C15 & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


_weight = rendezvous_weight


def rendezvous_order(key: bytes, endpoints: Sequence[str]) -> list[str]:
    """Endpoints ordered by rendezvous weight for ``key`` (stable, highest first)."""
    return sorted(endpoints, key=lambda e: _weight(key, e), reverse=True)


def pick(
    endpoints: Sequence[str],
    health: HealthState,
    now: float,
    *,
    config: BalancerConfig,
    prior_s: float,
    affinity_key: bytes | None = None,
    rng: random.Random | None = None,
) -> Pick | None:
    """Choose among ``endpoints`` (their breakers are consulted); ``None`` if none is
    available. ``prior_s`` is the TTFT assumed for endpoints not measured yet."""
    records = [health.endpoint(e) for e in endpoints if health.is_available(e, now)]
    return pick_available(
        records, config=config, prior_s=prior_s, affinity_key=affinity_key,
        rng=rng if rng is not None else SHARED_RNG,
    )


def pick_available(
    records: Sequence[EndpointHealth],
    *,
    config: BalancerConfig,
    prior_s: float,
    affinity_key: bytes | None,
    rng: random.Random,
    costs: dict[str, float] | None = None,
    loads: dict[str, float] | None = None,
    matches: dict[str, int] | None = None,
    min_match: int = 1,
    nblocks: int = 0,
    kv: dict[str, float] | None = None,
    pending: dict[str, float] | None = None,
    load_weight: float = 0.03,
    prefix_load_factor: float = 2.0,
    prefix_load_slack: int = 4,
) -> Pick | None:
    """``pick`` over records already known to be available (the policy's fast path).
    ``costs``: ``endpoint_cost`` per endpoint if the caller has them already; ``loads``:
    requests on each endpoint (default: this gateway's in-flight count; the policy merges
    in the servers' own figures); ``matches``: prefix blocks each endpoint probably caches
    of this prompt of ``nblocks`` blocks (``HealthState.prefix_match``), counted from
    ``min_match`` blocks on; ``kv``: a score penalty per endpoint for its KV use;
    ``pending``: prefill work sent to each and not answered yet, in prefix blocks."""
    if not records:
        return None
    if costs is None:
        penalty = config.error_penalty
        costs = {h.endpoint: endpoint_cost(h, prior_s, penalty) for h in records}
    if loads is None:
        loads = {h.endpoint: h.inflight for h in records}
    n = len(records)
    if n > 1 and nblocks:
        # the prompt's cached prefix against the load: each replica scores the share of the
        # prompt it would prefill (0 when it caches all of it) plus ``load_weight`` per
        # request on it and a KV term past the knee; replicas past the load bound
        # (``prefix_load_factor`` × mean + ``prefix_load_slack``) are left out. A prompt
        # nobody caches goes to the least loaded; a hot one stays put until its replica
        # carries 1 / load_weight requests more than another.
        mean = (sum(loads.values()) + 1) / n
        cap = math.ceil(prefix_load_factor * mean) + prefix_load_slack
        best = None
        best_score = math.inf
        for h in records:
            ep = h.endpoint
            q = loads[ep]
            if q + 1 > cap:
                continue
            m = matches.get(ep, 0) if matches else 0
            score = (1.0 - m / nblocks if m >= min_match else 1.0) + load_weight * q
            if pending is not None:
                score += pending.get(ep, 0.0) / nblocks  # prefill queued ahead, in prompts of this size
            if kv is not None:
                score += kv.get(ep, 0.0)
            if score < best_score or (score == best_score and costs[ep] < costs[best]):
                best, best_score = ep, score
        if best is not None:
            others = tuple(sorted((e for e in costs if e != best), key=costs.__getitem__))
            m = matches.get(best, 0) if matches else 0
            if m < min_match:
                return Pick(best, others, "prefix-none", 0)
            longest = max(matches.values())
            return Pick(best, others, "prefix-cache" if m == longest else "prefix-cache-partial", 0 if m == longest else 1)
        # every replica is past the bound: p2c below
    if affinity_key is not None and config.affinity and n > 1:
        predicted = {h.endpoint: predicted_ttft_s(h, prior_s) for h in records}
        cap = math.ceil((1.0 + config.affinity_load_factor) * (sum(loads.values()) + 1) / n)
        cap += config.affinity_load_slack
        slow = min(predicted.values()) * config.affinity_max_ttft_ratio
        ranked = sorted(records, key=lambda h: _weight(affinity_key, h.endpoint), reverse=True)
        for rank, h in enumerate(ranked):
            if loads[h.endpoint] + 1 <= cap and predicted[h.endpoint] <= slow:
                ep = h.endpoint
                others = tuple(sorted((e for e in costs if e != ep), key=costs.__getitem__))
                return Pick(ep, others, "hit" if rank == 0 else "overflow", rank)
        # no replica is both under the load bound and fast enough: plain p2c below
    if n == 1:
        chosen = records[0].endpoint
    else:
        a, b = rng.sample(records, 2)
        chosen = a.endpoint if costs[a.endpoint] <= costs[b.endpoint] else b.endpoint
    others = tuple(sorted((e for e in costs if e != chosen), key=costs.__getitem__))
    if affinity_key is None or not config.affinity:
        return Pick(chosen, others)
    if n == 1:
        return Pick(chosen, others, "hit")
    return Pick(chosen, others, "overflow", n)
