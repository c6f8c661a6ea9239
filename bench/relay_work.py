"""The relay's Python work per request and per SSE event, counted, not timed: an A/B that a
busy or noisy machine cannot move.

    .venv/bin/python bench/relay_work.py --gateway-root /tmp/before --gateway-root .   # A/B, one run
    .venv/bin/python bench/relay_work.py --requests 500 --streams 100 --top 25

CPU per request (``bench/relay.py``) swings by ±20 % between back-to-back runs of one
tree on a shared 2-core machine, more than the differences an A/B of two trees is after.
This counts what the interpreter executes instead: each gateway (``python -m gateway serve``
from its checkout, started here behind ``bench/fast_upstream.py``, traffic on 127.0.0.1)
gets the loads of ``bench/relay.py`` (non-streaming chat completions at c=16; 64-token SSE
streams at c=16, their events ``--stream-delay`` apart: unpaced, the events that one read of
the gateway takes depend on the machine's load, and the count per event with them, by
±10 % between runs of one tree), and, for the measured requests only, a trace function
(``sys.settrace`` with ``f_trace_opcodes``, switched on and off by SIGUSR1 / SIGUSR2)
counts the bytecode instructions and the Python calls (function entries and coroutine
resumptions) of the gateway's main thread, per code object. Reported: both per request
(and per relayed SSE event), the same loads for every tree, and the functions whose counts
differ most between the first tree and each other one.

What it does not see: C code (uvloop, httptools, orjson, the kernel's socket work), which
is about a third of the gateway's CPU per request and the same in every tree that uses the
same listener and pools; and how costly each instruction is. It is the relay's own
Python-level work, exactly, and how it moved. The trace slows the gateway some 20-fold:
this is not a throughput figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

import orjson
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.processes import Child, free_port, pinned  # noqa: E402
from bench.relay import EVENTS, GATEWAY_CORE, MODEL, OTHER_CORE, PY, TOKENS, gateway_config, run_phase  # noqa: E402

CONCURRENCY = 16

# Runs the gateway of the checkout it is started in, with the counting trace behind two
# signals; the counts go to $EDGEGW_WORK_OUT when the trace is switched off.
_TRACED = r"""
import collections, os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
ops = collections.Counter()
calls = collections.Counter()
def tracer(frame, event, arg):
    code = frame.f_code
    key = (code.co_filename, code.co_firstlineno, code.co_qualname)
    calls[key] += 1
    frame.f_trace_opcodes = True
    frame.f_trace_lines = False
    def local(frame, event, arg):
        if event == "opcode":
            ops[key] += 1
        return local
    return local
def on(*_):
    sys.settrace(tracer)
def off(*_):
    sys.settrace(None)
    with open(os.environ["EDGEGW_WORK_OUT"], "w") as out:
        for key in set(ops) | set(calls):
            out.write(f"{ops[key]}\t{calls[key]}\t{key[0]}\t{key[1]}\t{key[2]}\n")
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
sys.argv = ["gateway", *sys.argv[1:]]
runpy.run_module("gateway", run_name="__main__", alter_sys=True)
"""


def _function(path: str, root: str, name: str) -> str:
    """A code object by its qualified name, the same for every checkout however its module
    moved (``Meter.note``), its package named when it is not the project's (``uvicorn:
    RequestResponseCycle.send``, ``stdlib ipaddress.py: _BaseV4._parse_octet``)."""
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0] + ": " + name
    if path.startswith(root + os.sep):
        return name
    if "/lib/python3" in path:
        return "stdlib " + path.rsplit("/", 1)[1] + ": " + name
    return path + ": " + name


async def count(root: str, tmp: str, upstream_port: int, requests: int, streams: int, delay: float) -> dict:
    """Opcodes and calls per request and per SSE event, and per function, of ``root``'s gateway."""
    port = free_port()
    config = os.path.join(tmp, "gateway.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(gateway_config(upstream_port, "http1", port), f)
    script = os.path.join(tmp, "traced.py")
    with open(script, "w") as f:
        f.write(_TRACED)
    results = {}
    for load, stream, n in (("request", False, requests), ("stream", True, streams)):
        out = os.path.join(tmp, f"work-{load}.tsv")
        gw = Child("gateway-traced", pinned(GATEWAY_CORE, [PY, script, "serve", "--config", config]), tmp, root,
                   env={"EDGEGW_WORK_OUT": out})
        try:
            gw.wait_http(port, "/readyz")
            pace = delay if stream else 0.0
            await run_phase(port, CONCURRENCY, 200, stream, None, pace)  # warm: imports, pools, caches
            os.kill(gw.pid, signal.SIGUSR1)
            phase = await run_phase(port, CONCURRENCY, n, stream, None, pace)
            os.kill(gw.pid, signal.SIGUSR2)
            for _ in range(100):
                if os.path.exists(out):
                    break
                await asyncio.sleep(0.1)
            time.sleep(0.5)  # the file is written in one go by the signal handler
        finally:
            gw.stop()
        if phase.errors:
            raise SystemExit(f"{root}: {phase.errors} of {phase.requests} {load}s failed: {phase.error_kinds.most_common(3)}")
        # run_phase's own warm-up (two requests per connection) ran under the trace too
        done = phase.requests + 2 * CONCURRENCY
        per = done * (EVENTS if stream else 1)
        ops: collections.Counter = collections.Counter()
        calls: collections.Counter = collections.Counter()
        with open(out) as f:
            for line in f:
                o, c, path, _, name = line.rstrip("\n").split("\t")
                key = _function(path, root, name)
                ops[key] += int(o)
                calls[key] += int(c)
        results[load] = {
            "ops": sum(ops.values()) / per,
            "calls": sum(calls.values()) / per,
            "by_function": {k: (ops[k] / per, calls[k] / per) for k in ops | calls},
        }
    return results


def _revision(root: str) -> str:
    done = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return done.stdout.strip()[:72] or "?"


def report(trees: list[str], results: list[dict], top: int) -> str:
    lines = [
        "| tree | opcodes per request | calls per request | opcodes per SSE event | calls per SSE event |",
        "|---|---:|---:|---:|---:|",
    ]
    base = results[0]
    for root, r in zip(trees, results):
        cells = []
        for load in ("request", "stream"):
            for what in ("ops", "calls"):
                value = r[load][what]
                delta = "" if r is base else f" ({(value / base[load][what] - 1) * 100:+.1f} %)"
                cells.append(f"{value:,.0f}{delta}" if load == "request" else f"{value:,.1f}{delta}")
        lines.append(f"| {root} @ {_revision(root)} | " + " | ".join(cells) + " |")
    for root, r in zip(trees[1:], results[1:]):
        for load in ("request", "stream"):
            a, b = base[load]["by_function"], r[load]["by_function"]
            keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
            lines += ["", f"Opcodes per {load if load == 'request' else 'SSE event'}, the functions that moved most ({trees[0]} → {root}):", ""]
            lines += ["| function | before | after | change |", "|---|---:|---:|---:|"]
            for k in keys[:top]:
                x, y = a.get(k, (0, 0))[0], b.get(k, (0, 0))[0]
                lines.append(f"| `{k}` | {x:.1f} | {y:.1f} | {y - x:+.1f} |")
    return "\n".join(lines)


async def main_async(args) -> None:
    trees = [os.path.abspath(t) for t in args.gateway_root] or [ROOT]
    with tempfile.TemporaryDirectory() as tmp:
        upstream_port = free_port()
        upstream = Child("fast-upstream", pinned(OTHER_CORE, [PY, "bench/fast_upstream.py", "--port", str(upstream_port),
                                                              "--tokens", str(TOKENS), "--model", MODEL]), tmp, ROOT)
        try:
            upstream.wait_http(upstream_port, "/health")
            results = []
            for root in trees:
                print(f"counting {root} ...", file=sys.stderr, flush=True)
                results.append(await count(root, tmp, upstream_port, args.requests, args.streams, args.stream_delay))
        finally:
            upstream.stop()
    print(report(trees, results, args.top))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(dict(zip(trees, results)), option=orjson.OPT_INDENT_2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-root", action="append", default=[], help="a checkout to count (repeat; the first is the baseline)")
    parser.add_argument("--requests", type=int, default=500, help="measured non-streaming requests per tree")
    parser.add_argument("--streams", type=int, default=100, help=f"measured SSE streams per tree ({EVENTS} events each)")
    parser.add_argument("--stream-delay", type=float, default=0.01,
                        help="seconds between a stream's events (0: as fast as the upstream writes, when how many "
                        "events one read of the gateway takes, and so its work per event, depends on the machine's load)")
    parser.add_argument("--top", type=int, default=15, help="functions listed per comparison")
    parser.add_argument("--json", help="also write every tree's counts, per function, to this file")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
