"""Overload benchmark: what the gateway's queueing decides, with admission off and on, in one run.

    .venv/bin/python bench/overload.py [--seconds 20] [--loads 1,2,3] [--json FILE]

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1):

- the upstream: ``loadgen/fake_upstream.py``'s scripted server under uvicorn with ``slots: 4`` (it
  answers four requests at a time and queues the rest first come, first served, as an
  inference server does), each answer a stream with a TTFT of 0.2 s and 20 tokens 20 ms
  apart: one slot is busy 0.6 s, so the capacity is 4 / 0.6 = 6.7 requests/s;
- the gateway, ``python -m gateway serve``, pinned to core 0 (the rest share core 1), twice:
  admission **off** (today's behaviour: no limit at the gateway, every request forwarded at
  once, the queue forms inside the server) and **on** (``max_concurrency: 4``, the gateway's
  fair priority queue with deadlines, ``admission.predict``);
- the load: this process (loadgen's raw asyncio + httptools client), open-loop Poisson
  arrivals at 1x, 2x and 3x the capacity for ``--seconds`` each: 90 % from two batch
  tenants of equal weight (45 % each, TTFT budget 10 s), 10 % from an interactive tenant
  (budget 1 s). Every request streams; TTFT is the first content event.

Reported per load and mode: goodput (answers whose TTFT met their budget, per second), the
interactive tenant's p50/p99 TTFT, the share shed (answered at once, 429/503, by the
predicted-wait decision) and how fast (p50/p99, on the client's clock and as the gateway's
own ``Server-Timing`` total), the share dropped when its deadline passed
in the gateway's queue (never sent), the other failures (e.g. the pool's 503 after 5 s, or
a 504 when a stream's headers did not come within its budget), and Jain's fairness index
over the two batch tenants' goodput. Goodput counts from the first arrival to the last
answer (what was queued is answered after the arrivals stop). The goals (with admission on, at 3x): interactive p99 TTFT within
its budget, goodput at least 90 % of the goodput measured at 1x, sheds answered in under
5 ms at p99.
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
from dataclasses import dataclass, field

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import free_port, pinned, stop, wait_port  # noqa: E402
from loadgen.http import BaseURL, ConnectionPool, HttpError  # noqa: E402
from loadgen.openai import RequestHead, make_reader  # noqa: E402

SLOTS, TTFT, TOKENS, DELAY = 4, 0.2, 20, 0.02
CAPACITY = SLOTS / (TTFT + DELAY * (TOKENS - 1) + 0.02)  # requests/s the upstream can serve
TENANTS = {  # name: (key, priority, budget ms, share of the load)
    "batch-a": ("sk-batch-a", "batch", 10_000, 0.45),
    "batch-b": ("sk-batch-b", "batch", 10_000, 0.45),
    "app": ("sk-app", "interactive", 1_000, 0.10),
}
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": TOKENS}


def start_upstream(port: int, slots: int = SLOTS, ttft: float = TTFT, tokens: int = TOKENS, delay: float = DELAY) -> subprocess.Popen:
    """The scripted server (``loadgen/fake_upstream.py``) under uvicorn on core 1: ``slots``
    answers at a time, the rest queued first come, first served, as an inference server does."""
    code = (
        "import sys, uvicorn; sys.path.insert(0, %r); from loadgen.fake_upstream import FakeApp; "
        "app = FakeApp(['fake-model'], {'slots': %d, 'ttft': %r, 'tokens': %d, 'delay': %r}); "
        "app.requests = type('Discard', (list,), {'append': lambda self, item: None})(); "
        "uvicorn.run(app, host='127.0.0.1', port=%d, log_level='error', lifespan='off', access_log=False)"
    ) % (ROOT, slots, ttft, tokens, delay, port)
    proc = subprocess.Popen(pinned("1", [sys.executable, "-c", code]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    return proc


def gateway_config(upstream: int, port: int, admission: bool) -> dict:
    endpoint = {"url": f"http://127.0.0.1:{upstream}/v1", "warm_connections": 8, "read_timeout_s": 300}
    if admission:
        endpoint["max_concurrency"] = SLOTS
    return {
        "listen": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cache": {"backend": "off"},
        "clusters": [{"name": "central", "models": ["fake-model"], "endpoints": [endpoint]}],
        "routing": {"hedging": {"enabled": False}},
        "auth": {"mode": "required"},
        "tenants": [
            {"name": name, "keys": [key], "priority": priority, "budget_ms": budget}
            for name, (key, priority, budget, _) in TENANTS.items()
        ],
        "admission": {"predict": admission, "ageing_s": 30, "max_queue": 100_000},
    }


def start_gateway(config: dict, workdir: str) -> tuple[subprocess.Popen, str]:
    path = os.path.join(workdir, f"gateway-{config['listen']['port']}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    proc = subprocess.Popen(
        pinned("0", [sys.executable, "-m", "gateway", "serve", "--config", path]),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(config["listen"]["port"], proc)
    return proc, f"http://127.0.0.1:{config['listen']['port']}/v1"





@dataclass
class Outcome:
    tenant: str
    status: int = 0
    code: str | None = None  # an error's code
    ttft: float | None = None  # seconds, first content event
    answered: float = 0.0  # seconds until the response headers (for refusals: the whole answer)
    gateway_ms: float | None = None  # the gateway's own time for it (Server-Timing total)
    ended: float = 0.0  # perf_counter() when it was complete


SHED_AT_ONCE = {"capacity_exceeded", "tenant_backlog"}  # the predicted-wait decision
DROPPED = {"deadline_exceeded"}  # waited in the gateway's queue until the budget was gone


@dataclass
class Phase:
    mode: str
    load: float
    rate: float
    seconds: float
    started: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    def figures(self) -> dict:
        ok = lambda o: o.status == 200 and o.ttft is not None and o.ttft * 1000 <= TENANTS[o.tenant][2]  # noqa: E731
        good = [o for o in self.outcomes if ok(o)]
        # answers keep coming after the arrivals stop (what was queued): goodput is over the
        # whole time from the first arrival to the last answer
        span = max([o.ended for o in self.outcomes] + [self.started + self.seconds]) - self.started
        shed = [o for o in self.outcomes if o.code in SHED_AT_ONCE]
        dropped = [o for o in self.outcomes if o.status == 503 and o.code in DROPPED]
        app = sorted(o.ttft for o in self.outcomes if o.tenant == "app" and o.status == 200 and o.ttft is not None)
        app_all = [o for o in self.outcomes if o.tenant == "app"]
        per_batch = [sum(1 for o in good if o.tenant == t) for t in ("batch-a", "batch-b")]
        jain = sum(per_batch) ** 2 / (2 * sum(x * x for x in per_batch)) if any(per_batch) else float("nan")
        shed_ms = sorted(o.answered * 1000 for o in shed)
        decided_ms = sorted(o.gateway_ms for o in shed if o.gateway_ms is not None)
        return {
            "mode": self.mode,
            "load": self.load,
            "offered_rps": round(len(self.outcomes) / self.seconds, 2),
            "goodput_rps": round(len(good) / span, 2),
            "app_p50_ttft_ms": _pct(app, 50, 1000),
            "app_p99_ttft_ms": _pct(app, 99, 1000),
            "app_served_share": round(len(app) / len(app_all), 3) if app_all else None,
            "app_met_budget_share": round(sum(1 for o in good if o.tenant == "app") / len(app_all), 3) if app_all else None,
            "shed_share": round(len(shed) / len(self.outcomes), 3) if self.outcomes else 0.0,
            "dropped_share": round(len(dropped) / len(self.outcomes), 3) if self.outcomes else 0.0,
            "shed_p50_ms": _pct(shed_ms, 50, 1),
            "shed_p99_ms": _pct(shed_ms, 99, 1),
            "decision_p50_ms": _pct(decided_ms, 50, 1),
            "decision_p99_ms": _pct(decided_ms, 99, 1),
            "jain_batch": round(jain, 3),
            "other_failures": sum(1 for o in self.outcomes if o.status != 200 and o not in shed and o not in dropped),
        }


def _pct(values: list[float], q: float, scale: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return round(sorted(values)[k] * scale, 2)


async def one(pool: ConnectionPool, head: RequestHead, tenant: str, payload: bytes) -> Outcome:
    outcome = Outcome(tenant)
    started = time.perf_counter()
    try:
        response = await pool.request(head.encode(payload), make_reader, 120)
    except HttpError:
        outcome.status = -1
        return outcome
    outcome.status = response.status
    outcome.answered = response.first_byte - started if response.first_byte else response.done - started
    outcome.ended = response.done or time.perf_counter()
    times = getattr(response.reader, "times", None)
    if response.status == 200 and times:
        outcome.ttft = times[0] - started
    timing = response.headers.get("server-timing", "")
    if "total;dur=" in timing:
        outcome.gateway_ms = float(timing.split("total;dur=")[1].split(",")[0].split(";")[0])
    data = getattr(response.reader, "data", None)
    if response.status != 200 and data:
        try:
            outcome.code = json.loads(data)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
    return outcome


async def phase(url: str, mode: str, load: float, seconds: float, seed: int) -> Phase:
    rate = load * CAPACITY
    base = BaseURL.parse(url)
    pools = {name: ConnectionPool(base) for name in TENANTS}
    heads = {name: RequestHead(base, "/chat/completions", {"authorization": f"Bearer {key}"}, True) for name, (key, *_) in TENANTS.items()}
    payload = json.dumps(BODY).encode()
    rng = random.Random(seed)
    names, weights = list(TENANTS), [TENANTS[n][3] for n in TENANTS]
    tasks = []
    start = time.perf_counter()
    due = 0.0
    while due < seconds:
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        name = rng.choices(names, weights)[0]
        tasks.append(asyncio.ensure_future(one(pools[name], heads[name], name, payload)))
        due += rng.expovariate(rate)
    result = Phase(mode, load, rate, seconds, start, list(await asyncio.gather(*tasks)))
    for pool in pools.values():
        pool.close()
    await asyncio.sleep(0.05)
    return result


def table(rows: list[dict]) -> str:
    cols = [
        ("load", "load"), ("mode", "admission"), ("offered_rps", "offered req/s"), ("goodput_rps", "goodput req/s"),
        ("app_p50_ttft_ms", "interactive TTFT p50 ms"), ("app_p99_ttft_ms", "interactive TTFT p99 ms"),
        ("app_met_budget_share", "interactive within budget"), ("shed_share", "shed at once"),
        ("shed_p50_ms", "shed answered p50 ms"), ("shed_p99_ms", "shed answered p99 ms"),
        ("decision_p50_ms", "shed decided p50 ms"), ("decision_p99_ms", "shed decided p99 ms"),
        ("dropped_share", "dropped at deadline"), ("jain_batch", "Jain (batch a/b)"), ("other_failures", "other failures"),
    ]
    lines = ["| " + " | ".join(title for _, title in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join("–" if row[key] is None else (f"{row[key]}x" if key == "load" else str(row[key])) for key, _ in cols) + " |")
    return "\n".join(lines)


async def main_async(args) -> list[dict]:
    rows = []
    workdir = tempfile.mkdtemp(prefix="edgegw-overload-")
    upstream_port = free_port()
    upstream = start_upstream(upstream_port)
    try:
        for mode in ("off", "on"):
            gateway, url = start_gateway(gateway_config(upstream_port, free_port(), mode == "on"), workdir)
            try:
                await phase(url, mode, 0.5, 3, seed=99)  # warm-up: connections, and the queue's service time
                for load in args.loads:
                    result = await phase(url, mode, load, args.seconds, seed=int(load * 100))
                    rows.append(result.figures())
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                    await asyncio.sleep(TTFT + DELAY * TOKENS + 2)  # drain what the upstream still holds
            finally:
                stop(gateway)
    finally:
        stop(upstream)
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of load per phase (default 20)")
    parser.add_argument("--loads", default="1,2,3", help="loads as multiples of the upstream's capacity (default 1,2,3)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    print(f"upstream capacity: {CAPACITY:.2f} requests/s ({SLOTS} slots, {TTFT + DELAY * (TOKENS - 1):.2f} s per answer)")
    rows = asyncio.run(main_async(args))
    print()
    print(table(rows))
    on = {r["load"]: r for r in rows if r["mode"] == "on"}
    if 1.0 in on and 3.0 in on:
        top = on[3.0]
        print()
        print("| goal (admission on, 3x) | value | limit | met |\n|---|---:|---:|:---:|")
        checks = [
            ("interactive p99 TTFT", top["app_p99_ttft_ms"], TENANTS["app"][2], "ms"),
            ("goodput vs 1x", round(top["goodput_rps"] / on[1.0]["goodput_rps"], 3) if on[1.0]["goodput_rps"] else None, 0.9, "x (at least)"),
            ("shed answered p99 (client's clock)", top["shed_p99_ms"], 5, "ms"),
            ("shed decided p99 (gateway's Server-Timing total)", top["decision_p99_ms"], 5, "ms"),
        ]
        for name, value, limit, unit in checks:
            met = value is not None and (value >= limit if "least" in unit else value <= limit)
            print(f"| {name} | {value} | {limit} {unit} | {'yes' if met else '**no**'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
