"""Fairness under predicted-wait admission: one tenant's flood against another's trickle.

    .venv/bin/python bench/fairness.py [--seconds 10] [--baseline-root DIR] [--json FILE]

``--baseline-root`` runs the same phases, in the same run, with the gateway of another
checkout (e.g. ``git worktree add /tmp/before 830ed1f``: the tree before the fix).

The case the issue reported (issue 20): one endpoint with ``max_concurrency: 1``, tenants
``acme`` and ``gamma`` both ``standard`` with weight 1; acme runs 8 closed-loop clients,
gamma sends one request every 0.5 s. Before, admission predicted gamma's wait from every
waiting request of the class and answered gamma 503 ``capacity_exceeded`` 18 times in 20
(20 in 20 when acme sent a huge budget), while the fair queue would have served gamma first.

Processes (started and stopped here by PID; traffic only on 127.0.0.1): ``loadgen/fake_upstream.py``'s
scripted upstream (one slot: an inference server that answers one request at a time, TTFT
0.05 s, 15 tokens 10 ms apart: 0.2 s a request, 5 requests/s; gamma offers 2/s, under its fair half) and the gateway (``python -m gateway serve``). Four phases in
one run: ``admission.predict`` on and off, acme sending the tenant's budget (1 s) or a huge
one (``x-latency-budget-ms: 600000``). Reported per phase: gamma's answers by status (and
error code), gamma's TTFT p50/p99, acme's answers served. The goal: with ``predict: true``
gamma is served like with ``predict: false`` (every request, within its budget).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import yaml  # noqa: E402

from bench.overload import one, start_upstream  # noqa: E402
from bench.processes import free_port, pinned, stop, wait_port  # noqa: E402
from loadgen.http import BaseURL, ConnectionPool  # noqa: E402
from loadgen.openai import RequestHead  # noqa: E402

TTFT, TOKENS, DELAY = 0.05, 15, 0.01
BUDGET_MS = 1_000
TENANTS = {"acme": "sk-acme", "gamma": "sk-gamma"}
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": TOKENS}


def gateway_config(upstream: int, port: int, predict: bool) -> dict:
    endpoint = {"url": f"http://127.0.0.1:{upstream}/v1", "warm_connections": 4, "read_timeout_s": 300, "max_concurrency": 1}
    return {
        "listen": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cache": {"backend": "off"},
        "clusters": [{"name": "central", "models": ["fake-model"], "endpoints": [endpoint]}],
        "routing": {"hedging": {"enabled": False}},
        "auth": {"mode": "required"},
        "tenants": [
            {"name": name, "keys": [key], "priority": "standard", "weight": 1, "budget_ms": BUDGET_MS}
            for name, key in TENANTS.items()
        ],
        "admission": {"predict": predict, "max_queue": 10_000},
    }


def start_gateway(config: dict, workdir: str, root: str) -> tuple[subprocess.Popen, str]:
    """``python -m gateway serve`` from ``root`` (its cwd comes first on sys.path: that tree's gateway)."""
    path = os.path.join(workdir, f"gateway-{config['listen']['port']}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    argv = pinned("0", [sys.executable, "-m", "gateway", "serve", "--config", path])
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(config["listen"]["port"], proc)
    return proc, f"http://127.0.0.1:{config['listen']['port']}/v1"


async def phase(url: str, seconds: float, acme_budget_ms: float | None) -> dict:
    base = BaseURL.parse(url)
    payload = json.dumps(BODY).encode()
    acme_headers = {"authorization": f"Bearer {TENANTS['acme']}"}
    if acme_budget_ms is not None:
        acme_headers["x-latency-budget-ms"] = str(int(acme_budget_ms))
    acme_head = RequestHead(base, "/chat/completions", acme_headers, True)
    gamma_head = RequestHead(base, "/chat/completions", {"authorization": f"Bearer {TENANTS['gamma']}"}, True)
    stop_at = time.perf_counter() + seconds
    acme_outcomes, gamma_outcomes = [], []

    async def acme_client() -> None:
        pool = ConnectionPool(base)
        try:
            while time.perf_counter() < stop_at:
                acme_outcomes.append(await one(pool, acme_head, "acme", payload))
        finally:
            pool.close()

    async def gamma_client() -> None:
        pool = ConnectionPool(base)
        tasks = []
        try:
            for i in range(int(seconds / 0.5)):
                await asyncio.sleep(max(0.0, stop_at - seconds + i * 0.5 - time.perf_counter()))
                tasks.append(asyncio.ensure_future(one(pool, gamma_head, "gamma", payload)))
            gamma_outcomes.extend(await asyncio.gather(*tasks))
        finally:
            pool.close()

    await asyncio.gather(gamma_client(), *(acme_client() for _ in range(8)))
    ttft = sorted(o.ttft * 1000 for o in gamma_outcomes if o.status == 200 and o.ttft is not None)
    pick = lambda q: round(ttft[min(len(ttft) - 1, round(q * (len(ttft) - 1)))], 1) if ttft else None  # noqa: E731
    return {
        "gamma_sent": len(gamma_outcomes),
        "gamma_answers": dict(Counter(f"{o.status}" + (f" {o.code}" if o.code else "") for o in gamma_outcomes)),
        "gamma_within_budget": sum(1 for o in gamma_outcomes if o.status == 200 and o.ttft is not None and o.ttft * 1000 <= BUDGET_MS),
        "gamma_ttft_p50_ms": pick(0.5),
        "gamma_ttft_p99_ms": pick(0.99),
        "acme_served": sum(1 for o in acme_outcomes if o.status == 200),
        "acme_refused": sum(1 for o in acme_outcomes if o.status != 200),
    }


async def main_async(args) -> list[dict]:
    rows = []
    workdir = tempfile.mkdtemp(prefix="edgegw-fairness-")
    upstream_port = free_port()
    upstream = start_upstream(upstream_port, slots=1, ttft=TTFT, tokens=TOKENS, delay=DELAY)
    try:
        trees = [("this tree", ROOT)] + ([("baseline", os.path.abspath(args.baseline_root))] if args.baseline_root else [])
        for (tree, root), predict in ((t, p) for t in trees for p in (True, False)):
            gateway, url = start_gateway(gateway_config(upstream_port, free_port(), predict), workdir, root)
            try:
                await phase(url, 2, None)  # warm-up: connections, the queue's service time
                for acme_budget in (None, 600_000):
                    await asyncio.sleep(1.0)  # what the upstream still holds
                    row = {"tree": tree, "predict": predict, "acme_budget_ms": acme_budget or BUDGET_MS, **await phase(url, args.seconds, acme_budget)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop(gateway)
    finally:
        stop(upstream)
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| gateway | admission.predict | acme's budget | gamma sent | gamma answers | gamma within budget | gamma TTFT p50 / p99 ms | acme served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        answers = ", ".join(f"{n} × {k}" for k, n in sorted(r["gamma_answers"].items()))
        lines.append(
            f"| {r['tree']} | {str(r['predict']).lower()} | {r['acme_budget_ms']} ms | {r['gamma_sent']} | {answers} | {r['gamma_within_budget']} "
            f"| {r['gamma_ttft_p50_ms']} / {r['gamma_ttft_p99_ms']} | {r['acme_served']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per phase (default 10: gamma sends 20)")
    parser.add_argument("--baseline-root", help="also run the gateway of this checkout (the tree before), same phases")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    random.seed(0)
    rows = asyncio.run(main_async(args))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
