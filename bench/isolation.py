"""Does the relay feel the edge engine? Relayed latency with the engine idle and decoding.

    .venv/bin/python bench/isolation.py [--seconds 10] [--concurrency 8] [--streams 16] [--json FILE]

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1):

- ``bench/fast_upstream.py``, a zero-delay upstream (16-token JSON answers) for a central
  cluster;
- the gateway, ``python -m gateway serve``, with that cluster and the embedded SmolLM2 as its
  edge engine (``edge.num_threads: 1``, so that the engine leaves a core to the relay),
  three times: the engine **in-process** (``edge.process: false``, its step thread shares
  the relay's interpreter), in a **process of its own** (``edge.process: true``, reached
  over a Unix socket), and in its own process on a **CPU of its own** (``edge.cpus``: the
  last CPU, the relay worker on the others; the upstream and this load generator are then
  held to the relay's CPUs too, in both phases, so that only the engine's work differs).

For each, this process sends non-streaming requests to the cluster's model through the
gateway, ``--concurrency`` at a time (closed loop, loadgen's raw client) for ``--seconds``,
first with the engine idle, then while ``--streams`` long streams decode on it, and reports
the relayed requests' p50/p99 latency and requests/s in both phases and their ratio (busy /
idle). The goal on this 2-core machine: with the engine in its own process, at most 1.2x at
p50 and 1.5x at p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.edge_contention import Bulk, start_ready  # noqa: E402
from bench.processes import free_port, stop, wait_port  # noqa: E402
from loadgen.http import BaseURL, ConnectionPool, HttpError  # noqa: E402
from loadgen.openai import RequestHead, make_reader  # noqa: E402

MODEL = "fake-model"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


def gateway_config(port: int, upstream: int, process: bool, engine_cpus: str | None = None) -> dict:
    edge = {"enabled": True, "num_threads": 1, "max_num_seqs": 32}
    if process:
        edge["process"] = True
    if engine_cpus is not None:
        edge["cpus"] = engine_cpus
    return {
        "listen": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cache": {"backend": "off"},
        "routing": {"hedging": {"enabled": False}},
        "clusters": [{"name": "central", "models": [MODEL], "endpoints": [{"url": f"http://127.0.0.1:{upstream}/v1"}]}],
        "edge": edge,
    }


async def relay_phase(url: str, concurrency: int, seconds: float) -> dict:
    base = BaseURL.parse(url + "/v1")
    pool = ConnectionPool(base)
    head = RequestHead(base, "/chat/completions", {}, False)
    raw = head.encode(BODY)
    latencies: list[float] = []
    failures = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal failures
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                response = await pool.request(raw, make_reader, 30)
            except HttpError:
                failures += 1
                continue
            if response.status != 200:
                failures += 1
                continue
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    pool.close()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, round(q * (len(latencies) - 1)))] * 1000  # noqa: E731
    return {"requests": len(latencies), "rps": round(len(latencies) / elapsed, 1), "p50_ms": round(pick(0.5), 3), "p99_ms": round(pick(0.99), 3), "failures": failures}


def edge_running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("edgegw_edge_running"):
            return float(line.split()[-1])
    return 0.0


def measure(mode: str, upstream: subprocess.Popen, upstream_port: int, args, workdir: str) -> dict:
    """One gateway in ``mode`` (``in-process``, ``own process``, or ``own CPU``: the engine's
    process on the last CPU by ``edge.cpus``, and the relay worker, the upstream and this
    load generator on the others, in both phases), idle then busy."""
    port = free_port()
    allowed = sorted(os.sched_getaffinity(0))
    engine_cpu = allowed[-1] if mode == "own CPU" else None
    relay = set(allowed[:-1]) if engine_cpu is not None and len(allowed) > 1 else set(allowed)
    config = gateway_config(port, upstream_port, mode != "in-process", None if engine_cpu is None else str(engine_cpu))
    gw = start_ready(config, port, workdir)  # on every CPU: edge.cpus splits them between its processes
    os.sched_setaffinity(0, relay)
    os.sched_setaffinity(upstream.pid, relay)
    try:
        return _phases(mode, gw, port, args)
    finally:
        os.sched_setaffinity(0, allowed)
        os.sched_setaffinity(upstream.pid, allowed)


def _phases(mode: str, gw: subprocess.Popen, port: int, args) -> dict:
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(relay_phase(url, args.concurrency, 2))  # warm-up: connections, caches
        idle = asyncio.run(relay_phase(url, args.concurrency, args.seconds))
        bulk = Bulk(port, args.streams, None)
        bulk.start()
        try:
            deadline = time.monotonic() + 120
            while edge_running(url) < args.streams and time.monotonic() < deadline:
                time.sleep(0.2)
            running = edge_running(url)
            busy = asyncio.run(relay_phase(url, args.concurrency, args.seconds))
            still = edge_running(url)
        finally:
            bulk.stop()
    finally:
        stop(gw)
    return {
        "engine": mode,
        "idle": idle,
        "busy": busy,
        "streams_running": [running, still],
        "p50_ratio": round(busy["p50_ms"] / idle["p50_ms"], 2),
        "p99_ratio": round(busy["p99_ms"] / idle["p99_ms"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--in-process-only", action="store_true", help="skip the engine-in-its-own-process phases")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.modes = ("in-process",) if args.in_process_only else ("in-process", "own process", "own CPU")
    upstream_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "bench/fast_upstream.py", "--port", str(upstream_port), "--tokens", "16", "--model", MODEL],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    rows = []
    try:
        wait_port(upstream_port, upstream)
        with tempfile.TemporaryDirectory() as workdir:
            for mode in args.modes:
                rows.append(measure(mode, upstream, upstream_port, args, workdir))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(upstream)
    print(f"\n| engine | idle: req/s, p50 / p99 ms | {args.streams} streams decoding: req/s, p50 / p99 ms | busy / idle p50 | busy / idle p99 | streams running (start, end) |")
    print("|---|---|---|---:|---:|---|")
    for r in rows:
        i, b = r["idle"], r["busy"]
        print(
            f"| {r['engine']} | {i['rps']}, {i['p50_ms']} / {i['p99_ms']} | {b['rps']}, {b['p50_ms']} / {b['p99_ms']} | "
            f"{r['p50_ratio']} | {r['p99_ratio']} | {r['streams_running'][0]:.0f}, {r['streams_running'][1]:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
