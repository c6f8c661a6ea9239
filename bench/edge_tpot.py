"""Per-class token-time objectives on the edge engine, and the busy neighbour.

    .venv/bin/python bench/edge_tpot.py [--streams 96] [--probes 10] [--window 20] [--json FILE]

The gateway (``python -m gateway serve`` on ``configs/default.yaml``: SmolLM2 in-process,
int4 on this CPU, 32 sequences at once, ``edge.tpot_ms`` interactive 100 / standard 200 /
batch none) is started here once per scenario and stopped here by PID; traffic only on
127.0.0.1. Tenants: ``bulk`` (``batch``) and ``app`` (``interactive``, ``budget_ms: 1000``).

- ``alone``: ``--streams`` batch streams of 600 tokens (32 run, the rest wait in the
  gateway's queue); their aggregate tokens/s over ``--window`` seconds once they run.
- ``probes``: the same streams, plus an interactive probe every 2 s (32 tokens, streamed):
  each probe's TTFT (budget 1 s) and TPOT (objective 100 ms), and the batch aggregate
  against ``alone``'s. Goals: >= 95 % of probes within both; batch >= 80 % of alone.
- ``busy neighbour``: the same streams and probes with a CPU hog (a process spinning on
  one core, started and killed here by PID) beside the engine. Goal: every probe either
  meets its budget (first token within 1 s) or is refused within 100 ms of arrival.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.edge_contention import MODEL, QUESTION, Bulk, config, start_ready  # noqa: E402
from bench.overload import free_port, stop  # noqa: E402

BUDGET_S = 1.0
TPOT_OBJECTIVE_S = 0.100
PROBE_TOKENS = 32


class CountingBulk(Bulk):
    """``Bulk`` that counts the SSE events its streams receive (one per token)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.counts = [0] * self.n

    def start(self) -> None:
        for i in range(self.n):
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.settimeout(1.0)
            sock.sendall(self.request)
            self.socks.append(sock)
            thread = threading.Thread(target=self._count, args=(sock, i), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _count(self, sock, i: int) -> None:
        deadline = time.monotonic() + 900
        while not self.stopping and time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            self.counts[i] += data.count(b"data: ")

    def total(self) -> int:
        return sum(self.counts)


def probe(url: str) -> dict:
    """One interactive request: status, seconds to its first token or its refusal, TPOT."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": PROBE_TOKENS, "stream": True, "ignore_eos": True}
    headers = {"authorization": "Bearer sk-app"}
    started = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                code = r.json().get("error", {}).get("code") if r.content else None
                # the gateway's own time for it (the client's clock adds a loaded machine's delays)
                return {"status": r.status_code, "code": code, "seconds": time.monotonic() - started, "server_timing": r.headers.get("server-timing")}
            times = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line:  # the head had gone out: an in-band error
                    return {"status": 200, "code": json.loads(line[6:])["error"]["code"], "seconds": time.monotonic() - started}
                if '"content"' in line or '"finish_reason":"length"' in line:
                    times.append(time.monotonic() - started)
    except httpx.HTTPError as exc:
        return {"status": 0, "code": type(exc).__name__, "seconds": time.monotonic() - started}
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"status": 200, "seconds": times[0] if times else None, "tpot": tpot, "tokens": len(times)}


def verdict(p: dict) -> str:
    if p["status"] == 200 and "code" not in p and p["seconds"] is not None and p["seconds"] <= BUDGET_S:
        return "met" if p["tpot"] is not None and p["tpot"] <= TPOT_OBJECTIVE_S else "met-ttft-only"
    if p["status"] in (429, 503) and p["seconds"] <= 0.100:
        return "refused-fast"
    return "missed"


def scenario(name: str, streams: int, probes: int, window: float, hog: bool, workdir: str) -> dict:
    port = free_port()
    proc = start_ready(config(port, tenants=True), port, workdir)
    url = f"http://127.0.0.1:{port}"
    hog_proc = None
    results: list[dict] = []
    try:
        bulk = CountingBulk(port, streams, "sk-bulk")
        bulk.start()
        try:
            time.sleep(5)  # admitted and decoding
            if hog:
                hog_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(3)  # the engine's step cost model follows the slower node
            before, started = bulk.total(), time.monotonic()
            threads = []
            if probes:
                for i in range(probes):
                    t = threading.Thread(target=lambda: results.append(probe(url)), daemon=True)
                    t.start()
                    threads.append(t)
                    time.sleep(max(0.0, started + 2.0 * (i + 1) - time.monotonic()))
            else:
                time.sleep(window)
            elapsed = time.monotonic() - started
            tokens = bulk.total() - before
            for t in threads:
                t.join(120)
            stats = httpx.get(url + "/metrics").text
        finally:
            bulk.stop()
    finally:
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
        stop(proc)
    gauges = {
        line.split()[0]: line.split()[-1]
        for line in stats.splitlines()
        if line.startswith(("edgegw_edge_running ", "edgegw_edge_preemptions ", "edgegw_edge_deadline_drops "))
    }
    return {"scenario": name, "batch_tok_s": tokens / elapsed, "seconds": elapsed, "probes": results, "gauges": gauges}


def summary(row: dict, alone: float | None) -> str:
    probes = row["probes"]
    verdicts = [verdict(p) for p in probes]
    ttfts = [p["seconds"] * 1000 for p in probes if p["status"] == 200 and "code" not in p and p["seconds"] is not None]
    tpots = [p["tpot"] * 1000 for p in probes if p.get("tpot") is not None]
    share = f"{row['batch_tok_s'] / alone:.0%}" if alone else "100 %"
    counts = {v: verdicts.count(v) for v in ("met", "met-ttft-only", "refused-fast", "missed")}
    fmt = lambda xs: f"{statistics.median(xs):.0f} / {max(xs):.0f}" if xs else "-"  # noqa: E731
    codes = ", ".join(sorted({f"{p['status']} {p.get('code')}" for p in probes if "code" in p})) or "-"
    return (
        f"| {row['scenario']} | {row['batch_tok_s']:.0f} ({share}) | {len(probes)} | {counts['met']} | {counts['met-ttft-only']} "
        f"| {counts['refused-fast']} | {counts['missed']} | {fmt(ttfts)} | {fmt(tpots)} | {codes} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=96)
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--window", type=float, default=20.0, help="seconds the batch streams are measured alone")
    parser.add_argument("--only", choices=("alone", "probes", "busy"), action="append")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    plan = [("alone", 0, False), ("probes", args.probes, False), ("busy", args.probes, True)]
    out = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, probes, hog in plan:
            if args.only and name not in args.only:
                continue
            label = {"alone": f"{args.streams} batch streams alone", "probes": "+ interactive probes every 2 s", "busy": "+ probes, CPU hog beside the engine"}[name]
            out.append(scenario(label, args.streams, probes, args.window, hog, workdir))
            print(json.dumps(out[-1]), flush=True)
    alone = out[0]["batch_tok_s"] if out and not out[0]["probes"] else None
    print("\n| scenario | batch tok/s (of alone) | probes | TTFT <= 1 s and TPOT <= 100 ms | TTFT only | refused <= 100 ms | missed | TTFT ms p50 / max | TPOT ms p50 / max | refusals |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in out:
        print(summary(row, alone))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
