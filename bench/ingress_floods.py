"""Floods against the gateway's listeners while a second client measures the others.

Each flood runs for ``--seconds`` (10) against one gateway (``python -m gateway serve``,
default limits, with ``listen.tls`` and ``listen.http3`` on a certificate made here), while
a second client sends, one after the other, ``GET /healthz`` and a relayed non-streaming
chat completion on every listener (plain HTTP/1.1, HTTPS with HTTP/2, HTTP/3) through the
gateway's own pools (kept-alive connections), each with a 2 s timeout (past it: an error).

    .venv/bin/python bench/ingress_floods.py [--seconds 10] [--only ping,settings] [--json FILE]
    .venv/bin/python bench/ingress_floods.py --baseline /tmp/base   # also a gateway from another checkout

``--baseline PATH`` runs every flood against a gateway started from another checkout too
(``git worktree add /tmp/base <commit>``), in the same run, before the candidate.

The floods (``loadgen/floods.py``; a flooder whose connection is closed opens another,
until the time is up):

- ``rapid-reset``: HTTP/2 HEADERS + RST_STREAM pairs (CVE-2023-44487);
- ``ping``, ``settings``: HTTP/2 PING or SETTINGS frames, the client reading the answers;
- ``ping-unread``: PINGs from a client that reads nothing (4 KiB receive buffer);
- ``continuation``: an HTTP/2 header block that never ends (4 KiB CONTINUATION frames);
- ``header-bombs``: HTTP/2 requests with 70 KB of headers (431 on the stream) mixed with
  HPACK bombs (a 4 KB header referenced 1,000 times), HTTP/1.1 requests with 70 KB of
  headers (431, closed), HTTP/3 requests with 2,000 headers (431 on the stream);
- ``h3-rapid-reset``, ``h3-ping``: HTTP/3 requests cancelled at once (RESET_STREAM and
  STOP_SENDING), QUIC PINGs;
- ``idle-1000``: 1,000 connections that send nothing more (500 plain TCP, 250 TLS
  handshakes never made, 250 HTTP/2 connections after their preface), held for the flood;
- ``none``: no flood, a busy loop in the flooder's place on its core (the reference for
  the second client's latency: a flooder takes CPU from the second client too).

Reported per flood and gateway: the second client's requests, errors, p50/p99/max latency
(all listeners together, and the worst listener's p99); the flood's connections and how
the gateway ended them (GOAWAY code, HTTP/3 close code, closed after a 431); the
gateway's RSS before, at its peak and 6 s after the flood (past the 5 s an HTTP/2 connection the
gateway closed is given to flush its GOAWAY before it is aborted). Targets: p99 <= 100 ms and no
error for the second client, each flooding connection closed by the gateway (the 431s of
header bombs answer a stream, not the connection), RSS back within 10 MB.

Processes (started and stopped here, by PID; traffic only to 127.0.0.1): the gateway on
core 0; the fast upstream (``bench/fast_upstream.py``), this process (the second client)
and the flooder (this file with ``--flood NAME``) on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hyperframe.frame import ContinuationFrame, HeadersFrame  # noqa: E402

from loadgen.certificates import make_certificate  # noqa: E402
from loadgen.floods import H2_FLOODS, RawH2, h3_connect  # noqa: E402
from bench.processes import Child, free_port, pinned  # noqa: E402
from bench.relay import GATEWAY_CORE, MODEL, OTHER_CORE, PY, TOKENS  # noqa: E402
from gateway.upstream import H1Pool, H2Pool, H3Pool, Origin, Timeouts  # noqa: E402

AFTER_S = 6.0  # the RSS after a flood, this long after it: past h2's _CLOSE_GRACE (5 s) for the connections it closed

FLOODS = [
    "none",  # the second client alone: the reference
    "rapid-reset", "ping", "ping-unread", "settings", "continuation", "header-bombs", "h3-rapid-reset", "h3-ping",
    "idle-1000",
]
TIMEOUT_S = 2.0
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say something short."}]}).encode()


# -- the flooder (a child process: --flood NAME) ------------------------------------------


class Tally(collections.Counter):
    def ended(self, how: str) -> None:
        self["closed by the gateway"] += 1
        self[how] += 1


async def h2_flood(name: str, args, deadline: float) -> Tally:
    tally = Tally()
    loop = asyncio.get_running_loop()
    unread = name == "ping-unread"
    make = {
        "rapid-reset": H2_FLOODS["rapid-reset"],
        "ping": H2_FLOODS["ping"],
        "ping-unread": H2_FLOODS["ping"],
        "settings": H2_FLOODS["settings"],
        "continuation": H2_FLOODS["endless-continuation"],
        "header-bombs": _h2_header_bombs,
    }[name]
    while loop.time() < deadline:
        try:
            client = await asyncio.wait_for(RawH2.connect(args.tls_port, args.ca, reading=not unread, rcvbuf=4096 if unread else None), 5)
        except (OSError, asyncio.TimeoutError, ssl.SSLError):
            tally["connect failed"] += 1
            await asyncio.sleep(0.05)
            continue
        tally["connections"] += 1
        batch = make(client)
        i = 0
        while loop.time() < deadline and not client.closed.is_set() and client.goaway is None:
            client.write(batch(i))
            i += 1
            try:
                await asyncio.wait_for(client.drain(), max(0.01, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
            await asyncio.sleep(0)
            if unread and i % 100 == 0:  # a glance, every 100 batches: has the gateway closed it?
                client.transport.resume_reading()
                await asyncio.sleep(0.001)
                client.transport.pause_reading()
        tally["batches"] += i
        if unread:
            client.transport.resume_reading()
        if client.goaway is None and not client.closed.is_set():  # the time is up: is this one ended too?
            try:
                await asyncio.wait_for(client.closed.wait(), 2)
            except asyncio.TimeoutError:
                pass
        if client.goaway is not None:  # an attacker opens the next connection at once
            tally.ended(f"GOAWAY {client.goaway.error_code}")
        elif client.closed.is_set():
            tally.ended("closed, GOAWAY unread")
        else:
            tally["open at the end"] += 1
        await client.close()
    return tally


def _h2_header_bombs(client: RawH2):
    """70 KB of headers (431 on the stream), in HEADERS + CONTINUATION frames of 16 KB; every
    tenth an HPACK bomb (closes the connection)."""
    bomb = H2_FLOODS["hpack-bomb"](client)

    def batch(i: int) -> bytes:
        if i % 10 == 9:
            return bomb(i)
        stream_id = client.new_stream()
        fields = [(":method", "GET"), (":scheme", "https"), (":authority", "127.0.0.1"), (":path", "/healthz")]
        block = client.encoder.encode([*fields, *[(f"x-big-{i}-{k}", "b" * 1000) for k in range(70)]])
        chunks = [block[k : k + 16384] for k in range(0, len(block), 16384)]
        frames = [HeadersFrame(stream_id, chunks[0], flags=["END_STREAM"] + (["END_HEADERS"] if len(chunks) == 1 else []))]
        for n, chunk in enumerate(chunks[1:], 2):
            frames.append(ContinuationFrame(stream_id, chunk, flags=["END_HEADERS"] if n == len(chunks) else []))
        return b"".join(frame.serialize() for frame in frames)

    return batch


async def h1_header_bombs(args, deadline: float) -> Tally:
    tally = Tally()
    loop = asyncio.get_running_loop()
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n"
    while loop.time() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        except OSError:
            tally["connect failed"] += 1
            continue
        tally["connections"] += 1
        try:
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(), 5)
            tally.ended("431, closed" if answer.startswith(b"HTTP/1.1 431") else f"closed: {answer[:12]!r}")
        except (OSError, asyncio.TimeoutError):
            tally.ended("reset")
        writer.close()
    return tally


async def h3_flood(name: str, args, deadline: float) -> Tally:
    tally = Tally()
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            async with h3_connect(args.h3_port, args.ca) as client:
                tally["connections"] += 1
                i = 0
                while loop.time() < deadline and not client.terminated.is_set():
                    if name == "h3-rapid-reset":
                        client.rapid_reset()
                    elif name == "h3-ping":
                        client._quic.send_ping(i)
                    else:  # header bombs: 2,000 headers, 431 on each stream
                        client.request([(b"x-h%d" % k, b"v" * 16) for k in range(2000)])
                    client.transmit()
                    i += 1
                    await asyncio.sleep(0)
                    if i % 20 == 0:
                        try:
                            await asyncio.wait_for(client.ping(), 5)  # a round trip: sent is handled
                        except (ConnectionError, asyncio.TimeoutError):
                            break
                tally["batches"] += i
                if client.terminated.is_set():
                    tally.ended(f"CONNECTION_CLOSE 0x{client.close_code:x}")
                else:
                    tally["open at the end"] += 1
        except (ConnectionError, OSError, asyncio.TimeoutError):
            tally["connect failed"] += 1
    return tally


async def idle_flood(args, deadline: float) -> Tally:
    tally = Tally()
    held: list = []
    for _ in range(500):
        held.append(("plain", await asyncio.open_connection("127.0.0.1", args.port)))
    for _ in range(250):
        held.append(("tls, no handshake", await asyncio.open_connection("127.0.0.1", args.tls_port)))
    for _ in range(250):
        held.append(("http2, no stream", await RawH2.connect(args.tls_port, args.ca)))
    tally["connections"] = len(held)
    # held for the flood, and until the last one opened is 12 s old (the default
    # limits.header_timeout_s, 10 s, and a margin): is each closed by then?
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(deadline, loop.time() + 12) - loop.time())
    for kind, conn in held:
        if kind == "http2, no stream":
            if conn.closed.is_set():
                tally.ended(f"closed: {kind}")
            else:
                tally[f"open at the end: {kind}"] += 1
            await conn.close()
        else:
            reader, writer = conn
            if reader.at_eof() or writer.transport.is_closing():
                tally.ended(f"closed: {kind}")
            else:
                try:
                    data = await asyncio.wait_for(reader.read(1), 0.001)
                    if data or reader.at_eof():
                        tally.ended(f"closed: {kind}")
                    else:
                        tally[f"open at the end: {kind}"] += 1
                except (asyncio.TimeoutError, OSError):
                    tally[f"open at the end: {kind}"] += 1
            writer.close()
    return tally


async def run_flood(args) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.seconds
    name = args.flood
    if name == "header-bombs":
        parts = await asyncio.gather(
            h2_flood(name, args, deadline), h1_header_bombs(args, deadline), h3_flood("h3-header-bombs", args, deadline)
        )
        tally = Tally()
        for label, part in zip(("h2", "h1", "h3"), parts):
            for key, value in part.items():
                tally[f"{label} {key}"] += value
        return dict(tally)
    if name.startswith("h3-"):
        return dict(await h3_flood(name, args, deadline))
    if name == "idle-1000":
        return dict(await idle_flood(args, deadline))
    if name == "none":  # no traffic, but the flooder's CPU use on its core: the reference
        while loop.time() < deadline:
            sum(range(10_000))
            await asyncio.sleep(0)
        return {}
    return dict(await h2_flood(name, args, deadline))


# -- the second client -----------------------------------------------------------------------


class Probe:
    """The gateway's own pools, one per listener, each request timed."""

    def __init__(self, port: int, tls_port: int, h3_port: int, ca: str) -> None:
        context = ssl.create_default_context(cafile=ca)
        context.set_alpn_protocols(["h2"])
        timeouts = Timeouts(TIMEOUT_S, TIMEOUT_S, TIMEOUT_S, TIMEOUT_S)
        common = dict(max_connections=1, warm_connections=0, timeouts=timeouts, high_water=1 << 20)
        self.pools = {
            "http1": H1Pool(Origin("127.0.0.1", port, None, f"127.0.0.1:{port}".encode(), b"http"), **common),
            "http2": H2Pool(Origin("127.0.0.1", tls_port, context, f"127.0.0.1:{tls_port}".encode(), b"https"), **common),
            "http3": H3Pool(Origin("127.0.0.1", h3_port, context, f"127.0.0.1:{h3_port}".encode(), b"https"), **common, ca_file=ca),
        }
        self.samples: list[tuple[str, str, float, bool]] = []

    async def one(self, listener: str, what: str) -> None:
        pool = self.pools[listener]
        method, path, body = (b"GET", b"/healthz", b"") if what == "healthz" else (b"POST", b"/v1/chat/completions", CHAT)
        started = time.perf_counter()
        ok = False
        try:
            async with asyncio.timeout(TIMEOUT_S):
                response = await pool.request(method, path, [(b"content-type", b"application/json")], body)
                try:
                    await response.body.read_all(TIMEOUT_S, 1 << 20)
                    ok = response.status == 200
                finally:
                    response.close()
        except Exception:  # noqa: BLE001 (any failure is an error of the second client)
            ok = False
        self.samples.append((listener, what, (time.perf_counter() - started) * 1000, ok))

    async def run(self, stop: asyncio.Event, gateway: Child, peak: list[int]) -> None:
        while not stop.is_set():
            for listener in self.pools:
                for what in ("healthz", "relay"):
                    await self.one(listener, what)
            peak[0] = max(peak[0], rss(gateway))
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


def rss(child: Child) -> int:
    with open(f"/proc/{child.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(samples: list[tuple[str, str, float, bool]]) -> dict:
    latencies = [ms for _, _, ms, _ in samples]
    by_listener = {
        listener: pct([ms for name, _, ms, _ in samples if name == listener], 0.99) for listener in ("http1", "http2", "http3")
    }
    return {
        "requests": len(samples),
        "errors": sum(1 for *_, ok in samples if not ok),
        "p50_ms": pct(latencies, 0.5),
        "p99_ms": pct(latencies, 0.99),
        "max_ms": max(latencies, default=float("nan")),
        "p99_by_listener_ms": by_listener,
    }


# -- the run ------------------------------------------------------------------------------


def start_gateway(key: str, root: str, tmp: str, upstream_port: int, cert: tuple[str, str], children: list[Child]) -> dict:
    port, tls_port, h3_port = free_port(), free_port(), free_port()
    config = {
        "cache": {"backend": "off"},
        "clusters": [{"name": "bench", "models": [MODEL], "endpoints": [{"url": f"http://127.0.0.1:{upstream_port}", "warm_connections": 2}]}],
        "listen": {
            "host": "127.0.0.1",
            "port": port,
            "tls": {"port": tls_port, "certfile": cert[0], "keyfile": cert[1]},
            "http3": {"port": h3_port, "certfile": cert[0], "keyfile": cert[1]},
        },
    }
    path = os.path.join(tmp, f"{key}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root  # the checkout under test, not the installed one
    try:
        gw = Child(key, pinned(GATEWAY_CORE, [PY, "-m", "gateway", "serve", "--config", path]), tmp, cwd=root)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    children.append(gw)
    gw.wait_http(port, "/readyz")
    return {"child": gw, "port": port, "tls_port": tls_port, "h3_port": h3_port}


async def measure(name: str, gw: dict, args, ca: str, tmp: str) -> dict:
    child: Child = gw["child"]
    probe = Probe(gw["port"], gw["tls_port"], gw["h3_port"], ca)
    for _ in range(3):  # warm: connections open, imports done
        for listener in probe.pools:
            for what in ("healthz", "relay"):
                await probe.one(listener, what)
    probe.samples.clear()
    before = rss(child)
    peak = [before]
    flooder = subprocess.Popen(
        [*pinned(OTHER_CORE, [PY, os.path.abspath(__file__), "--flood", name, "--port", str(gw["port"]),
          "--tls-port", str(gw["tls_port"]), "--h3-port", str(gw["h3_port"]), "--ca", ca, "--seconds", str(args.seconds)])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, f"flood-{name}.log"), "ab"),  # noqa: SIM115
    )
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop, child, peak))
    try:
        out, _ = await asyncio.to_thread(flooder.communicate, None, args.seconds + 120)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
        stop.set()
        await task
    await asyncio.sleep(AFTER_S)
    after = rss(child)
    result = summary(probe.samples)
    await probe.aclose()
    lines = out.decode().strip().splitlines()
    result["flood"] = json.loads(lines[-1]) if lines else {"error": "the flooder printed nothing"}
    result["rss_mb"] = {"before": before / 2**20, "peak": peak[0] / 2**20, "after": after / 2**20}
    return result


def verdict(r: dict, name: str) -> str:
    ok_latency = r["errors"] == 0 and r["p99_ms"] <= 100
    flood = r["flood"]
    opened = flood.get("connections", 0) or sum(v for k, v in flood.items() if k.endswith(" connections"))
    still_open = sum(v for k, v in flood.items() if "open at the end" in k)
    closed_ok = name in ("none", "header-bombs", "idle-1000") or (opened and still_open == 0)
    rss_ok = r["rss_mb"]["after"] - r["rss_mb"]["before"] <= 10
    return "met" if ok_latency and closed_ok and rss_ok else "missed"


def report(results: dict, command: str, seconds: float) -> str:
    lines = [
        f"`{command}` ({seconds:g} s per flood; second client: /healthz + a relayed chat completion on each listener, "
        "2 s timeout; machine shared with other work)",
        "",
        "| gateway | flood | 2nd client requests | errors | p50 ms | p99 ms (worst listener) | max ms | flood connections, how they ended | RSS MB before / peak / after | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, floods in results.items():
        for name, r in floods.items():
            flood = ", ".join(f"{k}: {v}" for k, v in sorted(r["flood"].items()) if k != "batches")
            worst = max(r["p99_by_listener_ms"].items(), key=lambda kv: kv[1] if kv[1] == kv[1] else -1)
            m = r["rss_mb"]
            lines.append(
                f"| {key} | {name} | {r['requests']} | {r['errors']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                f"({worst[0]} {worst[1]:.1f}) | {r['max_ms']:.0f} | {flood} | {m['before']:.0f} / {m['peak']:.0f} / {m['after']:.0f} "
                f"| {verdict(r, name)} |"
            )
    return "\n".join(lines)


async def main_async(args) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 1,000 idle connections, on both sides
    floods = args.only.split(",") if args.only else FLOODS
    children: list[Child] = []
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cert = make_certificate(tmp)
        try:
            upstream_port = free_port()
            upstream = Child(
                "fast-upstream",
                pinned(OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(upstream_port), "--tokens", str(TOKENS), "--model", MODEL]),
                tmp,
            )
            children.append(upstream)
            upstream.wait_http(upstream_port, "/health")
            targets = ([("baseline", os.path.abspath(args.baseline))] if args.baseline else []) + [("candidate", ROOT)]
            for key, root in targets:
                gw = start_gateway(key, root, tmp, upstream_port, cert, children)
                results[key] = {}
                for name in floods:
                    results[key][name] = await measure(name, gw, args, cert[0], tmp)
                    r = results[key][name]
                    print(f"{key} {name}: p99 {r['p99_ms']:.1f} ms, errors {r['errors']}/{r['requests']}, {r['flood']}", flush=True)
                gw["child"].stop()
                children.remove(gw["child"])
        finally:
            for child in children:
                child.stop()
    command = "python bench/ingress_floods.py " + " ".join(sys.argv[1:])
    text = report(results, command.strip(), args.seconds)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--only", default="", help="comma-separated floods: " + ", ".join(FLOODS))
    parser.add_argument("--baseline", default="", help="another checkout to run the same floods against first")
    parser.add_argument("--json", default="")
    # the flooder's own arguments
    parser.add_argument("--flood", default="")
    parser.add_argument("--port", type=int)
    parser.add_argument("--tls-port", type=int)
    parser.add_argument("--h3-port", type=int)
    parser.add_argument("--ca")
    args = parser.parse_args()
    if args.flood:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(json.dumps(asyncio.run(run_flood(args))), flush=True)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
