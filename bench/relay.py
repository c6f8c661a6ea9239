"""Relay benchmark: the direct path against the path through the gateway, in one run.

    .venv/bin/python bench/relay.py [--quick] [--reps 3] [--no-h2] [--traces] [--json FILE]
    .venv/bin/python bench/relay.py --profile [--profile-seconds 12]      # + py-spy
    .venv/bin/python bench/relay.py --workers [--reps 3]   # listen.workers 1 against 2, same run
    .venv/bin/python bench/relay.py --workers --native-peers   # the same with wrk and nginx as load generator and upstream
    .venv/bin/python bench/relay.py --isolation [-- --json FILE]   # the relay beside a busy edge engine (bench/isolation.py)
    .venv/bin/python bench/relay.py --nginx [--no-h2]      # + nginx as a reference proxy (apt-get install nginx)

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1):

- upstream ``bench/fast_upstream.py`` (raw asyncio + httptools, zero delays, 64-token
  answers), pinned with ``taskset -c 1``;
- for the HTTP/2 variant, ``bench/fast_upstream.py --hypercorn`` (``loadgen/fake_upstream.py`` under
  hypercorn: h1 and h2c on one port), also ``taskset -c 1``;
- the gateway, ``taskset -c 0 python -m gateway serve --config <tmp yaml>``, once with
  ``protocol: http1`` towards the fast upstream and once with ``protocol: http2`` towards
  hypercorn (``pool_size: 128, warm_connections: 8``); with ``--traces`` also a third,
  as the first but tracing every request (OpenTelemetry, ``sample_ratio: 1``) with its
  spans exported over OTLP/HTTP to a sink in the fast upstream (``POST /v1/traces``);
- with ``--nginx``, nginx (``apt-get install nginx``: the bench's own set-up, not a
  dependency of the project) as a reference proxy in front of the fast upstream, pinned to
  core 0 like the gateway: one worker, ``proxy_buffering off``, HTTP/1.1 keep-alive to the
  upstream (``keepalive 128``), no access log; its added latency and CPU are reported
  beside the gateway's and as the gateway's ratio to them;
- the load generator is this process, pinned to core 1 (with the upstreams): loadgen's
  keep-alive HTTP/1.1 client (``loadgen/http.py``: asyncio (uvloop) + httptools, a few tens
  of µs per request; ``edgegw bench`` measures with the same one).

Loads, each on fresh keep-alive connections after a warm-up of 2 requests per connection,
with a fixed number of requests: non-streaming chat completions at concurrency 1, 16, 64;
SSE streams (64 content chunks + a finish chunk + ``data: [DONE]`` = 66 events) at
concurrency 1 and 64. Figures:

- requests/s and p50/p99 end-to-end latency (request written -> response complete);
- TTFT: request written -> first body byte (the first ``data:`` event) received;
  inter-token gap: between the arrivals of consecutive events (events that arrive in the
  same read count as a gap of 0: that is how a client sees them);
- gateway CPU (user + system, psutil ``cpu_times`` of the gateway process before and
  after each load) per non-streaming request, and per relayed SSE event (events counted
  at the client); the gateway's peak RSS (``VmHWM``);
- added latency: gateway figure minus direct figure (of the medians over repetitions).
  The direct baseline for the HTTP/2 variant is hypercorn over HTTP/1.1 (this client
  speaks only HTTP/1.1), so there "added" also contains h2-vs-h1 differences upstream.

``--workers`` runs another scenario instead: two HTTP/1.1 gateways in front of the fast
upstream, ``listen.workers: 1`` and ``listen.workers: 2``, both allowed on cores 0 and 1
(the upstream and the load generator stay on core 1), under non-streaming c=64 and SSE c=64
loads: requests/s of each, the ratio, and the CPU (cores busy) of the gateway's processes,
the upstream and the load generator during each load.

``--workers --native-peers`` runs that scenario with peers outside the interpreter, so that
they leave the gateway more of the machine (``apt-get install wrk nginx``, the bench's own
set-up): ``wrk`` (one thread, pinned to core 1, 8 s per load, req/s and its p50/p99 latency,
its CPU from its own rusage) as the load generator, and nginx (one worker, core 1) as the
upstream, answering every request with the fast upstream's 64-token JSON answer or its
66-event stream as one fixed body (one cluster per kind, by model name). A stream that
arrives in one read is relayed as one chunk: this measures requests, not events.

Every figure is the median over ``--reps`` repetitions (default 3; the box is noisy).
``--profile`` afterwards samples the HTTP/1.1 gateway with ``py-spy record --format raw``
(``pip install py-spy``) under the non-streaming c=16 load and the SSE c=64 loads (back to
back, and paced at 100 tokens/s) and prints
the functions with the most self time (share of the gateway's non-idle samples).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import http.client
import itertools
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import Child, free_port, pinned  # noqa: E402
from loadgen.http import BaseURL, ConnectionPool, HttpError, Response  # noqa: E402

PY = sys.executable
MODEL = "bench-model"
TOKENS = 64
EVENTS = TOKENS + 2  # content chunks, the finish chunk, [DONE]
GATEWAY_CORE = 0
OTHER_CORE = 1

_MESSAGES = [{"role": "user", "content": "Say something short."}]


@functools.cache
def request_bytes(stream: bool, delay: float = 0.0) -> bytes:
    """The load's raw HTTP/1.1 request: a chat completion, streamed or not, with the fake
    upstream's time between tokens (made once per kind)."""
    payload = {"model": MODEL, "messages": _MESSAGES, "max_tokens": TOKENS, "stream": stream}
    if delay:
        payload["fake"] = {"delay": delay}  # the upstream's time between tokens (loadgen/fake_upstream.py's script field)
    body = json.dumps(payload).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"accept: " + (b"text/event-stream" if stream else b"application/json") + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


# (name, concurrency, requests) -- full run; --quick divides the counts
NONSTREAM = [("c1", 1, 1500), ("c16", 16, 4000), ("c64", 64, 6400)]
# (name, concurrency, streams, seconds between tokens): zero delay saturates the gateway
# (closed loop: TTFT at c=64 is then mostly queueing behind 63 other streams' events); the
# paced load is 64 live streams at 100 tokens/s each, started staggered, which is what a
# gateway in front of inference servers sees.
STREAM = [("c1", 1, 150, 0.0), ("c64", 64, 640, 0.0), ("c64-paced", 64, 192, 0.01)]
PACED_STREAM_S = TOKENS * 0.01


# -- the load generator ----------------------------------------------------------------


class EventCounter:
    """Reads one response for loadgen's client (a ``loadgen.http.BodyReader``): its bytes,
    the first byte's time, and for a stream its SSE events with the gaps between their
    arrivals (events that arrive in one read count as gaps of 0: what a client sees) and
    its tail, to check the ``[DONE]``."""

    __slots__ = ("stream", "gaps", "first", "last_event", "events", "nbytes", "half_boundary", "tail")

    def __init__(self, stream: bool, gaps: list[float]) -> None:
        self.stream = stream
        self.gaps = gaps
        self.first = 0.0
        self.last_event = 0.0
        self.events = 0
        self.nbytes = 0
        self.half_boundary = False
        self.tail = b""

    def feed(self, body: bytes, now: float) -> None:
        self.nbytes += len(body)
        if not self.first:
            self.first = now
        if self.stream:
            n = body.count(b"\n\n")
            if self.half_boundary and body[:1] == b"\n":
                n += 1
            self.half_boundary = body.endswith(b"\n") and not body.endswith(b"\n\n")
            if n:
                gaps = self.gaps
                last = self.last_event
                for _ in range(n):
                    if last:
                        gaps.append(now - last)
                    last = now
                self.last_event = now
                self.events += n
            self.tail = (self.tail + body)[-200:]

    def ok(self, status: int) -> bool:
        if status != 200 or not self.nbytes:
            return False
        if self.stream:
            return self.events == EVENTS and self.tail.endswith(b"data: [DONE]\n\n")
        return True


class Client:
    """One keep-alive HTTP/1.1 connection of loadgen's client (``loadgen/http.py``), one
    request at a time, the benchmark's prepared request bytes."""

    def __init__(self, port: int, delay: float = 0.0) -> None:
        self.pool = ConnectionPool(BaseURL.parse(f"http://127.0.0.1:{port}"))
        self.delay = delay

    async def request(self, stream: bool, gaps: list[float]) -> tuple[Response, EventCounter]:
        response = await self.pool.request(request_bytes(stream, self.delay), lambda status, headers: EventCounter(stream, gaps), 300)
        return response, response.reader

    def close(self) -> None:
        self.pool.close()


@dataclass
class PhaseResult:
    requests: int = 0
    errors: int = 0
    wall: float = 0.0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    events: int = 0
    cpu: float | None = None  # gateway CPU seconds during the phase
    error_kinds: collections.Counter = field(default_factory=collections.Counter)


async def run_phase(
    port: int, concurrency: int, total: int, stream: bool, gateway: Child | None, delay: float = 0.0
) -> PhaseResult:
    clients = [Client(port, delay) for _ in range(concurrency)]
    try:
        for _ in range(2):  # warm-up: connections, upstream pool, caches
            await asyncio.gather(*(c.request(stream, []) for c in clients), return_exceptions=True)
        result = PhaseResult()
        counter = itertools.count()
        gaps = result.gaps

        async def worker(index: int, client: Client) -> None:
            if delay:  # stagger the paced streams over one stream's duration
                await asyncio.sleep(index * TOKENS * delay / concurrency)
            while next(counter) < total:
                try:
                    response, read = await client.request(stream, gaps)
                except HttpError as exc:  # the server dropped the connection: the next request opens another
                    result.requests += 1
                    result.errors += 1
                    result.error_kinds[f"{exc.kind}: {exc.detail}"] += 1
                    continue
                result.requests += 1
                if not read.ok(response.status):
                    result.errors += 1
                    result.error_kinds[f"status {response.status}, {read.events} events, ends {read.tail[-160:]!r}"] += 1
                    continue
                if stream:
                    result.ttft.append(read.first - response.sent)
                    result.events += read.events
                result.e2e.append(response.done - response.sent)

        gc.collect()
        gc.disable()
        cpu0 = gateway.cpu() if gateway else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(worker(i, c) for i, c in enumerate(clients)))
        result.wall = time.perf_counter() - start
        if gateway:
            result.cpu = gateway.cpu() - cpu0
        gc.enable()
        return result
    finally:
        for c in clients:
            c.close()
        await asyncio.sleep(0.05)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(r: PhaseResult, stream: bool) -> dict:
    s = {
        "requests": r.requests,
        "errors": r.errors,
        "rps": r.requests / r.wall if r.wall else float("nan"),
        "e2e_p50": pct(r.e2e, 0.5) * 1e3,
        "e2e_p99": pct(r.e2e, 0.99) * 1e3,
    }
    if stream:
        s.update(
            ttft_p50=pct(r.ttft, 0.5) * 1e3,
            ttft_p99=pct(r.ttft, 0.99) * 1e3,
            gap_p50=pct(r.gaps, 0.5) * 1e3,
            gap_p99=pct(r.gaps, 0.99) * 1e3,
            events=r.events,
        )
    if r.cpu is not None:
        if stream:
            s["cpu_us_per_event"] = r.cpu / r.events * 1e6 if r.events else float("nan")
            s["cpu_ms_per_stream"] = r.cpu / max(1, r.requests) * 1e3
        else:
            ok = r.requests - r.errors  # failed requests cost little: count the successful ones
            s["cpu_ms_per_req"] = r.cpu / ok * 1e3 if ok else float("nan")
    return s


# -- the run ---------------------------------------------------------------------------


@dataclass
class Target:
    key: str  # "direct-h1", "gw-h1", "direct-hc", "gw-h2"
    port: int
    gateway: Child | None


GATEWAY_SET: dict[str, object] = {}  # --set KEY=VALUE: configuration keys of the gateways under test


def _apply_set(config: dict) -> dict:
    """``--set usage.enabled=false``: dotted keys into the gateway's configuration (values as YAML)."""
    for dotted, value in GATEWAY_SET.items():
        node = config
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def gateway_config(upstream_port: int, protocol: str, port: int, traces: bool = False) -> dict:
    config = {
        "clusters": [
            {
                "name": "bench",
                "models": [MODEL],
                "endpoints": [
                    {
                        "url": f"http://127.0.0.1:{upstream_port}",
                        "protocol": protocol,
                        "pool_size": 128,
                        "warm_connections": 8,
                    }
                ],
            }
        ],
        "listen": {"host": "127.0.0.1", "port": port},
    }
    if traces:  # every request traced (sample_ratio 1), spans exported to the fast upstream's sink
        config["tracing"] = {"endpoint": f"http://127.0.0.1:{upstream_port}/v1/traces", "sample_ratio": 1.0}
    return _apply_set(config)


def nginx_config(upstream_port: int, port: int, tmp: str) -> str:
    """A reference proxy as a careful operator would set one up for SSE: one worker, no
    response buffering, kept-alive HTTP/1.1 connections to the upstream, no access log."""
    return f"""
daemon off;
master_process on;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    keepalive_requests 1000000;  # the client's connections (the default 1000 closes them mid-run)
    upstream bench {{ server 127.0.0.1:{upstream_port}; keepalive 128; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def start_processes(
    tmp: str, children: list[Child], with_h2: bool, gateway_root: str, with_traces: bool = False, nginx: str | None = None
) -> dict[str, Target]:
    """The upstreams, the gateways (and nginx), each added to ``children`` as it starts."""
    targets: dict[str, Target] = {}

    def child(name: str, core: int, argv: list[str], cwd: str = ROOT) -> Child:
        c = Child(name, pinned(core, argv), tmp, cwd)
        children.append(c)
        return c

    fast_port = free_port()
    fast = child("fast-upstream", OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(fast_port), "--tokens", str(TOKENS), "--model", MODEL])
    fast.wait_http(fast_port, "/health")
    targets["direct-h1"] = Target("direct-h1", fast_port, None)
    gw_specs = [("gw-h1", fast_port, "http1", False)]
    if with_traces:
        gw_specs.append(("gw-h1-traced", fast_port, "http1", True))
    if with_h2:
        hc_port = free_port()
        hc = child("hypercorn-upstream", OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(hc_port), "--tokens", str(TOKENS), "--model", MODEL, "--hypercorn"])
        hc.wait_http(hc_port, "/health")
        targets["direct-hc"] = Target("direct-hc", hc_port, None)
        gw_specs.append(("gw-h2", hc_port, "http2", False))
    if nginx is not None:
        port = free_port()
        conf = os.path.join(tmp, "nginx.conf")
        with open(conf, "w") as f:
            f.write(nginx_config(fast_port, port, tmp))
        proxy = child("nginx-h1", GATEWAY_CORE, [nginx, "-p", tmp, "-c", conf])
        proxy.wait_http(port, "/health")
        targets["nginx-h1"] = Target("nginx-h1", port, proxy)
    for key, upstream_port, protocol, traces in gw_specs:
        port = free_port()
        path = os.path.join(tmp, f"{key}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(gateway_config(upstream_port, protocol, port, traces), f)
        gw = child(key, GATEWAY_CORE, [PY, "-m", "gateway", "serve", "--config", path], cwd=gateway_root)
        gw.wait_http(port, "/readyz")
        targets[key] = Target(key, port, gw)
    return targets


async def measure(targets: dict[str, Target], reps: int, scale: float) -> dict:
    """results[target][load] -> list of per-repetition summaries."""
    results: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    loads = [("json", name, conc, n, False, 0.0) for name, conc, n in NONSTREAM] + [
        ("sse", name, conc, n, True, delay) for name, conc, n, delay in STREAM
    ]
    for rep in range(reps):
        for target in targets.values():
            for kind, name, conc, n, stream, delay in loads:
                total = max(conc * 2, int(n * scale))
                if (target.key.endswith("hc") or target.key.endswith("h2")) and not delay:
                    total = max(conc * 2, total // 2)  # hypercorn is ~10x slower: fewer requests
                r = await asyncio.wait_for(run_phase(target.port, conc, total, stream, target.gateway, delay), 300)
                s = summarise(r, stream)
                results[target.key][f"{kind}-{name}"].append(s)
                line = f"rep {rep + 1} {target.key:9} {kind}-{name:4} n={s['requests']:5} err={s['errors']} {s['rps']:8.0f}/s"
                if stream:
                    line += f" ttft p50 {s['ttft_p50']:.3f} p99 {s['ttft_p99']:.3f} gap p50 {s['gap_p50']:.4f} p99 {s['gap_p99']:.3f} ms"
                    if "cpu_us_per_event" in s:
                        line += f" cpu {s['cpu_us_per_event']:.1f} us/event"
                else:
                    line += f" e2e p50 {s['e2e_p50']:.3f} p99 {s['e2e_p99']:.3f} ms"
                    if "cpu_ms_per_req" in s:
                        line += f" cpu {s['cpu_ms_per_req']:.3f} ms/req"
                print(line, file=sys.stderr, flush=True)
                for kind_, count in r.error_kinds.most_common(3):
                    print(f"    {count} x {kind_}", file=sys.stderr)
    return results


# -- listen.workers: 1 against 2 ----------------------------------------------------------

WORKER_LOADS = [("json-c64", 64, 6400, False), ("sse-c64", 64, 640, True)]


def start_worker_gateways(tmp: str, gateway_root: str, children: list[Child]) -> tuple[Child, dict[str, Target]]:
    """The fast upstream (core 1), and a gateway with ``listen.workers: 1`` and one with 2,
    each allowed on both cores (added to ``children`` as they start)."""
    fast_port = free_port()
    fast = Child("fast-upstream", pinned(OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(fast_port), "--tokens", str(TOKENS), "--model", MODEL]), tmp)
    children.append(fast)
    fast.wait_http(fast_port, "/health")
    return fast, start_gateways_1_and_2(tmp, gateway_root, children, lambda port: gateway_config(fast_port, "http1", port))


def start_gateways_1_and_2(tmp: str, gateway_root: str, children: list[Child], config_for) -> dict[str, Target]:
    """Two gateways on ``config_for(port)``, one with ``listen.workers: 1`` and one with 2,
    each allowed on both cores; ready once every worker answers the node's /metrics."""
    targets: dict[str, Target] = {}
    for workers in (1, 2):
        key = f"gw-h1-w{workers}"
        port = free_port()
        config = config_for(port)
        config["listen"]["workers"] = workers
        path = os.path.join(tmp, f"{key}.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(config, fh)
        gw = Child(key, pinned(f"{GATEWAY_CORE},{OTHER_CORE}", [PY, "-m", "gateway", "serve", "--config", path]), tmp, gateway_root)
        children.append(gw)
        gw.wait_http(port, "/readyz")
        deadline = time.monotonic() + 30
        while workers > 1 and f"edgegw_workers_scraped {workers:.1f}" not in _get(port, "/metrics"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{key}: its {workers} workers did not all start")
            time.sleep(0.1)
        targets[key] = Target(key, port, gw)
    return targets


# -- listen.workers with peers outside the interpreter: wrk and nginx ---------------------

NATIVE_SECONDS = 8.0


def native_upstream_config(json_port: int, sse_port: int, tmp: str) -> str:
    """nginx answering every request with one fixed answer: the fast upstream's 64-token JSON
    answer on ``json_port``, its 66-event stream (one body, Content-Length) on ``sse_port``.
    The answers are files; nginx's static module refuses POST (405), which ``error_page``
    turns into the file itself (a GET of the same URI, internally)."""
    from fast_upstream import Answers  # bench/ is this script's directory

    answers = Answers(TOKENS, [MODEL])
    bodies = {
        "json": answers.json(MODEL, "chat").split(b"\r\n\r\n", 1)[1],
        "sse": b"".join(frame.split(b"\r\n", 1)[1][:-2] for frame in answers.sse(MODEL, "chat")[:-1]),
    }
    for kind, body in bodies.items():
        for path in ("v1/chat/completions", "health"):
            os.makedirs(os.path.join(tmp, kind, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(tmp, kind, path), "wb") as fh:
                fh.write(body)
    for path, _, _ in [*os.walk(os.path.join(tmp, "json")), *os.walk(os.path.join(tmp, "sse")), (tmp, 0, 0)]:
        os.chmod(path, 0o755)  # nginx's worker runs as nobody when started by root
    return f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx-upstream.pid;
error_log {tmp}/nginx-upstream-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-up-body;
    proxy_temp_path {tmp}/nginx-up-proxy;
    fastcgi_temp_path {tmp}/nginx-up-fastcgi;
    uwsgi_temp_path {tmp}/nginx-up-uwsgi;
    scgi_temp_path {tmp}/nginx-up-scgi;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{json_port};
        location / {{ root {tmp}/json; default_type application/json; error_page 405 =200 $uri; }}
    }}
    server {{
        listen 127.0.0.1:{sse_port};
        location / {{ root {tmp}/sse; default_type "text/event-stream; charset=utf-8"; error_page 405 =200 $uri; }}
    }}
}}
"""


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
"""


def run_wrk(wrk: str, port: int, conc: int, seconds: float, stream: bool, tmp: str) -> dict:
    """``wrk`` (one thread, pinned to core 1) for ``seconds``: req/s, p50/p99 latency (ms),
    failures, and the CPU it took (cores busy, from its own rusage)."""
    model = MODEL + ("-sse" if stream else "-json")
    payload = {"model": model, "messages": _MESSAGES, "max_tokens": TOKENS, "stream": stream}
    script = os.path.join(tmp, f"wrk-{model}.lua")
    with open(script, "w") as fh:
        fh.write(WRK_SCRIPT.format(body=json.dumps(payload)))
    argv = pinned(OTHER_CORE, [wrk, "-t1", f"-c{conc}", f"-d{seconds:g}s", "--latency", "-s", script, f"http://127.0.0.1:{port}/v1/chat/completions"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed:\n{out}")
    figures: dict = {"errors": 0}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("Requests/sec:"):
            figures["rps"] = float(words[1])
        elif words[:1] == ["50%"]:
            figures["p50_ms"] = _wrk_ms(words[1])
        elif words[:1] == ["99%"]:
            figures["p99_ms"] = _wrk_ms(words[1])
        elif "Non-2xx" in line:
            figures["errors"] += int(words[-1])
        elif line.strip().startswith("Socket errors:"):
            figures["errors"] += sum(int(w.rstrip(",")) for w in words if w.rstrip(",").isdigit())
        elif "requests in" in line:
            figures["requests"] = int(words[0])
    figures["wall"] = seconds
    figures["loadgen_cores"] = (usage.ru_utime + usage.ru_stime) / seconds
    return figures


def _wrk_ms(text: str) -> float:
    for unit, scale in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def start_native_worker_gateways(tmp: str, gateway_root: str, nginx: str, children: list[Child]) -> tuple[Child, dict[str, Target]]:
    """nginx as the upstream (core 1), and gateways with ``listen.workers: 1`` and 2 on
    both cores, with one cluster per answer kind (model ``bench-model-json`` / ``-sse``)."""
    json_port, sse_port = free_port(), free_port()
    conf = os.path.join(tmp, "nginx-upstream.conf")
    with open(conf, "w") as fh:
        fh.write(native_upstream_config(json_port, sse_port, tmp))
    upstream = Child("nginx-upstream", pinned(OTHER_CORE, [nginx, "-p", tmp, "-c", conf]), tmp)
    children.append(upstream)
    upstream.wait_http(json_port, "/health")

    def config_for(port: int) -> dict:
        config = gateway_config(json_port, "http1", port)
        cluster = config["clusters"][0]
        sse_endpoint = {**cluster["endpoints"][0], "url": f"http://127.0.0.1:{sse_port}"}
        sse_cluster = {**cluster, "name": "bench-sse", "models": [MODEL + "-sse"], "endpoints": [sse_endpoint]}
        config["clusters"] = [{**cluster, "models": [MODEL + "-json"]}, sse_cluster]
        return config

    return upstream, start_gateways_1_and_2(tmp, gateway_root, children, config_for)


def measure_native_workers(targets: dict[str, Target], upstream: Child, reps: int, wrk: str, tmp: str, seconds: float) -> dict:
    results: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for rep in range(reps):
        for target in targets.values():
            for load, conc, _n, stream in WORKER_LOADS:
                run_wrk(wrk, target.port, conc, 1.0, stream, tmp)  # warm-up: connections, pools
                gw0, up0 = target.gateway.cpu(), upstream.cpu()
                s = run_wrk(wrk, target.port, conc, seconds, stream, tmp)
                s["gateway_cores"] = (target.gateway.cpu() - gw0) / s["wall"]
                s["upstream_cores"] = (upstream.cpu() - up0) / s["wall"]
                results[target.key][load].append(s)
                print(
                    f"rep {rep + 1} {target.key:9} {load:8} n={s.get('requests', 0):6} err={s['errors']} {s['rps']:8.0f}/s "
                    f"p50 {s.get('p50_ms', float('nan')):.2f} p99 {s.get('p99_ms', float('nan')):.2f} ms "
                    f"cores: gateway {s['gateway_cores']:.2f} upstream {s['upstream_cores']:.2f} load generator {s['loadgen_cores']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


async def measure_workers(targets: dict[str, Target], upstream: Child, reps: int, scale: float) -> dict:
    """results[target][load] -> per-repetition summaries, with the CPU (cores busy) of the
    gateway, the upstream and this load generator during the load."""
    me = psutil.Process()
    results: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for rep in range(reps):
        for target in targets.values():
            for load, conc, n, stream in WORKER_LOADS:
                total = max(conc * 2, int(n * scale))
                gw0, up0, me0 = target.gateway.cpu(), upstream.cpu(), sum(me.cpu_times()[:2])
                r = await asyncio.wait_for(run_phase(target.port, conc, total, stream, None), 300)
                s = summarise(r, stream)
                s["gateway_cores"] = (target.gateway.cpu() - gw0) / r.wall
                s["upstream_cores"] = (upstream.cpu() - up0) / r.wall
                s["loadgen_cores"] = (sum(me.cpu_times()[:2]) - me0) / r.wall
                results[target.key][load].append(s)
                print(
                    f"rep {rep + 1} {target.key:9} {load:8} n={s['requests']:5} err={s['errors']} {s['rps']:8.0f}/s "
                    f"cores: gateway {s['gateway_cores']:.2f} upstream {s['upstream_cores']:.2f} load generator {s['loadgen_cores']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def report_workers(results: dict, command: str, reps: int, revision: str, peers: str = "the fast upstream and the load generator") -> str:
    out = [
        f"Command: `{command}`  ",
        f"Gateway code: {revision}  ",
        f"Medians over {reps} repetition(s). Both gateways may use cores {GATEWAY_CORE} and {OTHER_CORE}; "
        f"{peers} are pinned to core {OTHER_CORE}. CPU in cores busy during the load.",
        "",
        "| load | workers | req/s (streams/s) | × 1 worker | gateway CPU | upstream CPU | load generator CPU | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for load, _conc, _n, _stream in WORKER_LOADS:
        one = med(results, "gw-h1-w1", load, "rps")
        for workers in (1, 2):
            key = f"gw-h1-w{workers}"
            rps = med(results, key, load, "rps")
            failed = sum(s["errors"] for s in results.get(key, {}).get(load, []))
            out.append(
                f"| {load} | {workers} | {f(rps, 0)} | {f(rps / one, 2)} | {f(med(results, key, load, 'gateway_cores'), 2)} "
                f"| {f(med(results, key, load, 'upstream_cores'), 2)} | {f(med(results, key, load, 'loadgen_cores'), 2)} | {failed} |"
            )
    return "\n".join(out)


def med(results: dict, target: str, load: str, key: str) -> float:
    values = [s[key] for s in results.get(target, {}).get(load, []) if key in s and s[key] == s[key]]
    return statistics.median(values) if values else float("nan")


def spread(results: dict, target: str, load: str, key: str) -> str:
    values = [s[key] for s in results.get(target, {}).get(load, []) if key in s and s[key] == s[key]]
    return f"{min(values):.3g}–{max(values):.3g}" if values else "-"


def f(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def report(results: dict, peaks: dict[str, int], command: str, reps: int, revision: str) -> str:
    out = []
    variants = [("h1", "direct-h1", "gw-h1", "HTTP/1.1 → fast upstream")]
    if "gw-h1-traced" in results:
        variants.append(("h1 + traces", "direct-h1", "gw-h1-traced", "as h1, every request traced, OTLP/HTTP export"))
    if "gw-h2" in results:
        variants.append(("h2", "direct-hc", "gw-h2", "HTTP/2 (h2c) → hypercorn loadgen/fake_upstream.py; direct = hypercorn over h1"))
    if "nginx-h1" in results:
        variants.append(("nginx (reference)", "direct-h1", "nginx-h1", "nginx, one worker, proxy_buffering off"))
    out.append(f"Command: `{command}`  ")
    out.append(f"Gateway code: {revision}  ")
    out.append(
        f"Medians over {reps} repetition(s). Gateway pinned to core {GATEWAY_CORE}; upstream and load generator on core {OTHER_CORE}. "
        f"Latencies in ms; added = gateway − direct."
    )
    out.append("")
    out.append("**Non-streaming chat completions** (64-token answer)")
    out.append("")
    out.append("| hop | conc | direct req/s | gateway req/s | direct p50 / p99 | gateway p50 / p99 | **added p50 / p99** | gateway CPU ms/req |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tag, direct, gw, _ in variants:
        for name, conc, _n in NONSTREAM:
            load = f"json-{name}"
            d50, d99 = med(results, direct, load, "e2e_p50"), med(results, direct, load, "e2e_p99")
            g50, g99 = med(results, gw, load, "e2e_p50"), med(results, gw, load, "e2e_p99")
            out.append(
                f"| {tag} | {conc} | {f(med(results, direct, load, 'rps'), 0)} | {f(med(results, gw, load, 'rps'), 0)} "
                f"| {f(d50, 3)} / {f(d99, 3)} | {f(g50, 3)} / {f(g99, 3)} | **{f(g50 - d50, 3)} / {f(g99 - d99, 3)}** "
                f"| {f(med(results, gw, load, 'cpu_ms_per_req'), 3)} |"
            )
    out.append("")
    out.append(f"**SSE streams** ({TOKENS} content chunks + finish + [DONE] = {EVENTS} events per stream)")
    out.append("")
    out.append(
        "| hop | conc | direct TTFT p50 / p99 | gateway TTFT p50 / p99 | **added TTFT p50 / p99** "
        "| direct gap p50 / p99 | gateway gap p50 / p99 | added gap p50 / p99 | direct / gateway streams/s | gateway CPU µs/event |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tag, direct, gw, _ in variants:
        for name, conc, _n, delay in STREAM:
            load = f"sse-{name}"
            dt = med(results, direct, load, "ttft_p50"), med(results, direct, load, "ttft_p99")
            gt = med(results, gw, load, "ttft_p50"), med(results, gw, load, "ttft_p99")
            dg = med(results, direct, load, "gap_p50"), med(results, direct, load, "gap_p99")
            gg = med(results, gw, load, "gap_p50"), med(results, gw, load, "gap_p99")
            label = f"{conc}, {1 / delay:.0f} tok/s" if delay else f"{conc}"
            out.append(
                f"| {tag} | {label} | {f(dt[0], 3)} / {f(dt[1], 3)} | {f(gt[0], 3)} / {f(gt[1], 3)} "
                f"| **{f(gt[0] - dt[0], 3)} / {f(gt[1] - dt[1], 3)}** "
                f"| {f(dg[0], 4)} / {f(dg[1], 3)} | {f(gg[0], 4)} / {f(gg[1], 3)} | {f(gg[0] - dg[0], 4)} / {f(gg[1] - dg[1], 3)} "
                f"| {f(med(results, direct, load, 'rps'), 0)} / {f(med(results, gw, load, 'rps'), 0)} "
                f"| {f(med(results, gw, load, 'cpu_us_per_event'), 1)} |"
            )
    out.append("")
    errors = sum(s["errors"] for loads in results.values() for reps_ in loads.values() for s in reps_)
    out.append("**Against the targets** (value: median; range over repetitions in brackets)")
    out.append("")
    out.append("| target | hop | value | limit | met |")
    out.append("|---|---|---:|---:|:---:|")
    for tag, direct, gw, _ in variants:
        if gw == "nginx-h1":
            continue  # the reference, not held to the gateway's targets
        cpu_req = [med(results, gw, f"json-{n}", "cpu_ms_per_req") for n, _, _ in NONSTREAM]
        cpu_evt = [med(results, gw, f"sse-{x[0]}", "cpu_us_per_event") for x in STREAM]
        rows = []
        for load, label in (("sse-c64", "SSE c=64, zero delay (saturated)"), ("sse-c64-paced", "SSE c=64 at 100 tok/s")):
            added50 = med(results, gw, load, "ttft_p50") - med(results, direct, load, "ttft_p50")
            added99 = med(results, gw, load, "ttft_p99") - med(results, direct, load, "ttft_p99")
            rows.append((f"added p50 TTFT, {label}", f"{f(added50, 3)} ms", "≤ 1 ms", added50 <= 1.0))
            rows.append((f"added p99 TTFT, {label}", f"{f(added99, 3)} ms", "≤ 5 ms", added99 <= 5.0))
        for (n, _, _), v in zip(NONSTREAM, cpu_req):
            rows.append((f"gateway CPU per request, {n}", f"{f(v, 3)} ms ({spread(results, gw, f'json-{n}', 'cpu_ms_per_req')})", "≤ 0.5 ms", v <= 0.5))
        for (n, _, _, _), v in zip(STREAM, cpu_evt):
            rows.append((f"gateway CPU per SSE event, {n}", f"{f(v, 1)} µs ({spread(results, gw, f'sse-{n}', 'cpu_us_per_event')})", "≤ 25 µs", v <= 25))
        for label, value, limit, ok in rows:
            out.append(f"| {label} | {tag} | {value} | {limit} | {'yes' if ok else '**no**'} |")
    out.append("")
    if "nginx-h1" in results:
        out += against_nginx(results)
    out.append(
        "Gateway peak RSS (VmHWM): "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks.items())
        + f". Failed requests (bad status or incomplete stream), all runs: {errors}."
    )
    return "\n".join(out)


def against_nginx(results: dict) -> list[str]:
    """The HTTP/1.1 gateway's added latency and CPU as multiples of nginx's, load by load."""
    out = ["**Against nginx** (the same loads through nginx; ratio = gateway / nginx)", ""]
    out.append("| load | nginx added p50 / p99 ms | gateway added p50 / p99 ms | ratio p50 / p99 | nginx CPU | gateway CPU | CPU ratio |")
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    loads = [(f"json-{n}", f"JSON c={c}", "e2e", "cpu_ms_per_req", "ms/req") for n, c, _ in NONSTREAM]
    loads += [
        (f"sse-{n}", f"SSE c={c}" + (f", {1 / d:.0f} tok/s" if d else ""), "ttft", "cpu_us_per_event", "µs/event")
        for n, c, _, d in STREAM
    ]
    for load, label, metric, cpu_key, unit in loads:
        direct = [med(results, "direct-h1", load, f"{metric}_p{q}") for q in (50, 99)]
        ng = [med(results, "nginx-h1", load, f"{metric}_p{q}") - d for q, d in zip((50, 99), direct)]
        gw = [med(results, "gw-h1", load, f"{metric}_p{q}") - d for q, d in zip((50, 99), direct)]
        ratio = [g / n if n > 0 else float("nan") for g, n in zip(gw, ng)]
        ng_cpu, gw_cpu = med(results, "nginx-h1", load, cpu_key), med(results, "gw-h1", load, cpu_key)
        out.append(
            f"| {label} | {f(ng[0], 3)} / {f(ng[1], 3)} | {f(gw[0], 3)} / {f(gw[1], 3)} | {f(ratio[0], 1)} / {f(ratio[1], 1)} "
            f"| {f(ng_cpu, 3)} {unit} | {f(gw_cpu, 3)} {unit} | {f(gw_cpu / ng_cpu if ng_cpu else float('nan'), 1)} |"
        )
    out.append("")
    return out


# -- profiling -------------------------------------------------------------------------


def py_spy() -> str | None:
    here = os.path.join(os.path.dirname(PY), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


def profile_summary(raw_path: str, top: int = 18) -> str:
    """Top functions by self time, as shares of all sampled (non-idle) gateway stacks."""
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(raw_path) as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            n = int(count)
            frames = stack.split(";")
            # drop the thread name frame py-spy puts first (e.g. "process 123:..." / "thread (0x..)")
            frames = [fr for fr in frames if not fr.startswith(("process ", "thread "))]
            if not frames:
                continue
            total += n
            self_time[_short(frames[-1])] += n
            for fr in set(_short(fr) for fr in frames):
                inclusive[fr] += n
    if not total:
        return "(no samples)"
    lines = [f"{total} samples", "", "| self % | incl % | function |", "|---:|---:|---|"]
    for fn, n in self_time.most_common(top):
        lines.append(f"| {100 * n / total:.1f} | {100 * inclusive[fn] / total:.1f} | `{fn}` |")
    lines += ["", "Top inclusive (gateway code and its libraries):", "", "| incl % | function |", "|---:|---|"]
    shown = 0
    for fn, n in inclusive.most_common():
        if any(k in fn for k in ("gateway/", "starlette", "uvicorn", "httptools", "prometheus", "orjson", "h2/")):
            lines.append(f"| {100 * n / total:.1f} | `{fn}` |")
            shown += 1
            if shown >= top:
                break
    return "\n".join(lines)


def _short(frame: str) -> str:
    # "name (/path/to/site-packages/pkg/mod.py:123)" -> "name (pkg/mod.py)"  (line numbers merged)
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", ROOT + "/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})" if path else name


async def profile(targets: dict[str, Target], seconds: float, tmp: str, key: str = "gw-h1") -> str:
    spy = py_spy()
    if spy is None:
        return "py-spy not found: `.venv/bin/pip install py-spy`"
    gw = targets[key]
    out = [f"## {key}", ""]
    loads = (
        ("non-streaming c=16", 16, False, 0.0, "json-c16"),
        ("SSE c=64", 64, True, 0.0, "sse-c64"),
        ("SSE c=64 at 100 tok/s", 64, True, 0.01, "sse-c64-paced"),
    )
    for label, conc, stream, delay, name in loads:
        raw = os.path.join(tmp, f"profile-{name}.txt")
        argv = pinned(OTHER_CORE, [spy, "record", "--pid", str(gw.gateway.pid), "--format", "raw", "--rate", "250",
                                   "--nonblocking", "--duration", str(int(seconds)), "--output", raw])
        spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        await asyncio.sleep(1.0)
        deadline = time.monotonic() + seconds - 1.5
        cpu0 = gw.gateway.cpu()
        done = 0
        t0 = time.perf_counter()
        while time.monotonic() < deadline:
            total = 2000 if not stream else conc * (2 if delay else 20)
            r = await run_phase(gw.port, conc, total, stream, None, delay)
            done += r.requests
        wall = time.perf_counter() - t0
        cpu = gw.gateway.cpu() - cpu0
        try:
            _, err = await asyncio.get_running_loop().run_in_executor(None, lambda: spy_proc.communicate(timeout=seconds + 30))
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            err = b"timed out"
        out.append(f"### gateway profile, {label} ({done} requests in {wall:.1f} s, gateway CPU {100 * cpu / wall:.0f}% of a core)")
        out.append("")
        if spy_proc.returncode != 0 or not os.path.exists(raw):
            out.append(f"py-spy failed: {err.decode(errors='replace')[-500:]}")
        else:
            out.append(profile_summary(raw))
            keep = os.path.join(tempfile.gettempdir(), f"edgegw-relay-profile-{key}-{name}.txt")
            shutil.copy(raw, keep)
            out.append("")
            out.append(f"(raw stacks: {keep})")
        out.append("")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------


def _revision(root: str) -> str:
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "(not a git checkout)"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "gateway"], capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + (" + uncommitted changes in gateway/" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description="edgegw relay benchmark: direct vs through the gateway.")
    parser.add_argument("--quick", action="store_true", help="a tenth of the requests, one repetition (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    parser.add_argument("--no-h2", action="store_true", help="skip the HTTP/2 (hypercorn h2c) variant")
    parser.add_argument(
        "--traces", action="store_true", help="also a gateway tracing every request (OTLP/HTTP to a sink in the fast upstream)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the per-repetition figures as JSON")
    parser.add_argument("--profile", action="store_true", help="then py-spy the h1 gateway under json c=16 and SSE c=64")
    parser.add_argument("--profile-seconds", type=float, default=12)
    parser.add_argument("--profile-only", action="store_true", help="skip the measurements, only profile")
    parser.add_argument("--profile-h2", action="store_true", help="profile the HTTP/2 gateway (hypercorn upstream) instead")
    parser.add_argument("--workers", action="store_true", help="instead: listen.workers 1 against 2 (req/s and CPU)")
    parser.add_argument(
        "--isolation",
        action="store_true",
        help="instead: does the relay feel the edge engine? (runs bench/isolation.py; its flags after --)",
    )
    parser.add_argument(
        "--native-peers",
        action="store_true",
        help="with --workers: wrk as the load generator and nginx as the upstream (apt-get install wrk nginx)",
    )
    parser.add_argument("--nginx", action="store_true", help="also nginx as a reference proxy (apt-get install nginx)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a configuration key of the gateways under test, dotted, the value as YAML (e.g. usage.enabled=false); repeatable",
    )
    parser.add_argument(
        "--gateway-root",
        metavar="DIR",
        default=ROOT,
        help="run the gateway from this checkout (e.g. `git archive HEAD | tar -x -C DIR`); default: this repository",
    )
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.isolation:  # the scenario lives in its own script; this is its name here too
        return subprocess.call([PY, os.path.join(ROOT, "bench", "isolation.py"), *rest], cwd=ROOT)
    gateway_root = os.path.abspath(args.gateway_root)
    for item in args.set:
        key, _, value = item.partition("=")
        GATEWAY_SET[key] = yaml.safe_load(value)
    reps = args.reps or (1 if args.quick else 3)
    scale = 0.1 if args.quick else 1.0
    command = " ".join([".venv/bin/python", "bench/relay.py", *sys.argv[1:]])
    revision = f"{gateway_root} @ {_revision(gateway_root)}"
    print(f"gateway code: {revision}", file=sys.stderr)

    if (os.cpu_count() or 1) < 2:
        print("warning: fewer than 2 cores, no pinning", file=sys.stderr)
    else:
        os.sched_setaffinity(0, {OTHER_CORE})
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    with_h2 = (not args.no_h2 and not args.profile_only) or args.profile_h2
    if with_h2:
        try:
            import hypercorn  # noqa: F401
        except ImportError:
            print("hypercorn not installed: skipping the HTTP/2 variant", file=sys.stderr)
            with_h2 = False
    nginx = None
    if args.nginx:
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if nginx is None:
            print("--nginx: nginx not found (apt-get install nginx)", file=sys.stderr)
            return 2
    tmp = tempfile.mkdtemp(prefix="edgegw-relay-")
    children: list[Child] = []
    if args.workers:
        try:
            if args.native_peers:
                nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
                wrk = shutil.which("wrk")
                if nginx is None or wrk is None:
                    print("--native-peers: needs wrk and nginx (apt-get install wrk nginx)", file=sys.stderr)
                    return 2
                upstream, targets = start_native_worker_gateways(tmp, gateway_root, nginx, children)
                results = measure_native_workers(targets, upstream, reps, wrk, tmp, NATIVE_SECONDS * (0.5 if args.quick else 1.0))
                print(report_workers(results, command, reps, revision, "nginx (the upstream) and wrk (the load generator)"))
            else:
                upstream, targets = start_worker_gateways(tmp, gateway_root, children)
                results = runner(measure_workers(targets, upstream, reps, scale))
                print(report_workers(results, command, reps, revision))
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"command": command, "reps": reps, "results": results}, fh, indent=1)
        finally:
            for c in reversed(children):
                c.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    try:
        targets = start_processes(tmp, children, with_h2, gateway_root, args.traces and not args.profile_only, nginx)
        if not args.profile_only:
            results = runner(measure(targets, reps, scale))
            peaks = {t.key: t.gateway.peak_rss() for t in targets.values() if t.gateway}
            print(report(results, peaks, command, reps, revision))
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"command": command, "reps": reps, "results": results, "peak_rss": peaks}, fh, indent=1)
        if args.profile or args.profile_only:
            print()
            print(runner(profile(targets, args.profile_seconds, tmp, "gw-h2" if args.profile_h2 else "gw-h1")))
    except BaseException:
        for c in children:
            c.log.flush()
            with open(c.log_path, errors="replace") as fh:
                tail = fh.read()[-3000:]
            if tail.strip():
                print(f"--- {c.name} log (tail) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        for c in reversed(children):
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
