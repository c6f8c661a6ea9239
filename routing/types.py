"""Value types of the routing package: inputs (request features, cluster specs, edge
engine stats, client location) and the output (``RouteDecision``).

Plain slotted dataclasses, immutable where they are values, so the gateway can build
them from its own objects and tests can build them by hand. Nothing here imports the
rest of the package.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ClusterSpec",
    "EdgeStats",
    "Location",
    "RouteDecision",
    "RouteRequest",
    "Target",
    "TargetKind",
]


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A central cluster as the gateway config defines it.

    ``endpoints`` are base URLs; an endpoint's id (in health state, decisions, metrics)
    is its URL string.
    """

    name: str
    models: tuple[str, ...]
    endpoints: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a client address is, as far as the GeoIP database knows.

    ``source`` is ``"geoip"`` for a database hit and ``"default"`` when the address was
    not found (private, documentation or unknown ranges) and the default region applies.
    """

    country: str | None = None
    city: str | None = None
    latitude: float | None = None
    longitude: float | None = None
    source: str = "geoip"

    def to_dict(self) -> dict[str, Any]:
        return {
            "country": self.country,
            "city": self.city,
            "latitude": self.latitude,
            "longitude": self.longitude,
            "source": self.source,
        }


@dataclass(frozen=True, slots=True)
class EdgeStats:
    """A snapshot of the in-process edge engine, taken by the gateway before deciding.

    The edge engine does not know this type; the gateway copies its ``stats()`` here.
    ``recent_ttft_ms`` / ``recent_tpot_ms`` of ``None`` mean "not measured yet".
    """

    queue_depth: int = 0  # sequences waiting to be scheduled
    running: int = 0  # sequences currently decoding
    kv_blocks_free: int = 1 << 30  # free KV cache blocks
    kv_blocks_total: int = 1 << 30  # all KV cache blocks
    block_size: int = 16  # tokens per KV block
    recent_ttft_ms: float | None = None  # recent time to first token
    recent_tpot_ms: float | None = None  # recent time per output token
    healthy: bool = True  # False while the engine is loading, draining or broken
    # the engine honours tools, tool_choice and response_format (constrained decoding);
    # without it a request asking for structure never goes to the edge
    structured_output: bool = False


class TargetKind(str, enum.Enum):
    EDGE = "edge"
    ENDPOINT = "endpoint"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request (or its fallback / hedge) goes.

    For ``ENDPOINT``: ``cluster``, ``endpoint`` (URL) and ``region`` are set. For
    ``EDGE``: ``region`` is the local region. ``model`` is the model name to send
    upstream (aliases already resolved). ``predicted_ttft_ms`` is routing's estimate.
    """

    kind: TargetKind
    model: str
    region: str | None = None
    cluster: str | None = None
    endpoint: str | None = None
    predicted_ttft_ms: float | None = None

    def label(self) -> str:
        """Short human label: ``edge``, ``cache`` or ``cluster@url``."""
        if self.kind is TargetKind.ENDPOINT:
            return f"{self.cluster}@{self.endpoint}"
        return self.kind.value

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "model": self.model,
            "region": self.region,
            "cluster": self.cluster,
            "endpoint": self.endpoint,
            "predicted_ttft_ms": None
            if self.predicted_ttft_ms is None
            else round(self.predicted_ttft_ms, 1),
        }


# RouteRequest and RouteDecision are values (nothing assigns to them once made) but not
# ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, about 30
# calls per request for these two, each made once per request
@dataclass(slots=True, eq=False)
class RouteRequest:
    """The features of one request that routing looks at.

    Build it by hand or with ``routing.features.request_from_openai``. ``budget_ms``
    of ``None`` means the configured default. ``affinity_key`` is the session id or a
    digest of the conversation's leading messages (``None`` = no affinity);
    ``affinity_source`` says which (``"session"`` / ``"prefix"``). The exact-response cache
    is looked up before routing (a hit needs no decision), so it is not a target here.
    """

    model: str = "auto"
    prompt_tokens: int = 0
    max_tokens: int | None = None
    has_tools: bool = False
    has_attachments: bool = False
    # the first field asking for structured output (``tools``, ``tool_choice``,
    # ``response_format``...): only a target that honours it may serve the request
    structured: str | None = None
    # the API: ``chat`` and ``completion`` are the edge engine's; any other (``embeddings``,
    # ``responses``, a pass-through path) goes to the clusters serving the model
    api: str = "chat"
    stream: bool = False
    budget_ms: float | None = None
    affinity_key: bytes | None = None
    affinity_source: str | None = None
    client_ip: str | None = None
    location: Location | None = None
    # chained hashes of the prompt's blocks (``routing.prefix.prompt_blocks``): which
    # replica probably caches the longest part of it
    prefix_blocks: tuple[int, ...] = ()


_UNSAFE = re.compile(r"[^\x20-\x7e]")


def _ascii_line(text: str) -> str:
    return _UNSAFE.sub("?", text)


@dataclass(slots=True, eq=False)
class RouteDecision:
    """Where to send a request, what to try next, and why.

    - ``target``: the first place to send it; ``fallbacks``: ordered alternatives (the
      gateway walks them on a connect error / 5xx, within the retry budget).
    - ``region``: the client's home region (nearest to its location, or the default).
    - ``degraded``: an ``auto`` request was kept at the edge although it would have been
      escalated, because the central path is unhealthy or cannot meet the budget.
    - ``hedge_after_ms`` / ``hedge_target``: if no first token by then, start the same
      request on ``hedge_target`` and keep whichever answers first (``None`` = no hedge).
    - ``cascade_threshold``: for a non-streaming ``auto`` request served at the edge, the
      gateway escalates to ``fallbacks[0]`` if the answer's mean token logprob is below it.
    - ``reasons``: human-readable, in the order they were applied.
    """

    target: Target
    fallbacks: tuple[Target, ...] = ()
    # other models' targets (``routing.fallbacks``), tried after ``fallbacks`` when every one
    # failed before its first byte or refused the prompt as too long for its context
    model_fallbacks: tuple[Target, ...] = ()
    reasons: tuple[str, ...] = ()
    model: str = ""
    requested_model: str = ""
    region: str | None = None
    client_ip: str | None = None
    location: Location | None = None
    budget_ms: float = 0.0
    degraded: bool = False
    hedge_after_ms: float | None = None
    hedge_target: Target | None = None
    cascade_threshold: float | None = None
    affinity: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # the request's prefix blocks: the gateway records them against the endpoint it sends
    # the request to (``HealthState.record_routed``)
    prefix_blocks: tuple[int, ...] = ()

    def header_value(self, max_len: int = 512) -> str:
        """One ASCII line for the ``x-edgegw-route`` response header."""
        parts = [f"target={self.target.kind.value}"]
        t = self.target
        if t.kind is TargetKind.ENDPOINT:
            parts.append(f"cluster={t.cluster}")
            parts.append(f"endpoint={t.endpoint}")
        parts.append(f"model={self.model}")
        if t.region is not None:
            parts.append(f"target-region={t.region}")
        if self.region is not None:
            parts.append(f"client-region={self.region}")
        parts.append(f"budget={self.budget_ms:.0f}ms")
        if self.degraded:
            parts.append("degraded=1")
        if self.hedge_after_ms is not None and self.hedge_target is not None:
            parts.append(f"hedge={self.hedge_target.label()}@{self.hedge_after_ms:.0f}ms")
        if self.cascade_threshold is not None:
            parts.append(f"cascade<{self.cascade_threshold:g}")
        if self.fallbacks:
            parts.append("fallbacks=" + ",".join(f.label() for f in self.fallbacks))
        if self.model_fallbacks:
            parts.append("model-fallbacks=" + ",".join(f"{f.model}@{f.label()}" for f in self.model_fallbacks))
        if self.reasons:
            parts.append("why=" + " | ".join(self.reasons))
        line = _ascii_line("; ".join(parts))
        if len(line) > max_len:
            line = line[: max_len - 3] + "..."
        return line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``edgegw explain --json``)."""
        return {
            "client_ip": self.client_ip,
            "location": None if self.location is None else self.location.to_dict(),
            "region": self.region,
            "requested_model": self.requested_model,
            "model": self.model,
            "target": self.target.to_dict(),
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "model_fallbacks": [f.to_dict() for f in self.model_fallbacks],
            "budget_ms": self.budget_ms,
            "degraded": self.degraded,
            "hedge_after_ms": self.hedge_after_ms,
            "hedge_target": None if self.hedge_target is None else self.hedge_target.to_dict(),
            "cascade_threshold": self.cascade_threshold,
            "affinity": self.affinity,
            "reasons": list(self.reasons),
            **self.extra,
        }
