"""Reading what an edgegw says about each answer: ``Server-Timing``, ``x-edgegw-route``,
``x-cache``. Any other server simply lacks them, and the report then has no gateway part.

``Server-Timing`` (RFC-style ``name;dur=ms;desc="..."``, comma-separated; a ``desc`` may
itself hold a comma) lists the gateway's stages in order: ``admit``, ``cache``, ``route``,
``pool``, then the backend's ``upstream`` (to the upstream's first byte) or ``engine``, and
``total``. The gateway's own time is the sum of the stages that are neither the backend's
nor ``total``.
"""

from __future__ import annotations

__all__ = ["BACKEND_STAGES", "own_ms", "parse_route", "parse_server_timing"]

BACKEND_STAGES = frozenset({"upstream", "engine"})


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside double quotes (backslash escapes inside)."""
    parts, start, quoted, escaped = [], 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_server_timing(value: str) -> dict[str, float]:
    """Stage name -> milliseconds; a name given twice is summed; entries without a
    parseable ``dur`` are skipped."""
    stages: dict[str, float] = {}
    for entry in _split(value, ","):
        params = _split(entry, ";")
        name = params[0].strip()
        if not name:
            continue
        for param in params[1:]:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            try:
                ms = float(raw.strip().strip('"'))
            except ValueError:
                break
            stages[name] = stages.get(name, 0.0) + ms
            break
    return stages


def own_ms(stages: dict[str, float]) -> float | None:
    """The gateway's own time: its stages other than the backend's and ``total``."""
    own = [ms for name, ms in stages.items() if name not in BACKEND_STAGES and name != "total"]
    return sum(own) if own else None


def parse_route(value: str) -> str:
    """A short label of where the answer came from: ``cache``, ``edge``,
    ``cluster:<name>`` for an endpoint of a cluster, ``none`` when nothing was routed."""
    fields = {}
    for part in value.split(";"):
        key, sep, val = part.strip().partition("=")
        if sep and key not in fields:
            fields[key] = val.strip()
    target = fields.get("target", "?")
    if target == "endpoint":
        return f"cluster:{fields.get('cluster', '?')}"
    return target
