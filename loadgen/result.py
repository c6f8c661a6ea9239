"""The result document: a run's parameters, its environment and every figure, as JSON.

    {"format": "edgegw-bench/1",
     "parameters": {...},             # what was asked (never the API key or header values)
     "environment": {...},            # edgegw version, python, host, cpus, time, command
     "runs": [RunSummary, ...],       # one per --repeat
     "median": {"p95_ttft_ms": ..., ...},   # per metric, the median over the runs
     "gate": {...} | null,            # the comparison with --baseline, when asked
     "interrupted": false}

Latencies are milliseconds, rates per second, and a figure that could not be measured is
``null`` (JSON has no NaN). ``median`` is the gate's vocabulary: flat metric names such as
``p95_ttft_ms`` (``{mean,p50,p90,p95,p99,max}_{ttft,tpot,itl,e2e,gateway}_ms``,
``request_throughput``, ``output_throughput``, ``goodput``, ``error_rate``). Each run keeps
its per-request samples (columns) so that plots can be drawn again from a saved file.

Validated with pydantic when read back, so a baseline from another version or another tool
fails with the field at fault rather than somewhere in the comparison.
"""

from __future__ import annotations

import statistics
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "FORMAT",
    "BenchResult",
    "ClientFigures",
    "Distribution",
    "Environment",
    "GateOutcome",
    "GateRow",
    "GatewayFigures",
    "Goodput",
    "Parameters",
    "ResultError",
    "RunSummary",
    "Samples",
    "load_result",
    "median_metrics",
    "save_result",
]

FORMAT = "edgegw-bench/1"
STATS = ("mean", "p50", "p90", "p95", "p99", "max")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


class ResultError(ValueError):
    """A result file that cannot be read back."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Distribution(_Model):
    """Summary statistics of one latency, in ms (all ``None`` when nothing was measured)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


class Goodput(_Model):
    """Requests that met every ``--goodput`` bound."""

    bounds_ms: dict[str, float]  # ttft / tpot / e2e -> ms
    requests: int
    per_s: float
    share: float  # of all requests that ended


class GatewayFigures(_Model):
    """What edgegw's response headers said, over the answers that carried them."""

    responses: int  # answers with a Server-Timing header
    stages_ms: dict[str, Distribution]  # in the order the gateway lists them
    own_ms: Distribution  # the gateway's own stages summed (not upstream, engine, total)
    routes: dict[str, int]  # cache, edge, cluster:<name>, none
    cache: dict[str, int]  # x-cache: HIT, MISS, BYPASS
    cache_hit_share: float | None  # HIT / answers with x-cache


class ClientFigures(_Model):
    """The load generator's own cost, to tell whether it kept up."""

    cpu_s: float  # process CPU (user + system) over the run
    cpu_ms_per_request: float | None
    cpu_share: float  # of one core, over the run's wall time
    lag_ms: Distribution  # how late requests were written after they were due and had a slot
    connections: int  # opened during the run


class Samples(_Model):
    """Per-request columns, in the order the requests were started."""

    start_s: list[float]
    ttft_ms: list[float | None]
    e2e_ms: list[float | None]
    output_tokens: list[int]
    error: list[str | None]


class RunSummary(_Model):
    started_at: str  # ISO 8601, UTC
    duration_s: float
    interrupted: bool = False
    requests: int  # ended: completed + failed
    completed: int
    failed: int
    errors: dict[str, int]  # kind -> count (http_503, timeout, connection, tls, protocol, stream_error)
    error_examples: dict[str, str]  # kind -> the first message seen
    send_rate: float | None  # requests written per second, first to last
    request_throughput: float  # completed per second
    output_throughput: float  # output tokens of completed requests per second
    total_input_tokens: int | None  # from usage, when the server reports it
    total_output_tokens: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    goodput: Goodput | None = None
    client: ClientFigures
    gateway: GatewayFigures | None = None
    server: str | None = None  # the Server header, if any
    samples: Samples

    def metrics(self) -> dict[str, float | None]:
        """The flat figures the gate compares."""
        figures: dict[str, float | None] = {}
        for name in LATENCIES:
            dist: Distribution = getattr(self, f"{name}_ms")
            for stat in STATS:
                figures[f"{stat}_{name}_ms"] = getattr(dist, stat)
        if self.gateway is not None:
            for stat in STATS:
                figures[f"{stat}_gateway_ms"] = getattr(self.gateway.own_ms, stat)
        figures["request_throughput"] = self.request_throughput
        figures["output_throughput"] = self.output_throughput
        if self.goodput is not None:
            figures["goodput"] = self.goodput.per_s
        figures["error_rate"] = self.failed / self.requests if self.requests else None
        return figures


class Parameters(_Model):
    base_url: str
    endpoint: str  # chat | completions
    model: str
    num_prompts: int | None
    duration_s: float | None
    request_rate: float | None  # None: unlimited (all due at once)
    burstiness: float
    max_concurrency: int | None
    stream: bool
    dataset: str | None
    input_len: int | None
    output_len: int | None
    range_ratio: float
    seed: int
    timeout_s: float
    warmup: int
    repeat: int
    goodput_ms: dict[str, float]
    header_names: list[str]  # values are never saved: they may hold credentials
    extra_body: dict[str, object]


class Environment(_Model):
    edgegw_version: str
    python: str
    platform: str
    host: str
    cpus: int
    started_at: str
    command: list[str]  # with the API key and header values masked


class GateRow(_Model):
    metric: str
    baseline: float | None
    current: float | None
    change: float | None  # relative; positive = worse, whichever way the metric points
    rule: str  # what passing means, e.g. "+10% at most", "≤ 1.0%"
    passed: bool


class GateOutcome(_Model):
    baseline_file: str
    max_regression: float
    max_error_rate: float
    rows: list[GateRow]
    passed: bool
    notes: list[str] = []  # differences in parameters that make the comparison doubtful


class BenchResult(_Model):
    format: Literal["edgegw-bench/1"] = FORMAT
    parameters: Parameters
    environment: Environment
    runs: list[RunSummary]
    median: dict[str, float | None]
    gate: GateOutcome | None = None
    interrupted: bool = False


def median_metrics(runs: list[RunSummary]) -> dict[str, float | None]:
    """Per metric, the median over the runs that measured it."""
    merged: dict[str, list[float]] = {}
    for run in runs:
        for name, value in run.metrics().items():
            values = merged.setdefault(name, [])
            if value is not None:
                values.append(value)
    return {name: statistics.median(values) if values else None for name, values in merged.items()}


def save_result(result: BenchResult, path: str) -> None:
    data = orjson.dumps(result.model_dump(mode="json"), option=orjson.OPT_INDENT_2) + b"\n"
    with open(path, "wb") as fh:
        fh.write(data)


def load_result(path: str) -> BenchResult:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ResultError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return BenchResult.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise ResultError(f"{path}: not an edgegw bench result ({FORMAT}): {where}: {first['msg']}") from None
