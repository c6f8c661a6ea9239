"""A whole benchmark: its configuration, the model, a warm-up, the repetitions, the result.

``run_bench(config, stop)`` is what ``edgegw bench`` runs once the command line is parsed:

1. the model: ``--model``, or the first of ``GET {base}/models``;
2. warm-up: ``--warmup`` requests, one at a time, not counted; the first failure ends the
   benchmark with its message (a wrong URL, model or key shows at once, not as a run of
   failures);
3. ``--repeat`` runs, each with prompts and arrivals drawn from its own seed
   (``{seed}:{run}``), on the same connection pool;
4. the result document, with the median of each metric over the runs.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import random
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from loadgen.arrivals import arrival_times
from loadgen.http import BaseURL, ConnectionPool, HttpError, ssl_context
from loadgen.openai import ENDPOINTS, RequestHead, Requester, check_headers, client_version, list_models
from loadgen.progress import Progress
from loadgen.result import BenchResult, Environment, Parameters, RunSummary, median_metrics
from loadgen.runner import Run, Schedule
from loadgen.stats import summarise
from loadgen.types import RequestSpec
from loadgen.workload import BodyBuilder, DatasetError, Prompt, SyntheticPrompts, dataset_prompts, load_dataset

__all__ = ["BenchConfig", "BenchError", "run_bench"]


class BenchError(Exception):
    """The benchmark cannot run: unreachable server, unknown model, failed warm-up."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark needs, checked when built (``ValueError`` names the option)."""

    base_url: str
    endpoint: str = "chat"  # chat | completions
    model: str | None = None  # None: the first model the server lists
    num_prompts: int | None = None  # requests per run; 1000 unless a duration is given
    duration: float | None = None  # seconds of sending per run, instead of num_prompts
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    stream: bool = True
    dataset: str | None = None
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    timeout: float = 300.0
    warmup: int = 1
    repeat: int = 1
    goodput_ms: dict[str, float] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; Authorization included
    extra_body: dict[str, Any] = field(default_factory=dict)
    verify_tls: bool = True
    ca_file: str | None = None
    progress: bool = True
    command: list[str] = field(default_factory=list)  # argv with secrets masked

    def __post_init__(self) -> None:
        BaseURL.parse(self.base_url)
        if self.num_prompts is None and self.duration is None:
            object.__setattr__(self, "num_prompts", 1000)
        object.__setattr__(self, "headers", check_headers(self.headers))
        checks = [
            (self.endpoint in ENDPOINTS, f"--endpoint must be one of {', '.join(ENDPOINTS)}"),
            ((self.num_prompts is None) != (self.duration is None), "give one of --num-prompts or --duration"),
            (self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be at least 1"),
            (self.duration is None or self.duration > 0, "--duration must be positive"),
            (self.request_rate > 0, "--request-rate must be positive (inf: all at once)"),
            (self.burstiness > 0, "--burstiness must be positive"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be at least 1"),
            (self.input_len >= 1 and self.output_len >= 1, "--input-len and --output-len must be at least 1"),
            (0 <= self.range_ratio < 1, "--range-ratio must be in [0, 1)"),
            (self.timeout > 0, "--timeout must be positive"),
            (self.warmup >= 0, "--warmup must be 0 or more"),
            (self.repeat >= 1, "--repeat must be at least 1"),
            (set(self.goodput_ms) <= {"ttft", "tpot", "e2e"}, "--goodput bounds are ttft, tpot and e2e"),
            (all(v > 0 for v in self.goodput_ms.values()), "--goodput bounds must be positive milliseconds"),
            (not (math.isinf(self.request_rate) and self.duration and not self.max_concurrency),
             "--duration with an unlimited rate needs --max-concurrency (or a --request-rate)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def base(self) -> BaseURL:
        return BaseURL.parse(self.base_url)

    def parameters(self, model: str) -> Parameters:
        return Parameters(
            base_url=self.base.url(),
            endpoint=self.endpoint,
            model=model,
            num_prompts=self.num_prompts,
            duration_s=self.duration,
            request_rate=None if math.isinf(self.request_rate) else self.request_rate,
            burstiness=self.burstiness,
            max_concurrency=self.max_concurrency,
            stream=self.stream,
            dataset=self.dataset,
            input_len=None if self.dataset else self.input_len,
            output_len=None if self.dataset else self.output_len,
            range_ratio=self.range_ratio,
            seed=self.seed,
            timeout_s=self.timeout,
            warmup=self.warmup,
            repeat=self.repeat,
            goodput_ms=self.goodput_ms,
            header_names=sorted(self.headers),
            extra_body=self.extra_body,
        )


def environment(command: list[str]) -> Environment:
    return Environment(
        edgegw_version=client_version(),
        python=platform.python_version(),
        platform=platform.platform(),
        host=socket.gethostname(),
        cpus=os.cpu_count() or 1,
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=command,
    )


class _Workload:
    """The request specs of each run, from the dataset or drawn from the run's seed."""

    def __init__(self, config: BenchConfig, dataset: list[Prompt] | None, builder: BodyBuilder) -> None:
        self.config = config
        self.dataset = dataset
        self.builder = builder

    def prompts(self, label: str) -> Iterator[Prompt]:
        c = self.config
        if self.dataset is not None:
            return dataset_prompts(self.dataset)
        return SyntheticPrompts(random.Random(f"{c.seed}:{label}:prompts"), c.input_len, c.output_len, c.range_ratio)

    def specs(self, label: str) -> Iterator[RequestSpec]:
        return map(self.builder.build, self.prompts(label))


async def run_bench(config: BenchConfig, stop: asyncio.Event) -> BenchResult:
    env = environment(config.command)
    try:
        dataset = load_dataset(config.dataset) if config.dataset else None
        context = ssl_context(config.verify_tls, config.ca_file) if config.base.tls else None
    except (DatasetError, OSError, ssl.SSLError) as exc:  # a dataset or CA file that cannot be used
        raise BenchError(str(exc)) from None
    pool = ConnectionPool(config.base, context)
    try:
        model = config.model or await _discover_model(pool, config)
        builder = BodyBuilder(config.endpoint, model, config.stream, config.extra_body)
        workload = _Workload(config, dataset, builder)
        head = RequestHead(config.base, ENDPOINTS[config.endpoint], config.headers, config.stream)
        await _warm_up(pool, head, workload, config)
        runs: list[RunSummary] = []
        for index in range(config.repeat):
            if stop.is_set():
                break
            runs.append(await _one_run(pool, head, workload, config, index, stop))
    finally:
        pool.close()
    return BenchResult(
        parameters=config.parameters(model),
        environment=env,
        runs=runs,
        median=median_metrics(runs),
        interrupted=stop.is_set() or any(r.interrupted for r in runs),
    )


async def _one_run(
    pool: ConnectionPool, head: RequestHead, workload: _Workload, config: BenchConfig, index: int, stop: asyncio.Event
) -> RunSummary:
    schedule = Schedule(config.num_prompts, config.duration, config.max_concurrency)
    arrivals = arrival_times(config.request_rate, random.Random(f"{config.seed}:{index}:arrivals"), config.burstiness)
    progress = None
    if config.progress:
        label = f"run {index + 1}/{config.repeat} " if config.repeat > 1 else ""
        progress = Progress(total=config.num_prompts, label=label)
    run = Run(pool, head, config.timeout, workload.specs(str(index)), arrivals, schedule, stop, progress)
    outcome = await run.execute()
    return summarise(outcome.records, outcome.facts, config.goodput_ms)


async def _discover_model(pool: ConnectionPool, config: BenchConfig) -> str:
    try:
        models = await list_models(pool, config.headers, min(config.timeout, 30.0))
    except (HttpError, ValueError) as exc:
        raise BenchError(f"cannot list the models ({exc}); give --model") from None
    if not models:
        raise BenchError(f"{config.base.url('/models')} lists no model; give --model")
    return models[0]


async def _warm_up(pool: ConnectionPool, head: RequestHead, workload: _Workload, config: BenchConfig) -> None:
    specs = workload.specs("warmup")
    requester = Requester(pool, head, config.timeout, time.perf_counter())
    for i in range(config.warmup):
        record = await requester.send(i, next(specs), 0.0, time.perf_counter())
        if record.error is not None:
            url = config.base.url(ENDPOINTS[config.endpoint])
            raise BenchError(f"warm-up request to {url} failed: {record.error}: {record.detail}")
