"""What usage per tenant costs a request, and how long a live reload takes.

    .venv/bin/python -m bench.usage [--requests N] [--tenants N]

- ``record``: ``Usage.record`` (the counters, the hourly bucket, the month's total) per
  request, beside a bare dict update in the same run (the floor of any counting).
- ``reload``: ``Reloader.reload`` of an in-process gateway whose configuration gained one
  tenant key, with N tenants and 8 endpoints (read, validate, diff, build, swap), median of 20.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from gateway.core.settings import UsageSettings, load_settings
from gateway.node.app import create_app
from gateway.node.reload import ConfigSource
from gateway.observe.usage import Usage


def record(n: int) -> tuple[float, float]:
    usage = Usage(UsageSettings(), CollectorRegistry())
    spent = timeit.timeit(lambda: usage.record("acme", "llama-3.1-70b", "http://10.0.0.1:8000/v1", 812, 240), number=n)
    totals: dict = {}

    def bare(tenant, model, target, prompt, completion):
        key = (tenant, model, target)
        row = totals.get(key)
        if row is None:
            row = totals[key] = [0, 0, 0]
        row[0] += 1
        row[1] += prompt
        row[2] += completion

    floor = timeit.timeit(lambda: bare("acme", "llama-3.1-70b", "http://10.0.0.1:8000/v1", 812, 240), number=n)
    return spent / n * 1e6, floor / n * 1e6


def config(tenants: int, version: int) -> dict:
    return {
        "cache": {"backend": "off"},
        "reload": {"watch": False},
        "auth": {"mode": "required"},
        "tenants": [{"name": f"t{i}", "keys": [f"k-{i}-{version if i == 0 else 0}"]} for i in range(tenants)],
        "clusters": [{"name": "central", "models": ["m"], "endpoints": [{"url": f"http://127.0.0.{i + 2}:9/v1", "warm_connections": 0} for i in range(8)]}],
    }


async def reload_time(tenants: int) -> float:
    folder = Path(tempfile.mkdtemp())
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config(tenants, 0)))
    app = create_app(load_settings(path), source=ConfigSource(str(path)))
    gateway = app.gateway
    await gateway.start()
    times = []
    try:
        for version in range(1, 21):
            path.write_text(yaml.safe_dump(config(tenants, version)))
            started = time.perf_counter()
            outcome = await gateway.reloader.reload("bench")
            times.append(time.perf_counter() - started)
            assert outcome.ok and outcome.applied == ["tenants"], outcome
    finally:
        await gateway.aclose()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--tenants", type=int, default=200)
    args = parser.parse_args()
    spent, floor = record(args.requests)
    print(f"record: {spent:.2f} us per request (a bare dict update: {floor:.2f} us)")
    print(f"reload: {asyncio.run(reload_time(args.tenants)):.1f} ms median ({args.tenants} tenants, 8 endpoints)")


if __name__ == "__main__":
    main()
