"""Exact-response cache benchmark: hits through the gateway against the uncached relay, in one run.

    .venv/bin/python bench/cache.py [--reps 3] [--n 1000] [--tput-n 3000] [--profile]

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1):

- the fake upstream: ``loadgen/fake_upstream.py``'s ``FakeApp`` under uvicorn (64-token answers, scripted per
  request by the body's ``fake`` object), pinned to core 1; ``GET /count`` answers how many
  completions it has served;
- gateways, ``taskset -c 0 python -m gateway serve --config <tmp yaml>``: one with the
  memory cache, two with the Redis cache (the real Redis at 127.0.0.1:6379, DB 15, a fresh
  namespace deleted at the end) sharing the namespace;
- the load generator is this process, on core 1 (with the upstream): keep-alive HTTP/1.1
  connections of loadgen's client (``loadgen/http.py``: asyncio + httptools, a few tens of
  microseconds per request).

Loads, each after a warm-up (the entry is stored by one request, then every connection
sends a few requests): for the memory and the Redis gateway and for JSON and SSE (64 content
chunks + finish + [DONE]): latency at concurrency 1 (request written -> response complete,
p50/p99) and throughput at concurrency 16 (requests/s). Every measured response is checked
to say ``x-cache: HIT``. The uncached relay is the same memory gateway with
``Cache-Control: no-store`` (``x-cache: BYPASS``), i.e. every request goes to the upstream.

Single-flight: 100 identical requests at once (half JSON, half SSE) on a fresh key whose
upstream answer takes 0.5 s to its first token; the upstream's own count of completions
says how many went upstream. For Redis, the burst is split over the two gateway processes.
The ``no-store`` burst is the baseline (every request goes upstream).

Every figure is the median over ``--reps`` repetitions. ``--profile`` samples the memory
gateway with py-spy (``pip install py-spy``) under the JSON hit load and prints the
functions with the most self time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import redis
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import free_port, pinned, stop, wait_http  # noqa: E402
from loadgen.http import BaseURL, ConnectionPool, Response  # noqa: E402

PY = sys.executable
GATEWAY_CORE, OTHER_CORE = "0", "1"
REDIS_URL = "redis://127.0.0.1:6379/15"
TOKENS = 64


# -- the fake upstream, as a child process ------------------------------------------------


def serve_fake(port: int) -> None:
    sys.path.insert(0, ROOT)
    import uvicorn

    from loadgen.fake_upstream import FakeApp

    app = FakeApp(["fake-model"], {"tokens": TOKENS})

    async def counted(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/count":
            body = str(sum(1 for r in app.requests if r.path.endswith("/completions"))).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    uvicorn.run(counted, host="127.0.0.1", port=port, log_level="error", lifespan="off", access_log=False)


# -- the load generator: loadgen's HTTP/1.1 client -------------------------------------------


class _Discard:
    """A body reader that keeps nothing: the figures are the exchange's times."""

    __slots__ = ()

    def feed(self, data: bytes, now: float) -> None:
        pass


_DISCARD = _Discard()


def discard(status: int, headers: dict[str, str]) -> _Discard:
    return _DISCARD


async def ask(pool: ConnectionPool, req: bytes) -> Response:
    """One request on ``pool``'s keep-alive connection, answered in whole."""
    return await pool.request(req, discard, 60)


def pool_for(port: int) -> ConnectionPool:
    return ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{port}"))


def request(body: dict, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode()
    head = [b"POST /v1/chat/completions HTTP/1.1", b"host: 127.0.0.1", b"content-type: application/json",
            b"content-length: " + str(len(data)).encode()]
    head += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    return b"\r\n".join(head) + b"\r\n\r\n" + data


def chat(key: str, stream: bool, **fake) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": f"bench {key}"}], "temperature": 0,
            "max_tokens": TOKENS, "stream": stream}
    if fake:
        body["fake"] = fake
    return body


async def run_load(port: int, req: bytes, concurrency: int, n: int, expect: str) -> dict:
    """n requests over `concurrency` keep-alive connections; latencies, req/s, bad answers."""
    pools = [pool_for(port) for _ in range(concurrency)]  # one keep-alive connection each
    for pool in pools:  # warm each connection
        for _ in range(3):
            await ask(pool, req)
    latencies: list[float] = []
    bad = 0
    left = n

    async def worker(pool: ConnectionPool) -> None:
        nonlocal left, bad
        while left > 0:
            left -= 1
            response = await ask(pool, req)
            latencies.append(response.done - response.sent)
            if response.status != 200 or response.headers.get("x-cache") != expect:
                bad += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(p) for p in pools))
    elapsed = time.perf_counter() - started
    for pool in pools:
        pool.close()
    latencies.sort()
    return {
        "p50": latencies[len(latencies) // 2] * 1000,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
        "rps": n / elapsed,
        "bad": bad,
    }


async def burst(ports: list[int], key: str, n: int, headers: dict[str, str] | None = None) -> int:
    """n identical requests at once (half JSON, half SSE); returns how many answered 200."""
    reqs = [request(chat(key, i % 2 == 1, ttft=0.5), headers) for i in range(n)]
    pools = [pool_for(port) for port in ports]  # a connection each for requests at once
    responses = await asyncio.gather(*(ask(pools[i % len(pools)], r) for i, r in enumerate(reqs)))
    for pool in pools:
        pool.close()
    return sum(r.status == 200 for r in responses)


# -- processes ---------------------------------------------------------------------------


def upstream_count(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(b"GET /count HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    return int(data.split(b"\r\n\r\n", 1)[1])


def start_gateway(tmp: str, upstream_port: int, cache: dict) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "clusters": [{"name": "central", "models": ["fake-model"],
                      "endpoints": [{"url": f"http://127.0.0.1:{upstream_port}", "protocol": "http1"}]}],
        "cache": cache,
    }
    path = os.path.join(tmp, f"gateway-{port}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    log = open(os.path.join(tmp, f"gateway-{port}.log"), "wb")
    proc = subprocess.Popen(pinned(GATEWAY_CORE, [PY, "-m", "gateway", "serve", "--config", path]),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wait_http(port, "/healthz", proc)
    return proc, port


# -- profile ------------------------------------------------------------------------------


def profile_summary(raw_path: str, top: int = 15) -> str:
    self_time: collections.Counter = collections.Counter()
    total = 0
    with open(raw_path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            if not frames:
                continue
            total += int(count)
            name, _, where = frames[-1].partition(" (")
            path = where.rstrip(")").rsplit(":", 1)[0]
            for marker in ("site-packages/", ROOT + "/", "lib/python3"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            self_time[f"{name} ({path})"] += int(count)
    lines = [f"{total} samples", "", "| self % | function |", "|---:|---|"]
    for fn, n in self_time.most_common(top):
        lines.append(f"| {100 * n / max(total, 1):.1f} | `{fn}` |")
    return "\n".join(lines)


async def profile(port: int, tmp: str, seconds: int = 8) -> str:
    spy = os.path.join(os.path.dirname(PY), "py-spy")
    if not os.path.exists(spy):
        spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy not found: `.venv/bin/pip install py-spy`"
    target = str(port_owner[port])  # taskset execs the gateway: same PID
    raw = os.path.join(tmp, "profile.txt")
    spy_proc = subprocess.Popen(pinned(OTHER_CORE, [spy, "record", "--pid", target, "--format", "raw", "--rate", "250",
                                                   "--nonblocking", "--duration", str(seconds), "--output", raw]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    req = request(chat("hit-json", False))
    deadline = time.monotonic() + seconds + 1
    while time.monotonic() < deadline:
        await run_load(port, req, 16, 1000, "HIT")
    spy_proc.wait(30)
    if not os.path.exists(raw):
        return f"py-spy failed: {spy_proc.stderr.read().decode(errors='replace')[-400:]}"
    return profile_summary(raw)


port_owner: dict[int, int] = {}


# -- main --------------------------------------------------------------------------------


def med(rows: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in rows)


async def bench(args: argparse.Namespace, tmp: str) -> None:
    namespace = "bench-" + uuid.uuid4().hex[:10]
    up_port = free_port()
    upstream = subprocess.Popen(pinned(OTHER_CORE, [PY, __file__, "--serve-fake", str(up_port)]), cwd=ROOT)
    procs = [upstream]
    try:
        wait_http(up_port, "/v1/models", upstream)
        mem, mem_port = start_gateway(tmp, up_port, {"backend": "memory"})
        rds, rds_port = start_gateway(tmp, up_port, {"backend": "redis", "redis_url": REDIS_URL, "namespace": namespace})
        rds2, rds2_port = start_gateway(tmp, up_port, {"backend": "redis", "redis_url": REDIS_URL, "namespace": namespace})
        procs += [mem, rds, rds2]
        port_owner[mem_port] = mem.pid
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {int(OTHER_CORE)})

        rows: list[tuple[str, str, dict, dict]] = []
        cases = [
            ("memory hit", mem_port, {}, "HIT"),
            ("Redis hit", rds_port, {}, "HIT"),
            ("uncached relay (no-store)", mem_port, {"cache-control": "no-store"}, "BYPASS"),
        ]
        for label, port, headers, expect in cases:
            for stream in (False, True):
                req = request(chat("hit-" + ("sse" if stream else "json"), stream), headers)
                pool = pool_for(port)
                await ask(pool, req)  # store the entry (a MISS), or a first relayed request
                pool.close()
                lat, tput = [], []
                for _ in range(args.reps):
                    lat.append(await run_load(port, req, 1, args.n, expect))
                    tput.append(await run_load(port, req, 16, args.tput_n, expect))
                rows.append((label, "SSE" if stream else "JSON", {k: med(lat, k) for k in lat[0]},
                             {k: med(tput, k) for k in tput[0]}))
                print(f"  {label:28} {'SSE' if stream else 'JSON':4}  p50 {rows[-1][2]['p50']:.3f} ms  "
                      f"p99 {rows[-1][2]['p99']:.3f} ms  {rows[-1][3]['rps']:.0f} req/s  "
                      f"bad {sum(r['bad'] for r in lat + tput)}", flush=True)

        bursts = []
        for label, ports, headers in (
            ("memory, one gateway", [mem_port], {}),
            ("Redis, split over two gateway processes", [rds_port, rds2_port], {}),
            ("baseline: Cache-Control no-store", [mem_port], {"cache-control": "no-store"}),
        ):
            calls, oks = [], []
            for _ in range(args.reps):
                before = upstream_count(up_port)
                oks.append(await burst(ports, "burst-" + uuid.uuid4().hex, 100, headers))
                calls.append(upstream_count(up_port) - before)
            bursts.append((label, statistics.median(calls), min(oks)))
            print(f"  burst {label}: upstream calls {calls}, 200s (min) {min(oks)}", flush=True)

        base = {shape: (lat, tput) for label, shape, lat, tput in rows if label.startswith("uncached")}
        out = [
            "| path | shape | p50 ms (c=1) | p99 ms (c=1) | req/s (c=16) | vs uncached relay |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for label, shape, lat, tput in rows:
            ratio = tput["rps"] / base[shape][1]["rps"]
            out.append(f"| {label} | {shape} | {lat['p50']:.3f} | {lat['p99']:.3f} | {tput['rps']:.0f} | "
                       f"{ratio:.2f}x |")
        out += ["", "| burst of 100 identical requests (50 JSON + 50 SSE, TTFT 0.5 s) | upstream calls | saved | answered 200 |",
                "|---|---:|---:|---:|"]
        for label, calls, ok in bursts:
            out.append(f"| {label} | {calls:g} | {100 - calls:g} | {ok} |")
        print("\n" + "\n".join(out))
        if args.profile:
            print("\nprofile: memory gateway, JSON hits, c=16\n")
            print(await profile(mem_port, tmp))
    finally:
        for proc in reversed(procs):  # gateways first, then the upstream they probe
            stop(proc)
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".log"):
                with open(os.path.join(tmp, name), errors="replace") as fh:
                    warnings = [line for line in fh if "WARNING" in line or "ERROR" in line]
                kinds = collections.Counter(w.split(": ", 1)[-1].split(" (")[0].strip()[:90] for w in warnings)
                for what, count in kinds.most_common(4):
                    print(f"{name}: {count} x {what}")
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=namespace + ":*"))
        if keys:
            client.delete(*keys)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=1000, help="requests per latency run (c=1)")
    parser.add_argument("--tput-n", type=int, default=3000, help="requests per throughput run (c=16)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake)
        return
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        asyncio.run(bench(args, tmp))


if __name__ == "__main__":
    main()
