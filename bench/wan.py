"""WAN benchmark: the edge -> central hop over HTTP/1.1+TLS, HTTP/2+TLS and HTTP/3, through a
user-space WAN emulator on loopback (this machine has no netem), and the CPU of each hop.

    .venv/bin/python bench/wan.py [--quick] [--reps 3] [--json FILE]
    .venv/bin/python bench/wan.py --emulate --rtt-ms 40 --loss 0.01 ...   # the emulator alone

Processes (each started here and stopped here by PID; traffic only on 127.0.0.1):

- upstream: ``bench/fast_upstream.py`` (HTTP/1.1, 64-token answers, tokens paced by the
  request's ``"fake": {"delay": s}``);
- central tier: ``python -m gateway serve`` with ``listen.tls`` (HTTP/1.1 and HTTP/2 by
  ALPN) and ``listen.http3`` in front of it (a certificate for 127.0.0.1 is made at start);
- the WAN emulator: ``bench/wan.py --emulate``, one process per (RTT, loss) setting,
  between this process (the edge) and the central tier:
  * one-way delay RTT/2 plus jitter (uniform, +-10 % of the one-way delay) on every UDP
    datagram and TCP segment, both directions; packets of a direction stay in order (one
    queue per direction, as on a real path);
  * UDP: each datagram dropped with probability ``loss`` (QUIC recovers it itself);
  * TCP: the byte stream is cut into 1448-byte segments; a "lost" segment, and every byte
    behind it, is held back one retransmission timeout more (RTO = RTT + 200 ms, Linux's
    rule with its 200 ms floor on the variance term): the head-of-line blocking TCP gives
    a lost segment. Delivery stays in order (jitter cannot reorder a byte stream). The TCP
    handshake's round trip is charged to the first client bytes (the client could not send
    them before the SYN-ACK came back). No bandwidth limit.
- the edge: this process, driving the gateway's own pools (``H1Pool``/``H2Pool`` over TLS,
  ``H3Pool``) as the edge gateway does.

Phases:

A. time to first token on a new connection, at 40 and 120 ms RTT, no loss: a fresh pool
   per sample (connect + TLS + request), HTTP/1.1+TLS, HTTP/2+TLS, HTTP/3, HTTP/3 resumed
   (a session ticket from the previous connection; 1-RTT), HTTP/3 resumed with 0-RTT
   (``early_data``). TTFT = ``pool.request()`` called -> first ``data:`` event received.
B. 32 concurrent streams over one warm HTTP/2 connection vs one warm HTTP/3 connection, at
   40 and 120 ms RTT and 0 / 1 / 3 % loss: 64 tokens each, 20 ms apart (50 tok/s); TTFT
   (request -> first event) and inter-token gap (arrivals of consecutive events; events
   arriving in one read count as a gap of 0), p50 / p99 over all streams.
C. CPU per request and per SSE event of the hop, no emulator: three edge gateways
   (``protocol: http1`` / ``http2`` over the TLS listener, ``http3``) in front of the same
   central gateway; a raw HTTP/1.1 load generator (``bench/relay.py``'s) drives each edge;
   CPU (user + system, psutil) of the edge process (its pool: the client side of the hop)
   and of the central process (its listener: the server side), divided by requests or by
   events. Non-streaming at concurrency 1 and 16; SSE at concurrency 16, 100 tok/s,
   staggered. The edge gateways are pinned to core 0, everything else to core 1.

Every figure is the median over ``--reps`` repetitions (default 3).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
sys.path[:0] = [ROOT, HERE]

from loadgen.certificates import make_certificate  # noqa: E402
from bench.processes import Child, free_port, pinned  # noqa: E402

MODEL = "bench-model"
TOKENS = 64
MSS = 1448


# -- the WAN emulator --------------------------------------------------------------------


class Link:
    """One direction of the emulated path: delay, jitter, loss. Packets of a direction
    share one queue, as on a real path: jitter stretches or squeezes the gaps between
    them but does not reorder them (per-packet independent jitter would reorder nearly
    every back-to-back burst, which real paths rarely do)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rtt: float, jitter: float, loss: float, rng: random.Random) -> None:
        self.loop = loop
        self.owd = rtt / 2
        self.jitter = jitter
        self.loss = loss
        self.rto = rtt + 0.2
        self.rng = rng
        self.dropped = 0
        self.sent = 0
        self.last = 0.0  # the latest release time given to a datagram (UDP)

    def delay(self) -> float:
        return self.owd + self.rng.uniform(-self.jitter, self.jitter)

    def release_at(self) -> float:
        """When a datagram sent now arrives: delayed and jittered, never before an earlier one."""
        at = max(self.loop.time() + self.delay(), self.last)
        self.last = at
        return at

    def lost(self) -> bool:
        self.sent += 1
        if self.loss and self.rng.random() < self.loss:
            self.dropped += 1
            return True
        return False


class _UdpBack(asyncio.DatagramProtocol):
    """The emulator's socket towards the server for one client address."""

    def __init__(self, front: _UdpFront, client: tuple) -> None:
        self.front = front
        self.client = client
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        for data in self.pending:
            transport.sendto(data)
        self.pending.clear()

    def datagram_received(self, data: bytes, addr) -> None:
        link = self.front.down
        if link.lost():
            return
        link.loop.call_at(link.release_at(), self.front.send_back, data, self.client)

    def send(self, data: bytes) -> None:
        if self.transport is None:
            self.pending.append(data)
        elif not self.transport.is_closing():
            self.transport.sendto(data)


class _UdpFront(asyncio.DatagramProtocol):
    def __init__(self, target: tuple[str, int], up: Link, down: Link) -> None:
        self.target = target
        self.up = up
        self.down = down
        self.backs: dict[tuple, _UdpBack] = {}
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        back = self.backs.get(addr)
        if back is None:
            back = self.backs[addr] = _UdpBack(self, addr)
            self.up.loop.create_task(
                self.up.loop.create_datagram_endpoint(lambda: back, remote_addr=self.target)
            )
        if self.up.lost():
            return
        self.up.loop.call_at(self.up.release_at(), back.send, data)

    def send_back(self, data: bytes, addr) -> None:
        if not self.transport.is_closing():
            self.transport.sendto(data, addr)


class _TcpPipe:
    """One direction of one TCP connection: segments released in order at their times."""

    def __init__(self, link: Link, start_at: float = 0.0) -> None:
        self.link = link
        self.loop = link.loop
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.last = start_at  # no segment leaves before this (the handshake for the client's first bytes)
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.eof = False

    def feed(self, data: bytes) -> None:
        link = self.link
        now = self.loop.time()
        for i in range(0, len(data), MSS):
            at = now + link.delay()
            if link.lost():
                at += link.rto
            at = max(at, self.last)
            self.last = at
            self.queue.append((at, data[i : i + MSS]))
        self._arm()

    def feed_eof(self) -> None:
        self.eof = True
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and self.transport is not None:
            if self.queue:
                self.timer = self.loop.call_at(self.queue[0][0], self._fire)
            elif self.eof:
                self.transport.close()

    def _fire(self) -> None:
        self.timer = None
        now = self.loop.time() + 0.0002
        out = []
        queue = self.queue
        while queue and queue[0][0] <= now:
            out.append(queue.popleft()[1])
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))
        self._arm()


class _TcpSide(asyncio.Protocol):
    def __init__(self, pipe_out: _TcpPipe) -> None:
        self.pipe_out = pipe_out  # where what this side receives goes

    def data_received(self, data: bytes) -> None:
        self.pipe_out.feed(data)

    def eof_received(self) -> bool:
        self.pipe_out.feed_eof()
        return True

    def connection_lost(self, exc) -> None:
        self.pipe_out.feed_eof()


class _TcpFront(_TcpSide):
    """A client's connection to the emulator; opens the emulator's connection to the server."""

    def __init__(self, target: tuple[str, int], up: Link, down: Link) -> None:
        loop = up.loop
        rtt = up.owd + down.owd
        super().__init__(_TcpPipe(up, start_at=loop.time() + rtt + up.owd))
        self.target = target
        self.down_pipe = _TcpPipe(down)
        self.loop = loop

    def connection_made(self, transport) -> None:
        self.down_pipe.transport = transport
        self.loop.create_task(self._open())

    async def _open(self) -> None:
        try:
            transport, _ = await self.loop.create_connection(lambda: _TcpSide(self.down_pipe), *self.target)
        except OSError:
            self.down_pipe.transport.close()
            return
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pipe_out.transport = transport
        self.pipe_out._arm()


async def emulate(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(args.seed)
    rtt = args.rtt_ms / 1000
    jitter = rtt / 2 * args.jitter
    up, down = Link(loop, rtt, jitter, args.loss, rng), Link(loop, rtt, jitter, args.loss, rng)
    tcp_target = ("127.0.0.1", args.tcp_target)
    udp_target = ("127.0.0.1", args.udp_target)

    def tcp_factory() -> _TcpFront:
        return _TcpFront(tcp_target, up, down)

    server = await loop.create_server(tcp_factory, "127.0.0.1", args.tcp_port)
    for sock in server.sockets:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.create_datagram_endpoint(lambda: _UdpFront(udp_target, up, down), local_addr=("127.0.0.1", args.udp_port))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    print(f"up: {up.dropped}/{up.sent} dropped; down: {down.dropped}/{down.sent} dropped", flush=True)


# -- processes ---------------------------------------------------------------------------


class Emulator:
    def __init__(self, tmp: str, rtt_ms: float, loss: float, tcp_target: int, udp_target: int, seed: int) -> None:
        self.tcp_port, self.udp_port = free_port(udp=True), free_port(udp=True)
        argv = [
            PY, __file__, "--emulate", "--rtt-ms", str(rtt_ms), "--loss", str(loss), "--seed", str(seed),
            "--tcp-port", str(self.tcp_port), "--tcp-target", str(tcp_target),
            "--udp-port", str(self.udp_port), "--udp-target", str(udp_target),
        ]
        self.child = Child(f"wan-{rtt_ms:g}-{loss:g}-{seed}", pinned(1, argv), tmp)
        deadline = time.monotonic() + 15
        while "ready" not in open(self.child.log_path).read():
            if time.monotonic() > deadline or self.child.proc.poll() is not None:
                raise RuntimeError(f"emulator did not start: {open(self.child.log_path).read()}")
            time.sleep(0.02)

    def stop(self) -> str:
        self.child.proc.send_signal(signal.SIGTERM)
        try:
            self.child.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.child.proc.kill()
        self.child.log.close()
        return open(self.child.log_path).read().strip().splitlines()[-1]


# -- the edge's side: the gateway's own pools ----------------------------------------------


def request_body(delay: float = 0.0) -> bytes:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Say something short."}], "stream": True}
    if delay:
        payload["fake"] = {"delay": delay}
    return json.dumps(payload).encode()


def make_pool(kind: str, port: int, cafile: str, *, early_data: bool = False, warm: int = 0):
    from gateway.upstream import H1Pool, H2Pool, H3Pool, Origin, Timeouts

    context = ssl.create_default_context(cafile=cafile)
    context.set_alpn_protocols(["h2"] if kind == "h2" else ["http/1.1"])
    origin = Origin("127.0.0.1", port, context, f"127.0.0.1:{port}".encode(), b"https")
    common = dict(max_connections=1, warm_connections=warm, timeouts=Timeouts(10, 30, 30, 10), high_water=256 * 1024)
    if kind == "h1":
        return H1Pool(origin, **common)
    if kind == "h2":
        return H2Pool(origin, **common)
    return H3Pool(origin, **common, ca_file=cafile, early_data=early_data)


async def one_stream(pool, body: bytes, gaps: list[float] | None = None) -> tuple[float, int]:
    """(TTFT, events) of one streamed request; inter-event gaps appended to ``gaps``."""
    t0 = time.perf_counter()
    response = await pool.request(b"POST", b"/v1/chat/completions", [(b"content-type", b"application/json")], body)
    ttft = None
    events = 0
    last = 0.0
    tail = b""
    try:
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")
        while True:
            data = await response.body.read(30)
            if data is None:
                raise RuntimeError("stream stalled for 30 s")
            if not data:
                break
            now = time.perf_counter()
            n = (tail[-1:] + data).count(b"\n\n")
            tail = data[-1:]
            if n:
                if ttft is None:
                    ttft = now - t0
                if gaps is not None and last:
                    gaps.append(now - last)
                    gaps.extend([0.0] * (n - 1))
                elif gaps is not None:
                    gaps.extend([0.0] * (n - 1))
                last = now
                events += n
    finally:
        response.close()
    return ttft, events


async def new_connection_ttft(kind: str, port: int, cafile: str, samples: int) -> list[float]:
    """TTFT of a request on a brand-new connection, ``samples`` times. ``h3-resumed`` and
    ``h3-0rtt`` keep one pool (and its session ticket) and drop its connection each time."""
    body = request_body()
    out = []
    if kind in ("h3-resumed", "h3-0rtt"):
        pool = make_pool("h3", port, cafile, early_data=kind == "h3-0rtt")
        try:
            await one_stream(pool, body)  # the first connection: gets a ticket
            for _ in range(samples):
                for conn in list(pool._conns):
                    conn.close()
                await asyncio.sleep(0.3)
                resumed = pool.resumed
                ttft, _ = await one_stream(pool, body)
                if pool.resumed == resumed + 1:  # count only resumed handshakes
                    out.append(ttft)
        finally:
            await pool.aclose()
        return out
    for _ in range(samples):
        pool = make_pool(kind, port, cafile)
        try:
            ttft, _ = await one_stream(pool, body)
            out.append(ttft)
        finally:
            await pool.aclose()
        await asyncio.sleep(0.05)
    return out


async def multiplexed(kind: str, port: int, cafile: str, streams: int, delay: float) -> dict:
    """``streams`` concurrent streams on one warm connection."""
    pool = make_pool(kind, port, cafile, warm=1)
    try:
        await pool.warm()
        await one_stream(pool, request_body())
        gaps: list[float] = []
        results = await asyncio.gather(*[one_stream(pool, request_body(delay), gaps) for _ in range(streams)])
        assert pool.num_connections == 1
    finally:
        await pool.aclose()
    ttfts = [r[0] for r in results]
    bad = sum(1 for r in results if r[1] != TOKENS + 2)
    return {"ttft": ttfts, "gaps": gaps, "bad": bad}


# -- report helpers ------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def ms(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x * 1e3:.{digits}f}"


# -- phases --------------------------------------------------------------------------------

NEW_KINDS = [("h1", "HTTP/1.1 + TLS"), ("h2", "HTTP/2 + TLS"), ("h3", "HTTP/3"), ("h3-resumed", "HTTP/3 resumed"),
             ("h3-0rtt", "HTTP/3 resumed + 0-RTT")]


async def phase_a(central, tmp: str, cafile: str, rtts: list[float], samples: int, reps: int) -> dict:
    out: dict = {}
    for rtt in rtts:
        for rep in range(reps):
            emu = Emulator(tmp, rtt, 0.0, central["tls_port"], central["h3_port"], seed=rep)
            try:
                for kind, _ in NEW_KINDS:
                    port = emu.udp_port if kind.startswith("h3") else emu.tcp_port
                    values = await new_connection_ttft(kind, port, cafile, samples)
                    out.setdefault(f"{rtt:g}", {}).setdefault(kind, []).append(med(values))
                    print(f"A rtt {rtt:g} rep {rep + 1} {kind:10} new-connection TTFT median {ms(med(values))} ms "
                          f"(n={len(values)}, {ms(min(values, default=float('nan')))}–{ms(max(values, default=float('nan')))})",
                          file=sys.stderr, flush=True)
            finally:
                emu.stop()
    return out


async def phase_b(central, tmp: str, cafile: str, rtts: list[float], losses: list[float], reps: int, streams: int,
                  delay: float) -> dict:
    out: dict = {}
    for rtt in rtts:
        for loss in losses:
            for rep in range(reps):
                emu = Emulator(tmp, rtt, loss, central["tls_port"], central["h3_port"], seed=100 + rep)
                try:
                    for kind in ("h2", "h3"):
                        port = emu.udp_port if kind == "h3" else emu.tcp_port
                        r = await multiplexed(kind, port, cafile, streams, delay)
                        row = {
                            "ttft_p50": pct(r["ttft"], 0.5), "ttft_p99": pct(r["ttft"], 0.99),
                            "gap_p50": pct(r["gaps"], 0.5), "gap_p99": pct(r["gaps"], 0.99),
                            "gap_max": max(r["gaps"]), "bad": r["bad"],
                        }
                        out.setdefault(f"{rtt:g}/{loss:g}", {}).setdefault(kind, []).append(row)
                        print(f"B rtt {rtt:g} loss {loss:g} rep {rep + 1} {kind}: TTFT p50 {ms(row['ttft_p50'])} p99 {ms(row['ttft_p99'])} "
                              f"gap p50 {ms(row['gap_p50'])} p99 {ms(row['gap_p99'])} max {ms(row['gap_max'])} ms bad={row['bad']}",
                              file=sys.stderr, flush=True)
                finally:
                    print("   emulator:", emu.stop(), file=sys.stderr, flush=True)
    return out


async def phase_c(central, fast_port: int, tmp: str, cafile: str, reps: int, scale: float) -> dict:
    import yaml
    from relay import run_phase, summarise

    edges = {}
    children = []
    try:
        for kind, protocol, port in (("h1", "http1", central["tls_port"]), ("h2", "http2", central["tls_port"]),
                                     ("h3", "http3", central["h3_port"])):
            edge_port = free_port(udp=True)
            endpoint = {"url": f"https://127.0.0.1:{port}", "protocol": protocol, "ca_file": cafile,
                        "pool_size": 64, "warm_connections": 8 if kind == "h1" else 1}
            config = {"clusters": [{"name": "central", "models": [MODEL], "endpoints": [endpoint]}],
                      "listen": {"host": "127.0.0.1", "port": edge_port, "log_level": "warning"}, "cache": {"backend": "off"}}
            path = os.path.join(tmp, f"edge-{kind}.yaml")
            with open(path, "w") as fh:
                yaml.safe_dump(config, fh)
            child = Child(f"edge-{kind}", pinned(0, [PY, "-m", "gateway", "serve", "--config", path]), tmp)
            children.append(child)
            child.wait_http(edge_port, "/readyz")
            edges[kind] = (edge_port, child)
        loads = [("json-c1", 1, int(800 * scale), False, 0.0), ("json-c16", 16, int(2400 * scale), False, 0.0),
                 ("sse-c16-paced", 16, max(32, int(96 * scale)), True, 0.01)]
        out: dict = {}
        central_child = central["child"]
        for rep in range(reps):
            for kind, (port, child) in edges.items():
                for name, conc, total, stream, delay in loads:
                    c0 = central_child.cpu()
                    r = await run_phase(port, conc, total, stream, child, delay)
                    central_cpu = central_child.cpu() - c0
                    s = summarise(r, stream)
                    ok = r.requests - r.errors
                    if stream:
                        s["central_us_per_event"] = central_cpu / r.events * 1e6 if r.events else float("nan")
                    else:
                        s["central_ms_per_req"] = central_cpu / ok * 1e3 if ok else float("nan")
                    out.setdefault(kind, {}).setdefault(name, []).append(s)
                    edge_cpu = s.get("cpu_us_per_event") if stream else s.get("cpu_ms_per_req")
                    central_cpu_v = s.get("central_us_per_event") if stream else s.get("central_ms_per_req")
                    unit = "µs/event" if stream else "ms/req"
                    print(f"C rep {rep + 1} {kind} {name:14} n={s['requests']} err={s['errors']} edge {edge_cpu:.3f} central "
                          f"{central_cpu_v:.3f} {unit}; e2e p50 {s['e2e_p50']:.2f} ms", file=sys.stderr, flush=True)
        out["peak_rss"] = {kind: child.peak_rss() for kind, (_, child) in edges.items()}
        return out
    finally:
        for child in children:
            child.stop()


def report(a: dict, b: dict, c: dict, command: str, reps: int, samples: int, streams: int, delay: float) -> str:
    out = [f"Command: `{command}`  ", f"Medians over {reps} repetition(s); latencies in ms.", ""]
    if a:
        out += report_a(a, samples)
    if b:
        out += report_b(b, streams, delay)
    if c:
        out += report_c(c)
    return "\n".join(out)


def report_a(a: dict, samples: int) -> list[str]:
    out = []
    out.append(f"**A. Time to first token on a new connection** (median of {samples} samples per repetition; no loss)")
    out.append("")
    rtts = list(a)
    out.append("| protocol | " + " | ".join(f"RTT {r} ms: TTFT / in RTTs" for r in rtts) + " |")
    out.append("|---|" + "---:|" * len(rtts))
    for kind, label in NEW_KINDS:
        cells = []
        for r in rtts:
            v = med(a[r].get(kind, []))
            cells.append(f"{ms(v)} / {v / (float(r) / 1e3):.2f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    for r in rtts:
        h2, h3 = med(a[r]["h2"]), med(a[r]["h3"])
        out.append(f"- RTT {r} ms: HTTP/3 saves {ms(h2 - h3)} ms = {(h2 - h3) / (float(r) / 1e3):.2f} RTT against HTTP/2+TLS on a new "
                   f"connection; resumed with 0-RTT {ms(h2 - med(a[r]['h3-0rtt']))} ms = "
                   f"{(h2 - med(a[r]['h3-0rtt'])) / (float(r) / 1e3):.2f} RTT.")
    out.append("")
    return out


def report_b(b: dict, streams: int, delay: float) -> list[str]:
    out = []
    out.append(f"**B. {streams} concurrent streams on one warm connection** ({TOKENS} tokens each, {delay * 1e3:.0f} ms apart)")
    out.append("")
    out.append("| RTT / loss | protocol | TTFT p50 / p99 | gap p50 / p99 | gap max | incomplete streams |")
    out.append("|---|---|---:|---:|---:|---:|")
    for key, kinds in b.items():
        rtt, loss = key.split("/")
        for kind in ("h2", "h3"):
            rows = kinds.get(kind, [])
            out.append(
                f"| {rtt} ms / {float(loss) * 100:g} % | {'HTTP/2' if kind == 'h2' else 'HTTP/3'} "
                f"| {ms(med([x['ttft_p50'] for x in rows]))} / {ms(med([x['ttft_p99'] for x in rows]))} "
                f"| {ms(med([x['gap_p50'] for x in rows]))} / {ms(med([x['gap_p99'] for x in rows]))} "
                f"| {ms(med([x['gap_max'] for x in rows]))} | {sum(x['bad'] for x in rows)} |"
            )
    out.append("")
    return out


def report_c(c: dict) -> list[str]:
    out = []
    if c:
        out.append("**C. CPU of the hop** (no emulator; edge = the pool side, central = the listener side)")
        out.append("")
        out.append("| hop | edge ms/req c1 | edge ms/req c16 | edge µs/event (c16, 100 tok/s) | central ms/req c1 | central ms/req c16 "
                   "| central µs/event | e2e p50 c1 |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        labels = {"h1": "HTTP/1.1 + TLS", "h2": "HTTP/2 + TLS", "h3": "HTTP/3"}
        for kind in ("h1", "h2", "h3"):
            loads = c.get(kind, {})

            def m(load: str, key: str) -> float:
                return med([s.get(key, float("nan")) for s in loads.get(load, [])])

            out.append(
                f"| {labels[kind]} | {m('json-c1', 'cpu_ms_per_req'):.3f} | {m('json-c16', 'cpu_ms_per_req'):.3f} "
                f"| {m('sse-c16-paced', 'cpu_us_per_event'):.1f} | {m('json-c1', 'central_ms_per_req'):.3f} "
                f"| {m('json-c16', 'central_ms_per_req'):.3f} | {m('sse-c16-paced', 'central_us_per_event'):.1f} "
                f"| {m('json-c1', 'e2e_p50'):.2f} |"
            )
        errors = sum(s["errors"] for k in ("h1", "h2", "h3") for reps_ in c.get(k, {}).values() for s in reps_)
        out.append("")
        out.append("Edge peak RSS: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in c.get("peak_rss", {}).items())
                   + f". Failed requests: {errors}.")
        out.append("")
    return out


async def run(args: argparse.Namespace) -> None:
    import yaml

    tmp = tempfile.mkdtemp(prefix="edgegw-wan-")
    certfile, keyfile = make_certificate(tmp)
    children = []
    try:
        fast_port = free_port(udp=True)
        fast = Child("fast-upstream", pinned(1, [PY, "bench/fast_upstream.py", "--port", str(fast_port),
                                                  "--tokens", str(TOKENS), "--model", MODEL]), tmp)
        children.append(fast)
        fast.wait_http(fast_port, "/health")
        port, tls_port, h3_port = free_port(udp=True), free_port(udp=True), free_port(udp=True)
        config = {
            "clusters": [{"name": "inference", "models": [MODEL],
                          "endpoints": [{"url": f"http://127.0.0.1:{fast_port}", "pool_size": 128, "warm_connections": 8}]}],
            "listen": {"host": "127.0.0.1", "port": port, "log_level": "warning",
                       "tls": {"port": tls_port, "certfile": certfile, "keyfile": keyfile},
                       "http3": {"port": h3_port, "certfile": certfile, "keyfile": keyfile}},
            "cache": {"backend": "off"},
        }
        path = os.path.join(tmp, "central.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(config, fh)
        central_child = Child("central", pinned(0 if args.central_core0 else 1, [PY, "-m", "gateway", "serve", "--config", path]), tmp)
        children.append(central_child)
        central_child.wait_http(port, "/readyz")
        central = {"tls_port": tls_port, "h3_port": h3_port, "child": central_child}
        rtts = [40.0, 120.0]
        samples = 5 if args.quick else args.samples
        a = await phase_a(central, tmp, certfile, rtts, samples, args.reps) if "a" in args.phases else {}
        losses = [0.0, 0.01, 0.03]
        b = {}
        if "b" in args.phases:
            b = await phase_b(central, tmp, certfile, rtts if not args.quick else [40.0], losses, args.reps, args.streams, args.delay)
        c = {}
        if "c" in args.phases:
            c = await phase_c(central, fast_port, tmp, certfile, args.reps, 0.25 if args.quick else 1.0)
        command = "bench/wan.py " + " ".join(sys.argv[1:])
        text = report(a, b, c, command.strip(), args.reps, samples, args.streams, args.delay)
        print(text)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"a": a, "b": b, "c": c}, fh, indent=1, default=str)
    finally:
        for child in children:
            child.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples, 40 ms only in phase B")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=10, help="new-connection samples per protocol and repetition")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between tokens in phase B")
    parser.add_argument("--phases", default="abc", help="which phases to run (default abc)")
    parser.add_argument("--central-core0", action="store_true", help="pin the central gateway to core 0 (default 1)")
    parser.add_argument("--json", metavar="FILE")
    # the emulator alone
    parser.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--jitter", type=float, default=0.1, help="jitter as a share of the one-way delay (uniform +-)")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tcp-port", type=int)
    parser.add_argument("--tcp-target", type=int)
    parser.add_argument("--udp-port", type=int)
    parser.add_argument("--udp-target", type=int)
    args = parser.parse_args()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(emulate(args) if args.emulate else run(args))


if __name__ == "__main__":
    main()
