"""One interactive request beside another tenant's long streams on the edge engine.

    .venv/bin/python bench/edge_contention.py [--streams 48] [--asks 5] [--json FILE]

The gateway (``python -m gateway serve``, the embedded SmolLM2 in its default CPU mode, as
``make run`` serves it) is started here, once per scenario, and stopped here by PID;
traffic only on 127.0.0.1. In each scenario a bulk client opens ``--streams`` long streams
(600 tokens each, read as they come), waits until the engine is full, then an application
sends ``--asks`` short chat requests one after the other with a 1 s budget and reports, for
each, the status, the time to its first token (or to its refusal) and the route header.

- ``tenants``: the bulk client is a ``batch`` tenant, the application an ``interactive``
  one with ``budget_ms: 1000``: the gateway's queue puts it first and the engine preempts a
  batch sequence for it.
- ``one tenant``: no keys (``auth: off``), everyone the anonymous tenant; the application
  sends ``x-latency-budget-ms: 1000``: nothing makes it more urgent than the streams ahead
  of it, so the gateway predicts its wait and refuses it at once when the budget cannot be
  met, instead of answering it after the streams ahead have ended.
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
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import free_port, stop, wait_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def config(port: int, tenants: bool) -> dict:
    with open(os.path.join(ROOT, "configs", "default.yaml")) as f:
        base = yaml.safe_load(f)
    base["listen"] = {**base["listen"], "host": "127.0.0.1", "port": port, "log_level": "warning"}
    base["cache"] = {**base["cache"], "backend": "off"}
    base["auth"] = {**base["auth"], "mode": "off"}  # PyYAML read the word as false
    if tenants:
        base["auth"] = {**base["auth"], "mode": "required"}
        base["tenants"] = [
            {"name": "bulk", "keys": ["sk-bulk"], "priority": "batch"},
            {"name": "app", "keys": ["sk-app"], "priority": "interactive", "budget_ms": 1000},
        ]
    return base


class Bulk:
    """``n`` long streams over raw sockets, each drained by a thread until it ends or
    ``stop`` is called."""

    def __init__(self, port: int, n: int, key: str | None) -> None:
        body = json.dumps(
            {"model": MODEL, "messages": QUESTION, "max_tokens": 600, "stream": True, "ignore_eos": True}
        ).encode()
        auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            + auth + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.port = port
        self.n = n
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stopping = False

    def start(self) -> None:
        for _ in range(self.n):
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.settimeout(1.0)
            sock.sendall(self.request)
            self.socks.append(sock)
            thread = threading.Thread(target=self._drain, args=(sock,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _drain(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + 600
        while not self.stopping and time.monotonic() < deadline:
            try:
                if not sock.recv(65536):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def stop(self) -> None:
        self.stopping = True
        for sock in self.socks:
            sock.close()
        for thread in self.threads:
            thread.join(5)


def ask(url: str, headers: dict) -> dict:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        route = r.headers.get("x-edgegw-route", "")
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "seconds": time.monotonic() - started, "route": route, "code": r.json()["error"]["code"]}
        lines = r.iter_lines()
        first = None
        for line in lines:
            if line.startswith("data:"):
                first = time.monotonic() - started
                break
        for _ in lines:  # the rest of the answer
            pass
    return {"status": 200, "seconds": first, "route": route}


def start_ready(config: dict, port: int, workdir: str) -> subprocess.Popen:
    """``python -m gateway serve`` on ``config``, once its /readyz answers 200 and, with the
    edge engine on, the engine answers a one-token request (workers serve the clusters
    while the engine's process loads); the caller stops it (``bench.processes.stop``)."""
    path = os.path.join(workdir, f"{port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", path], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, timeout=300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # connections may wait while the engine loads
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60).status_code == 200 and _edge_answers(config, port):
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the gateway did not become ready")
    except BaseException:
        stop(proc)
        raise


def _edge_answers(config: dict, port: int) -> bool:
    edge = config.get("edge") or {}
    if not edge.get("enabled"):
        return True
    body = {"model": edge.get("name") or MODEL, "messages": QUESTION, "max_tokens": 1}
    keys = [k for t in config.get("tenants") or [] for k in t.get("keys", [])]
    headers = {"authorization": f"Bearer {keys[0]}"} if keys else {}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200


def scenario(name: str, tenants: bool, streams: int, asks: int, workdir: str) -> dict:
    port = free_port()
    proc = start_ready(config(port, tenants), port, workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        headers = {"x-latency-budget-ms": "1000"}
        if tenants:
            headers = {"authorization": "Bearer sk-app"}
        idle = ask(url, headers)  # the same request on an idle engine: the baseline
        bulk = Bulk(port, streams, "sk-bulk" if tenants else None)
        bulk.start()
        try:
            time.sleep(5)  # the streams are admitted and decoding
            results = [ask(url, headers) for _ in range(asks)]
            gauges = httpx.get(url + "/metrics").text
        finally:
            bulk.stop()
    finally:
        stop(proc)
    running = next((line.split()[-1] for line in gauges.splitlines() if line.startswith("edgegw_edge_running ")), "?")
    return {"scenario": name, "idle": idle, "results": results, "edge_running_during": running}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--asks", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, tenants in (("tenants", True), ("one tenant", False)):
            out.append(scenario(name, tenants, args.streams, args.asks, workdir))
            print(json.dumps(out[-1]), flush=True)
    print(f"\n| scenario | idle: status / first token ms | beside {args.streams} streams: statuses | ms to first token or refusal, median (max) | target (first ask) |")
    print("|---|---|---|---|---|")
    for row in out:
        times = [r["seconds"] * 1000 for r in row["results"] if r["seconds"] is not None]
        statuses = ", ".join(str(r["status"]) + (f" {r['code']}" if "code" in r else "") for r in row["results"])
        idle = row["idle"]
        print(
            f"| {row['scenario']} | {idle['status']} / {idle['seconds'] * 1000:.0f} | {statuses} | "
            f"{statistics.median(times):.0f} ({max(times):.0f}) | `{row['results'][0]['route'].split(';')[0]}` |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
